"""Chunk-ownership planning: holdings of every rank -> chunk grid, one owner per chunk, transfers.

Every chunk of a logical array gets exactly one writer (DESIGN.md: two writers of one chunk lose
data at the OCDBT merge). Given the boxes each rank holds (pieces of physical shards or of DP
flat fragments; replicas allowed), `plan_ownership`:
1. picks an outer chunk shape that follows the holders' layout (`choose_chunk_shape`);
2. gives each chunk to a rank holding (nearly) the most of it, the least loaded among those, so
   owners write mostly what they already hold and load spreads over ranks and arrays;
3. lists the transfers that complete each owner's chunks: every element of a chunk the owner
   lacks comes from exactly one holder (no duplicates when replicas exist).

>>> plan = plan_ownership((8, 4), {0: [Box((0, 0), (5, 4))], 1: [Box((5, 0), (8, 4))]}, itemsize=4,
...                       target_chunk_bytes=64)
>>> plan.ownership.chunk_shape, plan.ownership.owners.ravel().tolist()
((4, 4), [0, 1])
>>> [(str(t.box), t.src, t.dst) for t in plan.transfers]
[('[4:5, 0:4]', 0, 1)]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import gcd, prod
from typing import Iterable, Mapping, Sequence

import numpy as np

from bridge.errors import BridgeError
from bridge.layout.boxes import Box
from bridge.layout.chunks import ArrayOwnership

DEFAULT_TARGET_CHUNK_BYTES = 4 << 20


@dataclass(frozen=True)
class Transfer:
    """Region `box` (global coordinates, inside one chunk) moves from rank `src` to owner `dst`."""

    box: Box
    src: int
    dst: int


@dataclass
class OwnershipPlan:
    """Chunk grid + owners of one array and the transfers that make owners hold whole chunks."""

    ownership: ArrayOwnership
    transfers: list[Transfer] = field(default_factory=list)

    def moved_elements(self) -> int:
        return sum(t.box.size for t in self.transfers)


def box_difference(a: Box, b: Box) -> list[Box]:
    """`a` minus `b` as at most 2·ndim disjoint boxes.

    >>> [str(x) for x in box_difference(Box((0, 0), (4, 4)), Box((1, 1), (3, 3)))]
    ['[0:1, 0:4]', '[3:4, 0:4]', '[1:3, 0:1]', '[1:3, 3:4]']
    """
    inter = a.intersect(b)
    if inter is None:
        return [a]
    out = []
    lo, hi = list(a.start), list(a.stop)
    for d in range(a.ndim):
        if lo[d] < inter.start[d]:
            out.append(Box(tuple(lo[:d]) + (lo[d],) + tuple(lo[d + 1:]),
                           tuple(hi[:d]) + (inter.start[d],) + tuple(hi[d + 1:])))
        if inter.stop[d] < hi[d]:
            out.append(Box(tuple(lo[:d]) + (inter.stop[d],) + tuple(lo[d + 1:]),
                           tuple(hi[:d]) + (hi[d],) + tuple(hi[d + 1:])))
        lo[d], hi[d] = inter.start[d], inter.stop[d]
    return out


def _largest_divisor_at_most(n: int, cap: int) -> int:
    best, i = 1, 1
    while i * i <= n:
        if n % i == 0:
            for d in (i, n // i):
                if best < d <= cap:
                    best = d
        i += 1
    return best


def choose_chunk_shape(shape: Sequence[int], boxes: Iterable[Box], itemsize: int,
                       target_bytes: int = DEFAULT_TARGET_CHUNK_BYTES) -> tuple[int, ...]:
    """Outer chunk shape that follows the holders' boxes.

    - Leading dims in which every box has extent 1 (stacked layer / expert axes): chunk 1.
    - Later dims: cut at the common divisor of the boundaries of *multi-row* boxes (TP column
      splits of row-parallel weights); partial-row boxes of DP fragments are ignored there.
    - The row dim (first non-stacked dim): as many rows as fit `target_bytes`, snapped to a
      divisor of the multi-row boxes' row boundaries when that loses at most 2x in size.

    >>> choose_chunk_shape((4, 10, 6), [Box((0, 0, 0), (1, 10, 3)), Box((0, 0, 3), (1, 10, 6))], 4, 64)
    (1, 5, 3)
    """
    shape = tuple(int(s) for s in shape)
    if not shape:
        return ()
    boxes = list(boxes)
    nd = len(shape)
    lead = 0
    while lead < nd - 1 and shape[lead] > 1 and boxes and all(b.shape[lead] == 1 for b in boxes):
        lead += 1
    chunk = [1] * lead + [max(1, s) for s in shape[lead:]]
    multi = [b for b in boxes if b.shape[lead] > 1] or boxes
    for d in range(lead + 1, nd):
        g = shape[d]
        for b in multi:
            g = gcd(g, b.start[d], b.stop[d])
        chunk[d] = max(1, g)
    inner = max(1, prod(chunk[lead + 1:]) * itemsize)
    rows = max(1, min(shape[lead], target_bytes // inner))
    if rows < shape[lead]:
        g = 0
        for b in multi:
            g = gcd(g, b.start[lead], b.stop[lead] if b.stop[lead] < shape[lead] else 0)
        if g:
            snapped = _largest_divisor_at_most(g, rows)
            if snapped * 2 >= rows:
                rows = snapped
    chunk[lead] = rows
    return tuple(chunk)


def _holdings_list(holdings) -> list[tuple[int, Box]]:
    if isinstance(holdings, Mapping):
        return [(int(r), b) for r, bs in holdings.items() for b in bs if not b.empty]
    return [(int(r), b) for r, b in holdings if not b.empty]


def plan_ownership(shape: Sequence[int], holdings, itemsize: int = 4, *,
                   target_chunk_bytes: int = DEFAULT_TARGET_CHUNK_BYTES, chunk_shape: Sequence[int] | None = None,
                   load: dict[int, int] | None = None, slack: float = 0.25, name: str = "array") -> OwnershipPlan:
    """Chunk grid, owners and transfers for one array.

    `holdings`: {rank: [Box]} or [(rank, Box)] in global coordinates (replicas allowed). `load`
    (elements owned so far per rank) is updated, so passing one dict over many arrays balances
    them. A chunk goes to the least-loaded rank among those holding at least (1 - slack) of what
    its best holder holds. BridgeError when some region is held by nobody.
    """
    shape = tuple(int(s) for s in shape)
    hold = _holdings_list(holdings)
    load = {} if load is None else load
    for r, b in hold:
        if b.ndim != len(shape) or not Box.full(shape).contains(b):
            raise BridgeError(f"{name}: rank {r} holds box {b}, outside the array of shape {shape}")
    if not shape:  # 0-d: one chunk
        ranks = sorted({r for r, _ in hold})
        if not ranks:
            raise BridgeError(f"{name}: no rank holds this scalar; pass every rank's holdings")
        owner = min(ranks, key=lambda r: (load.get(r, 0), r))
        load[owner] = load.get(owner, 0) + 1
        return OwnershipPlan(ArrayOwnership((), (), np.array(owner, dtype=np.int32)), [])
    chunk = tuple(int(c) for c in chunk_shape) if chunk_shape is not None else \
        choose_chunk_shape(shape, (b for _, b in hold), itemsize, target_chunk_bytes)
    grid = tuple(-(-s // c) for s, c in zip(shape, chunk))
    owners = np.full(grid, -1, dtype=np.int32)
    own = ArrayOwnership(shape, chunk, np.zeros(grid, dtype=np.int32))
    # parts of each holding per chunk
    parts: dict[tuple[int, ...], list[tuple[int, Box]]] = {}
    for r, b in hold:
        sl = own.chunks_touching(b)
        if all(s.stop - s.start == 1 for s in sl):
            parts.setdefault(tuple(s.start for s in sl), []).append((r, b))
            continue
        for idx in np.ndindex(*(s.stop - s.start for s in sl)):
            key = tuple(s.start + i for s, i in zip(sl, idx))
            part = b.intersect(own.chunk_box(key))
            if part is not None:
                parts.setdefault(key, []).append((r, part))
    transfers: list[Transfer] = []
    for key in np.ndindex(*grid):
        cbox = own.chunk_box(key)
        if cbox.empty:
            owners[key] = 0
            continue
        plist = parts.get(key)
        if not plist:
            raise BridgeError(f"{name}: no rank holds region {cbox}; pass every rank's holdings "
                              f"(pieces must cover the array)")
        held: dict[int, int] = {}
        for r, p in plist:
            held[r] = held.get(r, 0) + p.size
        best = max(held.values())
        cands = [r for r, v in held.items() if v >= best * (1 - slack)]
        owner = min(cands, key=lambda r: (load.get(r, 0), -held[r], r))
        owners[key] = owner
        load[owner] = load.get(owner, 0) + cbox.size
        needed = [cbox]
        for r, p in plist:
            if r == owner:
                needed = [x for n in needed for x in box_difference(n, p)]
        for r, p in sorted(plist, key=lambda rp: (load.get(rp[0], 0), rp[0])):
            if r == owner or not needed:
                continue
            rest = []
            for n in needed:
                inter = n.intersect(p)
                if inter is None:
                    rest.append(n)
                    continue
                transfers.append(Transfer(inter, r, owner))
                rest.extend(box_difference(n, p))
            needed = rest
        if needed:
            raise BridgeError(f"{name}: no rank holds region {needed[0]} (chunk {cbox}); pass every rank's holdings "
                              f"(pieces must cover the array)")
    return OwnershipPlan(ArrayOwnership(shape, chunk, owners), transfers)


def plan_ownership_many(arrays: Mapping[str, tuple[Sequence[int], object, int]], *,
                        target_chunk_bytes: int = DEFAULT_TARGET_CHUNK_BYTES,
                        load: dict[int, int] | None = None) -> dict[str, OwnershipPlan]:
    """`plan_ownership` over many arrays {name: (shape, holdings, itemsize)} with one shared load.

    >>> plans = plan_ownership_many({"a": ((2,), {0: [Box((0,), (2,))], 1: [Box((0,), (2,))]}, 4),
    ...                              "b": ((2,), {0: [Box((0,), (2,))], 1: [Box((0,), (2,))]}, 4)})
    >>> [int(p.ownership.owners[0]) for p in plans.values()]       # replicas: spread over ranks
    [0, 1]
    """
    load = {} if load is None else load
    return {name: plan_ownership(shape, h, itemsize, target_chunk_bytes=target_chunk_bytes, load=load, name=name)
            for name, (shape, h, itemsize) in arrays.items()}
