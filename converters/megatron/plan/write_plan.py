"""PURE planning for `to-megatron`: which logical boxes each target DCP chunk takes, grouped into
units of work that read each logical array's boxes once and fit a memory budget.

A `ChunkJob` is one DCP tensor chunk (fqn, global offset, shape) and the `Take`s that fill it. A
`ChunkGroup` is the chunks of one parameter for a run of stacked instances (all roles together, so the
bf16 weights can be checked against the fp32 masters of the same elements); its reads are one
bounding box per logical array, kept exact (no element read that no chunk needs). An instance too
large for the budget is split by target box, then by rows (DCP lets a tensor be stored in any
tiling; the reader takes the overlap of what it asks with every stored chunk).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np

from bridge.dtypes import ITEMSIZE
from bridge.errors import BridgeError
from bridge.layout.boxes import Box
from converters.megatron.plan.legacy_grid import legacy_box_map, legacy_shape
from bridge.layout.parallel import MAX_WORLD, ParallelLayout
from bridge.layout.params import ParamGeometry
from converters.megatron.read.dcp_metadata import ChunkInfo, StorageRef
from bridge.format.schema import MODEL, OPTIMIZER_ROLES, PARAMS, ROLE_STATE, in_role, to_role
from converters.megatron.plan.naming import SPLIT_SECTIONS
from converters.megatron.plan.convert_plan import box_copies, is_scrambled_swiglu, logical_row_runs, role_path

STATE_NAMES = ROLE_STATE  # role -> the `optimizer.state.<name>.<param>` name Megatron saves it under
READ_FACTOR = 2  # host bytes per byte read while a TensorStore read is in flight


@dataclass(frozen=True)
class Take:
    """Copy logical box `logical` of array `array` (a store path) into box `dst` of the chunk."""

    array: tuple[str, ...]
    logical: Box
    dst: Box


@dataclass
class ChunkJob:
    """One DCP tensor chunk: `fqn` at global `start` with `shape`, filled by `takes` (rest zero)."""

    fqn: str
    start: tuple[int, ...]
    shape: tuple[int, ...]
    dtype: str
    takes: list[Take]
    cast: bool = False
    global_shape: tuple[int, ...] = ()  # the takes are fp32 masters, rounded to `dtype` (weights derived from masters)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * ITEMSIZE[self.dtype]


@dataclass
class ChunkGroup:
    """Chunks written from one read of a bounding box of each logical array they need."""

    name: str
    chunks: list[ChunkJob] = field(default_factory=list)
    checks: list[tuple[tuple[str, ...], tuple[str, ...]]] = field(default_factory=list)  # (weights, masters)
    check_takes: list[Take] = field(default_factory=list)  # masters read only for the check

    def reads(self) -> dict[tuple[str, ...], Box]:
        """Array -> bounding box of everything the group takes (one read each)."""
        out: dict[tuple[str, ...], Box] = {}
        for t in self.takes():
            b = out.get(t.array)
            out[t.array] = t.logical if b is None else union(b, t.logical)
        return out

    def takes(self) -> Iterable[Take]:
        for c in self.chunks:
            yield from c.takes
        yield from self.check_takes

    def needed(self) -> dict[tuple[str, ...], int]:
        """Array -> elements the group takes (each element once)."""
        out: dict[tuple[str, ...], int] = {}
        for t in self.takes():
            out[t.array] = out.get(t.array, 0) + t.logical.size
        return out

    def read_elements(self) -> int:
        return sum(b.size for b in self.reads().values())

    @property
    def nbytes(self) -> int:
        """Host memory while the group is processed: what is read, counted twice (TensorStore holds
        the stored bytes while it fills the result), plus the chunks."""
        read = sum(b.size * (2 if in_role(t, MODEL) else 4) for t, b in self.reads().items())
        return READ_FACTOR * read + sum(c.nbytes for c in self.chunks)


def union(a: Box, b: Box) -> Box:
    """Smallest box holding both.

    >>> str(union(Box.of((0, 0), (1, 4)), Box.of((2, 0), (1, 4))))
    '[0:3, 0:4]'
    """
    return Box(tuple(min(x, y) for x, y in zip(a.start, b.start)), tuple(max(x, y) for x, y in zip(a.stop, b.stop)))


# ---------------------------------------------------------------------------------------------
# Target-layout chunk boxes (one stacked instance)


def stored_shape(geom: ParamGeometry, tp: int, gtp: int) -> tuple[int, ...]:
    """Per-instance stored global shape: logical, or the 0.19.2 padded grid for GTP weights.

    >>> stored_shape(ParamGeometry("w", (10, 6), "column", gtp=True, pad_for_alignment=4), 2, 2)
    (16, 6)
    """
    if not geom.gtp_active(gtp) or not geom.shape:
        return geom.shape
    return legacy_shape(geom, tp, gtp)[len(geom.prepend):]


def instance_boxes(geom: ParamGeometry, tp: int, gtp: int) -> list[Box]:
    """Chunk boxes of one stacked instance (no prepend axes) as a run at (tp, gtp) writes them.

    >>> from bridge.layout.fused import FusedSpec
    >>> [str(b) for b in instance_boxes(ParamGeometry("f", (12, 4), "column", fused=FusedSpec.swiglu(6)), 2, 1)]
    ['[0:3, 0:4]', '[6:9, 0:4]', '[3:6, 0:4]', '[9:12, 0:4]']
    """
    shape = stored_shape(geom, tp, gtp)
    if not shape:
        return [Box((), ())]
    rest0, rest = (0,) * (len(shape) - 1), tuple(shape[1:])
    if geom.gtp_active(gtp):
        s = geom.split(tp, gtp).shard_rows
        out = []
        for t in range(tp):
            for g in range(gtp):
                if geom.tp_kind in ("column", "vocab"):
                    out.append(Box.of(((t * gtp + g) * s,) + rest0, (s,) + rest))
                else:
                    k = shape[1] // tp
                    out.append(Box.of((g * s, t * k) + rest0[1:], (s, k) + rest[1:]))
        return out
    split = split_key_sections(geom) is not None   # one key per section, whatever the TP
    if (tp == 1 and not split) or geom.tp_kind == "replicated":
        return [Box.full(shape)]
    if geom.tp_kind == "row":
        k = shape[1] // tp
        return [Box.of((0, t * k) + rest0[1:], (shape[0], k) + rest[1:]) for t in range(tp)]
    spec = geom.fused
    if spec is not None and spec.kind == "concat":
        out, starts, acc = [], [], 0
        for sec in spec.sections:
            starts.append(acc)
            acc += sec.rows
        for t in range(tp):
            for sec, st in zip(spec.sections, starts):
                n = sec.rows // tp
                out.append(Box.of((st + t * n,) + rest0, (n,) + rest))
        return out
    n = shape[0] // tp
    return [Box.of((t * n,) + rest0, (n,) + rest) for t in range(tp)]


def split_key_sections(geom: ParamGeometry) -> list[tuple[str, int, int]] | None:
    """(section, first row, rows) along the instance's dim 0 of a parameter megatron-core saves as
    one key per section (`<key>.<section>`, naming.SPLIT_SECTIONS: Mamba / GDN in_proj, conv1d);
    None for a parameter saved as one key.

    >>> from bridge.layout.fused import FusedSpec
    >>> split_key_sections(ParamGeometry("c", (12, 1, 4), "column", fused=FusedSpec.mamba_conv1d(4, 2, 2)))
    [('x', 0, 4), ('B', 4, 4), ('C', 8, 4)]
    """
    spec = geom.fused
    if spec is None or spec.kind != "concat" or spec.info.get("name") not in SPLIT_SECTIONS:
        return None
    out, row = [], 0
    for sec in spec.sections:
        out.append((sec.name, row, sec.rows))
        row += sec.rows
    return out


def section_key(fqn: str, secs: list[tuple[str, int, int]], start: tuple[int, ...], shape: tuple[int, ...],
                full: tuple[int, ...], axis: int) -> tuple[str, tuple[int, ...], tuple[int, ...]]:
    """(key, chunk start, global shape) of the chunk at `start` (fused coordinates) of a per-section
    parameter: the section's own key, rows counted from the section's first row.

    >>> section_key("w", [("x", 0, 4), ("B", 4, 4)], (6, 0), (2, 3), (8, 3), 0)
    ('w.B', (2, 0), (4, 3))
    """
    for name, r0, rows in secs:
        if r0 <= start[axis] < r0 + rows:
            if start[axis] + shape[axis] > r0 + rows:
                raise BridgeError(f"{fqn}: internal plan error: chunk rows {start[axis]}+{shape[axis]} cross "
                                  f"section {name} [{r0}, {r0 + rows})")
            return (f"{fqn}.{name}", start[:axis] + (start[axis] - r0,) + start[axis + 1:],
                    full[:axis] + (rows,) + full[axis + 1:])
    raise BridgeError(f"{fqn}: internal plan error: chunk row {start[axis]} outside its sections")


def split_rows(box: Box, axis: int, parts: int) -> list[Box]:
    """`box` cut into up to `parts` slabs along `axis` (nearly equal, none empty).

    >>> [str(b) for b in split_rows(Box.of((0, 4), (1, 5)), 1, 2)]
    ['[0:1, 4:6]', '[0:1, 6:9]']
    """
    n = box.shape[axis] if box.ndim > axis else 1
    parts = max(1, min(parts, n))
    if parts == 1 or box.ndim <= axis:
        return [box]
    edges = [box.start[axis] + (n * i) // parts for i in range(parts + 1)]
    out = []
    for a, b in zip(edges, edges[1:]):
        out.append(Box(box.start[:axis] + (a,) + box.start[axis + 1:], box.stop[:axis] + (b,) + box.stop[axis + 1:]))
    return out


def chunk_takes(geom: ParamGeometry, tp: int, gtp: int, role: str, fqn: str, chunk: Box, *,
                source_role: str | None = None) -> list[Take]:
    """Where the elements of stored chunk `chunk` (prepend axes included) of `fqn` come from."""
    src_role = source_role or role
    npre = len(geom.prepend)
    takes = []
    if geom.gtp_active(gtp) and geom.shape:  # the 0.19.2 padded grid (scrambled SwiGLU halves)
        for m in legacy_box_map(geom, tp, gtp, chunk, scrambled_swiglu=is_scrambled_swiglu(geom, gtp)):
            takes.append(Take(role_path(src_role, m.array), m.logical, m.src))
    else:
        ch = ChunkInfo(chunk.start, chunk.shape, StorageRef("", 0, 0))
        for c in box_copies(fqn, 0, ch, logical_row_runs(geom), npre):
            takes.append(Take(role_path(src_role, c.array), c.dst, Box(tuple(a for a, _ in c.src),
                                                                        tuple(b for _, b in c.src))))
    for t in takes:
        if t.logical.shape != t.dst.shape:
            raise BridgeError(f"{fqn}: internal plan error: take {t.logical} does not match chunk box {t.dst}")
    return takes


# ---------------------------------------------------------------------------------------------
# Groups


@dataclass(frozen=True)
class ParamSpec:
    """What planning needs of one parameter of the logical checkpoint, as Megatron keys it."""

    name: str
    geom: ParamGeometry
    dtype: str
    optimized: bool


def roles_of(p: ParamSpec, fmt: str, prefix: str = "") -> list[tuple[str, str, str]]:
    """(role, fqn, dtype) of the model-space tensors written for `p`; `prefix` is the key convention's
    (`naming.key_prefix`), on the weight's key and on the name inside the optimizer state's keys.

    >>> from types import SimpleNamespace as N
    >>> [f for _, f, _ in roles_of(N(name="decoder.w", dtype="bfloat16", optimized=True), "fully_reshardable", "module.")][:2]
    ['module.decoder.w', 'optimizer.state.param.module.decoder.w']
    """
    name = prefix + p.name
    out = [(MODEL, name, p.dtype)]
    if fmt == "fully_reshardable" and p.optimized:
        out += [(r, f"optimizer.state.{STATE_NAMES[r]}.{name}", "float32") for r in OPTIMIZER_ROLES]
    return out


def _items(p: ParamSpec, lay: ParallelLayout, fmt: str, derive: bool, limit: int,
           prefix: str = "") -> Iterable[ChunkGroup]:
    """Smallest units: all roles of one (instance, target box[, row slab]); split until under `limit`."""
    g = p.geom
    tp, gtp = lay.tp_gtp_sizes(g.expert)
    npre = len(g.prepend)
    roles = roles_of(p, fmt, prefix)
    full = tuple(g.prepend) + stored_shape(g, tp, gtp)
    per_element = sum(ITEMSIZE[dt] for _, _, dt in roles) * (READ_FACTOR + 1)  # read + assembled
    secs = split_key_sections(g)
    check = p.optimized and not derive and p.dtype in ("bfloat16", "float16")
    if check and fmt != "fully_reshardable":
        per_element += 4 * READ_FACTOR  # masters read for the check only
    for index in np.ndindex(*g.prepend) if g.prepend else [()]:
        for box in instance_boxes(g, tp, gtp):
            chunk_box = Box.of(tuple(index) + box.start, (1,) * npre + box.shape)
            rows = chunk_box.shape[npre] if chunk_box.ndim > npre else 1
            rows_per = max(1, limit // max(1, chunk_box.size // rows * per_element))
            for sub in split_rows(chunk_box, npre, -(-rows // rows_per)):
                item = ChunkGroup(p.name)
                for role, fqn, dt in roles:
                    src = PARAMS if (role == MODEL and derive) else role
                    takes = chunk_takes(g, tp, gtp, role, fqn, sub, source_role=src)
                    key, start, gshape = (fqn, sub.start, full) if secs is None else \
                        section_key(fqn, secs, sub.start, sub.shape, full, npre)
                    item.chunks.append(ChunkJob(key, start, sub.shape, dt, takes, cast=src != role, global_shape=gshape))
                if check:
                    model_takes = item.chunks[0].takes
                    if fmt != "fully_reshardable":
                        item.check_takes = [Take(to_role(t.array, PARAMS), t.logical, t.dst) for t in model_takes]
                    item.checks = sorted({(t.array, to_role(t.array, PARAMS)) for t in model_takes})
                yield item


class _Merger:
    """Running reads / needed counts of a growing group (merging stays linear in the items)."""

    def __init__(self, item: ChunkGroup) -> None:
        self.group = ChunkGroup(item.name, list(item.chunks), list(item.checks), list(item.check_takes))
        self.reads = item.reads()
        self.need = item.needed()
        self.bytes = item.nbytes

    def try_add(self, item: ChunkGroup, limit: int) -> bool:
        reads = dict(self.reads)
        for a, b in item.reads().items():
            reads[a] = b if a not in reads else union(reads[a], b)
        need = dict(self.need)
        for a, n in item.needed().items():
            need[a] = need.get(a, 0) + n
        if self.bytes + item.nbytes > limit or any(b.size != need[a] for a, b in reads.items()):
            return False
        self.reads, self.need, self.bytes = reads, need, self.bytes + item.nbytes
        self.group.chunks += item.chunks
        self.group.checks = sorted(set(self.group.checks) | set(item.checks))
        self.group.check_takes += item.check_takes
        return True


def plan_groups(params: Sequence[ParamSpec], lay: ParallelLayout, fmt: str, *, derive: bool,
                limit: int, key_prefix: str = "") -> list[ChunkGroup]:
    """Model-space work in groups of at most `limit` bytes (unless one item alone is larger),
    each reading exact bounding boxes (merging stops where a box would cover unneeded elements);
    keys carry `key_prefix` (the key convention's, `naming.key_prefix`)."""
    out: list[ChunkGroup] = []
    for p in params:
        cur: _Merger | None = None
        for item in _items(p, lay, fmt, derive, limit, key_prefix):
            if cur is not None and cur.try_add(item, limit):
                continue
            if cur is not None:
                out.append(cur.group)
            cur = _Merger(item)
        if cur is not None:
            out.append(cur.group)
    return out


# ---------------------------------------------------------------------------------------------
# Layout limits


def layout_limits(params: Sequence[ParamSpec], tp: int, gtp: int, dp: int, ep: int) -> None:
    """Refuse layout flags no run of this checkpoint could have, in one line naming the flag and the
    limit, before any work (a typo like `--dp 100000000` must not run for minutes first)."""
    for flag, v in (("--tp", tp), ("--gtp", gtp), ("--dp", dp), ("--ep", ep)):
        if not isinstance(v, int) or v < 1:
            raise BridgeError(f"{flag} {v}: must be a positive integer")
    dense = [p for p in params if not p.geom.expert]
    widest = max((max(p.geom.shape) for p in params if p.geom.shape), default=1)
    if tp > widest:
        raise BridgeError(f"--tp {tp}: above the largest dimension a TP split can divide ({widest}); "
                          f"choose a TP that divides the model's sizes")
    if gtp > widest:
        raise BridgeError(f"--gtp {gtp}: above the largest dimension a GTP split can divide ({widest})")
    experts = max((p.geom.prepend[1] for p in params if p.geom.expert and len(p.geom.prepend) >= 2), default=0)
    if ep > 1 and not experts:
        raise BridgeError(f"--ep {ep}: the checkpoint has no routed experts; use --ep 1")
    if ep > 1 and experts % ep:
        raise BridgeError(f"--ep {ep}: {experts} experts are not divisible by EP={ep}; "
                          f"choose an --ep that divides the number of experts")
    # Every DP rank of the distributed optimizer must own some of a model-parallel rank's state.
    numel = sum(int(np.prod(p.geom.shape, dtype=np.int64)) * int(np.prod(p.geom.prepend, dtype=np.int64))
                for p in (dense or params) if p.optimized)
    per_mp_rank = max(1, numel // (tp * gtp))
    world = tp * gtp * dp
    limit = min(MAX_WORLD, per_mp_rank * tp * gtp)
    if world > limit:
        raise BridgeError(f"--dp {dp}: world size TP*GTP*DP = {world} is above the limit {limit} for this checkpoint "
                          f"({per_mp_rank} optimizer elements per model-parallel rank, at most {MAX_WORLD} GPUs); "
                          f"every DP rank must hold part of the optimizer state")


# ---------------------------------------------------------------------------------------------
# dp_reshardable buckets


@dataclass
class DpJob:
    """One role of one DistOpt bucket: flat fp32 tensor `fqn` of `numel` elements, written as the chunk
    `ranges` (one per DP rank's shard, cut to the budget), filled from `segments`
    (bucket offset, array, logical box), sorted, each a contiguous flat run of the bucket."""

    fqn: str
    numel: int
    ranges: list[tuple[int, int]]
    segments: list[tuple[int, tuple[str, ...], Box]]

    @property
    def nbytes(self) -> int:
        return 4 * self.numel


def shard_ranges(numel: int, shard: int, dp: int, max_elems: int) -> list[tuple[int, int]]:
    """Each DP rank's `[r*shard, (r+1)*shard)` clipped to `numel`, cut into runs of at most `max_elems`.

    >>> shard_ranges(10, 4, 3, 3)
    [(0, 3), (3, 4), (4, 7), (7, 8), (8, 10)]
    """
    out = []
    for r in range(min(dp, -(-numel // max(1, shard)))):
        lo, hi = r * shard, min((r + 1) * shard, numel)
        for a in range(lo, hi, max(1, max_elems)):
            out.append((a, min(hi, a + max(1, max_elems))))
    return out
