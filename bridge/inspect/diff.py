"""Element-wise comparison of two arrays, block by block (pure numpy; no I/O).

Semantics (NaN-aware, as the bridge promises bit-exact round trips):
- two NaNs at the same index are equal; a NaN against a number is a difference beyond any tolerance
  (`nan_mismatch`), as is +Inf against anything but +Inf;
- +0.0 against -0.0 is numerically equal: it is counted in `signed_zero` (noted), not as a difference;
- `max_ulp` counts representable values between the two (floats: distance in the ordered bit pattern,
  so adjacent floats are 1 apart and +0.0/-0.0 are 0 apart; ints: the absolute difference);
- an element is *within tolerance* when `|a-b| <= atol` or `ulp(a,b) <= ulp`; defaults 0/0 mean exact.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from bridge.dtypes import uint_view
from bridge.inspect.stats import as_float

def ulp_distance(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Number of representable steps between a and b, element-wise, as uint64 (floats of one dtype, or ints).

    NaN positions give meaningless values: callers mask them.

    >>> x = np.array([1.0, 0.0, -0.0, -1e-45], dtype=np.float32)
    >>> y = np.nextafter(x, np.float32(2)); y[1] = -0.0; y[2] = 1e-45; y[3] = 1e-45
    >>> ulp_distance(x, y).tolist()
    [1, 0, 1, 2]
    """
    if a.dtype != b.dtype:
        raise ValueError(f"ulp distance needs one dtype, got {a.dtype} and {b.dtype}")
    if a.dtype.kind in "iub":
        a64, b64 = a.astype(np.int64), b.astype(np.int64)
        return np.abs(a64 - b64).astype(np.uint64)
    sign = np.uint64(1) << np.uint64(8 * a.dtype.itemsize - 1)
    ua = uint_view(a).astype(np.uint64)
    ub = uint_view(b).astype(np.uint64)
    ma, mb = ua & ~sign, ub & ~sign           # magnitudes (bit patterns are monotone in |x|)
    same_sign = (ua & sign) == (ub & sign)
    return np.where(same_sign, np.maximum(ma, mb) - np.minimum(ma, mb), ma + mb)


@dataclass
class ArrayDiff:
    """Streaming comparison result for one array; `update` takes blocks (boxes) in any order.

    >>> d = ArrayDiff(shape=(2, 3))
    >>> a = np.zeros((2, 3), np.float32); b = a.copy(); b[1, 1] = 1e-3; b[0, 2] = -0.0
    >>> d.update(a[1:], b[1:], start=(1, 0)); d.update(a[:1], b[:1], start=(0, 0))
    >>> d.differing, d.first_index, d.signed_zero, d.beyond_tolerance
    (1, (1, 1), 1, 1)
    """

    shape: tuple[int, ...]
    atol: float = 0.0
    ulp: int = 0
    elements: int = 0
    differing: int = 0
    beyond_tolerance: int = 0
    nan_mismatch: int = 0
    signed_zero: int = 0
    max_abs: float = 0.0
    max_ulp: int = 0
    first_index: tuple[int, ...] | None = None
    first_beyond_index: tuple[int, ...] | None = None
    first_values: tuple[Any, Any] | None = None
    _first_flat: int | None = field(default=None, repr=False)
    _first_beyond_flat: int | None = field(default=None, repr=False)

    def update(self, a: np.ndarray, b: np.ndarray, start: Sequence[int] | None = None) -> None:
        """Compare one pair of equally shaped blocks located at `start` in the array (blocks in any order)."""
        a, b = np.asarray(a), np.asarray(b)
        start = tuple(start) if start is not None else (0,) * a.ndim
        fa, fb = a.reshape(-1), b.reshape(-1)
        self.elements += fa.size
        xa, xb = as_float(fa), as_float(fb)
        nan_a, nan_b = np.isnan(xa), np.isnan(xb)
        nan_mis = nan_a != nan_b
        differ = (xa != xb) & ~(nan_a & nan_b)  # NaN != NaN is True: mask both-NaN; NaN vs number stays
        self.signed_zero += int(np.count_nonzero((xa == 0) & (xb == 0) & (np.signbit(xa) != np.signbit(xb))))
        idx = np.flatnonzero(differ)
        if idx.size == 0:
            return
        self.differing += idx.size
        self.nan_mismatch += int(np.count_nonzero(nan_mis))
        da, db = fa[idx], fb[idx]
        with np.errstate(invalid="ignore", over="ignore"):
            absd = np.abs(xa[idx].astype(np.float64) - xb[idx].astype(np.float64))
        absd = np.where(np.isnan(absd), np.inf, absd)  # NaN vs number (both-NaN never gets here)
        top = np.iinfo(np.uint64).max
        ulps = ulp_distance(da, db) if da.dtype == db.dtype else np.full(idx.size, top, np.uint64)
        ulps = np.where(nan_mis[idx], top, ulps)
        self.max_abs = max(self.max_abs, float(absd.max()))
        self.max_ulp = max(self.max_ulp, int(ulps.max()))
        beyond = ~((absd <= self.atol) | (ulps <= np.uint64(self.ulp)))
        self.beyond_tolerance += int(np.count_nonzero(beyond))
        flat = _global_flat(idx, a.shape, start, self.shape)
        i = int(np.argmin(flat))
        if self._first_flat is None or flat[i] < self._first_flat:
            self._first_flat = int(flat[i])
            self.first_index = _unravel(int(flat[i]), self.shape)
            self.first_values = (_scalar(da[i]), _scalar(db[i]))
        if beyond.any():
            j = int(flat[beyond].min())
            if self._first_beyond_flat is None or j < self._first_beyond_flat:
                self._first_beyond_flat = j
                self.first_beyond_index = _unravel(j, self.shape)

    def to_json(self) -> dict[str, Any]:
        """JSON-safe dict (infinite max_abs becomes the string "inf")."""
        d = {k: getattr(self, k) for k in ("elements", "differing", "beyond_tolerance", "nan_mismatch",
                                           "signed_zero", "max_ulp")}
        d["max_abs"] = self.max_abs if np.isfinite(self.max_abs) else "inf"
        d["first_index"] = list(self.first_index) if self.first_index is not None else None
        d["first_beyond_index"] = list(self.first_beyond_index) if self.first_beyond_index is not None else None
        d["first_values"] = list(self.first_values) if self.first_values is not None else None
        return d


def _global_flat(local_idx: np.ndarray, block_shape: Sequence[int], start: Sequence[int],
                 shape: Sequence[int]) -> np.ndarray:
    """Row-major flat indices in the whole array of flat indices `local_idx` inside a block at `start`.

    >>> _global_flat(np.array([0, 3]), (2, 2), (1, 2), (4, 5)).tolist()
    [7, 13]
    """
    if not shape:
        return np.zeros(local_idx.size, np.int64)
    local = np.unravel_index(local_idx, tuple(block_shape))
    return np.ravel_multi_index(tuple(c + o for c, o in zip(local, start)), tuple(shape)).astype(np.int64)


def _unravel(flat: int, shape: Sequence[int]) -> tuple[int, ...]:
    """Row-major index of flat position `flat` (0-d arrays give ())."""
    return tuple(int(i) for i in np.unravel_index(flat, tuple(shape))) if shape else ()


def _scalar(x: Any) -> Any:
    """A JSON-friendly Python scalar (non-finite floats as strings)."""
    v = x.item() if hasattr(x, "item") else x
    if isinstance(v, float) and not np.isfinite(v):
        return str(v)
    if not isinstance(v, (int, float, bool)):
        v = float(v)
        return v if np.isfinite(v) else str(v)
    return v
