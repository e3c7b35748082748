"""Chunk-ownership planning: holdings of every rank -> chunk grid, one owner per chunk, transfers.

Every chunk of a logical array gets exactly one writer (docs/format.md: two writers of one chunk lose
data at the OCDBT merge). Given the boxes each rank holds (pieces of physical shards or of DP
flat fragments; replicas allowed), `plan_ownership`:
1. picks an outer chunk shape that follows the holders' layout (`choose_chunk_shape`);
2. gives each chunk to a rank holding (nearly) the most of it, the least loaded among those, so
   owners write mostly what they already hold and load spreads over ranks and arrays;
3. lists the transfers that complete each owner's chunks: every element of a chunk the owner
   lacks comes from exactly one holder (no duplicates when replicas exist).

>>> plan = plan_ownership((8, 4), {0: [Box((0, 0), (4, 4))], 1: [Box((4, 0), (7, 4))], 2: [Box((7, 0), (8, 4))]},
...                       itemsize=4, chunk_shape=(4, 4))
>>> plan.ownership.chunk_shape, plan.ownership.owners.ravel().tolist()
((4, 4), [0, 1])
>>> [(str(t.box), t.src, t.dst) for t in plan.transfers]
[('[7:8, 0:4]', 2, 1)]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import product
from operator import add, floordiv, sub
from math import gcd, prod
from typing import Iterable, Mapping, NamedTuple, Sequence

import numpy as np

from bridge.errors import BridgeError
from bridge.layout.boxes import Box
from bridge.layout.bulk import paused_gc
from bridge.layout.chunks import ArrayOwnership
from bridge.layout.rectangles import trusted_box

DEFAULT_TARGET_CHUNK_BYTES = 4 << 20


class RegionMove(NamedTuple):
    """Region `box` (global coordinates, inside one chunk) moves from rank `src` to owner `dst`."""

    box: Box
    src: int
    dst: int


@dataclass
class OwnershipPlan:
    """Chunk grid + owners of one array and the transfers that make owners hold whole chunks."""

    ownership: ArrayOwnership
    transfers: list[RegionMove] = field(default_factory=list)

    def moved_elements(self) -> int:
        return sum(t.box.size for t in self.transfers)


def box_difference(a: Box, b: Box) -> list[Box]:
    """`a` minus `b` as at most 2·ndim disjoint boxes.

    >>> [str(x) for x in box_difference(Box((0, 0), (4, 4)), Box((1, 1), (3, 3)))]
    ['[0:1, 0:4]', '[3:4, 0:4]', '[1:3, 0:1]', '[1:3, 3:4]']
    """
    if a.size == 0:
        return [a]
    return [trusted_box(s, e) for s, e in _diff(a.start, a.stop, b.start, b.stop)]


def _isect(a0: tuple, a1: tuple, b0: tuple, b1: tuple):
    lo = tuple(x if x > y else y for x, y in zip(a0, b0))
    hi = tuple(x if x < y else y for x, y in zip(a1, b1))
    for x, y in zip(lo, hi):
        if y <= x:
            return None
    return lo, hi


def _diff(a0: tuple, a1: tuple, b0: tuple, b1: tuple) -> list[tuple[tuple, tuple]]:
    """(start, stop) pairs of box a minus box b (slabs along each dim in turn)."""
    inter = _isect(a0, a1, b0, b1)
    if inter is None:
        return [(a0, a1)]
    i0, i1 = inter
    out = []
    lo, hi = list(a0), list(a1)
    for d in range(len(a0)):
        if lo[d] < i0[d]:
            out.append((tuple(lo), tuple(hi[:d]) + (i0[d],) + tuple(hi[d + 1:])))
        if i1[d] < hi[d]:
            out.append((tuple(lo[:d]) + (i1[d],) + tuple(lo[d + 1:]), tuple(hi)))
        lo[d], hi[d] = i0[d], i1[d]
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
      splits of row-parallel weights); single-row boxes (ends of DP flat fragments) are ignored.
    - The row dim (first non-stacked dim): as many rows as fit `target_bytes`, snapped to a
      divisor of the *shard* boundaries (rows where one aligned box ends and another begins:
      GTP / TP shard edges, not the partial-row cuts of DP fragments) while chunks stay at least
      `target_bytes / 16`; smaller arrays stay one chunk.

    >>> choose_chunk_shape((4, 10, 6), [Box((0, 0, 0), (1, 10, 3)), Box((0, 0, 3), (1, 10, 6))], 4, 64)
    (1, 5, 3)
    >>> choose_chunk_shape((1024, 8), [Box((0, 0), (300, 8)), Box((300, 0), (301, 5)),   # DP cut at row 300
    ...                                Box((300, 5), (301, 8)), Box((301, 0), (512, 8)), Box((512, 0), (1024, 8))], 4, 16384)
    (512, 8)
    """
    return _choose_chunk(tuple(int(s) for s in shape), [(b.start, b.stop) for b in boxes], itemsize, target_bytes)


