"""Pure planning of how a JAX save and restore move arrays between devices and the store (no I/O).

A restore reads each distinct device box of each requested array once (`plan_block_reads`) and
runs the reads within a host-memory budget (`run_bounded`, `concurrent_bytes`); a save makes each
process the writer of the shards its devices hold (`shard_ownership`). The I/O that uses these
plans: `bridge.jaxside.restore_io` and `bridge.jaxside.save_io`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import jax
import numpy as np

from bridge.errors import BridgeError
from bridge.jaxside.keypaths import Path
from bridge.layout.boxes import Box
from bridge.layout.chunks import ownership_from_claims
from bridge.store import divisors

# Orbax's PyTreeCheckpointHandler default for `restore_concurrent_gb`: `restore(..., concurrent_gb=)`
# keeps Orbax's knob, unit and default, so a user's setting means what it meant with Orbax.
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


def box_of(index: tuple, shape: tuple) -> Box:
    """The box a device's index (a tuple of slices) covers in an array of `shape`.

    >>> str(box_of((slice(None), slice(2, 4)), (3, 4)))
    '[0:3, 2:4]'
    """
    return Box(tuple(0 if s.start is None else int(s.start) for s in index),
               tuple(n if s.stop is None else int(s.stop) for s, n in zip(index, shape)))


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
            boxes.setdefault(box_of(index, shape), []).append(device)
        for box, devices in boxes.items():
            elems = int(np.prod(box.shape, dtype=np.int64))
            reads.append(BlockRead(path, box, tuple(devices), elems * (stored_itemsize[path] + cast)))
    return reads


def concurrent_bytes(concurrent_gb: float | None) -> int:
    """The host-memory budget `concurrent_gb` (GB, 10**9 bytes; None: Orbax's default) in bytes.

    >>> concurrent_bytes(1e-6), concurrent_bytes(None) == 96 * 10**9
    (1000, True)
    """
    gb = DEFAULT_CONCURRENT_GB if concurrent_gb is None else concurrent_gb
    if not gb > 0:
        raise BridgeError(f"concurrent_gb={concurrent_gb} must be positive (GB of host memory a save or restore "
                          f"may hold)")
    return max(1, int(gb * 10**9))


def run_bounded(reads: Sequence[BlockRead], budget: int, start: Callable, finish: Callable) -> None:
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


def process_local(a) -> bool:
    """Whether `a` lives on this process's devices only (a host array, or a jax.Array not spread
    over several processes)."""
    return not isinstance(a, jax.Array) or a.is_fully_addressable


def shard_ownership(a, max_chunk_bytes: int, name: str = "array"):
    """Ownership of array `a` (a jax.Array over devices of several processes) by process: chunks are
    its shards, cut along the leading axis to at most `max_chunk_bytes` where a divisor allows;
    each shard is owned by the lowest process index holding a replica of it (every process computes
    the same from the sharding, no exchange)."""
    shape = tuple(int(s) for s in np.shape(a))
    owner: dict[Box, int] = {}
    if process_local(a):  # each process holds its own copy (e.g. the step): process 0's is written
        owner[Box.full(shape)] = 0
    else:
        for device, index in a.sharding.devices_indices_map(shape).items():
            box = box_of(index, shape)
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
