"""JAX restore from object storage (s3://, gs://).

Orbax reaches gs:// only through gcsfs (its epath backend) and cannot open s3:// URLs, so for a
URL the bridge reads the committed checkpoint with its own TensorStore reader
(`bridge.store.reader`, which checks `_METADATA`'s seal and refuses uncommitted prefixes) and
places each array straight into its target sharding: every device's shard is one TensorStore
read of that box (`jax.make_array_from_callback`), so a process reads only what its devices hold.
Local paths keep going through Orbax (`bridge.jaxside.restore`).
"""

from __future__ import annotations

from typing import Mapping

import jax
import numpy as np

from bridge.jaxside.keypaths import Path
from bridge.layout.boxes import Box


def stored_arrays_remote(url: str, allow_edited_metadata: bool | None = None):
    """`bridge.jaxside.abstract.stored_arrays` for an s3:// / gs:// checkpoint (no data read)."""
    from bridge.format.tree import validate_path
    from bridge.jaxside.abstract import StoredArray, StoredTree
    from bridge.store.reader import find_checkpoint_root, open_checkpoint

    root = find_checkpoint_root(url)
    ck = open_checkpoint(root, allow_edited_metadata=allow_edited_metadata)
    for p in ck.paths():
        validate_path(p)
    arrays = {tuple(p): StoredArray(tuple(p), tuple(int(s) for s in info.shape), _np_dtype(info.dtype))
              for p, info in ck.arrays().items()}
    custom = ck.metadata.get("custom_metadata") or {}
    return StoredTree(root, arrays, dict(custom) if isinstance(custom, dict) else {})


def _np_dtype(name: str) -> np.dtype:
    from bridge.dtypes import numpy_dtype

    return numpy_dtype(name)


def restore_remote(directory: str, abstract: Mapping[Path, jax.ShapeDtypeStruct]) -> dict[Path, jax.Array]:
    """Every requested array of the committed checkpoint at `directory` (a URL) on its sharding."""
    from bridge.store.reader import open_checkpoint

    ck = open_checkpoint(directory)
    out = {}
    for path, want in abstract.items():
        out[path] = _place(ck, path, want)
    return out


def _place(ck, path: Path, want: jax.ShapeDtypeStruct) -> jax.Array:
    shape = tuple(int(s) for s in want.shape)
    dtype = np.dtype(want.dtype)
    cache: dict[tuple, np.ndarray] = {}  # replicated shards of one box are read once

    def shard(index: tuple[slice, ...]) -> np.ndarray:
        start = tuple(0 if s.start is None else int(s.start) for s in index)
        stop = tuple(n if s.stop is None else int(s.stop) for s, n in zip(index, shape))
        key = (start, stop)
        if key not in cache:
            block = ck.read(path, Box(start, stop)) if shape else ck.read(path)
            cache[key] = np.asarray(block).astype(dtype, copy=False)
        return cache[key]

    return jax.make_array_from_callback(shape, want.sharding, shard)


def save_remote(url: str, tree: dict, manifest, *, chunk_byte_size: int | None = None) -> None:
    """Write the logical tree `bridge.jaxside.save` built to an s3:// / gs:// prefix with the store's
    writer and commit (claim object, OCDBT databases, `_METADATA` last): the same arrays, names and
    manifest Orbax would have written to a local path.

    One process (Orbax's multi-host object-storage path needs gcsfs and has no s3://); arrays move
    to host memory one at a time."""
    from bridge.errors import BridgeError
    from bridge.format.schema import adamw_empty_paths
    from bridge.jaxside.keypaths import leaves_by_path
    from bridge.progress import progress
    from bridge.store.claim import claim_destination
    from bridge.store.commit import commit_checkpoint
    from bridge.store.plan import ArraySpec, make_write_plan
    from bridge.dtypes import check_name
    from bridge.store.specs import DEFAULT_INNER_CHUNK_BYTES, max_chunk_bytes
    from bridge.store.writer import CheckpointWriter

    if jax.process_count() > 1:
        raise BridgeError(f"{url}: saving to object storage from {jax.process_count()} JAX processes is not "
                          f"supported; save to a shared local path, or from one process")
    flat = {p: a for p, a in leaves_by_path(tree).items() if a is not None}
    catalog = [ArraySpec(p, tuple(int(s) for s in np.shape(a)), check_name(np.dtype(a.dtype).name, "/".join(p)))
               for p, a in flat.items()]
    plan = make_write_plan(catalog, 1, empty_paths=adamw_empty_paths(),
                           inner_chunk_bytes=DEFAULT_INNER_CHUNK_BYTES if chunk_byte_size is None else chunk_byte_size,
                           max_chunk_bytes=max_chunk_bytes(url))
    by_name = {spec.name: flat[tuple(spec.path)] for spec in catalog}
    with claim_destination(url) as claim:
        with progress(plan.total_bytes, "save") as bar:
            writer = CheckpointWriter(claim.tmp, plan, 0)
            for name, ap in plan.arrays.items():
                host = np.asarray(jax.device_get(by_name[name]))
                for box in ap.ownership.boxes_owned_by(0):
                    block = host[box.slices]
                    writer.write(name, box, block)
                    bar.update(block.nbytes)
                del host
            writer.finish()
        commit_checkpoint(url, plan, manifest, claim=claim)
