"""PURE conversion planning: which bytes of which stored chunk land where in which logical array.

A `Copy` moves one rectangular region from a stored DCP chunk into one logical array box; a
`Unit` gathers every copy that fills the four arrays of one parameter (bf16 `model`, fp32
`params`, `mu`, `nu`), so the master/weight cross-check sees both copies at once.

- Model-space entries (model weights, `fully_reshardable` optimizer state) are boxes of the
  stored global tensor; their rows map to logical arrays through row runs from the layout engine
  (fused sections, and 0.19.2's padded GTP grid §2.5 A).
- `dp_reshardable` bucket tensors are flat; the buffer layout is rebuilt with
  `bridge.layout.distopt.buffer_layout` and each param's flat range becomes Pieces through
  `ParamGeometry.fragment_pieces`.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from math import prod
from typing import Sequence

from bridge.errors import BridgeError
from bridge.layout.boxes import Box
from bridge.layout.distopt import BufferLayout, BufferParam, buffer_layout
from bridge.layout.parallel import ParallelLayout
from bridge.layout.params import ParamGeometry
from bridge.layout.rectangles import RowRun
from bridge.store.tree import megatron_key_to_path
from converters.dcp_reader import ChunkInfo, TensorInfo

ROLES = ("model", "params", "mu", "nu")


def role_path(role: str, array: str) -> tuple[str, ...]:
    """Tree path of a logical array in one role.

    >>> role_path("mu", "decoder.layers.mlp.linear_fc1.weight.gate")
    ('opt_state', '0', 'mu', 'decoder', 'layers', 'mlp', 'linear_fc1', 'weight', 'gate')
    """
    p = megatron_key_to_path(array)
    return {"model": ("model",), "params": ("params",), "mu": ("opt_state", "0", "mu"),
            "nu": ("opt_state", "0", "nu")}[role] + p


@dataclass(frozen=True)
class Copy:
    """Stored chunk region -> logical box.

    `flat` copies take `chunk.reshape(-1)[start : start + dst.size]`; box copies take
    `chunk[tuple(slice(a, b) for a, b in src)]`. Either way the data is reshaped to `dst.shape`.
    """

    key: str
    chunk: int
    array: str
    dst: Box
    src: tuple[tuple[int, int], ...] = ()
    flat_start: int = -1

    @property
    def flat(self) -> bool:
        return self.flat_start >= 0

    def clip_lead(self, lo: int, hi: int) -> "Copy | None":
        """This copy restricted to logical rows [lo, hi) of the array's leading axis."""
        if self.dst.ndim == 0:
            return self if lo == 0 else None
        a, b = max(lo, self.dst.start[0]), min(hi, self.dst.stop[0])
        if b <= a:
            return None
        if a == self.dst.start[0] and b == self.dst.stop[0]:
            return self
        d0 = a - self.dst.start[0]
        dst = Box((a,) + self.dst.start[1:], (b,) + self.dst.stop[1:])
        if self.flat:  # the box is row-major contiguous in the flat source
            inner = prod(self.dst.shape[1:])
            return Copy(self.key, self.chunk, self.array, dst, (), self.flat_start + d0 * inner)
        # box copies: source and logical boxes have the same axes (stacked axes kept), so dst axis 0
        # is source axis 0
        src = list(self.src)
        s0 = src[0][0] + d0
        src[0] = (s0, s0 + (b - a))
        return Copy(self.key, self.chunk, self.array, dst, tuple(src))


