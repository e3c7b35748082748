"""JAX restore from and save to object storage (s3://, gs://).

Orbax reaches gs:// only through gcsfs (its epath backend) and cannot open s3:// URLs, so for a
URL the bridge reads the committed checkpoint with its own TensorStore reader
(`bridge.store.reader`, which checks `_METADATA`'s seal and refuses uncommitted prefixes) and
places each array straight into its target sharding: every device's shard is one TensorStore
read of that box (`jax.make_array_from_callback`), so a process reads only what its devices hold.
A save writes with the store's writer and commit, every JAX process one writer of the shards its
devices hold (`save_remote`). Local paths keep going through Orbax (`bridge.jaxside.restore`).
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


def save_remote(url: str, tree: dict, manifest, *, chunk_byte_size: int | None = None,
                writer_class: type | None = None) -> None:
    """Write the logical tree `bridge.jaxside.save` built to an s3:// / gs:// prefix with the store's
    writer and commit (claim object, OCDBT databases, `_METADATA` last): the same arrays, names and
    manifest Orbax would have written to a local path.

    Every JAX process calls it (Orbax's multi-host object-storage path needs gcsfs and has no
    s3://): process 0 claims the prefix, each process is one writer of the regions its devices hold
    (`shard_ownership`) and writes them from its addressable shards, and process 0 commits once
    every writer reported; all processes return or raise the same error. With one process arrays
    move to host memory one at a time. `writer_class` (default `CheckpointWriter`) is a seam for tests
    that watch the writer's calls."""
    from bridge.dist import JaxCoordinator
    from bridge.format.schema import adamw_empty_paths
    from bridge.jaxside.keypaths import leaves_by_path
    from bridge.progress import progress
    from bridge.store.commit import begin_checkpoint, commit_checkpoint
    from bridge.store.remote import held_remote
    from bridge.store.plan import ArraySpec, make_write_plan
    from bridge.dtypes import check_name
    from bridge.store.specs import DEFAULT_INNER_CHUNK_BYTES, max_chunk_bytes
    from bridge.store.writer import CheckpointWriter

    coord = JaxCoordinator(job=f"save to {url}")
    rank, world = coord.rank, coord.world
    flat = {p: a for p, a in leaves_by_path(tree).items() if a is not None}
    catalog = [ArraySpec(p, tuple(int(s) for s in np.shape(a)), check_name(np.dtype(a.dtype).name, "/".join(p)))
               for p, a in flat.items()]
    limit = max_chunk_bytes(url)
    ownership = None
    if world > 1:  # chunks aligned to the shards, each owned by a process holding it
        ownership = {spec.name: shard_ownership(flat[tuple(spec.path)], limit, spec.name) for spec in catalog}
    plan = make_write_plan(catalog, world, ownership, empty_paths=adamw_empty_paths(),
                           inner_chunk_bytes=DEFAULT_INNER_CHUNK_BYTES if chunk_byte_size is None else chunk_byte_size,
                           max_chunk_bytes=limit)
    by_name = {spec.name: flat[tuple(spec.path)] for spec in catalog}
    tmp = begin_checkpoint(url, coordinator=coord)

    def write() -> dict:
        with progress(plan.bytes_of_writer(rank), "save" if world == 1 else f"save (process {rank})") as bar:
            writer = (writer_class or CheckpointWriter)(tmp, plan, rank)
            for name, ap in plan.arrays.items():
                # A jax.Array's host blocks are the save's own copy or views of an immutable buffer:
                # the writer references them (no copy; released before `finish` returns). A numpy
                # leaf is the caller's live buffer: copied.
                donate = isinstance(by_name[name], jax.Array)
                for box, host in _owned_blocks(by_name[name], ap.ownership, rank):
                    writer.write(name, box, host, donate=donate)
                    bar.update(host.nbytes)
            return writer.finish(publish=False)

    try:
        # every writer's report reaches process 0 through the coordinator (no report objects), and a
        # failing process's error reaches every process
        reports = coord.all_gather("writing", write)
        coord.broadcast("the commit", lambda: commit_checkpoint(url, plan, manifest, reports=reports))
    except BaseException:
        held = held_remote(url)  # process 0's claim (a failed commit released it already)
        if held is not None:
            held.release(reason="the save failed")
        raise


def shard_ownership(a, max_chunk_bytes: int, name: str = "array"):
    """Ownership of array `a` (a jax.Array over devices of several processes) by process: chunks are
    its shards, cut along the leading axis to at most `max_chunk_bytes` where a divisor allows;
    each shard is owned by the lowest process index holding a replica of it (every process computes
    the same from the sharding, no exchange)."""
    from bridge.layout.chunks import ownership_from_claims
    from bridge.store.specs import divisors

    shape = tuple(int(s) for s in np.shape(a))
    owner: dict[Box, int] = {}
    if _process_local(a):  # each process holds its own copy (e.g. the step): process 0's is written
        owner[Box.full(shape)] = 0
    else:
        for device, index in a.sharding.devices_indices_map(shape).items():
            box = _box_of(index, shape)
            owner[box] = min(owner.get(box, device.process_index), device.process_index)
    if not shape:
        return ownership_from_claims((), (), {min(owner.values()): [Box((), ())]}, name)
    shard = next(iter(owner)).shape
    chunk = list(max(1, s) for s in shard)
    row_bytes = max(1, int(np.prod(chunk[1:], dtype=np.int64)) * np.dtype(a.dtype).itemsize)
    chunk[0] = max([d for d in divisors(chunk[0]) if d * row_bytes <= max_chunk_bytes] or [1])
    claims: dict[int, list[Box]] = {}
    for box, p in owner.items():
        claims.setdefault(p, []).append(box)
    return ownership_from_claims(shape, tuple(chunk), claims, name)


def _process_local(a) -> bool:
    """Whether `a` lives on this process's devices only (a host array, or a jax.Array not spread
    over several processes)."""
    return not isinstance(a, jax.Array) or a.is_fully_addressable


def _box_of(index: tuple, shape: tuple) -> Box:
    """The box a device's index (a tuple of slices) covers in an array of `shape`.

    >>> str(_box_of((slice(None), slice(2, 4)), (3, 4)))
    '[0:3, 2:4]'
    """
    return Box(tuple(0 if s.start is None else int(s.start) for s in index),
               tuple(n if s.stop is None else int(s.stop) for s, n in zip(index, shape)))


def _owned_blocks(a, ownership, rank: int):
    """(box, host data) of every region of `a` that process `rank` owns, from its addressable shards
    (one replica of each); an array held whole here moves to host memory once."""
    if jax.process_count() == 1 or _process_local(a):
        boxes = ownership.boxes_owned_by(rank)
        host = np.asarray(jax.device_get(a)) if boxes else None
        for box in boxes:
            yield box, host[box.slices]
        return
    shape = tuple(int(s) for s in np.shape(a))
    owned = set(ownership.boxes_owned_by(rank))
    done = set()
    for shard in a.addressable_shards:
        box = _box_of(shard.index, shape)
        if box in done:
            continue
        mine = [b for b in owned if box.contains(b)]
        if mine:
            done.add(box)
            data = np.asarray(shard.data)
            for b in mine:
                yield b, data[b.relative_to(box).slices]
