"""Per-array digest over logical bytes: independent of chunking, combinable across writers.

digest(A) = sum over elements e of mix(flat_global_index(e), bits(e))  (mod 2**64)

`mix` is a bijection of the element bits for a fixed index (xor with an index key, odd multiply,
xorshift), so changing any single element always changes the digest; the index key makes it
sensitive to moved data. Because it is a sum, each writer digests the boxes it writes and the
commit adds the partial sums, whatever the chunking or the writer count.
"""

from __future__ import annotations

import threading
from math import prod
from typing import Sequence

import numpy as np

from bridge.dtypes import uint_view
from bridge.layout.boxes import Box

ALGORITHM = "gtpb-sum64-v2"
_MASK = (1 << 64) - 1
_BLOCK = 1 << 16          # elements per vectorised step: the working set stays in L2

# Elements of up to 4 bytes are mixed in 32-bit lanes (half the memory traffic), 8-byte ones in 64.
_LANES = {
    32: (np.uint32, np.uint32(0x9E3779B9), np.uint32(0x85EBCA6B), np.uint32(15)),
    64: (np.uint64, np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(31)),
}


def digest_box(global_shape: Sequence[int], box: Box, data: np.ndarray, step: int = _BLOCK) -> int:
    """Partial digest of `data` placed at `box` of an array of `global_shape`.

    `step`: elements per vectorised step (the result does not depend on it). Each step is a few
    numpy calls, each releasing and retaking the GIL: many threads digesting at once contend for
    it less with larger steps, at a small cost in cache locality.

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
    bits = uint_view(data)
    lane = 64 if bits.itemsize == 8 else 32
    if not global_shape:
        return _mix_sum(bits.reshape(1, 1), [0], lane, step)
    # View the box as rows: each row is a contiguous run of the last axis in global flat order.
    ncols = box.shape[-1]
    rows = bits.reshape(-1, ncols)
    strides = [prod(global_shape[k + 1:]) for k in range(len(global_shape))]
    base = np.zeros((), dtype=np.int64)
    for k in range(len(global_shape) - 1):
        base = np.add.outer(base, np.arange(box.start[k], box.stop[k], dtype=np.int64) * strides[k])
    row_base = np.asarray(base, dtype=np.int64).reshape(-1) + box.start[-1]
    return _mix_sum(rows, row_base, lane, step)


def _mix_sum(rows: np.ndarray, row_base, lane: int, step: int = _BLOCK) -> int:
    """Sum of mix(index, bits) over a (R, C) bit matrix whose element (r, c) has index row_base[r] + c.

    mix = xorshift(odd_multiply(bits ^ index_key)): a bijection of the bits for a fixed index.
    """
    dt, k_index, k_mul, shift = _LANES[lane]
    nrows, ncols = rows.shape
    mask = np.int64((1 << lane) - 1) if lane == 32 else None
    total = 0
    with np.errstate(over="ignore"):
        # Index keys (idx + 1) * K, split as row part + column part (wrapping arithmetic).
        rb = np.asarray(row_base, dtype=np.int64)
        rb = (rb & mask) if mask is not None else rb
        row_key = rb.astype(dt) * k_index
        buf, tmp = _scratch(dt, step)
        if ncols >= step:
            for c0 in range(0, ncols, step):
                c1 = min(ncols, c0 + step)
                col_key = (np.arange(c0, c1, dtype=dt) + dt(1)) * k_index
                for r in range(nrows):
                    y = buf[: c1 - c0]
                    np.add(col_key, row_key[r], out=y)
                    total += _finish(y, rows[r, c0:c1], k_mul, shift, tmp[: c1 - c0])
        else:
            col_key = (np.arange(ncols, dtype=dt) + dt(1)) * k_index
            nr = max(1, step // ncols)
            for r0 in range(0, nrows, nr):
                r1 = min(nrows, r0 + nr)
                n = (r1 - r0) * ncols
                y = buf[:n].reshape(r1 - r0, ncols)
                np.add(row_key[r0:r1, None], col_key[None, :], out=y)
                total += _finish(y, rows[r0:r1], k_mul, shift, tmp[:n].reshape(r1 - r0, ncols))
    return total & _MASK


_LOCAL = threading.local()


def _scratch(dt, step: int = _BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """Two `step`-element work buffers of dtype `dt`, reused per thread.

    Fresh 256 KiB buffers per call would come from mmap and be page-faulted in every time.
    """
    key = (np.dtype(dt).char, step)
    bufs = getattr(_LOCAL, "bufs", None)
    if bufs is None:
        bufs = _LOCAL.bufs = {}
    if key not in bufs:
        bufs[key] = (np.empty(step, dtype=dt), np.empty(step, dtype=dt))
    return bufs[key]


def _finish(y: np.ndarray, bits: np.ndarray, k_mul, shift, tmp: np.ndarray) -> int:
    np.bitwise_xor(y, bits, out=y, casting="unsafe")
    np.multiply(y, k_mul, out=y)
    np.right_shift(y, shift, out=tmp)
    np.bitwise_xor(y, tmp, out=y)
    if y.dtype == np.uint32:
        return _sum_u32(y.reshape(-1), tmp.reshape(-1))
    return int(y.sum(dtype=np.uint64))


def _sum_u32(y: np.ndarray, scratch: np.ndarray) -> int:
    """Exact sum of a contiguous uint32 vector (len <= 2**32) without widening every element.

    Pairs of lanes read as one uint64 v = a + 2**32 b: A = sum(v) mod 2**64 and B = sum(v >> 32)
    (exact) give sum(a) = (A - 2**32 B) mod 2**64 (exact: it is < 2**64), so the total is that
    plus B; about twice as fast as ``y.sum(dtype=np.uint64)``, which casts each element first.

    >>> v = np.array([2**32 - 1, 7, 2**31, 3, 5], dtype=np.uint32)
    >>> _sum_u32(v, np.empty_like(v)) == int(v.astype(np.uint64).sum())
    True
    """
    n = y.size
    even = n - (n & 1)
    total = int(y[even]) if n & 1 else 0
    if even:
        v = y[:even].view(np.uint64)
        a = int(np.add.reduce(v))
        b = int(np.add.reduce(np.right_shift(v, np.uint64(32), out=scratch[:even].view(np.uint64))))
        total += ((a - (b << 32)) & _MASK) + b
    return total


def combine(partials: Sequence[int]) -> int:
    """Add partial digests (mod 2**64)."""
    return sum(int(p) for p in partials) & _MASK


def to_hex(d: int) -> str:
    return f"{d & _MASK:016x}"


def digest_array(data: np.ndarray) -> int:
    """Digest of a whole array (a reference for tests and small callers)."""
    data = np.asarray(data)
    return digest_box(data.shape, Box.full(data.shape), data)
