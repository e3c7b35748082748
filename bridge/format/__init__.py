"""The logical checkpoint's format: tree paths, the manifest, `_METADATA` sealing."""
