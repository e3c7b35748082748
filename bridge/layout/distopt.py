"""Megatron-Core distributed-optimizer buffer layout, DP shard ranges, owned flat ranges.

Mirrors megatron-core 0.19.2 `DistributedOptimizer._compute_per_buffer_param_layout`
(`distrib_optimizer.py:506-589`), `param_layout.py:24-42` (64-element param alignment, bucket-end
padding to lcm(DP, 128) [or lcm(DP, 128, 65536)]), `_build_model_gbuf_range` and
`_build_model_gbuf_param_range_map` (`:134-256`), and `group_params_for_buffers`
(`param_and_grad_buffer.py:882`). Element counts are physical (padded GTP shard) numels.

>>> lay = buffer_layout([BufferParam("w", 24)], bucket_size=None, dp_size=2)   # §4.5
>>> lay.index["w"], lay.buckets, lay.numel_unpadded
((0, 24, 0), [(0, 128)], [24])
>>> [(o.name, o.param) for o in owned_ranges(lay, 0)], owned_ranges(lay, 1)
([('w', (0, 24))], [])
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from functools import cached_property
from math import lcm
from typing import Iterable, NamedTuple, Sequence

from bridge.errors import BridgeError

PARAM_ALIGN = 64


def _ceil_to(x: int, d: int) -> int:
    return -(-x // d) * d


def bucket_end_divisor(dp_size: int, pad_for_high_nccl_busbw: bool = False) -> int:
    """Divisor of every bucket end: lcm(DP, 128) (and 2**16 with `pad_for_high_nccl_busbw`).

    >>> bucket_end_divisor(6)
    384
    """
    return lcm(dp_size, 128, 2**16) if pad_for_high_nccl_busbw else lcm(dp_size, 128)


@dataclass(frozen=True)
class BufferParam:
    """One parameter of a DistOpt buffer: its key, physical numel, shared-embedding flag."""

    name: str
    numel: int
    shared_embedding: bool = False


@dataclass(frozen=True)
class BufferKey:
    """Buffer identity: Megatron's BufferKey(param_dtype, grad_dtype, is_expert_parallel)."""

    param_dtype: str
    grad_dtype: str
    expert: bool = False


@dataclass(frozen=True)
class BufferLayout:
    """Layout of one contiguous param/grad buffer.

    `index[name] = (start, end, bucket)`; `buckets[b] = (start, end)` with end padded;
    `numel_unpadded[b] = last param end - bucket start`; `order` = registration order.
    """

    order: tuple[str, ...]
    index: dict[str, tuple[int, int, int]]
    buckets: list[tuple[int, int]]
    numel_unpadded: list[int]
    dp_size: int

    @property
    def numel(self) -> int:
        """Total buffer numel (end of the last bucket)."""
        return self.buckets[-1][1] if self.buckets else 0

    def per_bucket_numel(self) -> list[int]:
        """Padded numel of each bucket (`per_bucket_numel` in a `dp_reshardable` checkpoint)."""
        return [e - s for s, e in self.buckets]

    def shard_size(self, bucket: int) -> int:
        """Elements each DP rank owns of `bucket`."""
        s, e = self.buckets[bucket]
        return (e - s) // self.dp_size

    def dp_range(self, bucket: int, r: int) -> tuple[int, int]:
        """World (buffer) range of `bucket` that DP rank r owns.

        >>> buffer_layout([BufferParam("w", 240)], None, 2).dp_range(0, 1)
        (128, 256)
        """
        if not 0 <= r < self.dp_size:
            raise BridgeError(f"DP rank {r} outside the DistOpt group of size {self.dp_size}")
        s, _ = self.buckets[bucket]
        n = self.shard_size(bucket)
        return s + r * n, s + (r + 1) * n

    def params_in_offset_order(self) -> list[str]:
        """Parameters by ascending buffer offset (reverse registration order)."""
        return list(reversed(self.order))

    @cached_property
    def _by_offset(self) -> tuple[list[str], list[int]]:
        names = sorted(self.index, key=lambda n: (self.index[n][0], self.index[n][1]))
        return names, [self.index[n][1] for n in names]


