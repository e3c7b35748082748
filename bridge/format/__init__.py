"""The logical checkpoint's format, owned here and spelled nowhere else.

schema (tree roots, Adam state paths, roles), tree (paths <-> Orbax names, tree metadata),
manifest (the versioned manifest's dataclasses, in and out of custom_metadata), seal (`_METADATA`
checksum), scheduler (Megatron's scheduler record). Pure: no I/O, no jax / torch / tensorstore.
"""
