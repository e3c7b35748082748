"""PURE global export plan: every rank computes the same plan from every rank's holdings summary.

Steps (no torch, no I/O):
1. merge the ranks' catalogs (same shape and dtype everywhere, else BridgeError naming the array);
2. elect one source among identical copies of a piece (DP / TP / GTP replicas; `main_replica`
   flags when the run gives them, else the first holder in rank order);
3. check that the elected pieces tile every array exactly (a gap or overlap names the array);
4. ask the layout engine's ownership planner for chunk grids and owners;
5. cut every piece along chunk boundaries into `Transfer`s (source rank, holding, piece, sub-box,
   destination = chunk owner); a rank's sends to each peer follow the plan order, so receivers
   know every split without a size exchange.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import product
from math import gcd, prod
from typing import Sequence

import numpy as np

from bridge.errors import BridgeError
from bridge.layout.boxes import Box
from bridge.layout.chunks import ArrayOwnership
from bridge.live.holdings import ROOT_PATHS
from bridge.store.plan import ArraySpec
from bridge.store.specs import ITEMSIZE
from bridge.store.tree import megatron_key_to_path, name_to_path


@dataclass(frozen=True)
class Source:
    """An elected piece: `rank`'s holding `holding`, piece `piece`, covering `box` of `array`."""

    array: str  # Orbax name (root included)
    box: Box
    rank: int
    holding: int
    piece: int
    local_start: int


@dataclass(frozen=True)
class Transfer:
    """Part `box` (global coordinates, inside one chunk) of source piece `src` going to `dst`."""

    src: Source
    box: Box
    dst: int

    @property
    def array(self) -> str:
        return self.src.array


@dataclass
class ExportPlan:
    """The plan every rank holds: catalog, ownership per array, transfers by (src, dst)."""

    world: int
    catalog: list[ArraySpec]
    ownership: dict[str, ArrayOwnership]
    transfers: list[Transfer]
    itemsize: dict[str, int] = field(default_factory=dict)

    def sends(self, rank: int, dst: int) -> list[Transfer]:
        return [t for t in self.transfers if t.src.rank == rank and t.dst == dst]

    def split_bytes(self, src: int, dst: int) -> int:
        return sum(t.box.size * self.itemsize[t.array] for t in self.transfers if t.src.rank == src and t.dst == dst)

    def send_splits(self, rank: int) -> list[int]:
        return [0 if d == rank else self.split_bytes(rank, d) for d in range(self.world)]

    def recv_splits(self, rank: int) -> list[int]:
        return [0 if s == rank else self.split_bytes(s, rank) for s in range(self.world)]

    def moved_bytes(self) -> int:
        """Bytes that cross ranks (what the exchange carries)."""
        return sum(t.box.size * self.itemsize[t.array] for t in self.transfers if t.src.rank != t.dst)

    def written_bytes(self, rank: int) -> int:
        return sum(t.box.size * self.itemsize[t.array] for t in self.transfers if t.dst == rank)


def array_path(name: str) -> tuple[str, ...]:
    return name_to_path(name)


def merge_catalogs(summaries: Sequence[dict]) -> list[ArraySpec]:
    """Union of the ranks' catalogs in a deterministic order; disagreement is a BridgeError."""
    merged: dict[str, tuple[tuple[int, ...], str, int]] = {}
    for rank, s in enumerate(summaries):
        for name, (shape, dtype) in s["catalog"].items():
            shape = tuple(int(x) for x in shape)
            prev = merged.get(name)
            if prev is None:
                merged[name] = (shape, dtype, rank)
            elif prev[:2] != (shape, dtype):
                raise BridgeError(f"{name}: rank {prev[2]} holds it as {prev[1]}{list(prev[0])}, rank {rank} as "
                                  f"{dtype}{list(shape)}; every rank must describe a parameter with the same geometry and dtype")
    root_order = {ROOT_PATHS[r]: i for i, r in enumerate(ROOT_PATHS)}

    def order(name: str):
        path = array_path(name)
        for prefix, i in root_order.items():
            if path[:len(prefix)] == prefix:
                return (i, path[len(prefix):])
        return (len(root_order), path)

    return [ArraySpec(array_path(n), merged[n][0], merged[n][1]) for n in sorted(merged, key=order)]


