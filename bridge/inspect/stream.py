"""Streamed reads of lazy TensorStore views under an in-flight byte budget, and the reductions on them.

One read is in flight while the previous block is processed, so at most three blocks per source
are alive at once (the one the caller still holds, the one just read, the one being read), and a
read in flight also holds TensorStore's raw and decoded chunk buffers (measured: about 4 bytes of
peak RSS per byte of block in steady state). Blocks are sized at budget / COST_PER_BLOCK_BYTE, so
host memory stays within `budget` plus a constant (a few read chunks, which TensorStore
always decodes whole), never proportional to the array size.
"""

from __future__ import annotations

from typing import Any, Iterator, Sequence

import numpy as np

from bridge.errors import IntegrityError
from bridge.inspect.blocks import block_elems_for_budget, plan_blocks
from bridge.inspect.diff import ArrayDiff
from bridge.inspect.stats import ArrayStats, as_float, reduce_rms_along
from bridge.layout.boxes import Box

# Peak host bytes per byte of block, all copies included (see module docstring; measured ~4, margin kept).
COST_PER_BLOCK_BYTE = 6
DEFAULT_BUDGET = 256 << 20


def _itemsize(view: Any) -> int:
    return int(np.dtype(view.dtype.numpy_dtype).itemsize)


def read_blocks(views: Sequence[Any], budget: int = DEFAULT_BUDGET, chunk: Sequence[int] | None = None,
                bar: Any = None, names: Sequence[str] | None = None) -> Iterator[tuple[Box, list[np.ndarray]]]:
    """Yield (box, [block of each view]) over equally shaped views, block by block, one read ahead.

    `chunk` aligns block cuts to storage chunks; `bar.update(nbytes)` is called per block. A failed
    read raises IntegrityError naming the array (`names[i]`, default "array <i>") and the box.
    """
    shape = tuple(views[0].shape)
    per_elem = sum(_itemsize(v) for v in views)
    max_elems = block_elems_for_budget(budget, per_elem, in_flight=COST_PER_BLOCK_BYTE)
    pending: tuple[Box, list[Any]] | None = None
    for box in plan_blocks(shape, max_elems, chunk):
        futures = [v[box.slices].read() for v in views]
        if pending is not None:
            yield _finish(pending, bar, per_elem, names)
        pending = (box, futures)
    if pending is not None:
        yield _finish(pending, bar, per_elem, names)


def _finish(pending: tuple[Box, list[Any]], bar: Any, per_elem: int,
            names: Sequence[str] | None) -> tuple[Box, list[np.ndarray]]:
    box, futures = pending
    blocks = []
    for i, f in enumerate(futures):
        try:
            blocks.append(f.result())
        except Exception as e:  # tensorstore reports missing/corrupt chunks as ValueError etc.
            name = names[i] if names else f"array {i}"
            msg = " ".join(str(e).split())[:300]
            raise IntegrityError(f"array {name}: read of {box} failed: {msg}; run `gtp-bridge verify` "
                                 "on the checkpoint") from e
    if bar is not None:
        bar.update(box.size * per_elem)
    return box, blocks


def stream_stats(view: Any, budget: int = DEFAULT_BUDGET, chunk: Sequence[int] | None = None,
                 bar: Any = None, name: str | None = None) -> ArrayStats:
    """ArrayStats of a lazy view, read block by block under `budget`."""
    stats = ArrayStats()
    for _, (block,) in read_blocks([view], budget, chunk, bar, [name] if name else None):
        stats.update(block)
        del block
    return stats


def stream_diff(view_a: Any, view_b: Any, atol: float = 0.0, ulp: int = 0, budget: int = DEFAULT_BUDGET,
                chunk: Sequence[int] | None = None, bar: Any = None, names: Sequence[str] | None = None) -> ArrayDiff:
    """ArrayDiff of two equally shaped lazy views, read block by block under `budget` (both sides together)."""
    shape = tuple(view_a.shape)
    diff = ArrayDiff(shape=shape, atol=atol, ulp=ulp)
    for box, (a, b) in read_blocks([view_a, view_b], budget, chunk, bar, names):
        diff.update(a, b, start=box.start)
        del a, b
    return diff


def stream_rms_along(view: Any, axis: int = 0, budget: int = DEFAULT_BUDGET,
                     chunk: Sequence[int] | None = None) -> np.ndarray:
    """RMS over the finite elements of each index along `axis` (e.g. per layer of a stacked array).

    Reads block by block; each block adds its partial sums to the rows it covers.
    """
    shape = tuple(view.shape)
    sumsq = np.zeros(shape[axis], np.float64)
    count = np.zeros(shape[axis], np.int64)
    for box, (block,) in read_blocks([view], budget, chunk):
        ss, n = reduce_rms_along(block, axis)
        sumsq[box.start[axis]:box.stop[axis]] += ss
        count[box.start[axis]:box.stop[axis]] += n
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.sqrt(sumsq / count)


def stream_histogram(view: Any, edges: np.ndarray, transform: Any = None, budget: int = DEFAULT_BUDGET,
                     chunk: Sequence[int] | None = None) -> np.ndarray:
    """Counts of finite `transform(x)` values in the bins given by `edges`, streamed block by block.
    E.g. `transform=np.log10` for a histogram of exp_avg_sq magnitudes (zeros map to -inf and are skipped).
    """
    counts = np.zeros(len(edges) - 1, np.int64)
    for _, (block,) in read_blocks([view], budget, chunk):
        x = as_float(block).reshape(-1)
        if transform is not None:
            with np.errstate(divide="ignore", invalid="ignore"):
                x = transform(x)
        counts += np.histogram(x[np.isfinite(x)], bins=edges)[0]
    return counts
