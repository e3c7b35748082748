"""Device -> host staging inside the writer: pinned buffers, overlapped copies, a bounded in-flight budget.

`StagedWriter` wraps the store's `CheckpointWriter` (as torch DCP puts staging in its storage
writer): the export hands it write items (contiguous tensors, each one box of one array) and it
decides how each reaches the store. CPU tensors go to the writer as numpy views (donated: no
copy). CUDA tensors are copied on a side stream into pinned host buffers that are kept across
exports (`HostBuffers`), while the writer consumes the previous buffer:
- donated (the writer commits in the background, `flush(wait=False)` with at most d =
  `commit_depth` commits outstanding): d + 2 buffers sharing the budget, each cut into whole
  inner chunks of the store (`split_cells`) and handed to the writer without a copy, a flush after
  each, and a buffer refilled only once the commit that references it has landed (and the writer
  saw TensorStore let go of it). A buffer holds whole outer chunks only (`chunk_groups`): the
  store writes each chunk within one transaction; a chunk larger than a buffer takes the copying path;
- copying (`donate=False`): two buffers of `budget // 2`, reused as soon as the writer's `write`
  returns (it copies).
Items larger than one buffer are split into row slabs first, so host memory for staging never
exceeds the budget whatever the model size.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from math import prod
from itertools import product
from typing import Callable, Hashable, Iterable, Iterator, Sequence

import numpy as np
import torch

from bridge.budget import staging_buffers
from bridge.layout.boxes import Box
from bridge.store import cells_are_row_runs, grid_cells
from bridge.dtypes import numpy_dtype_of_torch, to_numpy


@dataclass(frozen=True)
class WriteItem:
    """`data` (contiguous, shape == box.shape) is the content of `box` of array `name`."""

    name: str
    box: Box
    data: torch.Tensor


def split_rows(item: WriteItem, max_elems: int) -> Iterator[WriteItem]:
    """Slabs of at most `max_elems` elements, each contiguous (cut dim 0, then recurse into rows).

    >>> it = WriteItem("a", Box((0, 0), (3, 4)), torch.arange(12.).reshape(3, 4))
    >>> [(str(s.box), s.data.shape[0]) for s in split_rows(it, 8)]
    [('[0:2, 0:4]', 2), ('[2:3, 0:4]', 1)]
    """
    n = item.box.size
    if n <= max_elems or item.box.ndim == 0:
        yield item
        return
    rows = item.box.shape[0]
    row = prod(item.box.shape[1:])
    step = max_elems // row if row else rows
    if step >= 1:
        for r in range(0, rows, step):
            r1 = min(rows, r + step)
            box = Box((item.box.start[0] + r,) + item.box.start[1:], (item.box.start[0] + r1,) + item.box.stop[1:])
            yield WriteItem(item.name, box, item.data[r:r1])
        return
    for r in range(rows):  # one row is already too large: cut inside it
        sub = WriteItem(item.name, Box(item.box.start[1:], item.box.stop[1:]), item.data[r])
        for part in split_rows(sub, max_elems):
            s0 = item.box.start[0] + r
            yield WriteItem(item.name, Box((s0,) + part.box.start, (s0 + 1,) + part.box.stop), part.data.unsqueeze(0))


def chunk_groups(items: Sequence[WriteItem], chunks: Callable[[str, Box], Iterable[Hashable]]) -> list[list[WriteItem]]:
    """`items` grouped so that every outer chunk's pieces are in one group (items touching a common
    chunk, directly or through other items, share a group); groups and the items in each keep
    the order of `items`.

    >>> its = [WriteItem("a", Box((r,), (r + 2,)), torch.zeros(2)) for r in (0, 4, 2, 6)]
    >>> [[str(i.box) for i in g] for g in chunk_groups(its, lambda n, b: {b.start[0] // 4})]
    [['[0:2]', '[2:4]'], ['[4:6]', '[6:8]']]
    """
    parent = list(range(len(items)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    owner: dict = {}
    for i, it in enumerate(items):
        for key in chunks(it.name, it.box):
            j = owner.setdefault(key, i)
            a, b = root(i), root(j)
            if a != b:
                parent[max(a, b)] = min(a, b)   # the root is the group's first item
    groups: dict[int, list[WriteItem]] = {}
    for i, it in enumerate(items):
        groups.setdefault(root(i), []).append(it)
    return list(groups.values())


def _grouped_batches(groups: list[list[WriteItem]], part: int) -> list[list[WriteItem]]:
    """Batches of at most `part` bytes of whole groups (each group fits in `part`)."""
    out: list[list[WriteItem]] = []
    cur: list[WriteItem] = []
    used = 0
    for g in groups:
        nb = sum(_slot(it) for it in g)
        if cur and used + nb > part:
            out.append(cur)
            cur, used = [], 0
        cur.extend(g)
        used += nb
    if cur:
        out.append(cur)
    return out


def split_cells(item: WriteItem, cell_shape: Sequence[int]) -> list[WriteItem]:
    """`item` cut along the store's inner-chunk grid (views, no copy), or `[item]` when it needs no cut.

    Staged cell by cell, every host buffer holds whole inner chunks contiguously, so the store writer
    references them instead of copying them again; the rearrangement is done by the device copy.

    >>> it = WriteItem("a", Box((0, 0), (2, 4)), torch.arange(8.).reshape(2, 4))
    >>> [(str(c.box), c.data.tolist()) for c in split_cells(it, (2, 2))]
    [('[0:2, 0:2]', [[0.0, 1.0], [4.0, 5.0]]), ('[0:2, 2:4]', [[2.0, 3.0], [6.0, 7.0]])]
    """
    box = item.box
    if cells_are_row_runs(box, cell_shape):
        return [item]  # contiguous already
    return [WriteItem(item.name, cell, item.data[cell.relative_to(box).slices]) for cell in grid_cells(box, cell_shape)]


ALIGN = 16  # bytes: every staged item starts aligned, whatever dtypes share a pinned buffer


def _slot(p: WriteItem) -> int:
    """Bytes an item occupies in a pinned buffer (rounded up to ALIGN)."""
    return -(-p.data.numel() * p.data.element_size() // ALIGN) * ALIGN


def _batches(items: list[WriteItem], half: int) -> list[list[WriteItem]]:
    """Batches of at most `half` bytes; an item larger than that is cut into row runs first."""
    parts = [[part] for it in items for part in split_rows(it, max(1, (half - ALIGN) // it.data.element_size()))]
    return _grouped_batches(parts, half)


class HostBuffers:
    """One set of host staging buffers, reused across exports (pinning host memory is slow).

    The exporter owns one; at most one set is kept, so the budget bounds pinned memory too.
    """

    def __init__(self) -> None:
        self._bufs: list[torch.Tensor] = []

    def get(self, need: int, limit: int, count: int, use: int, pinned: bool) -> list[torch.Tensor]:
        """`use` host buffers of at least `need` bytes (reused when the kept set fits `limit`, else `count` new)."""
        b = self._bufs
        ok = len(b) >= use and need <= b[0].numel() <= limit and b[0].is_pinned() == pinned
        if not ok:
            b.clear()
            b.extend(torch.empty(need, dtype=torch.uint8, pin_memory=pinned) for _ in range(max(count, use)))
        return b[:use]


class _Copier:
    """Device -> host copies of one batch into one host buffer; async on a side stream for CUDA."""

    def __init__(self, cuda: bool) -> None:
        self.stream = torch.cuda.Stream() if cuda else None

    def start(self, buf: torch.Tensor, batch: list[WriteItem]):
        """Launch the copies of `batch` into `buf` (slots aligned); returns what `wait` needs."""
        if self.stream is None:
            self._copy(buf, batch, False)
            return None
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            self._copy(buf, batch, True)
            ev = torch.cuda.Event()
            ev.record(self.stream)
        return ev

    @staticmethod
    def _copy(buf: torch.Tensor, batch: list[WriteItem], non_blocking: bool) -> None:
        off = 0
        for p in batch:
            nb = p.data.numel() * p.data.element_size()
            buf[off:off + nb].copy_(p.data.contiguous().reshape(-1).view(torch.uint8), non_blocking=non_blocking)
            off += _slot(p)

    @staticmethod
    def wait(ev) -> None:
        if ev is not None:
            ev.synchronize()


@dataclass(frozen=True)
class StagingStats:
    """A `StagedWriter`'s counters: writer writes, staging buffer bytes used, bytes copied device ->
    host, seconds blocked on those copies, whether staged buffers were donated to the writer."""

    write_calls: int
    peak_bytes: int
    staged_bytes: int
    d2h_wait_s: float
    donated: bool


class StagedWriter:
    """A store writer (`CheckpointWriter`) with the staging policy inside: feed it `WriteItem`s.

    `budget` bounds the host staging buffers. With `donate` (the writer commits in the
    background with `commit_depth` commits outstanding, by default its own) staged buffers are handed to the
    writer without a copy and CPU items are donated as numpy views: the caller keeps every item
    alive until `finish()` returns. Without it the writer copies everything it is given.
    `stage_all` sends CPU items through the buffers as well, as CUDA items go on a GPU machine (tests
    of that path without a GPU); with `donate`, CPU items are staged too whenever some item of a
    call is on the device, so no flush splits a chunk between them. `cut_cells` cuts staged items
    into the store's inner chunks first (`split_cells`: the writer then references them).

    The writer's invariant holds: a buffer handed to it is refilled only once the commit that
    references it landed and TensorStore let go of it (the writer's `flush` returns only then).
    Counters for the report: `calls` (writer writes), `peak_bytes` (staging buffers used),
    `staged_bytes` (copied device -> host), `d2h_wait_s` (blocked on those copies).
    """

    def __init__(self, writer, budget: int, *, commit_depth: int | None = None, donate: bool = True,
                 stage_all: bool = False, cut_cells: bool = True, buffers: HostBuffers | None = None,
                 on_bytes: Callable[[int], None] | None = None) -> None:
        self.writer = writer
        self.budget = max(3, int(budget))
        # the writer's own depth unless given (one number, not passed twice: `CheckpointWriter.commit_depth`)
        self.commit_depth = max(1, int(commit_depth if commit_depth is not None else getattr(writer, "commit_depth", 1)))
        self.donate = donate
        self.stage_all = stage_all
        self.cut_cells = cut_cells
        self.buffers = buffers if buffers is not None else HostBuffers()
        self.on_bytes = on_bytes
        self.calls = 0
        self.peak_bytes = 0
        self.staged_bytes = 0
        self.d2h_wait_s = 0.0
        self.donated = False   # some staged buffer was donated to the writer

    # -- the writer's side ----------------------------------------------------------------------
    def write(self, name, box: Box, array: np.ndarray) -> None:
        """One write the writer copies (the caller may reuse `array` at once)."""
        self.calls += 1
        self.writer.write(name, box, array)

    def _write_donated(self, name, box: Box, array: np.ndarray) -> None:
        self.calls += 1
        self.writer.write(name, box, array, donate=True)

    def _flush(self) -> None:
        self.writer.flush(wait=False)  # returns once all but the last d - 1 earlier flushes committed

    def _drain(self) -> None:
        self.writer.flush()  # every commit landed: no staged buffer is referenced any more

    def finish(self) -> dict:
        """Flush and publish the writer's report (see `CheckpointWriter.finish`)."""
        return self.writer.finish()

    def stats(self) -> StagingStats:
        return StagingStats(self.calls, self.peak_bytes, self.staged_bytes, self.d2h_wait_s, self.donated)

    # -- staging -------------------------------------------------------------------------------
    def write_items(self, items: Iterable[WriteItem]) -> None:
        """Write every item (in order; a chunk's pieces together) by the policy above."""
        items = list(items)
        stage_cpu = self.stage_all or (self.donate and any(it.data.is_cuda for it in items))
        cpu: list[WriteItem] = []
        dev: list[WriteItem] = []
        for it in items:
            (dev if it.data.is_cuda or stage_cpu else cpu).append(it)
        write_cpu = self._write_donated if self.donate else self.write
        for it in cpu:
            write_cpu(it.name, it.box, to_numpy(it.data))  # to_numpy makes it contiguous
            if self.on_bytes:
                self.on_bytes(it.data.numel() * it.data.element_size())
        if not dev:
            return
        plan = self.writer.plan
        if self.cut_cells:
            dev = [c for it in dev for c in split_cells(it, plan.lookup(it.name).inner_chunk_shape)]
        budget = self.budget
        if not self.donate:
            self._peak(self._stage(_batches(dev, budget // 2), budget // 2, 2, donated=False))
            return
        n = staging_buffers(self.commit_depth)  # bridge.budget: the one split of a budget
        part = budget // n
        fit: list[list[WriteItem]] = []
        big: list[WriteItem] = []
        for g in chunk_groups(dev, lambda name, box: _chunks_touching(plan, name, box)):
            if sum(_slot(it) for it in g) <= part:
                fit.append(g)
            else:
                big.extend(g)
        if big:  # copied by the writer, which flushes only between complete chunks
            self._peak(self._stage(_batches(big, budget // 2), budget // 2, 2, donated=False))
        if fit:
            self._peak(self._stage(_grouped_batches(fit, part), part, n, donated=True))
            self.donated = True

    def _peak(self, nbytes: int) -> None:
        self.peak_bytes = max(self.peak_bytes, nbytes)

    def _stage(self, batches: list[list[WriteItem]], part: int, nbuf: int, donated: bool) -> int:
        """Copy `batches` (each at most `part` bytes) through `nbuf` reused host buffers into the writer;
        returns the buffer bytes used.

        Copying, the writer copies before `write` returns, so a buffer is free again as soon as its
        batch is written: batch k+1's copy overlaps batch k's writes. Donated (`lag` = nbuf - 2
        commits left in flight), the buffer of batch k-lag is free once the flush after batch k
        returned (its commit is done), so with lag + 2 buffers batch k+1's copy still overlaps
        batch k's writes.
        """
        write = self._write_donated if donated else self.write
        lag = nbuf - 2
        size = max(sum(_slot(p) for p in b) for b in batches)
        size = min(part, -(-size // (1 << 20)) * (1 << 20)) if size < part else size  # round up: reuse across calls
        cuda = any(p.data.is_cuda for b in batches for p in b)
        bufs = self.buffers.get(size, max(size, part), nbuf, min(nbuf, len(batches)), pinned=cuda)
        n = len(bufs)
        size = bufs[0].numel()
        copier = _Copier(cuda)
        pending: dict[int, object] = {}

        def launch(k: int) -> None:
            if k < len(batches):
                pending[k] = copier.start(bufs[k % n], batches[k])

        if not donated:
            launch(0)
        else:  # donated: every buffer starts free
            for k in range(n):
                launch(k)
        for k in range(len(batches)):
            if not donated and n > 1:
                launch(k + 1)  # into the buffer of batch k+1-n <= k-1, already written (the writer copied it)
            t0 = time.perf_counter()
            copier.wait(pending.pop(k))
            self.d2h_wait_s += time.perf_counter() - t0
            buf = bufs[k % n]
            off = 0
            for p in batches[k]:
                nb = p.data.numel() * p.data.element_size()
                arr = buf[off:off + nb].numpy().view(numpy_dtype_of_torch(p.data.dtype)).reshape(p.box.shape)
                write(p.name, p.box, arr)
                off += _slot(p)
                self.staged_bytes += nb
                if self.on_bytes:
                    self.on_bytes(nb)
            if donated:
                self._flush()  # batch k-lag's commit is done: its buffer may be refilled
                if k >= lag:
                    launch(k - lag + n)
            elif n == 1:
                launch(k + 1)
        if donated:
            self._drain()  # every batch's commit is done: the buffers are free when this returns
        return size * n


def _chunks_touching(plan, name: str, box: Box) -> list[tuple[str, tuple[int, ...]]]:
    """The outer chunks (array name, grid index) `box` of array `name` touches in write plan `plan`."""
    sl = plan.lookup(name).ownership.chunks_touching(box)
    return [(name, idx) for idx in product(*(range(s.start, s.stop) for s in sl))]
