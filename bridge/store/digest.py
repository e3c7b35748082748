"""Per-array digest over logical bytes: independent of chunking, combinable across writers.

digest(A) = sum over elements e of mix(flat_global_index(e), bits(e))  (mod 2**64)

`mix` is a bijection of the element bits for a fixed index (xor with an index key, odd multiply,
xorshift), so changing any single element always changes the digest; the index key makes it
sensitive to moved data. Because it is a sum, each writer digests the boxes it writes and the
commit adds the partial sums, whatever the chunking or the writer count.
"""

from __future__ import annotations

from math import prod
from typing import Sequence

import numpy as np

from bridge.layout.boxes import Box

ALGORITHM = "gtpb-sum64-v1"
_K_INDEX = np.uint64(0x9E3779B97F4A7C15)   # golden-ratio odd constant: spreads indices over 64 bits
_K_MUL = np.uint64(0xBF58476D1CE4E5B9)     # splitmix64 multiplier (odd => bijective)
_SHIFT = np.uint64(31)
_MASK = (1 << 64) - 1
_BLOCK = 1 << 16                            # elements per vectorised step (fits in L2 as uint64)

_UINT_OF_SIZE = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def element_bits(data: np.ndarray) -> np.ndarray:
    """Reinterpret elements as unsigned integers of the same width (no value conversion)."""
    data = np.asarray(data)
    try:
        return data.view(_UINT_OF_SIZE[data.dtype.itemsize])
    except KeyError:
        raise ValueError(f"cannot digest dtype {data.dtype} (itemsize {data.dtype.itemsize})") from None


def digest_box(global_shape: Sequence[int], box: Box, data: np.ndarray) -> int:
    """Partial digest of `data` placed at `box` of an array of `global_shape`.

    >>> a = np.arange(12, dtype=np.float32).reshape(3, 4)
    >>> whole = digest_box((3, 4), Box.full((3, 4)), a)
    >>> parts = digest_box((3, 4), Box((0, 0), (2, 4)), a[:2]) + digest_box((3, 4), Box((2, 0), (3, 4)), a[2:])
    >>> combine([parts]) == whole
    True
    """
    global_shape = tuple(int(s) for s in global_shape)
    data = np.asarray(data)
    if tuple(data.shape) != box.shape:
        raise ValueError(f"data shape {data.shape} != box shape {box.shape}")
    if box.empty:
        return 0
    bits = element_bits(np.ascontiguousarray(data))
    if not global_shape:
        return _mix_sum(bits.reshape(1, 1), np.zeros(1, np.uint64), np.zeros(1, np.uint64))
    # View the box as rows: each row is a contiguous run of the last axis in global flat order.
    ncols = box.shape[-1]
    rows = bits.reshape(-1, ncols)
    strides = [prod(global_shape[k + 1:]) for k in range(len(global_shape))]
    base = np.zeros((), dtype=np.uint64)
    for k in range(len(global_shape) - 1):
        coord = np.arange(box.start[k], box.stop[k], dtype=np.uint64) * np.uint64(strides[k])
        base = np.add.outer(base, coord)
    row_base = (np.asarray(base, dtype=np.uint64).reshape(-1) + np.uint64(box.start[-1]))
    col = np.arange(ncols, dtype=np.uint64)
    return _mix_sum(rows, row_base, col)


def _mix_sum(rows: np.ndarray, row_base: np.ndarray, col: np.ndarray) -> int:
    """Sum of mix(index, bits) over a (R, C) bit matrix whose element (r, c) has index row_base[r] + c."""
    nrows, ncols = rows.shape
    total = 0
    with np.errstate(over="ignore"):
        col_key = (col + np.uint64(1)) * _K_INDEX
        row_key = row_base * _K_INDEX
        if ncols >= _BLOCK:
            for r in range(nrows):
                for c0 in range(0, ncols, _BLOCK):
                    c1 = min(ncols, c0 + _BLOCK)
                    total += _block_sum(rows[r, c0:c1], row_key[r] + col_key[c0:c1])
        else:
            step = max(1, _BLOCK // ncols)
            for r0 in range(0, nrows, step):
                r1 = min(nrows, r0 + step)
                key = row_key[r0:r1, None] + col_key[None, :]
                total += _block_sum(rows[r0:r1], key)
    return total & _MASK


def _block_sum(bits: np.ndarray, key: np.ndarray) -> int:
    y = bits.astype(np.uint64)
    np.bitwise_xor(y, key, out=y)
    np.multiply(y, _K_MUL, out=y)
    np.bitwise_xor(y, y >> _SHIFT, out=y)
    return int(y.sum(dtype=np.uint64))


def combine(partials: Sequence[int]) -> int:
    """Add partial digests (mod 2**64)."""
    return sum(int(p) for p in partials) & _MASK


def to_hex(d: int) -> str:
    return f"{d & _MASK:016x}"


def digest_array(data: np.ndarray) -> int:
    """Digest of a whole array (a reference for tests and small callers)."""
    data = np.asarray(data)
    return digest_box(data.shape, Box.full(data.shape), data)
