"""Device -> host staging for writes: pinned buffers, overlapped copies, a bounded in-flight budget.

Each write item is a contiguous tensor holding one box of one array. CPU tensors are handed to
the writer as numpy views (no copy). CUDA tensors are copied on a side stream into pinned host
buffers that are kept across exports, while the writer consumes the previous buffer:
- donated (a writer whose `flush(wait=False)` commits in the background with at most d commits
  outstanding): d + 2 buffers sharing the budget, each cut into whole inner chunks of the store
  (`split_cells`) and handed to the writer without a copy, a flush after each, and a buffer
  refilled only once the commit that references it has landed (and the writer saw TensorStore
  let go of it). A buffer holds whole outer chunks only (`chunk_groups`): the store writes each
  chunk within one transaction; a chunk larger than a buffer takes the copying path;
- copying (any other writer): two buffers of `budget // 2`, reused as soon as `write` returns.
Items larger than one buffer are split into row slabs first, so host memory for staging never
exceeds the budget whatever the model size.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from math import prod
from typing import Callable, Hashable, Iterable, Iterator, Sequence

import numpy as np
import torch

from bridge.layout.boxes import Box
from bridge.store.staging import cells_are_row_runs, grid_cells
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


def stage_and_write(items: Iterable[WriteItem], write: Callable[[str, Box, np.ndarray], None],
                    budget_bytes: int, on_bytes: Callable[[int], None] | None = None,
                    write_cpu: Callable[[str, Box, np.ndarray], None] | None = None,
                    flush: Callable[[], None] | None = None, stage_cpu: bool = False,
                    stats: dict | None = None, commits_in_flight: int = 1,
                    drain: Callable[[], None] | None = None,
                    cell_shape: Callable[[str], Sequence[int]] | None = None,
                    chunks: Callable[[str, Box], Iterable[Hashable]] | None = None) -> int:
    """Feed every item to `write(name, box, ndarray)`; returns the peak staging bytes used.

    CPU items go to `write_cpu` when given: a writer that may keep referencing the numpy view
    (no copy) because the caller keeps the items alive until the writer has finished.
    CUDA items are copied to host buffers first. Without `flush` they go to `write`, which must
    copy before returning (two pinned buffers of half the budget, reused at once). With `flush`
    and `write_cpu` the staged arrays are donated too (no second copy on the host): with
    d = `commits_in_flight`, d + 2 pinned buffers sharing the budget, `flush()` after each buffer's
    writes, and a buffer is refilled only after the d-th flush after its own has returned. `flush`
    must guarantee that when it returns all but the last d - 1 earlier flushes' data has been
    committed (the store writer's `flush(wait=False)` with ``commit_depth=d``); `drain()` (default
    `flush`) at the end must commit everything, so no staged buffer is referenced when this
    returns. `cell_shape(name)` (the store's inner chunk of array `name`) cuts staged items into
    inner chunks first (`split_cells`). `chunks(name, box)` (the store's outer chunks a box
    touches) keeps each chunk's pieces in one donated buffer, hence one writer transaction
    (`chunk_groups`); pieces of chunks larger than a buffer go through `write` (which copies)
    with no flush between them. With `flush`, CPU items are staged as well when any item is on
    the device, so no flush splits a chunk between them. `stage_cpu=True` sends CPU items
    through the same buffers (tests of the staging pipeline on machines without a GPU). `stats`
    (optional) accumulates "d2h_wait_s" (time blocked on copies) and "staged_bytes".
    """
    budget_bytes = max(3, int(budget_bytes))
    items = list(items)
    if flush is not None and write_cpu is not None and any(it.data.is_cuda for it in items):
        stage_cpu = True
    cpu: list[WriteItem] = []
    dev: list[WriteItem] = []
    for it in items:
        (dev if it.data.is_cuda or stage_cpu else cpu).append(it)
    for it in cpu:
        (write_cpu or write)(it.name, it.box, to_numpy(it.data))  # to_numpy makes it contiguous
        if on_bytes:
            on_bytes(it.data.numel() * it.data.element_size())
    if not dev:
        return 0
    if cell_shape is not None:
        dev = [c for it in dev for c in split_cells(it, cell_shape(it.name))]
    stats = stats if stats is not None else {}
    if flush is not None and write_cpu is not None:
        n = max(1, int(commits_in_flight)) + 2
        part = budget_bytes // n
        if chunks is None:
            return _stage(_batches(dev, part), write_cpu, part, n, on_bytes, flush, stats, n - 2, drain)
        fit: list[list[WriteItem]] = []
        big: list[WriteItem] = []
        for g in chunk_groups(dev, chunks):
            if sum(_slot(it) for it in g) <= part:
                fit.append(g)
            else:
                big.extend(g)
        peak = 0
        if big:  # copied by the writer, which flushes only between complete chunks
            peak = _stage(_batches(big, budget_bytes // 2), write, budget_bytes // 2, 2, on_bytes, None, stats)
        if fit:
            peak = max(peak, _stage(_grouped_batches(fit, part), write_cpu, part, n, on_bytes, flush, stats,
                                    n - 2, drain))
        return peak
    return _stage(_batches(dev, budget_bytes // 2), write, budget_bytes // 2, 2, on_bytes, None, stats)


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


_PINNED: list[torch.Tensor] = []  # one set, reused across exports: pinning host memory is slow


def _host_buffers(need: int, limit: int, count: int, use: int, pinned: bool) -> list[torch.Tensor]:
    """`use` host buffers of at least `need` bytes (reused when the kept set fits `limit`, else `count` new)."""
    ok = (len(_PINNED) >= use and need <= _PINNED[0].numel() <= limit and _PINNED[0].is_pinned() == pinned)
    if not ok:
        _PINNED.clear()  # keep at most one set: the budget bounds pinned memory too
        _PINNED.extend(torch.empty(need, dtype=torch.uint8, pin_memory=pinned) for _ in range(max(count, use)))
    return _PINNED[:use]


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


def _stage(batches: list[list[WriteItem]], write, part: int, nbuf: int, on_bytes, flush, stats: dict,
           lag: int = 1, drain=None) -> int:
    """Copy `batches` (each at most `part` bytes) through `nbuf` reused host buffers into `write`.

    Without `flush`, `write` copies before returning, so a buffer is free again as soon as its
    batch is written: batch k+1's copy overlaps batch k's writes. With `flush` (donated buffers,
    `lag` commits left in flight), the buffer of batch k-lag is free once the flush after batch k
    returned (its commit is done), so with lag + 2 buffers batch k+1's copy still overlaps batch
    k's writes.
    """
    drain = drain or flush
    size = max(sum(_slot(p) for p in b) for b in batches)
    size = min(part, -(-size // (1 << 20)) * (1 << 20)) if size < part else size  # round up: reuse across calls
    cuda = any(p.data.is_cuda for b in batches for p in b)
    bufs = _host_buffers(size, max(size, part), nbuf, min(nbuf, len(batches)), pinned=cuda)
    n = len(bufs)
    size = bufs[0].numel()
    copier = _Copier(cuda)
    pending: dict[int, object] = {}

    def launch(k: int) -> None:
        if k < len(batches):
            pending[k] = copier.start(bufs[k % n], batches[k])

    if flush is None:
        launch(0)
    else:  # donated: every buffer starts free
        for k in range(n):
            launch(k)
    for k in range(len(batches)):
        if flush is None and n > 1:
            launch(k + 1)  # into the buffer of batch k+1-n <= k-1, already written (the writer copied it)
        t0 = time.perf_counter()
        copier.wait(pending.pop(k))
        stats["d2h_wait_s"] = stats.get("d2h_wait_s", 0.0) + time.perf_counter() - t0
        buf = bufs[k % n]
        off = 0
        for p in batches[k]:
            nb = p.data.numel() * p.data.element_size()
            arr = buf[off:off + nb].numpy().view(numpy_dtype_of_torch(p.data.dtype)).reshape(p.box.shape)
            write(p.name, p.box, arr)
            off += _slot(p)
            stats["staged_bytes"] = stats.get("staged_bytes", 0) + nb
            if on_bytes:
                on_bytes(nb)
        if flush is not None:
            flush()  # batch k-lag's commit is done: its buffer may be refilled
            if k >= lag:
                launch(k - lag + n)
        elif n == 1:
            launch(k + 1)
    if flush is not None:
        drain()  # every batch's commit is done: the buffers are free when this returns
    return size * n
