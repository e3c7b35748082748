"""Flat ranges -> rectangular boxes, and the Piece every plan speaks in.

A DP flat fragment `[f0, f1)` of a row-major tensor is a contiguous run; it decomposes into at most
three boxes per 2-D section (partial first row, run of full rows, partial last row;
megatron-layout.md §6.5-6.6), at most 2·ndim-1 for N-D. `map_flat_range` applies that per *row run*
of a physical shard (a run of TP-local rows that maps to one logical array), dropping rows that map
to nothing (GTP padding).

>>> flat_run_boxes((4, 60), 0, 128)            # §6.6: W[10,60], t=0 g=0, DP rank 0
[Box(start=(0, 0), stop=(2, 60)), Box(start=(2, 0), stop=(3, 8))]
>>> flat_run_boxes((4, 60), 128, 240)
[Box(start=(2, 8), stop=(3, 60)), Box(start=(3, 0), stop=(4, 60))]
"""

from __future__ import annotations

from math import prod
from typing import Iterable, NamedTuple, Sequence

import numpy as np

from bridge.layout.boxes import Box


def trusted_box(start: tuple[int, ...], stop: tuple[int, ...]) -> Box:
    """A Box built without re-validation, for boxes this module derives from valid ones (hot path)."""
    b = object.__new__(Box)
    object.__setattr__(b, "start", start)
    object.__setattr__(b, "stop", stop)
    return b


class Piece(NamedTuple):
    """A contiguous run of a rank's local flat tensor that is one box of one logical array.

    data = `local_flat[local_start : local_start + logical.size].reshape(logical.shape)`.
    (A NamedTuple: planning creates hundreds of thousands of these.)
    """

    array: str
    logical: Box
    local_start: int

    @property
    def local_stop(self) -> int:
        return self.local_start + self.logical.size

    def take(self, local_flat: np.ndarray) -> np.ndarray:
        """This piece's data out of the local flat tensor (a view when possible)."""
        return local_flat[self.local_start:self.local_stop].reshape(self.logical.shape)

    def put(self, local_flat: np.ndarray, data: np.ndarray) -> None:
        """Write `data` (this piece's box) into the local flat tensor."""
        local_flat[self.local_start:self.local_stop] = np.asarray(data).reshape(-1)


class RowRun(NamedTuple):
    """TP-local rows [row, row+rows) map to `array` with the first row at logical `offset`
    (full logical coordinates: prepended axes, row, trailing-dim offsets). Trailing dims keep
    their local extent."""

    row: int
    rows: int
    array: str
    offset: tuple[int, ...]


def flat_run_boxes(shape: Sequence[int], a: int, b: int) -> list[Box]:
    """Boxes (in order, each contiguous in memory) tiling flat run [a, b) of a row-major `shape`.

    >>> flat_run_boxes((3, 4), 2, 11)
    [Box(start=(0, 2), stop=(1, 4)), Box(start=(1, 0), stop=(2, 4)), Box(start=(2, 0), stop=(3, 3))]
    """
    return [trusted_box(s, e) for s, e in _run_boxes(tuple(int(x) for x in shape), a, b)]


def _run_boxes(shape: tuple[int, ...], a: int, b: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(start, stop) pairs of `flat_run_boxes` (no Box objects: hot path)."""
    if b <= a:
        return []
    if len(shape) == 1:
        return [((a,), (b,))]
    inner = shape[1:]
    k = prod(inner)
    r0, c0 = divmod(a, k)
    r1, c1 = divmod(b, k)
    if r0 == r1:
        return [((r0,) + s, (r0 + 1,) + e) for s, e in _run_boxes(inner, c0, c1)]
    out = []
    if c0:
        out += [((r0,) + s, (r0 + 1,) + e) for s, e in _run_boxes(inner, c0, k)]
        r0 += 1
    if r1 > r0:
        out.append(((r0,) + (0,) * len(inner), (r1,) + inner))
    if c1:
        out += [((r1,) + s, (r1 + 1,) + e) for s, e in _run_boxes(inner, 0, c1)]
    return out


def map_flat_range(runs: Iterable[RowRun], trailing: Sequence[int], lo: int, hi: int) -> list[Piece]:
    """Pieces of flat positions [lo, hi) of a TP-local tensor with trailing dims `trailing`.

    `local_start` is relative to `lo` (the start of the rank's local flat buffer). Positions in
    no run (padding) produce nothing. Prepended axes (len(offset) - 1 - len(trailing) of them) are
    explicit size-1 dims of each box.

    >>> runs = [RowRun(0, 5, "w", (0, 0))]                       # 5 logical rows, 3 pad rows
    >>> [(p.logical, p.local_start) for p in map_flat_range(runs, (6,), 24, 48)]
    [(Box(start=(4, 0), stop=(5, 6)), 0)]
    """
    trailing = tuple(trailing)
    k = prod(trailing)
    out: list[Piece] = []
    nt = len(trailing)
    for run in runs:
        base = run.row * k
        a = lo if lo > base else base
        end = base + run.rows * k
        b = hi if hi < end else end
        if b <= a:
            continue
        npre = len(run.offset) - 1 - nt
        pre, off = run.offset[:npre], run.offset[npre:]
        pre_stop = tuple(p + 1 for p in pre)
        pos = a - lo
        r0, c0 = divmod(a - base, k)
        r1, c1 = divmod(b - base, k)
        if c0 == 0 and c1 == 0:  # whole rows: one box (the common case)
            start = pre + (off[0] + r0,) + off[1:]
            stop = pre_stop + (off[0] + r1,) + tuple(o + n for o, n in zip(off[1:], trailing))
            out.append(Piece(run.array, trusted_box(start, stop), pos))
            continue
        for bs, be in _run_boxes((run.rows,) + trailing, a - base, b - base):
            start = pre + tuple(o + x for o, x in zip(off, bs))
            stop = pre_stop + tuple(o + x for o, x in zip(off, be))
            out.append(Piece(run.array, trusted_box(start, stop), pos))
            pos += prod(y - x for x, y in zip(bs, be))
    return out