def elect_sources(summaries: Sequence[dict], tree_name) -> list[Source]:
    """One source per distinct (array, box); replicas must hold identical boxes.

    `tree_name(root, array)` maps a holding's root and logical array to the Orbax name.
    """
    groups: dict[tuple[str, Box], list[tuple[Source, bool | None]]] = {}
    for rank, s in enumerate(summaries):
        for h_idx, h in enumerate(s["holdings"]):
            for p_idx, (array, start, stop, local_start) in enumerate(h["pieces"]):
                name = tree_name(h["root"], array)
                box = Box(tuple(start), tuple(stop))
                src = Source(name, box, rank, h_idx, p_idx, int(local_start))
                groups.setdefault((name, box), []).append((src, h["main"]))
    out = []
    load: dict[int, int] = {}  # elements elected per rank: spread replicated data over its holders
    for (name, box), cands in groups.items():
        flags = [f for _, f in cands]
        if any(f is not None for f in flags):
            mains = [c for c, f in cands if f]
            if len(mains) != 1:
                ranks = [c.rank for c, f in cands]
                raise BridgeError(f"{name}: region {box} is held by ranks {ranks} of which {len(mains)} are marked "
                                  "main_replica; mark exactly one copy (or leave main_replica None on all)")
            pick = mains[0]
        else:
            pick = min((c for c, _ in cands), key=lambda c: (load.get(c.rank, 0), c.rank))
        load[pick.rank] = load.get(pick.rank, 0) + box.size
        out.append(pick)
    out.sort(key=lambda s: (s.array, s.box.start))
    return out


def check_tiling(catalog: Sequence[ArraySpec], sources: Sequence[Source]) -> None:
    """The elected pieces cover every array exactly once (BridgeError naming array and region)."""
    by_array: dict[str, list[Box]] = {}
    for s in sources:
        by_array.setdefault(s.array, []).append(s.box)
    for spec in catalog:
        boxes = by_array.pop(spec.name, [])
        total = sum(b.size for b in boxes)
        size = prod(spec.shape)
        if total == size and _disjoint(boxes):
            continue
        hit = np.zeros(spec.shape, dtype=np.int32)
        for b in boxes:
            hit[b.slices] += 1
        if (hit > 1).any():
            idx = tuple(int(i) for i in np.argwhere(hit > 1)[0])
            raise BridgeError(f"{spec.name}: element {idx} is held by two ranks with different boxes; replicas must "
                              "describe identical shards (check geometry / optimizer ranges)")
        idx = tuple(int(i) for i in np.argwhere(hit == 0)[0])
        what = "optimizer state" if not spec.name.startswith("model.") else "weight data"
        raise BridgeError(f"{spec.name}: no rank holds {what} for element {idx} ({int((hit == 0).sum())} of {size} "
                          "missing); pass every rank's shard / optimizer fragment")
    if by_array:
        name = next(iter(by_array))
        raise BridgeError(f"{name}: pieces were produced for an array that is not in the catalog (internal error)")


def _disjoint(boxes: Sequence[Box]) -> bool:
    """True when no two boxes overlap (sweep along dim 0; boxes are few per array)."""
    if not boxes or boxes[0].ndim == 0:
        return len(boxes) <= 1
    order = sorted(boxes, key=lambda b: b.start)
    active: list[Box] = []
    for b in order:
        active = [a for a in active if a.stop[0] > b.start[0]]
        if any(a.intersect(b) is not None for a in active):
            return False
        active.append(b)
    return True


