"""Device -> host staging for writes: pinned buffers, overlapped copies, a bounded in-flight budget.

Each write item is a contiguous tensor holding one box of one array. CPU tensors are handed to
the writer as numpy views (no copy). CUDA tensors go through two pinned host buffers of
`budget // 2` bytes each: while the writer consumes one buffer (TensorStore copies the data
into its transaction before `write` returns), the next batch is copied device-to-host into the
other on a side stream. Items larger than half the budget are split into row slabs first, so
host memory for staging never exceeds the budget whatever the model size.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Callable, Iterable, Iterator

import numpy as np
import torch

from bridge.layout.boxes import Box
from bridge.torch_numpy import numpy_dtype_of, to_numpy


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
                    write_cpu: Callable[[str, Box, np.ndarray], None] | None = None) -> int:
    """Feed every item to `write(name, box, ndarray)`; returns the peak staging bytes used.

    CPU items go to `write_cpu` when given: a writer that may keep referencing the numpy view
    (no copy) because the caller keeps the items alive until the writer has finished. CUDA items
    always go to `write`, which must copy before returning (the pinned buffers are reused).
    """
    budget_bytes = max(2, int(budget_bytes))
    half = budget_bytes // 2
    cpu: list[WriteItem] = []
    dev: list[WriteItem] = []
    for it in items:
        (dev if it.data.is_cuda else cpu).append(it)
    for it in cpu:
        (write_cpu or write)(it.name, it.box, to_numpy(it.data.contiguous()))
        if on_bytes:
            on_bytes(it.data.numel() * it.data.element_size())
    if not dev:
        return 0
    return _stage_cuda(dev, write, half, on_bytes)


ALIGN = 16  # bytes: every staged item starts aligned, whatever dtypes share a pinned buffer


def _slot(p: WriteItem) -> int:
    """Bytes an item occupies in a pinned buffer (rounded up to ALIGN)."""
    return -(-p.data.numel() * p.data.element_size() // ALIGN) * ALIGN


def _batches(items: list[WriteItem], half: int) -> list[list[WriteItem]]:
    out: list[list[WriteItem]] = []
    cur: list[WriteItem] = []
    used = 0
    for it in items:
        es = it.data.element_size()
        for part in split_rows(it, max(1, (half - ALIGN) // es)):
            nb = _slot(part)
            if cur and used + nb > half:
                out.append(cur)
                cur, used = [], 0
            cur.append(part)
            used += nb
    if cur:
        out.append(cur)
    return out


_PINNED: dict[int, list[torch.Tensor]] = {}  # reused across exports: pinning host memory is slow


def _pinned(size: int, count: int) -> list[torch.Tensor]:
    bufs = _PINNED.get(size)
    if bufs is None or len(bufs) < count:
        _PINNED.clear()  # keep at most one size: the budget bounds pinned memory too
        bufs = _PINNED[size] = [torch.empty(size, dtype=torch.uint8, pin_memory=True) for _ in range(count)]
    return bufs[:count]


def _stage_cuda(items: list[WriteItem], write, half: int, on_bytes) -> int:
    batches = _batches(items, half)
    size = max(sum(_slot(p) for p in b) for b in batches)
    size = min(half, -(-size // (1 << 20)) * (1 << 20)) if size < half else size  # round up: reuse across calls
    bufs = _pinned(size, min(2, len(batches)))
    stream = torch.cuda.Stream()
    events: list[torch.cuda.Event | None] = [None] * len(bufs)

    def launch(k: int) -> None:
        buf = bufs[k % len(bufs)]
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            off = 0
            for p in batches[k]:
                nb = p.data.numel() * p.data.element_size()
                buf[off:off + nb].copy_(p.data.contiguous().reshape(-1).view(torch.uint8), non_blocking=True)
                off += _slot(p)
            ev = torch.cuda.Event()
            ev.record(stream)
        events[k % len(bufs)] = ev

    launch(0)
    for k in range(len(batches)):
        if k + 1 < len(batches) and len(bufs) > 1:
            launch(k + 1)  # next copy overlaps with this batch's writes
        events[k % len(bufs)].synchronize()
        buf = bufs[k % len(bufs)]
        off = 0
        for p in batches[k]:
            nb = p.data.numel() * p.data.element_size()
            arr = buf[off:off + nb].numpy().view(numpy_dtype_of(p.data.dtype)).reshape(p.box.shape)
            write(p.name, p.box, arr)  # the writer copies before returning: the buffer can be reused
            off += _slot(p)
            if on_bytes:
                on_bytes(nb)
        if len(bufs) == 1 and k + 1 < len(batches):
            launch(k + 1)
    return size * len(bufs)
