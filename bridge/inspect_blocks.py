"""Pure planning for streamed reads: cut an array into row-major contiguous blocks under a budget.

Statistics and diffs read an array block by block so host memory is bounded by the in-flight
budget, not by the array size. Every block is a *contiguous run of the row-major flattening*
(a range of rows of full trailing extent, or, when one row is too big, a range inside one row
along the next axis, recursively), and blocks come in row-major order: so the first differing
element of the first block that differs is the first differing element of the array, and a
block's flat offset is just its start index raveled.

Block extents along the cut axis are multiples of the storage chunk extent when they can be,
so reads do not straddle chunks needlessly.
"""

from __future__ import annotations

from math import prod
from typing import Iterator, Sequence

from bridge.layout.boxes import Box


def plan_blocks(shape: Sequence[int], max_elems: int, chunk: Sequence[int] | None = None) -> Iterator[Box]:
    """Yield boxes covering `shape` in row-major order, each a contiguous run of <= max_elems elements.

    `chunk` (the storage read-chunk shape) aligns cuts to chunk boundaries where the budget allows.
    A block is never smaller than one element, so `max_elems < 1` is treated as 1.

    >>> [str(b) for b in plan_blocks((4, 3), 6)]
    ['[0:2, 0:3]', '[2:4, 0:3]']
    >>> [str(b) for b in plan_blocks((2, 5), 3)]
    ['[0:1, 0:3]', '[0:1, 3:5]', '[1:2, 0:3]', '[1:2, 3:5]']
    >>> [str(b) for b in plan_blocks((10, 4), 20, chunk=(3, 4))]
    ['[0:3, 0:4]', '[3:6, 0:4]', '[6:9, 0:4]', '[9:10, 0:4]']
    >>> list(plan_blocks((), 5))
    [Box(start=(), stop=())]
    """
    shape = tuple(int(s) for s in shape)
    if any(s == 0 for s in shape):
        return
    chunk = tuple(int(c) for c in chunk) if chunk is not None else (1,) * len(shape)
    yield from _blocks((), shape, max(1, int(max_elems)), chunk)


def _blocks(prefix: tuple[int, ...], shape: tuple[int, ...], max_elems: int,
            chunk: tuple[int, ...]) -> Iterator[Box]:
    """Blocks of the sub-array at index `prefix` (fixed leading indices) of the remaining `shape`."""
    ones = (1,) * len(prefix)
    if not shape:
        yield Box(prefix, tuple(p + 1 for p in prefix))
        return
    inner = prod(shape[1:])  # elements in one step along the cut axis
    if inner <= max_elems:
        step = _aligned_step(shape[0], max_elems // inner, chunk[0] if chunk else 1)
        for lo in range(0, shape[0], step):
            hi = min(lo + step, shape[0])
            yield Box(prefix + (lo,) + (0,) * (len(shape) - 1), tuple(p + o for p, o in zip(prefix, ones)) + (hi,) + shape[1:])
        return
    for i in range(shape[0]):
        yield from _blocks(prefix + (i,), shape[1:], max_elems, chunk[1:])


def _aligned_step(extent: int, fit: int, chunk: int) -> int:
    """Largest step <= fit, rounded down to a multiple of `chunk` when at least one chunk fits.

    >>> _aligned_step(10, 7, 3), _aligned_step(10, 2, 3), _aligned_step(10, 50, 3)
    (6, 2, 10)
    """
    fit = max(1, min(fit, extent))
    if fit >= extent:
        return extent
    if chunk > 1 and fit >= chunk:
        return fit - fit % chunk
    return fit


def block_elems_for_budget(budget_bytes: int, itemsize: int, in_flight: int = 2) -> int:
    """Elements per block so that `in_flight` blocks of `itemsize` bytes fit in `budget_bytes`.

    >>> block_elems_for_budget(64 << 20, 4)
    8388608
    """
    return max(1, int(budget_bytes) // (max(1, in_flight) * max(1, int(itemsize))))
