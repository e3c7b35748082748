"""Summary statistics of arrays computed block by block (pure numpy; no I/O).

`ArrayStats` is a mergeable accumulator: feed it blocks in any order with `update`, or combine
partial results with `merge`; the result does not depend on how the array was cut (up to float64
rounding of the sums). Definitions, chosen for debugging optimizer state:

- `nan`, `posinf`, `neginf`: counts of those values.
- `min`, `max`, `mean`, `rms`: over the *finite* elements only (so one NaN does not hide the rest);
  None when there is no finite element.
- `zero_fraction`: elements equal to zero (+0.0 or -0.0) over all elements.

Temporaries are bounded by `_PIECE` elements whatever the block size, so memory stays within the
caller's read budget plus a small constant.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

# Elements processed at once inside a block: caps float64 temporaries at 8 MiB each.
_PIECE = 1 << 20


def as_float(x: np.ndarray) -> np.ndarray:
    """View/convert a block to a float type numpy ufuncs handle (bf16/fp16 -> fp32 exactly, ints -> fp64).

    >>> import ml_dtypes
    >>> as_float(np.array([1.5], dtype=ml_dtypes.bfloat16)).dtype
    dtype('float32')
    """
    if x.dtype in (np.float32, np.float64):
        return x
    if x.dtype.kind == "f" or x.dtype.name in ("bfloat16", "float16") or x.dtype.kind == "V":
        return x.astype(np.float32)
    return x.astype(np.float64)


@dataclass
class ArrayStats:
    """Mergeable summary statistics of one array (see module docstring for definitions).

    >>> s = ArrayStats()
    >>> s.update(np.array([0.0, 3.0, -4.0, np.nan], dtype=np.float32))
    >>> s.min, s.max, s.nan, s.zero_fraction, round(s.rms, 6)
    (-4.0, 3.0, 1, 0.25, 2.886751)
    """

    count: int = 0
    finite: int = 0
    nan: int = 0
    posinf: int = 0
    neginf: int = 0
    zeros: int = 0
    min: float | None = None
    max: float | None = None
    sum: float = 0.0
    sumsq: float = 0.0

    def update(self, block: np.ndarray) -> None:
        """Fold one block (any shape) into the statistics."""
        flat = np.asarray(block).reshape(-1)
        for lo in range(0, flat.size, _PIECE):
            self._update_piece(as_float(flat[lo:lo + _PIECE]))

    def _update_piece(self, x: np.ndarray) -> None:
        self.count += x.size
        self.zeros += int(np.count_nonzero(x == 0))
        finite_mask = np.isfinite(x)
        n_finite = int(np.count_nonzero(finite_mask))
        if n_finite != x.size:
            nan_mask = np.isnan(x)
            self.nan += int(np.count_nonzero(nan_mask))
            self.posinf += int(np.count_nonzero(x == np.inf))
            self.neginf += int(np.count_nonzero(x == -np.inf))
            x = x[finite_mask]
        if n_finite == 0:
            return
        self.finite += n_finite
        lo, hi = float(x.min()), float(x.max())
        self.min = lo if self.min is None else min(self.min, lo)
        self.max = hi if self.max is None else max(self.max, hi)
        x64 = x.astype(np.float64)
        self.sum += float(x64.sum())
        self.sumsq += float(np.dot(x64, x64))

    def merge(self, other: "ArrayStats") -> "ArrayStats":
        """Combine two partial results (of disjoint parts of one array) into a new one."""
        pick = lambda f, a, b: b if a is None else a if b is None else f(a, b)  # noqa: E731
        return ArrayStats(
            count=self.count + other.count, finite=self.finite + other.finite, nan=self.nan + other.nan,
            posinf=self.posinf + other.posinf, neginf=self.neginf + other.neginf, zeros=self.zeros + other.zeros,
            min=pick(min, self.min, other.min), max=pick(max, self.max, other.max),
            sum=self.sum + other.sum, sumsq=self.sumsq + other.sumsq)

    @property
    def mean(self) -> float | None:
        return self.sum / self.finite if self.finite else None

    @property
    def rms(self) -> float | None:
        return math.sqrt(self.sumsq / self.finite) if self.finite else None

    @property
    def zero_fraction(self) -> float | None:
        return self.zeros / self.count if self.count else None

    def to_json(self) -> dict[str, Any]:
        """JSON-safe dict (no NaN/Inf values: absent statistics are None)."""
        d = asdict(self)
        d.update(mean=self.mean, rms=self.rms, zero_fraction=self.zero_fraction)
        return d


def reduce_rms_along(block: np.ndarray, axis: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Per-index sum of squares and finite counts along `axis` (for per-layer RMS of a stacked array).

    Returns (sumsq[float64], finite_count[int64]) of length block.shape[axis]; combine blocks by
    adding, then rms = sqrt(sumsq / count).

    >>> ss, n = reduce_rms_along(np.array([[3.0, 4.0], [0.0, np.nan]]), axis=0)
    >>> ss.tolist(), n.tolist()
    ([25.0, 0.0], [2, 1])
    """
    x = as_float(np.asarray(block))
    x = np.moveaxis(x, axis, 0).reshape(x.shape[axis], -1)
    finite = np.isfinite(x)
    x64 = np.where(finite, x, 0).astype(np.float64)
    return np.einsum("ij,ij->i", x64, x64), finite.sum(axis=1).astype(np.int64)
