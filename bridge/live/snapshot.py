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
from bridge.store import WritePlan, grid_cells


@dataclass(frozen=True)
class SnapshotStats:
    """What the staging slots cost: bytes held, how many allocations so far (the first export pays
    them, later ones reuse the slots), seconds spent allocating (pinning is slow) in this export;
    and how many copies the call launched for how many pieces."""

    slot_bytes: int
    slots: int
    held_bytes: int
    pinned: bool
    allocations: int
    alloc_s: float
    copies: int = 0    # device -> host copies the call launches (merged runs)
    pieces: int = 0    # pieces handed to the store writer (whole inner chunks)


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
            self._drop()
        self.size, self.pinned = size, pinned
        t0 = time.perf_counter()
        while len(self.slots) < count:
            self.slots.append(self._new(size, pinned))
            self.allocations += 1
        return self.slots[:count], time.perf_counter() - t0

    def _new(self, size: int, pinned: bool) -> torch.Tensor:
        return torch.empty(size, dtype=torch.uint8, pin_memory=pinned)

    def _drop(self) -> None:
        self.slots.clear()

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
class Run:
    """One device -> host copy of a batch: `nbytes` from byte `src` of item `item`'s data to byte
    `dst` of the slot; `box` (not None) when the piece is not contiguous in the item (copied as
    `item.data[box]`, made contiguous on the device first)."""

    item: int
    src: int
    nbytes: int
    dst: int
    box: object = None


@dataclass(frozen=True)
class Recipe:
    """How a rank's items are cut, batched into slots and copied: per batch, the copy `Run`s and
    the pieces the writer gets (name, box, dtype, offset in the slot).

    It depends on the plan only (names, boxes, dtypes of the items), so an exporter computes it once
    per plan and applies it to each export's tensors: the call then spends its time on the copies,
    and consecutive pieces of one item (inner chunks of whole rows) are one copy, not one each.
    """

    runs: tuple[tuple[Run, ...], ...]
    pieces: tuple[tuple[tuple[str, object, object, int], ...], ...]
    slot_bytes: int

    @classmethod
    def of(cls, items: Sequence[WriteItem], plan: WritePlan, batch_bytes: int) -> "Recipe":
        """Cut `items` (`cut_items`), group whole chunks (`chunk_groups`), batch up to the slot size,
        and merge each batch's copies into runs."""
        from bridge.live.staging import _chunks_touching

        cut = cut_items(items, plan)
        index = {id(c): i for i, c in cut}
        groups = chunk_groups([c for _, c in cut], lambda name, box: _chunks_touching(plan, name, box))
        largest = max((sum(_slot(it) for it in g) for g in groups), default=0)
        size = slot_size(batch_bytes, largest)
        runs, pieces = [], []
        for batch in _grouped_batches(groups, size):
            rs: list[Run] = []
            ps = []
            dst = 0
            for c in batch:
                i = index[id(c)]
                base = items[i].data
                nb = c.data.numel() * c.data.element_size()
                if c.data.is_contiguous() and base.is_contiguous():
                    src = c.data.data_ptr() - base.data_ptr()
                    last = rs[-1] if rs else None
                    if last is not None and last.box is None and last.item == i and last.src + last.nbytes == src \
                            and last.dst + last.nbytes == dst:
                        rs[-1] = Run(i, last.src, last.nbytes + nb, last.dst)
                    else:
                        rs.append(Run(i, src, nb, dst))
                else:
                    rs.append(Run(i, 0, nb, dst, c.box))
                ps.append((c.name, c.box, c.data.dtype, dst))
                dst += _slot(c)
            runs.append(tuple(rs))
            pieces.append(tuple(ps))
        return cls(tuple(runs), tuple(pieces), size)


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
    """One batch copied (or being copied) into slot `slot`; `pieces` as `Recipe.pieces`."""

    slot: int
    buf: torch.Tensor
    pieces: tuple
    event: object = None   # the copy's CUDA event (None: copied already)

    def wait(self) -> None:
        _Copier.wait(self.event)
        self.event = None

    def wire_pieces(self) -> list[tuple]:
        """The pieces as plain values for the writer process: (name, box start, box stop, dtype name, offset)."""
        from bridge.dtypes import name_of_torch

        return [(name, box.start, box.stop, name_of_torch(dtype), dst) for name, box, dtype, dst in self.pieces]

    def items(self) -> list[WriteItem]:
        """The pieces as host views of the slot (built by the writer, not in the call)."""
        out = []
        for name, box, dtype, dst in self.pieces:
            nb = box.size * dtype.itemsize
            out.append(WriteItem(name, box, self.buf[dst:dst + nb].view(dtype).reshape(box.shape)))
        return out


class Snapshot:
    """Copies this export's items into ring slots by a `Recipe`: `stage(k)` launches the device ->
    host copies of batch k (on a side stream that first waits for the current stream: the state at
    the call); `sync()` waits for every copy launched (then the source tensors may change)."""

    def __init__(self, ring: SlotRing, cuda: bool, recipe: Recipe | None = None,
                 items: Sequence[WriteItem] = ()) -> None:
        self.ring = ring
        self.stream = torch.cuda.Stream() if cuda else None
        self.recipe = recipe
        self.items = list(items)
        self._bytes: dict[int, torch.Tensor] = {}   # item -> its data as flat bytes
        self.launched: list[StagedBatch] = []
        self.staged_bytes = 0
        self._waited = False

    def _src(self, run: Run) -> torch.Tensor:
        it = self.items[run.item]
        if run.box is not None:
            return it.data[run.box.relative_to(it.box).slices].contiguous().reshape(-1).view(torch.uint8)
        flat = self._bytes.get(run.item)
        if flat is None:
            flat = self._bytes[run.item] = it.data.reshape(-1).view(torch.uint8)
        return flat[run.src:run.src + run.nbytes]

    def stage(self, k: int) -> StagedBatch:
        slot = self.ring.acquire()
        buf = self.ring.slots[slot]
        event = None
        if self.stream is None:
            for run in self.recipe.runs[k]:
                buf[run.dst:run.dst + run.nbytes].copy_(self._src(run))
        else:
            if not self._waited:  # the state at the call: after every kernel queued so far
                self.stream.wait_stream(torch.cuda.current_stream())
                self._waited = True
            with torch.cuda.stream(self.stream):
                for run in self.recipe.runs[k]:
                    buf[run.dst:run.dst + run.nbytes].copy_(self._src(run), non_blocking=True)
                event = torch.cuda.Event()
                event.record(self.stream)
        self.staged_bytes += sum(run.nbytes for run in self.recipe.runs[k])
        staged = StagedBatch(slot, buf, self.recipe.pieces[k], event)
        self.launched.append(staged)
        return staged

    def sync(self) -> float:
        """Wait for every launched copy; the seconds waited."""
        t0 = time.perf_counter()
        for b in self.launched:
            b.wait()
        self.launched.clear()
        self._bytes.clear()
        self.items = []
        return time.perf_counter() - t0
