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

from bridge.inspect_stats import as_float

_UINT_OF = {2: np.uint16, 4: np.uint32, 8: np.uint64}


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
    ut = _UINT_OF[a.dtype.itemsize]
    sign = np.uint64(1) << np.uint64(8 * a.dtype.itemsize - 1)
    ua = a.view(ut).astype(np.uint64)
    ub = b.view(ut).astype(np.uint64)
    ma, mb = ua & ~sign, ub & ~sign           # magnitudes (bit patterns are monotone in |x|)
    same_sign = (ua & sign) == (ub & sign)
    return np.where(same_sign, np.maximum(ma, mb) - np.minimum(ma, mb), ma + mb)


@dataclass
class ArrayDiff:
    """Streaming comparison result for one array; `update` takes blocks in row-major order.

    >>> d = ArrayDiff(shape=(2, 3))
    >>> a = np.zeros((2, 3), np.float32); b = a.copy(); b[1, 1] = 1e-3; b[0, 2] = -0.0
    >>> d.update(a, b, flat_offset=0)
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
    first_values: tuple[Any, Any] | None = field(default=None)

    def update(self, a: np.ndarray, b: np.ndarray, flat_offset: int) -> None:
        """Compare one pair of equally shaped blocks whose first element has row-major index `flat_offset`."""
        fa, fb = np.asarray(a).reshape(-1), np.asarray(b).reshape(-1)
        self.elements += fa.size
        xa, xb = as_float(fa), as_float(fb)
        nan_a, nan_b = np.isnan(xa), np.isnan(xb)
        nan_mis = nan_a != nan_b
        both_nan = nan_a & nan_b
        differ = (xa != xb) & ~both_nan  # NaN != NaN is True, so mask both-NaN; NaN vs number stays True
        self.signed_zero += int(np.count_nonzero((xa == 0) & (xb == 0) & (np.signbit(xa) != np.signbit(xb))))
        n_diff = int(np.count_nonzero(differ))
        if n_diff == 0:
            return
        self.differing += n_diff
        self.nan_mismatch += int(np.count_nonzero(nan_mis))
        idx = np.flatnonzero(differ)
        da, db = fa[idx], fb[idx]
        ea, eb = xa[idx].astype(np.float64), xb[idx].astype(np.float64)
        with np.errstate(invalid="ignore", over="ignore"):
            absd = np.abs(ea - eb)
        absd = np.where(np.isnan(absd), np.inf, absd)  # NaN vs number, or +Inf vs +Inf impossible here
        ulps = ulp_distance(da, db) if da.dtype == db.dtype else np.full(idx.size, np.iinfo(np.uint64).max, np.uint64)
        ulps = np.where(nan_mis[idx], np.iinfo(np.uint64).max, ulps)
        self.max_abs = max(self.max_abs, float(absd.max()))
        self.max_ulp = max(self.max_ulp, int(ulps.max()))
        beyond = ~((absd <= self.atol) | (ulps <= np.uint64(self.ulp)))
        self.beyond_tolerance += int(np.count_nonzero(beyond))
        if self.first_index is None:
            self.first_index = _unravel(flat_offset + int(idx[0]), self.shape)
            self.first_values = (_scalar(fa[idx[0]]), _scalar(fb[idx[0]]))
        if self.first_beyond_index is None and beyond.any():
            self.first_beyond_index = _unravel(flat_offset + int(idx[np.argmax(beyond)]), self.shape)

    def to_json(self) -> dict[str, Any]:
        """JSON-safe dict (infinite max_abs becomes the string "inf")."""
        d = {k: getattr(self, k) for k in ("elements", "differing", "beyond_tolerance", "nan_mismatch",
                                           "signed_zero", "max_ulp")}
        d["max_abs"] = self.max_abs if np.isfinite(self.max_abs) else "inf"
        d["first_index"] = list(self.first_index) if self.first_index is not None else None
        d["first_beyond_index"] = list(self.first_beyond_index) if self.first_beyond_index is not None else None
        d["first_values"] = list(self.first_values) if self.first_values is not None else None
        return d


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