def chunk_shape_for(shape: Sequence[int], boxes: Sequence[Box], itemsize: int, target_bytes: int) -> tuple[int, ...]:
    """Outer chunk shape of one array from the boxes its holders have.

    Leading dims every box has extent 1 in (stacked layer / expert axes) get chunk 1; the next
    dim (rows) gets as many rows as fit `target_bytes`; the dim after it is cut at the common
    divisor of the boundaries of multi-row boxes (TP column splits of row-parallel weights), so
    chunks follow the holders' layout and only boundary rows of flat DP fragments move.

    >>> chunk_shape_for((4, 10, 6), [Box((0, 0, 0), (1, 10, 3)), Box((0, 0, 3), (1, 10, 6))], 4, 64)
    (1, 5, 3)
    """
    shape = tuple(int(x) for x in shape)
    if not shape:
        return ()
    nd = len(shape)
    lead = 0
    while lead < nd - 1 and shape[lead] > 1 and all(b.shape[lead] == 1 for b in boxes):
        lead += 1
    chunk = [1] * lead + list(shape[lead:])
    if lead + 1 < nd:
        multi = [b for b in boxes if b.shape[lead] > 1]
        g = shape[lead + 1]
        for b in multi:
            g = gcd(g, b.start[lead + 1], b.stop[lead + 1])
        chunk[lead + 1] = max(1, g)
    inner = max(1, prod(chunk[lead + 1:]) * itemsize)
    chunk[lead] = max(1, min(shape[lead], target_bytes // inner))
    return tuple(max(1, c) for c in chunk)


def majority_owners(shape: Sequence[int], chunk: Sequence[int], sources: Sequence["Source"],
                    load: dict[int, int]) -> np.ndarray:
    """Owner of each chunk = the rank holding most of it (ties: least loaded, then lowest rank).

    `load` (bytes-free element counts per rank) is updated so later arrays balance against it.
    """
    grid = tuple(-(-s // c) for s, c in zip(shape, chunk))
    counts: dict[tuple[int, ...], dict[int, int]] = {}
    for s in sources:
        if s.box.ndim == 0:
            counts.setdefault((), {})[s.rank] = 1
            continue
        ranges = []
        for d in range(s.box.ndim):
            c = chunk[d]
            idx = range(s.box.start[d] // c, -(-s.box.stop[d] // c))
            ranges.append([(i, min(s.box.stop[d], (i + 1) * c) - max(s.box.start[d], i * c)) for i in idx])
        for combo in product(*ranges):
            key = tuple(i for i, _ in combo)
            n = prod(x for _, x in combo)
            per = counts.setdefault(key, {})
            per[s.rank] = per.get(s.rank, 0) + n
    owners = np.zeros(grid, dtype=np.int32)
    for key in sorted(counts):
        per = counts[key]
        best = max(per.items(), key=lambda kv: (kv[1], -load.get(kv[0], 0), -kv[0]))[0]
        owners[key] = best
        load[best] = load.get(best, 0) + sum(per.values())
    return owners


def plan_chunk_owners(catalog: Sequence[ArraySpec], sources: Sequence["Source"], world: int,
                      target_chunk_bytes: int = 4 << 20) -> dict[str, ArrayOwnership]:
    """Chunk grid and owner of every chunk for every array (see `chunk_shape_for`, `majority_owners`)."""
    by_array: dict[str, list[Source]] = {}
    for s in sources:
        by_array.setdefault(s.array, []).append(s)
    load: dict[int, int] = {}
    out: dict[str, ArrayOwnership] = {}
    for spec in catalog:
        srcs = by_array.get(spec.name, [])
        chunk = chunk_shape_for(spec.shape, [s.box for s in srcs], spec.itemsize, target_chunk_bytes)
        out[spec.name] = ArrayOwnership(spec.shape, chunk, majority_owners(spec.shape, chunk, srcs, load))
    return out


def cut_transfers(sources: Sequence[Source], ownership: dict[str, ArrayOwnership]) -> list[Transfer]:
    """Cut each source piece along the chunk grid; each part goes to its chunk's owner.

    Parts of one piece that fall into consecutive chunks with the same owner stay whole when
    the piece lies within one chunk row band (the common case), keeping transfers few.
    """
    out: list[Transfer] = []
    for s in sources:
        own = ownership[s.array]
        if s.box.ndim == 0:
            out.append(Transfer(s, s.box, int(own.owners.reshape(-1)[0])))
            continue
        sl = own.chunks_touching(s.box)
        owners = own.owners[sl]
        if (owners == owners.flat[0]).all():
            out.append(Transfer(s, s.box, int(owners.flat[0])))
            continue
        for rel in np.ndindex(*owners.shape):
            idx = tuple(a.start + r for a, r in zip(sl, rel))
            part = s.box.intersect(own.chunk_box(idx))
            if part is not None:
                out.append(Transfer(s, part, int(owners[rel])))
    return out


def build_plan(summaries: Sequence[dict], tree_name, target_chunk_bytes: int = 4 << 20) -> ExportPlan:
    """The global export plan from every rank's summary (identical on every rank)."""
    world = len(summaries)
    catalog = merge_catalogs(summaries)
    sources = elect_sources(summaries, tree_name)
    check_tiling(catalog, sources)
    ownership = plan_chunk_owners(catalog, sources, world, target_chunk_bytes)
    transfers = cut_transfers(sources, ownership)
    itemsize = {a.name: ITEMSIZE[a.dtype] for a in catalog}
    return ExportPlan(world, catalog, ownership, transfers, itemsize)


__all__ = ["Source", "Transfer", "ExportPlan", "build_plan", "merge_catalogs", "elect_sources", "check_tiling",
           "cut_transfers", "megatron_key_to_path"]