@dataclass
class Unit:
    """All copies that fill one parameter's logical arrays in every role."""

    name: str
    arrays: dict[str, tuple[int, ...]]               # logical array -> full shape
    dtypes: dict[str, str]                           # role -> numpy dtype name
    copies: dict[str, list[Copy]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        n = 0
        for role in self.copies:
            item = 2 if self.dtypes[role] == "bfloat16" else 4
            n += sum(prod(s) for s in self.arrays.values()) * item
        return n

    def split_lead(self, max_bytes: int) -> list[tuple[int, int, "Unit"]]:
        """Sub-units of leading-axis row blocks so each fills at most ~`max_bytes` of buffers."""
        lead = min((s[0] for s in self.arrays.values() if s), default=0)
        if self.nbytes <= max_bytes or lead <= 1 or any(len(s) == 0 for s in self.arrays.values()):
            return [(0, lead, self)]
        if len({s[0] for s in self.arrays.values()}) != 1:
            return [(0, lead, self)]
        rows = max(1, int(lead * max_bytes // max(1, self.nbytes)))
        out = []
        for lo in range(0, lead, rows):
            hi = min(lead, lo + rows)
            sub = Unit(self.name, self.arrays, self.dtypes,
                       {r: [x for x in (c.clip_lead(lo, hi) for c in cs) if x is not None]
                        for r, cs in self.copies.items()})
            out.append((lo, hi, sub))
        return out


# ---------------------------------------------------------------------------------------------
# Model-space entries (model weights, fully_reshardable state)


def logical_row_runs(geom: ParamGeometry) -> list[RowRun]:
    """Rows of a per-instance tensor stored in the logical layout -> logical arrays (stacked index 0):
    the TP=1 row runs, fused sections split. (The 0.19.2 padded GTP grid goes through
    `bridge.layout.legacy.legacy_box_map` instead.)

    >>> from bridge.layout.fused import FusedSpec
    >>> g = ParamGeometry("f", (12, 4), "column", fused=FusedSpec.swiglu(6))
    >>> [(r.row, r.rows, r.array) for r in logical_row_runs(g)]
    [(0, 6, 'f.gate'), (6, 6, 'f.up')]
    """
    return geom.row_runs(1, 0, (0,) * len(geom.prepend))


def box_copies(key: str, index: int, chunk: ChunkInfo, runs: Sequence[RowRun], npre: int) -> list[Copy]:
    """Copies of one stored chunk of a model-space key, through `runs` (row axis = `npre`).

    >>> from converters.dcp_reader import ChunkInfo, StorageRef
    >>> ch = ChunkInfo((1, 4, 0), (1, 4, 6), StorageRef("f", 0, 0))     # layer 1, rows 4..7
    >>> [(c.array, str(c.dst), c.src) for c in box_copies("k", 0, ch, [RowRun(0, 6, "a", (0, 0, 0)), RowRun(6, 6, "b", (0, 0, 0))], 1)]
    [('a', '[1:2, 4:6, 0:6]', ((0, 1), (0, 2), (0, 6))), ('b', '[1:2, 0:2, 0:6]', ((0, 1), (2, 4), (0, 6)))]
    """
    offs, sizes = chunk.offsets, chunk.sizes
    if len(offs) == npre:  # 0-d instances: one element per stacked index
        return [Copy(key, index, runs[0].array, Box.of(offs, sizes), tuple((0, s) for s in sizes))] if runs else []
    r0c, r1c = offs[npre], offs[npre] + sizes[npre]
    out = []
    for run in runs:
        a, b = max(r0c, run.row), min(r1c, run.row + run.rows)
        if b <= a:
            continue
        src = tuple((0, s) for s in sizes[:npre]) + ((a - r0c, b - r0c),) + tuple((0, s) for s in sizes[npre + 1:])
        start = tuple(offs[:npre]) + (run.offset[npre] + a - run.row,) + tuple(
            run.offset[npre + 1 + i] + offs[npre + 1 + i] for i in range(len(offs) - npre - 1))
        shape = tuple(sizes[:npre]) + (b - a,) + tuple(sizes[npre + 1:])
        out.append(Copy(key, index, run.array, Box.of(start, shape), src))
    return out


def is_scrambled_swiglu(geom: ParamGeometry, gtp: int) -> bool:
    """0.19.2 stores a GTP-sharded SwiGLU fc1 as scrambled shard halves (§6.3)."""
    return geom.gtp_active(gtp) and geom.fused is not None and geom.fused.names == ("gate", "up")


def model_space_copies(key: str, info: TensorInfo, geom: ParamGeometry, npre: int, legacy: bool,
                       tp: int, gtp: int) -> list[Copy]:
    """Every copy of a model-space key (all chunks); legacy grids through `bridge.layout.legacy`."""
    out: list[Copy] = []
    if legacy:
        from bridge.layout.legacy import legacy_box_map

        scrambled = is_scrambled_swiglu(geom, gtp)
        for i, ch in enumerate(info.chunks):
            for m in legacy_box_map(geom, tp, gtp, Box.of(ch.offsets, ch.sizes), scrambled_swiglu=scrambled):
                out.append(Copy(key, i, m.array, m.logical, tuple(zip(m.src.start, m.src.stop))))
        return out
    runs = logical_row_runs(geom)
    for i, ch in enumerate(info.chunks):
        out += box_copies(key, i, ch, runs, npre)
    return out


# ---------------------------------------------------------------------------------------------
# dp_reshardable buckets


@dataclass(frozen=True)
class Instance:
    """One runtime parameter of a rank's buffer: a stacked-axes index of a geometry."""

    name: str
    index: tuple[int, ...]

    @property
    def label(self) -> str:
        return self.name + "".join(f"[{i}]" for i in self.index)


def local_instances(geoms: Sequence[ParamGeometry], layout: ParallelLayout, e: int) -> list[Instance]:
    """A rank's parameters of one DistOpt buffer in registration order (EP rank `e`).

    Stacked keys expand layer-major (all of layer 0's params, then layer 1's...); inside a layer,
    params keep the checkpoint's key order, and a run of routed-expert keys expands expert-major
    over the rank's local experts (`local_experts.<i>.linear_fc1`, `.linear_fc2`, then i+1).
    """
    out: list[Instance] = []
    i = 0
    while i < len(geoms):
        g = geoms[i]
        if not g.prepend:
            out.append(Instance(g.name, ()))
            i += 1
            continue
        j = i
        while j < len(geoms) and geoms[j].prepend and geoms[j].prepend[0] == g.prepend[0]:
            j += 1
        block = geoms[i:j]
        for layer in range(g.prepend[0]):
            k = 0
            while k < len(block):
                b = block[k]
                if not b.expert:
                    out.append(Instance(b.name, (layer,) + (0,) * (len(b.prepend) - 1)))
                    k += 1
                    continue
                m = k
                while m < len(block) and block[m].expert:
                    m += 1
                nle = b.prepend[1] // layout.ep
                for le in range(nle):
                    for x in block[k:m]:
                        out.append(Instance(x.name, (layer, e * nle + le)))
                k = m
        i = j
    return out


def parse_dtype_key(s: str) -> tuple[str, str]:
    """`(torch.bfloat16, torch.float32)` -> ('bfloat16', 'float32').

    >>> parse_dtype_key("(torch.bfloat16, torch.float32)")
    ('bfloat16', 'float32')
    """
    inner = s.strip()[1:-1]
    parts = [p.strip().replace("torch.", "") for p in inner.split(",") if p.strip()]
    if len(parts) != 2:
        raise BridgeError(f"cannot parse the buffer dtype key {s!r}; unknown format")
    return parts[0], parts[1]


def rebuild_bucket_layout(instances: Sequence[Instance], numels: dict[Instance, int], dp_size: int,
                          per_bucket_unpadded: Sequence[int] | None, per_bucket_padded: Sequence[int] | None,
                          bucket_size: int | None, where: str) -> BufferLayout:
    """Rebuild one buffer's layout and check it against the saved per-bucket numels.

    The bucket size is taken from `bucket_size` when given, else inferred: a single bucket when
    one numel is saved, else the smallest size that reproduces the saved bucket boundaries.
    """
    params = [BufferParam(i.label, numels[i]) for i in instances]
    cands: list[int | None]
    if bucket_size is not None:
        cands = [bucket_size]
    elif per_bucket_unpadded is None or len(per_bucket_unpadded) <= 1:
        cands = [None]
    else:
        # a bucket closes at the first param end reaching bucket_size: try each saved bucket's size
        cands = sorted(set(int(n) for n in per_bucket_unpadded[:-1]))
    last = None
    for bs in cands:
        lay = buffer_layout(params, bs, dp_size)
        last = lay
        if per_bucket_unpadded is not None and list(lay.numel_unpadded) != [int(n) for n in per_bucket_unpadded]:
            continue
        if per_bucket_padded is not None and lay.per_bucket_numel() != [int(n) for n in per_bucket_padded]:
            continue
        return lay
    got = last.numel_unpadded if last is not None else []
    raise BridgeError(f"{where}: rebuilt bucket numels {list(got)} do not match the saved per_bucket_numel_unpadded "
                      f"{list(per_bucket_unpadded or [])}; the parameter order, bucket size or GTP padding differs — "
                      f"pass --bucket-size and/or --pad-for-alignment")


def flat_copies(key: str, chunks: Sequence[ChunkInfo], geom: ParamGeometry, tp: int, gtp: int, t: int, g: int,
                index: tuple[int, ...], p0: int) -> list[Copy]:
    """Copies of one parameter whose physical shard sits at [p0, p0+numel) of a 1-D bucket tensor."""
    numel = geom.physical_numel(tp, gtp)
    out: list[Copy] = []
    for ci, ch in enumerate(chunks):
        c0, c1 = ch.offsets[0], ch.offsets[0] + ch.sizes[0]
        a, b = max(c0, p0), min(c1, p0 + numel)
        if b <= a:
            continue
        for piece in geom.fragment_pieces(tp, gtp, t, g, a - p0, b - p0, index):
            out.append(Copy(key, ci, piece.array, piece.logical, (), a - c0 + piece.local_start))
    return out


def contributes(geom: ParamGeometry, tp: int, gtp: int, t: int, g: int) -> bool:
    """Whether TP rank t / GTP rank g holds a distinct copy (replicas export once, from rank 0)."""
    if geom.tp_kind == "replicated" and t != 0:
        return False
    if not geom.gtp_active(gtp) and g != 0:
        return False
    return True


def literal(s: str):
    """Parse a Python literal safely (dtype keys in per_bucket_numel dicts are strings or tuples)."""
    try:
        return ast.literal_eval(s)
    except (ValueError, SyntaxError):
        return s
