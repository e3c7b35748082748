"""Pure planning for streamed reads: cut an array into blocks of whole storage chunks under a budget.

Statistics and diffs read an array block by block so host memory is bounded by the in-flight
budget, not by the array size. Blocks are disjoint boxes that tile the array; consumers must not
assume blocks are contiguous in row-major order (the diff takes the minimum flat index over blocks).
"""

from __future__ import annotations

from itertools import product
from math import prod
from typing import Iterator, Sequence

from bridge.layout.boxes import Box


def plan_blocks(shape: Sequence[int], max_elems: int, chunk: Sequence[int] | None = None) -> Iterator[Box]:
    """Yield disjoint boxes covering `shape`, each of <= max_elems elements, made of whole storage chunks.

    TensorStore decodes a whole read chunk for any read that touches it, so blocks are unions of
    whole `chunk`s (the storage read-chunk shape): the block grows over the innermost dimensions
    first, in chunk multiples, while it fits; blocks come in row-major order of the block grid.
    When one chunk alone exceeds `max_elems`, each chunk is cut into row-major slabs (each read then
    decodes that chunk again: give a budget of a few chunks to avoid it). Without `chunk`, blocks are
    row-major slabs. A block is never smaller than one element.

    >>> [str(b) for b in plan_blocks((4, 3), 6)]
    ['[0:2, 0:3]', '[2:4, 0:3]']
    >>> [str(b) for b in plan_blocks((2, 5), 3)]
    ['[0:1, 0:3]', '[0:1, 3:5]', '[1:2, 0:3]', '[1:2, 3:5]']
    >>> [str(b) for b in plan_blocks((10, 4), 20, chunk=(3, 4))]
    ['[0:3, 0:4]', '[3:6, 0:4]', '[6:9, 0:4]', '[9:10, 0:4]']
    >>> [str(b) for b in plan_blocks((4, 8), 8, chunk=(2, 2))]
    ['[0:2, 0:4]', '[0:2, 4:8]', '[2:4, 0:4]', '[2:4, 4:8]']
    >>> list(plan_blocks((), 5))
    [Box(start=(), stop=())]
    """
    shape = tuple(int(s) for s in shape)
    max_elems = max(1, int(max_elems))
    if any(s == 0 for s in shape):
        return
    if chunk is None or len(chunk) != len(shape):
        yield from _slabs((), shape, max_elems)
        return
    chunk = tuple(max(1, min(int(c), s)) for c, s in zip(chunk, shape))
    if prod(chunk) > max_elems:
        for cbox in _grid(shape, chunk):
            for b in _slabs((), cbox.shape, max_elems):
                yield b.shift(cbox.start)
        return
    yield from _grid(shape, block_shape(shape, chunk, max_elems))


def block_shape(shape: Sequence[int], chunk: Sequence[int], max_elems: int) -> tuple[int, ...]:
    """Largest block of whole chunks (innermost dimensions grown first) with <= max_elems elements.

    >>> block_shape((100, 64, 64), (10, 16, 64), 16 * 64 * 10 * 3)
    (10, 48, 64)
    >>> block_shape((100, 64, 64), (10, 16, 64), 64 * 64 * 25)
    (20, 64, 64)
    """
    block = list(chunk)
    for d in reversed(range(len(shape))):
        rest = prod(block) // block[d]
        units = max(1, (max_elems // rest) // chunk[d])
        block[d] = min(shape[d], units * chunk[d])
        if block[d] < shape[d]:
            break  # outer dims stay one chunk deep, so blocks remain compact
    return tuple(block)


def _grid(shape: tuple[int, ...], step: tuple[int, ...]) -> Iterator[Box]:
    """Boxes of a regular grid of `step`-shaped cells over `shape`, row-major, clipped at the edges."""
    counts = [-(-s // t) for s, t in zip(shape, step)]
    for cell in product(*(range(c) for c in counts)):
        start = tuple(i * t for i, t in zip(cell, step))
        yield Box(start, tuple(min(a + t, s) for a, t, s in zip(start, step, shape)))


def _slabs(prefix: tuple[int, ...], shape: tuple[int, ...], max_elems: int) -> Iterator[Box]:
    """Row-major contiguous slabs of the sub-array at index `prefix` of the remaining `shape`."""
    ones = tuple(p + 1 for p in prefix)
    if not shape:
        yield Box(prefix, ones)
        return
    inner = prod(shape[1:])  # elements in one step along the cut axis
    if inner <= max_elems:
        step = max(1, min(shape[0], max_elems // inner))
        for lo in range(0, shape[0], step):
            hi = min(lo + step, shape[0])
            yield Box(prefix + (lo,) + (0,) * (len(shape) - 1), ones + (hi,) + shape[1:])
        return
    for i in range(shape[0]):
        yield from _slabs(prefix + (i,), shape[1:], max_elems)


def block_elems_for_budget(budget: int, itemsize: int, in_flight: int = 2) -> int:
    """Elements per block so that `in_flight` blocks of `itemsize` bytes fit in `budget`.

    >>> block_elems_for_budget(64 << 20, 4)
    8388608
    """
    return max(1, int(budget) // (max(1, in_flight) * max(1, int(itemsize))))