def _choose_chunk(shape: tuple[int, ...], spans: list[tuple[tuple, tuple]], itemsize: int,
                  target_bytes: int) -> tuple[int, ...]:
    """`choose_chunk_shape` on (start, stop) pairs."""
    if not shape:
        return ()
    nd = len(shape)
    lead = 0
    while lead < nd - 1 and shape[lead] > 1 and spans and all(e[lead] - s[lead] == 1 for s, e in spans):
        lead += 1
    chunk = [1] * lead + [max(1, x) for x in shape[lead:]]
    multi = [(s, e) for s, e in spans if e[lead] - s[lead] > 1] or spans
    for d in range(lead + 1, nd):
        g = shape[d]
        for s, e in multi:
            g = gcd(g, s[d], e[d])
        chunk[d] = max(1, g)
    inner = max(1, prod(chunk[lead + 1:]) * itemsize)
    rows = max(1, min(shape[lead], target_bytes // inner))
    starts, ends = set(), set()
    trail = range(lead + 1, nd)
    for s, e in spans:  # boxes covering whole chunks in the trailing dims
        if all(s[d] % chunk[d] == 0 and (e[d] % chunk[d] == 0 or e[d] == shape[d]) for d in trail):
            starts.add(s[lead])
            ends.add(e[lead])
    g = 0
    for x in (starts & ends) - {0, shape[lead]}:
        g = gcd(g, x)
    if g:
        snapped = _largest_divisor_at_most(g, rows)
        # smaller chunks beat moving data across ranks, down to target/16 per chunk
        if snapped * inner * 16 >= target_bytes:
            rows = snapped
    chunk[lead] = rows
    return tuple(chunk)


def _holdings_list(holdings) -> list[tuple[int, Box]]:
    if isinstance(holdings, Mapping):
        return [(int(r), b) for r, bs in holdings.items() for b in bs]
    return [(int(r), b) for r, b in holdings]


def _vol(start: tuple[int, ...], stop: tuple[int, ...]) -> int:
    v = 1
    for x, y in zip(start, stop):
        v *= y - x
    return v


def plan_ownership(shape: Sequence[int], holdings, itemsize: int = 4, *,
                   target_chunk_bytes: int = DEFAULT_TARGET_CHUNK_BYTES, chunk_shape: Sequence[int] | None = None,
                   load: dict[int, int] | None = None, slack: float = 0.25, name: str = "array") -> OwnershipPlan:
    """Chunk grid, owners and transfers for one array.

    `holdings`: {rank: [Box]} or [(rank, Box)] in global coordinates; replicas (several ranks
    holding the same region) are allowed, one rank's own boxes must not overlap. `load`
    (elements owned so far per rank) is updated, so one dict passed over many arrays balances
    them. A chunk goes to the least-loaded rank among those holding at least (1 - slack) of what
    its best holder holds. BridgeError (naming the array and region) when nobody holds a region.
    """
    shape = tuple(int(s) for s in shape)
    load = {} if load is None else load
    nd = len(shape)
    hold = []
    for r, b in _holdings_list(holdings):
        st, sp = b.start, b.stop
        if len(st) != nd or any(x < 0 or y > n or y < x for x, y, n in zip(st, sp, shape)):
            raise BridgeError(f"{name}: rank {r} holds box {b}, outside the array of shape {shape}")
        v = _vol(st, sp)
        if v:
            hold.append((r, st, sp, v))
    if not shape:  # 0-d: one chunk
        ranks = sorted({r for r, *_ in hold})
        if not ranks:
            raise BridgeError(f"{name}: no rank holds this scalar; pass every rank's holdings")
        owner = min(ranks, key=lambda r: (load.get(r, 0), r))
        load[owner] = load.get(owner, 0) + 1
        return OwnershipPlan(ArrayOwnership((), (), np.array(owner, dtype=np.int32)), [])
    chunk = tuple(int(c) for c in chunk_shape) if chunk_shape is not None else \
        _choose_chunk(shape, [(st, sp) for _, st, sp, _ in hold], itemsize, target_chunk_bytes)
    grid = tuple(-(-s // c) for s, c in zip(shape, chunk))
    nchunks = prod(grid)
    parts = _parts_by_chunk(hold, chunk)
    if len(parts) != nchunks and 0 not in shape:
        missing = next(k for k in np.ndindex(*grid) if k not in parts)
        raise BridgeError(f"{name}: no rank holds region {_chunk_box(missing, chunk, shape)}; pass every rank's "
                          f"holdings (pieces must cover the array)")
    owners = np.zeros(grid, dtype=np.int32)
    transfers: list[RegionMove] = []
    for key in sorted(parts):
        plist = parts[key]
        c0 = tuple(k * c for k, c in zip(key, chunk))
        c1 = tuple(min(x + c, n) for x, c, n in zip(c0, chunk, shape))
        csize = _vol(c0, c1)
        held: dict[int, int] = {}
        for r, _, _, v in plist:
            held[r] = held.get(r, 0) + v
        if len(held) == 1:
            owner = plist[0][0]
        else:
            best = max(held.values())
            owner = min((r for r, v in held.items() if v >= best * (1 - slack)),
                        key=lambda r: (load.get(r, 0), -held[r], r))
        owners[key] = owner
        load[owner] = load.get(owner, 0) + csize
        if held[owner] != csize:  # else the owner already holds the whole chunk
            transfers.extend(_chunk_transfers(plist, owner, sum(held.values()) == csize, c0, c1, load, name))
    return OwnershipPlan(ArrayOwnership(shape, chunk, owners), transfers)


def _parts_by_chunk(hold: list[tuple[int, tuple, tuple, int]],
                    chunk: tuple[int, ...]) -> dict[tuple[int, ...], list[tuple[int, tuple, tuple, int]]]:
    """The (rank, start, stop, volume) holdings cut along the chunk grid, keyed by chunk index.

    >>> _parts_by_chunk([(0, (0,), (6,), 6)], (4,))
    {(0,): [(0, (0,), (4,), 4)], (1,): [(0, (4,), (6,), 2)]}
    """
    parts: dict[tuple[int, ...], list[tuple[int, tuple, tuple, int]]] = {}
    ones = (1,) * len(chunk)
    cm1 = tuple(c - 1 for c in chunk)
    for h in hold:
        r, st, sp, v = h
        lo = tuple(map(floordiv, st, chunk))
        hi = tuple(map(floordiv, map(add, sp, cm1), chunk))
        if lo == tuple(map(sub, hi, ones)):  # most holdings fall in one chunk: no cutting
            lst = parts.get(lo)
            if lst is None:
                parts[lo] = [h]
            else:
                lst.append(h)
            continue
        for key in product(*(range(x, y) for x, y in zip(lo, hi))):
            s0 = tuple(max(x, k * c) for x, k, c in zip(st, key, chunk))
            s1 = tuple(min(y, (k + 1) * c) for y, k, c in zip(sp, key, chunk))
            parts.setdefault(key, []).append((r, s0, s1, _vol(s0, s1)))
    return parts


def _chunk_transfers(plist: list[tuple[int, tuple, tuple, int]], owner: int, exact_cover: bool, c0: tuple,
                     c1: tuple, load: dict[int, int], name: str) -> list[RegionMove]:
    """Transfers that bring the owner of chunk [c0, c1) what it lacks, from the least-loaded holders.

    `exact_cover`: the parts' volumes add up to the chunk's, so disjoint parts tile it and are
    sent as they are; otherwise the owner's own parts are cut away and each remaining region is
    taken from the first holder (by load) that has it.

    >>> [(str(t.box), t.src, t.dst) for t in _chunk_transfers(
    ...     [(0, (0,), (4,), 4), (1, (2,), (8,), 6)], 0, False, (0,), (8,), {}, "a")]
    [('[4:8]', 1, 0)]
    """
    if exact_cover and _disjoint(plist):
        return [RegionMove(trusted_box(st, sp), r, owner) for r, st, sp, _ in plist if r != owner]
    out = []
    needed = [(c0, c1)]
    for r, st, sp, _ in plist:
        if r == owner:
            needed = [x for n0, n1 in needed for x in _diff(n0, n1, st, sp)]
    for r, st, sp, _ in sorted(plist, key=lambda h: (load.get(h[0], 0), h[0])):
        if r == owner or not needed:
            continue
        rest = []
        for n0, n1 in needed:
            inter = _isect(n0, n1, st, sp)
            if inter is None:
                rest.append((n0, n1))
                continue
            out.append(RegionMove(trusted_box(*inter), r, owner))
            rest.extend(_diff(n0, n1, st, sp))
        needed = rest
    if needed:
        raise BridgeError(f"{name}: no rank holds region {trusted_box(*needed[0])} (chunk {trusted_box(c0, c1)}); "
                          f"pass every rank's holdings (pieces must cover the array)")
    return out


def _disjoint(plist: list[tuple[int, tuple, tuple, int]]) -> bool:
    for i in range(len(plist)):
        _, a0, a1, _ = plist[i]
        for j in range(i + 1, len(plist)):
            if _isect(a0, a1, plist[j][1], plist[j][2]) is not None:
                return False
    return True


def _chunk_box(key: tuple[int, ...], chunk: tuple[int, ...], shape: tuple[int, ...]) -> Box:
    return trusted_box(tuple(k * c for k, c in zip(key, chunk)),
                       tuple(min((k + 1) * c, n) for k, c, n in zip(key, chunk, shape)))


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
    with paused_gc():
        return {name: plan_ownership(shape, h, itemsize, target_chunk_bytes=target_chunk_bytes, load=load, name=name)
                for name, (shape, h, itemsize) in arrays.items()}
