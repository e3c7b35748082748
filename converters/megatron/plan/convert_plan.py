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
from typing import Any, Iterable, Sequence

import numpy as np

from bridge.dtypes import ITEMSIZE
from bridge.errors import BridgeError
from bridge.layout.shares import contiguous_parts
from bridge.layout.boxes import Box
from bridge.layout.chunks import grid_shape
from bridge.layout.distopt import BufferLayout, BufferParam, buffer_layout
from bridge.layout.parallel import ParallelLayout
from bridge.layout.params import ParamGeometry
from bridge.layout.rectangles import RowRun
from bridge.format import schema
from bridge.format.schema import ROLES  # noqa: F401 - the roles a Unit copies, in write order
from bridge.format.tree import megatron_key_to_path
from converters.megatron.read.dcp_metadata import ChunkInfo, TensorInfo


def role_path(role: str, array: str) -> tuple[str, ...]:
    """Tree path of a logical array (a Megatron key, sections dotted) in one role.

    >>> role_path("mu", "decoder.layers.mlp.linear_fc1.weight.gate")
    ('opt_state', '0', 'mu', 'decoder', 'layers', 'mlp', 'linear_fc1', 'weight', 'gate')
    """
    return schema.role_path(role, megatron_key_to_path(array))


@dataclass(frozen=True)
class Copy:
    """Stored chunk region -> logical box.

    Box copies take `chunk[src slices]`; flat copies view `chunk.reshape(-1)[flat_start:]` as an
    array of shape `view` (row-major) and take its `src` slices. Either way the region has the
    shape of `dst` (clipping a copy to a box shrinks `src` and `dst` alike).
    """

    key: str
    chunk: int
    array: str
    dst: Box
    src: tuple[tuple[int, int], ...] = ()
    flat_start: int = -1
    view: tuple[int, ...] = ()

    @property
    def flat(self) -> bool:
        return self.flat_start >= 0

    def src_box(self) -> Box:
        """The source region: in the chunk (box copies) or in the flat view (flat copies)."""
        if self.flat and not self.src:
            return Box.full(self.dst.shape)
        return Box(tuple(a for a, _ in self.src), tuple(b for _, b in self.src))

    def clip(self, box: Box) -> "Copy | None":
        """This copy restricted to the logical `box` (None when they do not meet).

        >>> c = Copy("k", 0, "a", Box((0, 0), (4, 6)), flat_start=10)
        >>> d = c.clip(Box((2, 0), (8, 6)))
        >>> str(d.dst), d.src, d.flat_start, d.view
        ('[2:4, 0:6]', ((2, 4), (0, 6)), 10, (4, 6))
        """
        if self.dst.ndim == 0:
            return self
        inter = self.dst.intersect(box)
        if inter is None or inter.empty:
            return None
        if inter == self.dst:
            return self
        src = self.src_box()
        if src.shape != self.dst.shape:
            raise BridgeError(f"{self.key}: copy source {src} and logical box {self.dst} differ in shape; "
                              f"cannot split it along the chunk grid")
        delta = tuple(a - b for a, b in zip(inter.start, self.dst.start))
        sub = Box.of(tuple(s + d for s, d in zip(src.start, delta)), inter.shape)
        return Copy(self.key, self.chunk, self.array, inter, tuple(zip(sub.start, sub.stop)), self.flat_start,
                    self.view or (self.dst.shape if self.flat else ()))


@dataclass
class Unit:
    """All copies that fill one parameter's logical arrays in every role."""

    name: str
    arrays: dict[str, tuple[int, ...]]               # logical array -> full shape
    dtypes: dict[str, str]                           # role -> numpy dtype name
    copies: dict[str, list[Copy]] = field(default_factory=dict)
    stacked: int = 0                                 # leading layer / expert axes
    mirrors: dict[str, list[Copy]] = field(default_factory=dict)   # a second stored copy, checked equal
    # other TP / GTP ranks' copies of a replicated parameter, by replica label ("tp1"): compared with
    # the written copy, never written (converters.megatron.replicas)
    replicas: dict[str, dict[str, list[Copy]]] = field(default_factory=dict)

    def element_bytes(self) -> int:
        """Bytes one logical element costs over the roles this unit fills."""
        return sum(ITEMSIZE.get(self.dtypes[r], 4) for r in self.copies)

    @property
    def nbytes(self) -> int:
        return sum(prod(s) for s in self.arrays.values()) * self.element_bytes()


# ---------------------------------------------------------------------------------------------
# The chunk grid: each outer chunk is assembled once, in all roles, and written once


