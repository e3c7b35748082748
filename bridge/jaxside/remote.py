"""JAX restore from and save to object storage (s3://, gs://).

Orbax reaches gs:// only through gcsfs (its epath backend) and cannot open s3:// URLs, so for a
URL the bridge reads the committed checkpoint with its own TensorStore reader
(`bridge.store.reader`, which checks `_METADATA`'s seal and refuses uncommitted prefixes) and
places each array straight into its target sharding: every distinct device box is one TensorStore
read, all of them issued at once within a host-memory budget (`restore_remote`), so a process
reads only what its devices hold and object storage's round trips overlap.
A save writes with the store's writer and commit, every JAX process one writer of the shards its
devices hold (`save_remote`). Local paths keep going through Orbax (`bridge.jaxside.restore`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Mapping, Sequence

import jax
import numpy as np

from bridge.errors import BridgeError, IntegrityError
from bridge.jaxside.keypaths import Path, path_str
from bridge.layout.boxes import Box


# Orbax's PyTreeCheckpointHandler default for `restore_concurrent_gb`: a local restore (Orbax) and a
# remote one (below) bound their host memory with the same knob, `restore(..., concurrent_gb=)`.
DEFAULT_CONCURRENT_GB = 96


@dataclass(frozen=True)
class BlockRead:
    """One host read of a restore: `box` of stored array `path`, placed on `devices` (every addressable
    device whose shard is that box: a replicated box is read once). `nbytes` is what it holds in
    host memory between its read starting and its placement (the block, and its cast copy)."""

    path: Path
    box: Box
    devices: tuple
    nbytes: int


def plan_block_reads(abstract: Mapping[Path, jax.ShapeDtypeStruct],
                     stored_itemsize: Mapping[Path, int]) -> list[BlockRead]:
    """The host reads that place every array of `abstract` on its sharding, array by array.

    >>> import jax
    >>> from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    >>> mesh = Mesh(np.array(jax.devices()[:1]), ("d",))
    >>> want = {("w",): jax.ShapeDtypeStruct((4, 2), np.float32, sharding=NamedSharding(mesh, P("d")))}
    >>> [(str(r.box), r.nbytes) for r in plan_block_reads(want, {("w",): 2})]
    [('[0:4, 0:2]', 48)]
    """
    reads = []
    for path, want in abstract.items():
        shape = tuple(int(s) for s in want.shape)
        cast = np.dtype(want.dtype).itemsize if np.dtype(want.dtype).itemsize != stored_itemsize[path] else 0
        boxes: dict[Box, list] = {}
        for device, index in want.sharding.addressable_devices_indices_map(shape).items():
            boxes.setdefault(_box_of(index, shape), []).append(device)
        for box, devices in boxes.items():
            elems = int(np.prod(box.shape, dtype=np.int64))
            reads.append(BlockRead(path, box, tuple(devices), elems * (stored_itemsize[path] + cast)))
    return reads


def restore_remote(directory: str, abstract: Mapping[Path, jax.ShapeDtypeStruct],
                   concurrent_gb: float | None = None) -> dict[Path, jax.Array]:
    """Every requested array of the committed checkpoint at `directory` (a URL) on its sharding.

    All device boxes of all arrays are read at once (TensorStore futures), so the round trips of
    object storage overlap and the reader coalesces neighbouring chunks, within a host-memory
    budget of `concurrent_gb` (GB, 10**9 bytes; default Orbax's, as for a local restore): a read
    starts only while the blocks read and not yet placed on their devices fit in it (a block
    larger than the budget is read alone). Each finished block goes to its devices and the array
    is built from the placed shards. (Tests of the budget hear each block's "read" and "placed"
    through `bridge._testing`'s `restore_watch`.)"""
    from bridge import _testing
    from bridge.progress import progress
    from bridge.store.reader import open_checkpoint

    watch = _testing.current().restore_watch
    budget = _budget_bytes(concurrent_gb)
    ck = open_checkpoint(directory)
    paths = list(abstract)
    stores = dict(zip(paths, ck.open_many(paths)))
    reads = plan_block_reads(abstract, {p: t.dtype.numpy_dtype.itemsize for p, t in stores.items()})
    placed: dict[Path, list[jax.Array]] = {p: [] for p in paths}

    def start(r: BlockRead):
        if watch is not None:
            watch("read", r.nbytes)
        return _start_read(stores[r.path], r.box)

    def finish(r: BlockRead, future) -> None:
        try:
            block = np.asarray(future.result())
        except Exception as e:
            from bridge.store.reader import _one_line

            raise IntegrityError(f"process {jax.process_index()}: array {path_str(r.path)}: read of {r.box} "
                                 f"from {directory} failed: {_one_line(e)}") from e
        placed[r.path].extend(_to_devices(block.astype(abstract[r.path].dtype, copy=False), r.devices))
        if watch is not None:
            watch("placed", r.nbytes)
        bar.update(r.nbytes)

    with progress(sum(r.nbytes for r in reads), "restore") as bar:
        run_bounded(reads, budget, start, finish)
    return {p: jax.make_array_from_single_device_arrays(tuple(int(s) for s in want.shape), want.sharding, placed[p])
            for p, want in abstract.items()}


def _budget_bytes(concurrent_gb: float | None) -> int:
    gb = DEFAULT_CONCURRENT_GB if concurrent_gb is None else concurrent_gb
    if not gb > 0:
        raise BridgeError(f"concurrent_gb={concurrent_gb} must be positive (GB of host memory a restore may hold)")
    return max(1, int(gb * 10**9))


def run_bounded(reads: Sequence[BlockRead], budget: int, start, finish) -> None:
    """`start(read)` for each read in order, and `finish(read, started)` for each in the same order,
    with at most `budget` bytes of reads started and not finished (one read larger than the budget
    runs alone).

    >>> log = []
    >>> reads = [BlockRead(("w",), Box((i,), (i + 1,)), (), n) for i, n in enumerate([3, 3, 5, 1])]
    >>> run_bounded(reads, 6, lambda r: log.append(("start", r.nbytes)),
    ...             lambda r, _: log.append(("finish", r.nbytes)))
    >>> log
    [('start', 3), ('start', 3), ('finish', 3), ('finish', 3), ('start', 5), ('start', 1), ('finish', 5), ('finish', 1)]
    """
    window: deque = deque()
    held = 0
    for r in reads:
        while window and held + r.nbytes > budget:
            done, started = window.popleft()
            finish(done, started)
            held -= done.nbytes
        window.append((r, start(r)))
        held += r.nbytes
    while window:
        done, started = window.popleft()
        finish(done, started)


def _start_read(store, box: Box):
    """A TensorStore read of `box` (a future)."""
    return (store[box.slices] if box.ndim else store).read()


def _to_devices(block: np.ndarray, devices: Sequence) -> list[jax.Array]:
    """`block` placed on each of `devices` (the shards they hold)."""
    return [jax.device_put(block, d) for d in devices]


def save_remote(url: str, tree: dict, manifest, *, chunk_byte_size: int | None = None) -> None:
    """Write the logical tree `bridge.jaxside.save` built to an s3:// / gs:// prefix with the store's
    writer and commit (claim object, OCDBT databases, `_METADATA` last): the same arrays, names and
    manifest Orbax would have written to a local path.

    Every JAX process calls it (Orbax's multi-host object-storage path needs gcsfs and has no
    s3://): process 0 claims the prefix, each process is one writer of the regions its devices hold
    (`shard_ownership`) and writes them from its addressable shards, and process 0 commits once
    every writer reported; all processes return or raise the same error. With one process arrays
    move to host memory one at a time. (Tests that watch the writer's calls pass its class through
    `bridge._testing`'s `writer_class`.)"""
    from bridge import _testing
    from bridge.dist import JaxCoordinator
    from bridge.format.schema import adamw_empty_paths
    from bridge.jaxside.keypaths import leaves_by_path
    from bridge.progress import progress
    from bridge.store.commit import begin_checkpoint, commit_checkpoint
    from bridge.store.plan import ArraySpec, make_write_plan
    from bridge.dtypes import check_name
    from bridge.store.specs import DEFAULT_INNER_CHUNK_BYTES, max_chunk_bytes
    from bridge.store.writer import CheckpointWriter

    writer_class = _testing.current().writer_class  # read on the caller's thread
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
    claim = begin_checkpoint(url, coordinator=coord)

    def write() -> dict:
        with progress(plan.bytes_of_writer(rank), "save" if world == 1 else f"save (process {rank})") as bar:
            writer = (writer_class or CheckpointWriter)(claim.tmp, plan, rank)
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
        coord.broadcast("the commit", lambda: commit_checkpoint(claim, plan, manifest, reports=reports))
    except BaseException:
        # process 0's claim removes what this run wrote (a failed commit released it already); the
        # other processes' handles remove nothing
        claim.release(reason="the save failed")
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
