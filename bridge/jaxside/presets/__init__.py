"""Presets: the logical checkpoint presented as a named JAX trainer's own state (MaxText, issue #22)."""
