"""Distance between float arrays in float32 units in the last place."""

from __future__ import annotations

import numpy as np


def max_ulp(a: dict, b: dict, floor: float, before: dict | None = None) -> float:
    """Largest |a - b| in float32 ulp of max(|b|, |before|, floor).

    `before` (the value before the step) matters where a parameter crosses zero: `p - lr*u` is
    rounded at the magnitude of its operands, not of its small result.
    """
    worst = 0.0
    for k in b:
        mag = np.maximum(np.abs(b[k]), np.float32(floor))
        if before is not None:
            mag = np.maximum(mag, np.abs(before[k]))
        scale = np.spacing(mag.astype(np.float32))
        diff = np.abs(a[k].astype(np.float64) - b[k])
        diff = np.where(np.isnan(a[k]) & np.isnan(b[k]), 0.0, np.where(np.isnan(diff), np.inf, diff))
        worst = max(worst, float(np.max(diff / scale)))
    return worst
