"""Host snapshots of a rank's export data: what an asynchronous export copies before it returns.

An asynchronous export returns as soon as every byte this rank writes is in host memory of its
own (the training may then change its tensors); the writes happen later, in the background. The
bytes go into `HostSlots`: equal slots of host memory (pinned when the data is on a GPU, so the
copies are DMA at full speed), allocated once and kept for the next export. Each slot holds one
*batch*: whole outer chunks of the store (a chunk's pieces must reach the store writer in one
transaction), cut into its inner chunks (so the writer references them without another copy).

`SlotRing` hands slots to the copying side and takes them back from the writing side once the
store let go of them; with fewer slots than batches (a bound on staging memory) the copying side
waits for slots, i.e. the export blocks longer and needs less memory.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Sequence

import torch

from bridge.errors import BridgeError
from bridge.live.staging import ALIGN, WriteItem, _Copier, _grouped_batches, _slot, chunk_groups, split_cells
from bridge.store.plan import WritePlan
from bridge.store.staging import grid_cells


@dataclass(frozen=True)
class SnapshotStats:
    """What the staging slots cost: bytes held, how many allocations so far (the first export pays
    them, later ones reuse the slots), seconds spent allocating (pinning is slow) in this export."""

    slot_bytes: int
    slots: int
    held_bytes: int
    pinned: bool
    allocations: int
    alloc_s: float


class HostSlots:
    """Host staging slots, kept across exports: `count` slots of `size` bytes, pinned or not.

    Slots are allocated one by one (a power-of-two size when pinned: torch's pinned allocator
    rounds every block up to one) and reused while the size and kind match; `allocations` counts
    every slot ever allocated (tests and reports: reuse means it does not grow).
    """

    def __init__(self) -> None:
        self.slots: list[torch.Tensor] = []
        self.size = 0
        self.pinned = False
        self.allocations = 0

    def get(self, count: int, size: int, pinned: bool) -> tuple[list[torch.Tensor], float]:
        """`count` slots of `size` bytes (the kept ones, more allocated if needed); and the seconds
        spent allocating now."""
        if self.slots and (self.size != size or self.pinned != pinned):
            self.slots.clear()
        self.size, self.pinned = size, pinned
        t0 = time.perf_counter()
        while len(self.slots) < count:
            self.slots.append(torch.empty(size, dtype=torch.uint8, pin_memory=pinned))
            self.allocations += 1
        return self.slots[:count], time.perf_counter() - t0

    def held_bytes(self) -> int:
        return self.size * len(self.slots)


def slot_size(batch_bytes: int, largest_group: int) -> int:
    """Bytes per slot: the writer batch, or the largest chunk group if larger, as a power of two.

    >>> slot_size(64 << 20, 1 << 20) >> 20, slot_size(64 << 20, 100 << 20) >> 20, slot_size(3 << 20, 0) >> 20
    (64, 128, 4)
    """
    need = max(int(batch_bytes), int(largest_group), ALIGN)
    return 1 << (need - 1).bit_length()


def cut_items(items: Sequence[WriteItem], plan: WritePlan) -> list[tuple[int, WriteItem]]:
    """Items cut along the outer chunk grid, then along the inner chunk grid (views, no copy), each
    with the index of the item it comes from.

    Outer cells keep every batch small whatever the item (a whole embedding is one item at one
    rank); inner cells are what the writer references without copying (`split_cells`).
    """
    out: list[tuple[int, WriteItem]] = []
    for i, it in enumerate(items):
        ap = plan.lookup(it.name)
        if it.box.ndim == 0:
            out.append((i, it))
            continue
        for cell in grid_cells(it.box, ap.ownership.chunk_shape):
            piece = it if cell == it.box else WriteItem(it.name, cell, it.data[cell.relative_to(it.box).slices])
            out.extend((i, c) for c in split_cells(piece, ap.inner_chunk_shape))
    return out


@dataclass(frozen=True)
class Recipe:
    """How a rank's items are cut and batched into slots: per batch, (item index, box) of each piece.

    It depends on the plan only (names, boxes, dtypes of the items), so an exporter computes it once
    per plan and applies it to each export's tensors (`batches`): the call then spends its time on
    the copies, not on cutting and grouping.
    """

    parts: tuple[tuple[tuple[int, object], ...], ...]
    slot_bytes: int

    @classmethod
    def of(cls, items: Sequence[WriteItem], plan: WritePlan, batch_bytes: int) -> "Recipe":
        """Cut `items` (`cut_items`), group whole chunks (`chunk_groups`), batch up to the slot size."""
        from bridge.live.staging import _chunks_touching

        cut = cut_items(items, plan)
        index = {id(c): i for i, c in cut}
        groups = chunk_groups([c for _, c in cut], lambda name, box: _chunks_touching(plan, name, box))
        largest = max((sum(_slot(it) for it in g) for g in groups), default=0)
        size = slot_size(batch_bytes, largest)
        return cls(tuple(tuple((index[id(c)], c.box) for c in b) for b in _grouped_batches(groups, size)), size)

    def batches(self, items: Sequence[WriteItem]) -> list[list[WriteItem]]:
        """The batches of this export's `items` (the same names and boxes as the recipe's)."""
        out = []
        for batch in self.parts:
            cur = []
            for i, box in batch:
                it = items[i]
                cur.append(it if box == it.box else WriteItem(it.name, box, it.data[box.relative_to(it.box).slices]))
            out.append(cur)
        return out


class SlotRing:
    """Slots in use, in order: the copying side `acquire`s the next, the writing side `release`s
    them oldest first; a failure on the writing side (`close`) wakes a waiting copier."""

    def __init__(self, slots: Sequence[torch.Tensor]) -> None:
        self.slots = list(slots)
        self._free = list(range(len(self.slots)))
        self._cond = threading.Condition()
        self._closed: BaseException | None = None
        self.wait_s = 0.0   # the copying side's time waiting for a slot

    def acquire(self) -> int:
        """The index of a free slot (waits for the writing side to release one)."""
        t0 = time.perf_counter()
        with self._cond:
            while not self._free and self._closed is None:
                self._cond.wait()
            if self._closed is not None:
                raise BridgeError(f"the background write failed while staging: {self._closed}")
            self.wait_s += time.perf_counter() - t0
            return self._free.pop(0)

    def release(self, index: int) -> None:
        with self._cond:
            self._free.append(index)
            self._cond.notify_all()

    def close(self, error: BaseException) -> None:
        with self._cond:
            self._closed = error
            self._cond.notify_all()


@dataclass
class StagedBatch:
    """One batch copied (or being copied) into slot `slot`: `items` are host views of the slot."""

    slot: int
    items: list[WriteItem]
    event: object = None   # the copy's CUDA event (None: copied already)

    def wait(self) -> None:
        _Copier.wait(self.event)
        self.event = None


class Snapshot:
    """Copies batches into ring slots: `stage(batch)` launches the device -> host copies of one batch
    (on a side stream that first waits for the current stream: the state at the call) and returns the
    host items; `sync()` waits for every copy launched (then the source tensors may change)."""

    def __init__(self, ring: SlotRing, cuda: bool) -> None:
        self.ring = ring
        self.copier = _Copier(cuda)
        self.launched: list[StagedBatch] = []
        self.staged_bytes = 0

    def stage(self, batch: list[WriteItem]) -> StagedBatch:
        k = self.ring.acquire()
        buf = self.ring.slots[k]
        event = self.copier.start(buf, batch)
        host, off = [], 0
        for p in batch:
            nb = p.data.numel() * p.data.element_size()
            host.append(WriteItem(p.name, p.box, buf[off:off + nb].view(p.data.dtype).reshape(p.data.shape)))
            off += _slot(p)
            self.staged_bytes += nb
        staged = StagedBatch(k, host, event)
        self.launched.append(staged)
        return staged

    def sync(self) -> float:
        """Wait for every launched copy; the seconds waited."""
        t0 = time.perf_counter()
        for b in self.launched:
            b.wait()
        self.launched.clear()
        return time.perf_counter() - t0