def chunk_shape_for(shape: Sequence[int], element_bytes: int, max_bytes: int) -> tuple[int, ...]:
    """Outer chunk shape of an array whose chunks (times `element_bytes` per element) fit `max_bytes`.

    Row-major blocks: whole trailing axes, and as many indices of the first axis that must be cut
    as fit, spread evenly (equal chunks rather than a small remainder). A chunk that cuts axis k
    is one index wide on every axis before k: for stacked arrays one layer (and one expert), the
    inner-chunk policy's unit, is never split across chunks unless it alone exceeds `max_bytes`.

    >>> chunk_shape_for((16, 128, 64), 14, 1 << 20)      # 9 layers fit: 2 chunks of 8, not 9 + 7
    (8, 128, 64)
    >>> chunk_shape_for((16, 128, 64), 14, 64 << 10)     # less than a layer fits
    (1, 64, 64)
    >>> chunk_shape_for((), 4, 1), chunk_shape_for((5, 0), 4, 1)
    ((), (5, 1))
    """
    shape = tuple(int(s) for s in shape)
    if not shape:
        return ()
    if 0 in shape:
        return tuple(max(1, s) for s in shape)
    for k in range(len(shape)):
        inner = prod(shape[k + 1:]) * element_bytes
        if inner <= max_bytes or k == len(shape) - 1:
            fit = max(1, min(shape[k], max_bytes // max(1, inner)))
            n = -(-shape[k] // fit)                        # chunks along axis k
            return (1,) * k + (-(-shape[k] // n),) + shape[k + 1:]
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class Block:
    """One outer chunk of one logical array of a unit, filled in every role at once."""

    unit: int
    array: str
    box: Box
    nbytes: int


def plan_blocks(units: Sequence[Unit], max_block_bytes: int) -> tuple[list[Block], dict[str, tuple[int, ...]]]:
    """Every unit's arrays cut on their chunk grid; returns the blocks and each array's chunk shape.

    Blocks come unit by unit, and inside a unit chunk by chunk with the arrays (fused sections)
    interleaved, so the sections of one stored region are filled one after another.

    >>> u = Unit("w", {"w.a": (4, 8), "w.b": (4, 8)}, {"params": "float32"}, {"params": []})
    >>> blocks, chunks = plan_blocks([u], 64)
    >>> chunks, [(b.array, str(b.box)) for b in blocks][:3]
    ({'w.a': (2, 8), 'w.b': (2, 8)}, [('w.a', '[0:2, 0:8]'), ('w.b', '[0:2, 0:8]'), ('w.a', '[2:4, 0:8]')])
    """
    from bridge.layout.chunks import ArrayOwnership

    blocks: list[Block] = []
    chunks: dict[str, tuple[int, ...]] = {}
    for ui, u in enumerate(units):
        eb = u.element_bytes()
        grids = []
        for arr, shape in u.arrays.items():
            cs = chunk_shape_for(shape, eb, max_block_bytes)
            chunks[arr] = cs
            own = ArrayOwnership(shape, cs, np.zeros(grid_shape(shape, cs), dtype=np.int32))
            grids.append([(arr, own.chunk_box(i)) for i in own.chunk_indices()])
        for k in range(max(len(g) for g in grids)):
            for g in grids:
                if k < len(g):
                    arr, box = g[k]
                    blocks.append(Block(ui, arr, box, max(1, box.size) * eb))
    return blocks, chunks


def assign_blocks(blocks: Sequence[Block], workers: int) -> list[int]:
    """Writer of each block: `workers` contiguous runs of about equal bytes (contiguous, so each
    worker reads a compact part of the source).

    >>> assign_blocks([Block(0, "a", Box((), ()), n) for n in (4, 4, 4, 4, 8)], 2)
    [0, 0, 0, 1, 1]
    """
    return contiguous_parts([b.nbytes for b in blocks], workers)


class CopyIndex:
    """A unit's copies by (role, array), found by overlap with a box in one vectorized test.

    >>> u = Unit("w", {"w": (4, 2)}, {"params": "float32"},
    ...          {"params": [Copy("k", 0, "w", Box((0, 0), (3, 2)), flat_start=0),
    ...                      Copy("k", 1, "w", Box((3, 0), (4, 2)), flat_start=0)]})
    >>> [str(c.dst) for c in CopyIndex(u).clipped("params", "w", Box((2, 0), (4, 2)))]
    ['[2:3, 0:2]', '[3:4, 0:2]']
    """

    def __init__(self, unit: Unit) -> None:
        self._by: dict[tuple[str, str], tuple[list[Copy], np.ndarray, np.ndarray]] = {}
        groups: dict[tuple[str, str], list[Copy]] = {}
        for role, copies in unit.copies.items():
            for c in copies:
                groups.setdefault((role, c.array), []).append(c)
        for k, cs in groups.items():
            nd = cs[0].dst.ndim
            lo = np.array([c.dst.start for c in cs], dtype=np.int64).reshape(len(cs), nd)
            hi = np.array([c.dst.stop for c in cs], dtype=np.int64).reshape(len(cs), nd)
            self._by[k] = (cs, lo, hi)

    def clipped(self, role: str, array: str, box: Box) -> list[Copy]:
        """The copies of `array` in `role` restricted to `box`, in plan order."""
        got = self._by.get((role, array))
        if got is None:
            return []
        cs, lo, hi = got
        if box.ndim == 0:
            return list(cs)
        hit = (np.minimum(hi, box.stop) > np.maximum(lo, box.start)).all(axis=1)
        return [cs[i].clip(box) for i in np.flatnonzero(hit)]


# ---------------------------------------------------------------------------------------------
# Model-space entries (model weights, fully_reshardable state)


def logical_row_runs(geom: ParamGeometry) -> list[RowRun]:
    """Rows of a per-instance tensor stored in the logical layout -> logical arrays (stacked index 0):
    the TP=1 row runs, fused sections split. (The 0.19.2 padded GTP grid goes through
    `converters.megatron.plan.legacy_grid.legacy_box_map` instead.)

    >>> from bridge.layout.fused import FusedSpec
    >>> g = ParamGeometry("f", (12, 4), "column", fused=FusedSpec.swiglu(6))
    >>> [(r.row, r.rows, r.array) for r in logical_row_runs(g)]
    [(0, 6, 'f.gate'), (6, 6, 'f.up')]
    """
    return geom.row_runs(1, 0, (0,) * len(geom.prepend))


def box_copies(key: str, index: int, chunk: ChunkInfo, runs: Sequence[RowRun], npre: int) -> list[Copy]:
    """Copies of one stored chunk of a model-space key, through `runs` (row axis = `npre`).

    >>> from converters.megatron.read.dcp import ChunkInfo, StorageRef
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
    """Every copy of a model-space key (all chunks); legacy grids through `converters.megatron.plan.legacy_grid`."""
    out: list[Copy] = []
    if legacy:
        from converters.megatron.plan.legacy_grid import legacy_box_map

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
    shared: bool = False      # Megatron's `shared_embedding`: a bucket of its own (tied embeddings, PP > 1)
    tied_copy: bool = False   # the last stage's output layer: a copy of the geometry `name` (the embedding)

    @property
    def label(self) -> str:
        if self.tied_copy:
            return OUTPUT
        return self.name + "".join(f"[{i}]" for i in self.index)


EMBEDDING = "embedding.word_embeddings.weight"
OUTPUT = "output_layer.weight"   # on the last stage of a tied run: a copy of the word embeddings


FIRST_FLAG = "--decoder-first-pipeline-num-layers"
LAST_FLAG = "--decoder-last-pipeline-num-layers"
VPP_FLAG = "--virtual-pipeline-model-parallel-size (to-megatron's --vpp)"
SPLIT_FLAGS = "--account-for-embedding-in-pipeline-split / --account-for-loss-in-pipeline-split"


@dataclass(frozen=True)
class PipelineSplit:
    """How megatron-core 0.19.2 places the decoder layers on pipeline stages and their virtual chunks
    (`get_num_layers_to_build`, `get_transformer_layer_offset`, the checks of
    `TransformerConfig.__post_init__`) and whether the output layer is tied to the word embeddings
    (`share_embeddings_and_output_weights`).

    `first` / `last`: `decoder_first_pipeline_num_layers` / `decoder_last_pipeline_num_layers` (the
    other stages split the rest evenly); `embedding_in_split` / `loss_in_split`:
    `account_for_embedding_in_pipeline_split` / `account_for_loss_in_pipeline_split` (the embedding /
    loss counts as one layer of the first / last stage). Tied at PP > 1, the last stage holds a copy
    of the word embeddings as `output_layer.weight`: Megatron saves it as a replica of the
    embedding's key (`replica_id[0] = 1`, never written), but its DistOpt buffer holds the copy's
    master and moments, in a bucket of its own (`shared_embedding`), as it does the first stage's
    embedding.

    >>> s = PipelineSplit(pp=2, first=1)
    >>> [s.layers(4, p) for p in range(2)]
    [range(0, 1), range(1, 4)]
    >>> s = PipelineSplit(pp=4, embedding_in_split=True, loss_in_split=True)
    >>> [s.layers(6, p) for p in range(4)]
    [range(0, 1), range(1, 3), range(3, 5), range(5, 6)]
    """

    pp: int = 1
    first: int | None = None
    last: int | None = None
    embedding_in_split: bool = False
    loss_in_split: bool = False
    tied: bool = False
    vpp: int = 1   # virtual pipeline chunks per stage (model chunks, each with its own DDP buffer)

    def __post_init__(self) -> None:
        if type(self.vpp) is not int or self.vpp < 1:
            raise BridgeError(f"virtual pipeline size {self.vpp!r} must be a positive integer")
        if self.vpp > 1 and self.pp == 1:
            raise BridgeError(f"virtual pipeline size {self.vpp} needs pipeline stages (PP > 1): to-megatron's --vpp "
                              f"needs --pp > 1, as a run's --virtual-pipeline-model-parallel-size needs "
                              f"--pipeline-model-parallel-size > 1")
        if (self.first is not None or self.last is not None) and (self.embedding_in_split or self.loss_in_split):
            raise BridgeError(f"{FIRST_FLAG} / {LAST_FLAG} cannot be combined with {SPLIT_FLAGS} "
                              "(megatron-core refuses it too)")
        for flag, n in ((FIRST_FLAG, self.first), (LAST_FLAG, self.last)):
            if n is not None and (type(n) is not int or n <= 0):
                raise BridgeError(f"{flag} {n!r} must be a positive integer (megatron-core refuses 0 layers there)")
        if self.vpp > 1 and self.first is not None and self.last is not None and self.pp == 2:
            # get_transformer_layer_offset divides the middle layers by the middle stages, of which there are none
            raise BridgeError(f"{FIRST_FLAG} and {LAST_FLAG} together with {VPP_FLAG} need PP > 2: megatron-core "
                              "0.19.2 fails with no middle pipeline stage (ZeroDivisionError in "
                              "get_transformer_layer_offset); drop one of them")

    @property
    def even(self) -> bool:
        """Whether every stage holds num_layers / pp layers."""
        return self.first is None and self.last is None and not self.embedding_in_split and not self.loss_in_split

    def counts(self, num_layers: int) -> list[int]:
        """Decoder layers of each stage (all its virtual chunks); a BridgeError naming the flags when
        megatron-core would refuse the split.

        >>> PipelineSplit(pp=3, last=2).counts(6), PipelineSplit(pp=2).counts(4)
        ([2, 2, 2], [2, 2])
        """
        return [sum(len(self.layers(num_layers, p, v)) for v in range(self.vpp)) for p in range(self.pp)]

    def _per_rank(self, num_layers: int) -> list[int]:
        """Layers per stage as Megatron counts them before taking out the embedding / loss layer
        (each a multiple of vpp), checked as `TransformerConfig.__post_init__` checks them."""
        pp, vpp = self.pp, self.vpp
        if pp == 1:
            return [num_layers]
        vflag = f" with {VPP_FLAG} {vpp}" if vpp > 1 else ""
        if self.first is not None or self.last is not None:
            rest, left = num_layers, pp
            for flag, n in ((FIRST_FLAG, self.first), (LAST_FLAG, self.last)):
                if n is not None:
                    if n % vpp:
                        raise BridgeError(f"{flag} {n} does not split into {vpp} virtual pipeline chunks{vflag}: "
                                          "megatron-core needs it divisible by the virtual pipeline size")
                    rest, left = rest - n, left - 1
            if rest < 0 or bool(rest) != bool(left) or (left and rest % left):
                raise BridgeError(f"{num_layers} layers do not split over {pp} pipeline stages with {FIRST_FLAG} "
                                  f"{self.first}, {LAST_FLAG} {self.last}: the other stages must share the rest "
                                  "evenly (and hold at least one layer each)")
            mid = rest // left if left else 0
            if mid % vpp:
                raise BridgeError(f"{mid} layers on each middle pipeline stage do not split into {vpp} virtual "
                                  f"pipeline chunks ({FIRST_FLAG} {self.first}, {LAST_FLAG} {self.last}{vflag}): "
                                  "megatron-core needs them divisible by the virtual pipeline size")
            out = [mid] * pp
            if self.first is not None:
                out[0] = self.first
            if self.last is not None:
                out[-1] = self.last
            return out
        total = num_layers + int(self.embedding_in_split) + int(self.loss_in_split)
        if total % pp:
            extra = f" (with {SPLIT_FLAGS}: {total})" if total != num_layers else ""
            raise BridgeError(f"{num_layers} layers{extra} do not split evenly over {pp} pipeline stages; pass the "
                              f"run's {FIRST_FLAG} / {LAST_FLAG} or {SPLIT_FLAGS}")
        if (total // pp) % vpp:
            raise BridgeError(f"{total // pp} layers per pipeline stage do not split into {vpp} virtual chunks: "
                              f"megatron-core needs {VPP_FLAG} to divide the layers per stage (--pp"
                              + (f", counting {SPLIT_FLAGS}" if total != num_layers else "") + ")")
        return [total // pp] * pp

    def layers(self, num_layers: int, p: int, v: int = 0) -> range:
        """Global decoder layers of stage `p`'s virtual chunk `v`, exactly as megatron-core 0.19.2's
        `get_transformer_layer_offset` / `get_num_layers_to_build` place them.

        With virtual chunks each stage's layers are cut into vpp equal chunks (less the embedding /
        loss layer on the first chunk of the first stage / the last chunk of the last), and chunk v
        of every stage comes after chunk v - 1 of all of them: chunk v starts at v·(layers per
        round), stage p's part of it after the earlier stages' parts. E.g. 8 layers, PP 3, VPP 2,
        first 2, last 2 (middle stage 4): chunk 0 = [0] [1, 2] [3], chunk 1 = [4] [5, 6] [7].

        >>> s = PipelineSplit(pp=2, vpp=2)
        >>> [s.layers(8, p, v) for p in range(2) for v in range(2)]     # stage 0: [0, 1] [4, 5]
        [range(0, 2), range(4, 6), range(2, 4), range(6, 8)]
        >>> s = PipelineSplit(pp=3, vpp=2, first=2, last=2)
        >>> [s.layers(8, p, v) for p in range(3) for v in range(2)]
        [range(0, 1), range(4, 5), range(1, 3), range(5, 7), range(3, 4), range(7, 8)]
        >>> s = PipelineSplit(pp=2, vpp=2, embedding_in_split=True, loss_in_split=True)
        >>> [s.layers(6, p, v) for p in range(2) for v in range(2)]     # 8 "layers": 2 per chunk
        [range(0, 1), range(3, 5), range(1, 3), range(5, 6)]
        """
        if not (0 <= p < self.pp and 0 <= v < self.vpp):
            raise BridgeError(f"pipeline stage {p} / virtual chunk {v} outside PP={self.pp}, VPP={self.vpp}")
        per = self._per_rank(num_layers)
        vpp, emb, loss = self.vpp, int(self.embedding_in_split), int(self.loss_in_split)
        n = per[p] // vpp
        if vpp == 1:
            start = sum(per[:p]) - (emb if p > 0 else 0)
        elif self.first is not None or self.last is not None:
            f_v = (self.first or 0) // vpp
            m_v = (num_layers - (self.first or 0) - (self.last or 0)) // vpp
            middle = self.pp - (self.first is not None) - (self.last is not None)
            start = v * (f_v + m_v + (self.last or 0) // vpp)
            if p > 0:
                start += f_v + (p - (self.first is not None)) * (m_v // middle)
        else:
            start = v * ((num_layers + emb + loss) // vpp) + p * n - (emb if (p, v) != (0, 0) else 0)
        n -= emb if (p, v) == (0, 0) else 0
        n -= loss if (p, v) == (self.pp - 1, vpp - 1) else 0
        if n < 0:
            raise BridgeError(f"{num_layers} layers over {self.pp} stages (VPP {vpp}) leave no room for the "
                              f"embedding / loss layer ({SPLIT_FLAGS})")
        return range(start, start + n)

    def holds(self, name: str, p: int, v: int = 0) -> bool:
        """Whether stage `p`'s virtual chunk `v` holds non-layer parameter `name`: the embedding the
        first chunk of the first stage, the final norm and output layer the last chunk of the last.

        >>> s = PipelineSplit(pp=2, vpp=2)
        >>> [s.holds("decoder.final_layernorm.weight", p, v) for p in range(2) for v in range(2)]
        [False, False, False, True]
        """
        if name.startswith("embedding."):
            return p == 0 and v == 0
        return p == self.pp - 1 and v == self.vpp - 1

    def to_args(self) -> dict[str, Any]:
        """Megatron-LM argument names of this split (what a run records in `args`).

        >>> PipelineSplit(pp=2, last=3, tied=True).to_args()["decoder_last_pipeline_num_layers"]
        3
        """
        return {"pipeline_model_parallel_size": self.pp, "virtual_pipeline_model_parallel_size": self.vpp if
                self.vpp > 1 else None, "decoder_first_pipeline_num_layers": self.first,
                "decoder_last_pipeline_num_layers": self.last,
                "account_for_embedding_in_pipeline_split": self.embedding_in_split,
                "account_for_loss_in_pipeline_split": self.loss_in_split,
                "untie_embeddings_and_output_weights": not self.tied}

    @classmethod
    def from_args(cls, args: dict[str, Any], pp: int, tied: bool) -> "PipelineSplit":
        """The split a run's `args` record (missing arguments: Megatron's defaults)."""
        def opt_int(name: str) -> int | None:
            v = args.get(name)
            return None if v is None else int(v)

        return cls(pp=pp, first=opt_int("decoder_first_pipeline_num_layers"),
                   last=opt_int("decoder_last_pipeline_num_layers"),
                   embedding_in_split=bool(args.get("account_for_embedding_in_pipeline_split")),
                   loss_in_split=bool(args.get("account_for_loss_in_pipeline_split")), tied=tied,
                   vpp=int(args.get("virtual_pipeline_model_parallel_size") or 1) if pp > 1 else 1)


def stage_placement(split: PipelineSplit, num_layers: int) -> list[list[int]]:
    """Decoder layers of each pipeline stage (all its virtual chunks), ascending.

    >>> stage_placement(PipelineSplit(pp=2, vpp=2), 8), stage_placement(PipelineSplit(pp=2, first=1), 4)
    ([[0, 1, 4, 5], [2, 3, 6, 7]], [[0], [1, 2, 3]])
    """
    return [sorted(x for v in range(split.vpp) for x in split.layers(num_layers, p, v)) for p in range(split.pp)]


def layer_runs(layers: Sequence[int]) -> str:
    """Ascending layer numbers as runs.

    >>> layer_runs([0, 1, 4, 5, 6]), layer_runs([3]), layer_runs([])
    ('0-1, 4-6', '3', 'none')
    """
    runs: list[list[int]] = []
    for x in layers:
        if runs and x == runs[-1][1] + 1:
            runs[-1][1] = x
        else:
            runs.append([x, x])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs) or "none"


def placement_str(stages: Sequence[Sequence[int]]) -> str:
    """Which stage holds which decoder layers.

    >>> placement_str([[0], [1, 2, 3]])
    'stage 0: layers 0, stage 1: layers 1-3'
    """
    return ", ".join(f"stage {p}: layers {layer_runs(s)}" for p, s in enumerate(stages))


def split_flags(split: PipelineSplit) -> str:
    """The Megatron-LM flags that give `split` (what a user passes to convert).

    >>> split_flags(PipelineSplit(pp=2, first=1)), split_flags(PipelineSplit(pp=2, vpp=2))
    ('--decoder-first-pipeline-num-layers 1', 'the even split, --virtual-pipeline-model-parallel-size 2')
    """
    parts = [f"{FIRST_FLAG} {split.first}"] if split.first is not None else []
    parts += [f"{LAST_FLAG} {split.last}"] if split.last is not None else []
    parts += ["--account-for-embedding-in-pipeline-split"] if split.embedding_in_split else []
    parts += ["--account-for-loss-in-pipeline-split"] if split.loss_in_split else []
    parts = parts or ["the even split"]
    parts += [f"--virtual-pipeline-model-parallel-size {split.vpp}"] if split.vpp > 1 else []
    return ", ".join(parts)


def infer_split(num_layers: int, pp: int, stages: Sequence[Sequence[int]], tied: bool,
                vpp: int | None = None) -> PipelineSplit | None:
    """The simplest split megatron-core 0.19.2 accepts that puts the decoder layers on the stages as
    `stages` (each stage's layers, as a save's model entries show them), with `vpp` virtual chunks
    (None: any); None when no split does. Candidates, in order: the even split, the embedding and /
    or loss counted as a layer, the first and / or last stage's layer count as seen.

    >>> infer_split(4, 2, [[0], [1, 2, 3]], False)
    PipelineSplit(pp=2, first=1, last=None, embedding_in_split=False, loss_in_split=False, tied=False, vpp=1)
    >>> infer_split(8, 2, [[0, 1, 4, 5], [2, 3, 6, 7]], True).vpp, infer_split(4, 2, [[0, 2], [1, 3]], False, vpp=1)
    (2, None)
    """
    want = [sorted(s) for s in stages]
    if len(want) != pp:
        return None
    c0, c1 = len(want[0]), len(want[-1])
    kinds: list[dict[str, Any]] = [{}, {"embedding_in_split": True}, {"loss_in_split": True},
                                   {"embedding_in_split": True, "loss_in_split": True},
                                   {"first": c0}, {"last": c1}, {"first": c0, "last": c1}]
    for v in ([vpp] if vpp else range(1, (num_layers if pp > 1 else 1) + 1)):
        for kw in kinds:
            try:
                split = PipelineSplit(pp=pp, tied=tied, vpp=v, **kw)
                if stage_placement(split, num_layers) == want:
                    return split
            except BridgeError:   # a split megatron-core refuses for these layers
                continue
    return None


def is_tied(names: Iterable[str], untie: Any = None) -> bool:
    """Whether the output layer shares the word embeddings: the run's `untie_embeddings_and_output_weights`
    when recorded, else the keys (a tied model saves no `output_layer.weight`).

    >>> is_tied([EMBEDDING, "decoder.final_layernorm.weight"]), is_tied([EMBEDDING, OUTPUT])
    (True, False)
    """
    names = set(names)
    if EMBEDDING not in names:
        return False
    if untie is not None and OUTPUT not in names:
        return not bool(untie)
    return OUTPUT not in names


def stage_layers(num_layers: int, pp: int, p: int, split: PipelineSplit | None = None) -> range:
    """Layers of pipeline stage `p` (`split`: the run's pipeline split, else Megatron's even one).

    >>> stage_layers(8, 4, 1), stage_layers(2, 1, 0), stage_layers(4, 2, 0, PipelineSplit(pp=2, first=1))
    (range(2, 4), range(0, 2), range(0, 1))
    """
    return (split or PipelineSplit(pp=pp)).layers(num_layers, p)


def on_stage(name: str, pp: int, p: int) -> bool:
    """Whether a non-layer parameter lives on stage `p`: the embedding on the first stage, the final
    norm and output layer on the last (Megatron's pre_process / post_process).

    >>> [on_stage(n, 2, 1) for n in ("embedding.word_embeddings.weight", "output_layer.weight")]
    [False, True]
    """
    return pp == 1 or PipelineSplit(pp=pp).holds(name, p)


def dp_group_stages(layout: ParallelLayout, expert: bool = False) -> dict[int, int]:
    """`dp_group_idx` -> the pipeline stage of its members (a DistOpt group lies inside one stage).

    >>> dp_group_stages(ParallelLayout(tp=2, dp=2, pp=2))
    {0: 0, 1: 0, 2: 1, 3: 1}
    """
    out: dict[int, int] = {}
    for p in range(layout.pp):   # one DP-rank-0 member per group, as ParallelLayout.dp_group_coords visits them
        if expert:
            ranks = [layout.expert_rank(et=et, e=e, eg=eg, ed=0, p=p) for et in range(layout.etp)
                     for e in range(layout.ep) for eg in range(layout.egtp)]
            idxs = [layout.expert_dp_group_idx(r) for r in ranks]
        else:
            idxs = [layout.dp_group_idx(layout.rank(t=t, g=g, c=0, d=0, p=p)) for t in range(layout.tp)
                    for g in range(layout.gtp)]
        for idx in idxs:
            out.setdefault(idx, p)
    return out


def dp_group_places(layout: ParallelLayout, expert: bool = False) -> dict[int, tuple[int, int, int, int]]:
    """`dp_group_idx` -> (TP, GTP, EP rank, PP stage): `ParallelLayout.dp_group_coords` plus the stage.

    >>> dp_group_places(ParallelLayout(tp=2, pp=2))
    {0: (0, 0, 0, 0), 1: (1, 0, 0, 0), 2: (0, 0, 0, 1), 3: (1, 0, 0, 1)}
    """
    stages = dp_group_stages(layout, expert)
    return {k: (t, g, e, stages[k]) for k, (t, g, e) in layout.dp_group_coords(expert).items()}


def local_instances(geoms: Sequence[ParamGeometry], layout: ParallelLayout, e: int, p: int = 0,
                    split: PipelineSplit | None = None, v: int = 0) -> list[Instance]:
    """A rank's parameters of one DistOpt buffer in registration order (EP rank `e`, PP stage `p`,
    virtual chunk `v`: with virtual pipeline chunks, each chunk has its own buffer).

    Stacked keys expand layer-major (all of layer 0's params, then layer 1's...) over the stage's
    layers (`split`, else the even split); inside a layer, params keep the checkpoint's key order, and
    a run of routed-expert keys expands expert-major over the rank's local experts
    (`local_experts.<i>.linear_fc1`, `.linear_fc2`, then i+1). Non-layer params are kept on the
    stage that holds them (`on_stage`). Tied at PP > 1 (`split.tied`), the first stage's embedding
    and the last stage's copy of it (registered last, as GPTModel's `output_layer`) are `shared`.

    >>> g = [ParamGeometry(EMBEDDING, (8, 4), "vocab"), ParamGeometry("decoder.layers.w", (4,), "replicated", prepend=(3,)),
    ...      ParamGeometry("decoder.final_layernorm.weight", (4,), "replicated")]
    >>> s = PipelineSplit(pp=2, first=1, tied=True)
    >>> [(i.label, i.shared) for i in local_instances(g, ParallelLayout(pp=2), 0, 1, s)]
    [('decoder.layers.w[1]', False), ('decoder.layers.w[2]', False), ('decoder.final_layernorm.weight', False), ('output_layer.weight', True)]
    """
    split = split or PipelineSplit(pp=layout.pp)
    if split.pp != layout.pp:
        raise BridgeError(f"pipeline split for {split.pp} stages used with a layout of {layout.pp}")
    shared = split.tied and layout.pp > 1
    out: list[Instance] = []
    i = 0
    while i < len(geoms):
        g = geoms[i]
        if not g.prepend:
            if split.holds(g.name, p, v):
                out.append(Instance(g.name, (), shared=shared and g.name == EMBEDDING))
            i += 1
            continue
        j = i
        while j < len(geoms) and geoms[j].prepend and geoms[j].prepend[0] == g.prepend[0]:
            j += 1
        block = geoms[i:j]
        for layer in split.layers(g.prepend[0], p, v):
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
    if shared and split.holds(OUTPUT, p, v) and any(g.name == EMBEDDING for g in geoms):
        out.append(Instance(EMBEDDING, (), shared=True, tied_copy=True))
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
                          bucket_size: int | None, where: str, bucketed: bool = True) -> BufferLayout:
    """Rebuild one buffer's layout and check it against the saved per-bucket numels.

    The bucket size is taken from `bucket_size` when given, else inferred: a single bucket when
    one numel is saved, else the smallest size that reproduces the saved bucket boundaries.
    `bucketed=False`: a buffer Megatron-LM's training loop leaves unbucketed whatever the run's
    bucket size (not the first model chunk of the first pipeline stage), so one bucket is tried too.
    """
    params = [BufferParam(i.label, numels[i], i.shared) for i in instances]
    cands: list[int | None]
    if bucket_size is not None:
        cands = [bucket_size] + ([None] if not bucketed and per_bucket_unpadded is not None else [])
    elif per_bucket_unpadded is None or len(per_bucket_unpadded) <= 1:
        cands = [None]
    else:
        # a bucket closes at the first param end reaching bucket_size: try each saved bucket's size; and
        # one unbounded bucket (tied embeddings at PP > 1 take buckets of their own even so)
        cands = sorted(set(int(n) for n in per_bucket_unpadded[:-1])) + [None]
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
    if per_bucket_padded is not None and last is not None and list(got) == [int(n) for n in per_bucket_unpadded or got]:
        # the parameters fit; only the padding, set by the DistOpt group's size, does not
        raise BridgeError(f"{where}: the saved per_bucket_numel {[int(n) for n in per_bucket_padded]} (buckets padded "
                          f"for the DistOpt group) differs from {last.per_bucket_numel()}, the padding for a group of "
                          f"{dp_size} ranks; pass the run's --dp (and --tp / --gtp / --cp / --pp)")
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


def replica_label(geom: ParamGeometry, tp: int, gtp: int, t: int, g: int) -> str | None:
    """None when TP rank t / GTP rank g holds a distinct copy (a shard, or the main replica: rank 0
    exports replicas), else the label of its replica (compared with the main one, never written).

    >>> geom = ParamGeometry("decoder.final_layernorm.weight", (4,), "replicated")
    >>> replica_label(geom, 2, 1, 0, 0), replica_label(geom, 2, 1, 1, 0), replica_label(geom, 2, 2, 1, 1)
    (None, 'tp1', 'tp1.gtp1')
    >>> replica_label(ParamGeometry("w", (4, 4), "column"), 2, 1, 1, 0) is None
    True
    """
    tp_copy = geom.tp_kind == "replicated" and t != 0
    gtp_copy = not geom.gtp_active(gtp) and g != 0
    if not (tp_copy or gtp_copy):
        return None
    parts = ([f"tp{t}"] if tp > 1 else []) + ([f"gtp{g}"] if gtp > 1 else [])
    return ".".join(parts)


def literal(s: str):
    """Parse a Python literal safely (dtype keys in per_bucket_numel dicts are strings or tuples)."""
    try:
        return ast.literal_eval(s)
    except (ValueError, SyntaxError):
        return s


# ---------------------------------------------------------------------------------------------
# fully_sharded_model_space (megatron-core <= 0.15): flattened ranges of each rank's local shard


def flat_range_boxes(shape: Sequence[int], lo: int, hi: int) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """Elements [lo, hi) of a row-major array of `shape` as contiguous boxes: (start, box shape, flat offset
    of the box's first element relative to `lo`), in order; at most 2·ndim - 1 boxes.

    >>> flat_range_boxes((3, 4), 2, 11)      # rest of row 0, row 1, start of row 2
    [((0, 2), (1, 2), 0), ((1, 0), (1, 4), 2), ((2, 0), (1, 3), 6)]
    >>> flat_range_boxes((2, 2, 3), 0, 12), flat_range_boxes((5,), 1, 3)
    ([((0, 0, 0), (2, 2, 3), 0)], [((1,), (2,), 0)])
    """
    shape = tuple(int(s) for s in shape)
    out: list[tuple[tuple[int, ...], tuple[int, ...], int]] = []

    def rec(prefix: tuple[int, ...], sub: tuple[int, ...], a: int, b: int, base: int) -> None:
        if a >= b:
            return
        if not sub:
            out.append((prefix, (1,) * len(prefix), base))
            return
        inner = prod(sub[1:])
        lead = (1,) * len(prefix)
        row = a // inner
        if a % inner:                      # a partial first row
            end = min(b, (row + 1) * inner)
            rec(prefix + (row,), sub[1:], a - row * inner, end - row * inner, base)
            base, a, row = base + end - a, end, row + 1
        full = (b - a) // inner
        if full and a < b:
            out.append((prefix + (row,) + (0,) * (len(sub) - 1), lead + (full,) + sub[1:], base))
            base, a, row = base + full * inner, a + full * inner, row + full
        if a < b:                          # a partial last row
            rec(prefix + (row,), sub[1:], 0, b - a, base)

    if not 0 <= lo <= hi <= prod(shape):
        raise BridgeError(f"flat range [{lo}, {hi}) outside an array of shape {shape}")
    rec((), shape, lo, hi, 0)
    return out


def model_space_local_shape(key: str, stored: Sequence[int], model_shape: Sequence[int]) -> tuple[int, ...]:
    """Local shard shape of a flattened model-space entry: megatron-core stores a tensor of global shape
    G cut into shards of shape g as `G // g + (prod(g),)` (one leading index per shard, the shard's
    flat elements last; `nd_flattened_tensor_reformulated_global_shape`).

    >>> model_space_local_shape("k", (2, 2, 1, 960), (2, 80, 24))
    (1, 40, 24)
    """
    stored, model_shape = tuple(stored), tuple(model_shape)
    frag = stored[:-1]
    ok = len(stored) == len(model_shape) + 1 and all(f > 0 and m % f == 0 for f, m in zip(frag, model_shape))
    local = tuple(m // f for f, m in zip(frag, model_shape)) if ok else ()
    if not ok or prod(local) != stored[-1]:
        raise BridgeError(f"{key}: stored shape {stored} is not the flattened layout of the model entry's "
                          f"{model_shape} (shards x flat elements); unknown format")
    return local


def model_space_copies_flat(key: str, info: TensorInfo, model_shape: Sequence[int], geom: ParamGeometry,
                            npre: int) -> list[Copy]:
    """Copies of a `fully_sharded_model_space` optimizer entry: each stored chunk is the flat range
    [f0, f1) (last axis) of the local shard at the chunk's leading indices; its row-major pieces are
    boxes of the model entry's global tensor, which map to logical arrays as model entries do."""
    local = model_space_local_shape(key, info.shape, model_shape)
    runs = logical_row_runs(geom)
    out: list[Copy] = []
    for i, ch in enumerate(info.chunks):
        lead, f0, n = ch.offsets[:-1], ch.offsets[-1], ch.sizes[-1]
        if any(s != 1 for s in ch.sizes[:-1]):
            raise BridgeError(f"{key}: chunk {ch.offsets} spans {ch.sizes[:-1]} shards; unknown format")
        origin = tuple(j * g for j, g in zip(lead, local))
        for start, shape, off in flat_range_boxes(local, f0, f0 + n):
            glob = ChunkInfo(tuple(o + s for o, s in zip(origin, start)), shape, ch.storage)
            for c in box_copies(key, i, glob, runs, npre):
                out.append(Copy(key, i, c.array, c.dst, c.src, off, shape))
    return out


# ---------------------------------------------------------------------------------------------
# dp_zero_gather_scatter: tensors inside a pickled object

OBJECT_TENSOR_SEP = "#"


def object_tensor_key(obj: str, gbuf: int, dtype_key: str, state: str) -> str:
    """Copy key of one gathered state tensor inside a dp_zero_gather_scatter object.

    >>> object_tensor_key("optimizer.distributed.dp_group_idx_0.param_state", 0, "(torch.bfloat16, torch.float32)", "param")
    'optimizer.distributed.dp_group_idx_0.param_state#0#(torch.bfloat16, torch.float32)#param'
    >>> parse_object_tensor_key(_)
    ('optimizer.distributed.dp_group_idx_0.param_state', 0, '(torch.bfloat16, torch.float32)', 'param')
    """
    return OBJECT_TENSOR_SEP.join((obj, str(gbuf), dtype_key, state))


def parse_object_tensor_key(key: str) -> tuple[str, int, str, str] | None:
    """(object, buffer, dtype key, state) of an `object_tensor_key`, None for a plain tensor key."""
    parts = key.split(OBJECT_TENSOR_SEP)
    if len(parts) != 4 or not parts[1].isdigit():
        return None
    return parts[0], int(parts[1]), parts[2], parts[3]
