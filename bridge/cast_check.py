"""Are the stored weights the fp32 masters cast to the weights' dtype? (What Megatron's optimizer
step leaves; convert and to-megatron both check it, element by element.)"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from bridge.dtypes import uint_view
from bridge.layout.boxes import Box


def bits_equal(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Element-wise bit equality, NaN == NaN (NaN payloads may be canonicalised by a cast).

    >>> bits_equal(np.array([0.0, np.nan, 1.0], np.float32), np.array([-0.0, np.nan, 1.0], np.float32)).tolist()
    [False, True, True]
    """
    eq = uint_view(a) == uint_view(b)
    if not eq.all():
        eq |= np.isnan(a.astype(np.float32)) & np.isnan(b.astype(np.float32))
    return eq


@dataclass(frozen=True)
class CastMismatch:
    """Where `weight` differs from `master` cast to the weight's dtype, inside `box` of the array."""

    count: int              # differing elements
    size: int               # elements compared
    local: tuple[int, ...]  # first difference, relative to the box
    index: tuple[int, ...]  # the same, in the array's coordinates
    cast: np.ndarray        # master cast to the weight's dtype


def cast_mismatch(master: np.ndarray, weight: np.ndarray, box: Box) -> CastMismatch | None:
    """None when `weight` is bit for bit `master` cast to its dtype (NaN == NaN), else where not.

    >>> m = np.array([[1.0, 2.0], [3.0, 4.0]], np.float32); w = m.astype(np.float16); w[1, 0] = 0
    >>> mm = cast_mismatch(m, w, Box((4, 0), (6, 2))); (mm.count, mm.local, mm.index)
    (1, (1, 0), (5, 0))
    """
    cast = master.astype(weight.dtype)
    eq = bits_equal(cast, weight)
    if eq.all():
        return None
    local = tuple(int(i) for i in np.argwhere(~eq)[0])
    return CastMismatch(int(eq.size - eq.sum()), int(eq.size), local,
                        tuple(s + i for s, i in zip(box.start, local)), cast)