def buffer_layout(params: Sequence[BufferParam], bucket_size: int | None, dp_size: int,
                  pad_for_high_nccl_busbw: bool = False) -> BufferLayout:
    """Lay out one buffer's params (given in registration order) as Megatron does.

    >>> lay = buffer_layout([BufferParam("a", 100), BufferParam("b", 10)], bucket_size=None, dp_size=2)
    >>> lay.index, lay.buckets, lay.numel_unpadded
    ({'b': (0, 10, 0), 'a': (64, 164, 0)}, [(0, 256)], [164])
    """
    if dp_size < 1:
        raise BridgeError(f"DistOpt group size {dp_size} must be >= 1")
    if bucket_size is not None and bucket_size < 1:
        raise BridgeError(f"bucket_size={bucket_size} must be >= 1 or None (one bucket)")
    div = bucket_end_divisor(dp_size, pad_for_high_nccl_busbw)
    names = [p.name for p in params]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise BridgeError(f"DistOpt buffer: parameter names {dup[:3]} appear twice; give every parameter a unique name")
    index: dict[str, tuple[int, int, int]] = {}
    buckets: list[tuple[int, int]] = []
    unpadded: list[int] = []
    start = bstart = bid = in_bucket = 0
    end = 0

    def finalize(last_end: int) -> int:
        unpadded.append(last_end - bstart)
        bend = _ceil_to(last_end, div)
        buckets.append((bstart, bend))
        return bend

    for p in reversed(params):
        if p.numel < 0:
            raise BridgeError(f"DistOpt buffer: parameter {p.name} has negative numel {p.numel}")
        start = _ceil_to(start, PARAM_ALIGN)
        if p.shared_embedding and in_bucket:
            bstart = finalize(start)
            bid += 1
            in_bucket = 0
            start = bstart
        end = start + p.numel
        index[p.name] = (start, end, bid)
        in_bucket += 1
        if (bucket_size is not None and end - bstart >= bucket_size) or p.shared_embedding:
            bstart = finalize(end)
            bid += 1
            in_bucket = 0
            start = bstart
        else:
            start = end
    if in_bucket:
        finalize(end)
    return BufferLayout(tuple(names), index, buckets, unpadded, dp_size)


class OwnedRange(NamedTuple):
    """What DP rank r owns of one parameter (Megatron's `param_range_map` entry).

    `param` = flat range [f0, f1) in the physical shard; `gbuf_world` = buffer range;
    `gbuf_local` = range inside this rank's shard of the bucket.
    """

    name: str
    bucket: int
    param: tuple[int, int]
    gbuf_world: tuple[int, int]
    gbuf_local: tuple[int, int]


def owned_ranges(layout: BufferLayout, r: int) -> list[OwnedRange]:
    """Every (param, flat range) DP rank r owns, by ascending buffer offset.

    >>> lay = buffer_layout([BufferParam("w", 240)], None, 2)        # §4.5, W[10,60]
    >>> [o.param for o in owned_ranges(lay, 0)], [o.param for o in owned_ranges(lay, 1)]
    ([(0, 128)], [(128, 240)])
    """
    out: list[OwnedRange] = []
    names, ends = layout._by_offset
    for b in range(len(layout.buckets)):
        w0, w1 = layout.dp_range(b, r)
        # params are disjoint and sorted by offset: start at the first one ending after w0
        for i in range(bisect_right(ends, w0), len(names)):
            name = names[i]
            p0, p1, pb = layout.index[name]
            if p0 >= w1:
                break
            if pb != b:
                continue
            ls = max(0, p0 - w0)
            le = min(w1 - w0, p1 - w0)
            if le > ls:
                sub = max(0, w0 - p0)
                out.append(OwnedRange(name, b, (sub, sub + le - ls), (w0 + ls, w0 + le), (ls, le)))
    return out


def owners_of(layout: BufferLayout, name: str) -> list[tuple[int, tuple[int, int]]]:
    """(DP rank, flat range) pairs that together own parameter `name`, in flat order.

    >>> owners_of(buffer_layout([BufferParam("w", 240)], None, 2), "w")
    [(0, (0, 128)), (1, (128, 240))]
    """
    p0, p1, b = layout.index[name]
    s, _ = layout.buckets[b]
    n = layout.shard_size(b)
    out = []
    if p1 == p0:
        return out
    for r in range((p0 - s) // n, (p1 - 1 - s) // n + 1):
        w0, w1 = s + r * n, s + (r + 1) * n
        out.append((r, (max(p0, w0) - p0, min(p1, w1) - p0)))
    return out


@dataclass(frozen=True)
class DistOptParam:
    """A parameter as DDP sees it: name, physical numel, dtypes, expert flag, shared embedding."""

    name: str
    numel: int
    param_dtype: str = "bfloat16"
    expert: bool = False
    shared_embedding: bool = False


def group_buffers(params: Iterable[DistOptParam], grad_reduce_in_fp32: bool = True) -> dict[BufferKey, list[BufferParam]]:
    """Group params (registration order) into buffers, keys in first-appearance order (= gbuf_idx).

    >>> g = group_buffers([DistOptParam("a", 4), DistOptParam("e", 4, expert=True), DistOptParam("b", 4)])
    >>> [(k.expert, [p.name for p in v]) for k, v in g.items()]
    [(False, ['a', 'b']), (True, ['e'])]
    """
    out: dict[BufferKey, list[BufferParam]] = {}
    for p in params:
        key = BufferKey(p.param_dtype, "float32" if grad_reduce_in_fp32 else p.param_dtype, p.expert)
        out.setdefault(key, []).append(BufferParam(p.name, p.numel, p.shared_embedding))
    return out


def distopt_layouts(params: Iterable[DistOptParam], bucket_size: int | None, dp_size: int, edp_size: int,
                    grad_reduce_in_fp32: bool = True, pad_for_high_nccl_busbw: bool = False) -> dict[BufferKey, BufferLayout]:
    """Every buffer of one model chunk: dense buffers shard over `dp_size` (DP×CP), expert over `edp_size`."""
    return {k: buffer_layout(v, bucket_size, edp_size if k.expert else dp_size, pad_for_high_nccl_busbw)
            for k, v in group_buffers(params, grad_reduce_in_fp32).items()}
