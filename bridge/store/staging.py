"""Staging of writes into inner-chunk-contiguous host buffers that are reused across batches.

An inner chunk (e.g. 512x512 of a 4096-column block) is not contiguous in the caller's row-major
data, so it is copied once before it is encoded. TensorStore copies it into a fresh allocation per
inner chunk (~1 page fault per 4 KiB written); the writer (``staging=True``, the default on local
disks) copies it instead into reused slabs, and TensorStore references each staged cell without copying it
again (``can_reference_source_data_indefinitely``). A slab is refilled only once TensorStore
dropped every reference to it (`Lease`), which may be later than the commit that wrote it.
Reused slabs trade a little writer CPU for fewer page faults and less peak memory
(`bench_store_write`, store vs store_nostage; figures in the README's performance section).
Slabs are reused only from the writer's (commit_depth + 2)-th batch on; on object storage, where
batches are large, a checkpoint rarely gets there, so staging is off by default (bench_remote).

`grid_cells` is pure index math; `Lease` and `SlabPool` hold memory only (no I/O).
"""

from __future__ import annotations

import sys
from itertools import product
from typing import Sequence

import numpy as np

from bridge.errors import BridgeError
from bridge.layout.boxes import Box

_ALIGN = 64


def grid_cells(box: Box, cell_shape: Sequence[int]) -> list[Box]:
    """Split `box` along a regular grid of `cell_shape` anchored at the origin (row-major order).

    >>> [str(c) for c in grid_cells(Box((0, 2), (4, 6)), (2, 4))]
    ['[0:2, 2:4]', '[0:2, 4:6]', '[2:4, 2:4]', '[2:4, 4:6]']
    >>> grid_cells(Box((), ()), ())
    [Box(start=(), stop=())]
    """
    axes = []
    for a, b, c in zip(box.start, box.stop, cell_shape):
        c = max(1, int(c))
        edges = [a] + list(range((a // c + 1) * c, b, c)) + [b]
        axes.append(list(zip(edges[:-1], edges[1:])))
    return [Box(tuple(s for s, _ in cell), tuple(e for _, e in cell)) for cell in product(*axes)]


def num_grid_cells(box: Box, cell_shape: Sequence[int]) -> int:
    """How many cells `grid_cells` returns, without building them.

    >>> num_grid_cells(Box((0, 2), (4, 6)), (2, 4))
    4
    """
    n = 1
    for a, b, c in zip(box.start, box.stop, cell_shape):
        c = max(1, int(c))
        n *= (b - 1) // c - a // c + 1 if b > a else 0
    return n


def cells_are_row_runs(box: Box, cell_shape: Sequence[int]) -> bool:
    """Whether every grid cell of `box` is a run of whole rows of it (so contiguous in its
    row-major data): the box spans one cell along every dimension but the first.

    >>> cells_are_row_runs(Box((0, 0), (8, 4)), (2, 4)), cells_are_row_runs(Box((0, 0), (8, 8)), (2, 4))
    (True, False)
    """
    return box.ndim < 2 or num_grid_cells(Box(box.start[1:], box.stop[1:]), cell_shape[1:]) == 1


class Lease:
    """A buffer handed to TensorStore: `arr` is referenced only by this object and by TensorStore
    (directly or through views of it), so `busy` tells whether TensorStore still holds it.

    TensorStore keeps a reference to every source array it may still read (``can_reference_source_
    data_indefinitely``) and drops it once done with it, so the reference count is TensorStore's
    own word that a buffer may be refilled; a finished commit alone is not (see SlabPool).

    >>> lease = Lease(np.zeros(4)); lease.busy
    False
    >>> v = lease.arr[1:]; lease.busy
    True
    >>> del v; lease.busy
    False
    """

    __slots__ = ("arr",)

    def __init__(self, arr: np.ndarray) -> None:
        self.arr = arr

    @property
    def busy(self) -> bool:
        # getrefcount sees this attribute and its own argument; anything more is a view or TensorStore
        return sys.getrefcount(self.arr) > 2


class SlabPool:
    """Bump allocator over reusable byte slabs, each leased to one batch until TensorStore let go of it.

    A batch's slabs (`seal`) are handed back by the writer when that batch's commit landed
    (`release`); a released slab is refilled only once nothing references it any more
    (`Lease.busy`): TensorStore may keep referencing staged bytes after the commit that wrote them
    (a later transaction that rewrites the same shard carries those inner chunks forward by
    reference), so the commit alone is no proof. `take` never hands out memory of a slab still
    leased or referenced, and raises if it ever would.

    numpy backs allocations of >= 4 MiB with transparent huge pages where the kernel allows it,
    so a slab costs few page faults the first time and none when reused.
    """

    def __init__(self, slab_bytes: int = 16 << 20, keep_bytes: int = 512 << 20) -> None:
        self.slab_bytes = int(slab_bytes)
        self.keep_bytes = int(keep_bytes)       # released slabs kept for reuse beyond this are dropped
        self._released: list[Lease] = []        # lease ended: reusable once not busy
        self._leased: set[int] = set()          # ids of the slabs of the batch being filled and of sealed ones
        self._batch: list[Lease] = []
        self._cur: Lease | None = None
        self._off = 0
        self.fresh_slabs = 0                    # slabs allocated rather than reused

    def take(self, shape: Sequence[int], dtype: np.dtype) -> np.ndarray:
        """An uninitialised C-contiguous array carved from the current batch's slabs."""
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        need = (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
        if need > self.slab_bytes:  # larger than a slab: its own buffer, never reused
            buf = np.empty(need, dtype=np.uint8)
            return buf[:nbytes].view(dtype).reshape(shape)
        if self._cur is None or self._off + need > self._cur.arr.size:
            self._cur = self._refill(self._reusable())
            self._batch.append(self._cur)
            self._off = 0
        view = self._cur.arr[self._off:self._off + nbytes]
        self._off += need
        return view.view(dtype).reshape(shape)

    def seal(self) -> list[Lease]:
        """End the current batch: its slabs stay leased (never refilled) until handed to `release`."""
        batch, self._batch, self._cur, self._off = self._batch, [], None, 0
        return batch

    def release(self, slabs: Sequence[Lease]) -> None:
        """End the leases of a sealed batch whose commit landed; each slab is reused once not busy."""
        for slab in slabs:
            self._leased.discard(id(slab))
        room = max(0, self.keep_bytes // self.slab_bytes - len(self._released))
        self._released.extend(list(slabs)[:room])

    @property
    def leased(self) -> int:
        """Slabs leased: in the batch being filled or in a sealed batch not yet released."""
        return len(self._leased)

    @property
    def held(self) -> int:
        """Released slabs that TensorStore (or a view) still references."""
        return sum(s.busy for s in self._released)

    def _reusable(self) -> Lease | None:
        """A released slab that is not busy (taken off the list), or None."""
        for i, slab in enumerate(self._released):
            if not slab.busy:
                return self._released.pop(i)
        return None

    def _refill(self, slab: Lease | None) -> Lease:
        """Lease `slab` (checked: not leased, not busy) or a fresh slab to the batch being filled."""
        if slab is None:
            self.fresh_slabs += 1
            slab = Lease(np.empty(self.slab_bytes, dtype=np.uint8))
        elif id(slab) in self._leased or slab.busy:
            raise BridgeError("staging slab is still leased or referenced by TensorStore; refilling it would change "
                              "bytes a write has not stored yet")
        self._leased.add(id(slab))
        return slab
