"""PURE planning of the streamed maxtext preset: which box of which source array fills which output chunk.

Each table row (`maxtext.TABLE`) relates a logical layout and a MaxText layout as patterns of named
dims (`"L (H D) E"` <-> `"E L H D"`). An output array is cut into chunks so that every chunk is the
image of one rectangular box of one source array: cuts follow the source's own axis order (the
source's outermost dim first: for a layer-stacked source, whole layers), and a fused output axis
such as `(H D)` is cut only at multiples of its inner size. A `Move` says, for one output array,
where its data comes from; `source_box` turns an output box into the source box and the names of
the dims it spans, and `arrange_block` does the reshape + transpose of the block read from there.

>>> m = Move(("q",), "E L H D", (("s",),), "L (H D) E", {"E": 4, "L": 3, "H": 2, "D": 2})
>>> m.shape, chunk_shape(m, 4, 2 * 4 * 4 * 4)          # two layers of E*H*D fit: cut along L
((4, 3, 2, 2), (4, 2, 2, 2))
>>> src, box = source_box(m, Box((0, 2, 0, 0), (4, 3, 2, 2)))
>>> src, str(box)
(('s',), '[2:3, 0:4, 0:4]')
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import prod
from typing import Mapping, Sequence

import numpy as np

from bridge.errors import BridgeError
from bridge.layout.boxes import Box
from bridge.format import schema
from bridge.jaxside.presets.maxtext import Dims, Options, _drop_l, _maxtext_paths, _split, active_table, find_logical, parse_pattern

Path = tuple[str, ...]


@dataclass(frozen=True)
class Move:
    """One output array and where it comes from.

    `dst` / `dst_pattern`: the output array and its layout; `sources` / `src_pattern`: the source
    array(s) and their layout. Dims of the source pattern absent from the output pattern are fixed
    at `fixed` (an unscanned MaxText layer `n` taken from a stacked logical array: `{"L": n}`);
    dims of the output pattern absent from the source pattern index `sources` (a stacked logical
    array gathered from MaxText's per-layer arrays: one source per layer). `kind` and `leaf` say
    which value transform applies (`maxtext._value_forward` / `_value_inverse`).
    """

    dst: Path
    dst_pattern: str
    sources: tuple[Path, ...]
    src_pattern: str
    sizes: Mapping[str, int]
    fixed: Mapping[str, int] = field(default_factory=dict)
    kind: str = "params"  # foreign: maxtext / optax tree
    leaf: object = None
    dtype: str = "float32"
    whole: tuple[str, ...] = ()         # dims never cut (D of q/k: the RoPE permutation spans it)
    logical_dst: bool = False           # the output is the logical side (from-maxtext)

    @property
    def cut_order(self) -> list[str]:
        """Dims in the order chunks cut them: the logical layout's (layer first), whichever side it is
        on, so that the chunks of the way there are the chunks of the way back."""
        return [d for g in parse_pattern(self.dst_pattern if self.logical_dst else self.src_pattern) for d in g]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(prod(self.sizes[d] for d in g) for g in parse_pattern(self.dst_pattern))

    @property
    def src_names(self) -> list[str]:
        return [d for g in parse_pattern(self.src_pattern) for d in g]

    @property
    def stacked_names(self) -> list[str]:
        """Output dims that pick the source array (one source per index)."""
        return [d for g in parse_pattern(self.dst_pattern) for d in g if d not in self.src_names]

    @property
    def nbytes(self) -> int:
        return prod(self.shape) * np.dtype(self.dtype).itemsize


def chunk_shape(move: Move, itemsize: int, max_bytes: int) -> tuple[int, ...]:
    """Output chunk shape: whole on every axis but those cut, cut in the logical layout's axis order
    (`Move.cut_order`: the layer axis first; a source box is then one run of whole layers).

    The output axes are visited in that order (an axis by its first dim); each is
    cut to as many units as fit (a unit: one index, or the inner dims of a fused axis), evenly;
    an axis that must hold one unit (still too large, or a dim that picks the source array) is
    set to one unit and the next is visited.

    >>> m = Move(("w",), "E L F", (("s",),), "L F E", {"E": 8, "L": 4, "F": 16})
    >>> chunk_shape(m, 4, 8 * 16 * 4 * 2), chunk_shape(m, 4, 8 * 16 * 4 // 2)
    ((8, 2, 16), (8, 1, 8))
    >>> u = Move(("w",), "L (H D) E", (("a",), ("b",)), "E H D", {"E": 2, "L": 2, "H": 3, "D": 4})
    >>> chunk_shape(u, 4, 1 << 20)                         # one layer per chunk: one source each
    (1, 12, 2)
    >>> b = Move(("w",), "L (H D) E", (("s",),), "E L H D", {"E": 8, "L": 4, "H": 2, "D": 4}, logical_dst=True)
    >>> chunk_shape(b, 4, 2 * 64 * 4), chunk_shape(b, 4, 32 * 4)   # back from MaxText: layers, then heads
    ((2, 8, 8), (1, 4, 8))
    """
    groups = parse_pattern(move.dst_pattern)
    sizes = move.sizes
    order = move.cut_order
    unit = [prod(sizes[d] for d in g[1:]) for g in groups]          # a fused axis is cut in whole inner units
    count = [sizes[g[0]] for g in groups]                           # units along each axis
    chunk = list(count)
    stacked = set(move.stacked_names)
    for k, g in enumerate(groups):                                  # the source-picking dims: one unit
        if g[0] in stacked:
            chunk[k] = 1

    def nbytes() -> int:
        return prod(c * u for c, u in zip(chunk, unit)) * itemsize

    rank = sorted((k for k, g in enumerate(groups) if g[0] not in stacked and g[0] not in move.whole),
                  key=lambda k: order.index(groups[k][0]))
    for k in rank:
        if nbytes() <= max_bytes:
            break
        chunk[k] = 1
        one = nbytes()
        if one <= max_bytes:
            fit = max(1, min(count[k], max_bytes // one))
            n = -(-count[k] // fit)
            chunk[k] = -(-count[k] // n)
            break
    return tuple(c * u for c, u in zip(chunk, unit))


def _name_ranges(move: Move, box: Box) -> dict[str, tuple[int, int]]:
    """The range of every output dim a box of the output spans (fused axes: on unit boundaries)."""
    out: dict[str, tuple[int, int]] = {}
    for g, a, b in zip(parse_pattern(move.dst_pattern), box.start, box.stop):
        inner = prod(move.sizes[d] for d in g[1:])
        if len(g) > 1 and (a % inner or b % inner):
            raise BridgeError(f"{'/'.join(move.dst)}: box {box} cuts the fused axis {g} inside a unit")
        out[g[0]] = (a // inner, -(-b // inner))
        for d in g[1:]:
            out[d] = (0, move.sizes[d])
    return out


def source_box(move: Move, box: Box) -> tuple[Path, Box]:
    """(source array, its box) that holds the data of output `box` (one chunk of `chunk_shape`).

    >>> m = Move(("k",), "E V", (("s",),), "V E", {"E": 4, "V": 6})
    >>> src, b = source_box(m, Box((0, 2), (4, 4)))
    >>> src, str(b)
    (('s',), '[2:4, 0:4]')
    """
    r = _name_ranges(move, box)
    src = move.sources[0]
    stacked = move.stacked_names
    if stacked:
        a, b = r[stacked[0]]
        if b - a != 1:
            raise BridgeError(f"{'/'.join(move.dst)}: box {box} spans several source arrays")
        src = move.sources[a]
    start, stop = [], []
    for g in parse_pattern(move.src_pattern):
        rng = [(move.fixed[d], move.fixed[d] + 1) if d in move.fixed else r[d] for d in g]
        ns = [move.sizes[d] for d in g]
        # one rectangle of the fused axis only when every dim after the first one spanning more
        # than one index is whole (row-major: the run of flat indices is then contiguous)
        wide = [i for i, (a, b) in enumerate(rng) if b - a != 1]
        if wide and any(rng[j] != (0, ns[j]) for j in range(wide[0] + 1, len(g))):
            raise BridgeError(f"{'/'.join(move.dst)}: box {box} is not one box of the source")
        lo = int(np.ravel_multi_index([a for a, _ in rng], ns)) if ns else 0
        hi = int(np.ravel_multi_index([b - 1 for _, b in rng], ns)) + 1 if ns else 1
        start.append(lo)
        stop.append(hi)
    return src, Box(tuple(start), tuple(stop))


def arrange_block(move: Move, box: Box, data: np.ndarray) -> np.ndarray:
    """The output block `box` from `data`, the source box `source_box(move, box)` read (reshape +
    transpose only; the value transform is the caller's).

    >>> x = np.arange(3 * 4 * 4).reshape(3, 4, 4)                 # L (H D) E, H=D=2, E=4
    >>> m = Move(("q",), "E L H D", (("s",),), "L (H D) E", {"E": 4, "L": 3, "H": 2, "D": 2})
    >>> b = Box((0, 1, 0, 0), (4, 3, 2, 2))
    >>> y = arrange_block(m, b, x[source_box(m, b)[1].slices])
    >>> bool((y == x.reshape(3, 2, 2, 4).transpose(3, 0, 1, 2)[:, 1:3]).all())
    True
    """
    r = _name_ranges(move, box)
    src_names = move.src_names
    ext = {d: (1 if d in move.fixed else r[d][1] - r[d][0]) for d in src_names}
    x = np.asarray(data).reshape(tuple(ext[d] for d in src_names))
    dst_groups = parse_pattern(move.dst_pattern)
    dst_names = [d for g in dst_groups for d in g if d in ext]
    kept = [d for d in src_names if d in dst_names]
    x = x.reshape(tuple(ext[d] for d in kept)) if len(kept) != len(src_names) else x
    x = x.transpose(tuple(kept.index(d) for d in dst_names))
    return x.reshape(box.shape)


def blocks_of(shape: Sequence[int], chunk: Sequence[int]) -> list[Box]:
    """The chunk grid's boxes of an array, row-major (one block per output chunk).

    >>> [str(b) for b in blocks_of((3, 2), (2, 2))]
    ['[0:2, 0:2]', '[2:3, 0:2]']
    """
    from itertools import product

    if not shape:
        return [Box((), ())]
    counts = [-(-s // c) for s, c in zip(shape, chunk)]
    return [Box(tuple(i * c for i, c in zip(cell, chunk)),
                tuple(min((i + 1) * c, s) for i, c, s in zip(cell, chunk, shape)))
            for cell in product(*(range(n) for n in counts))]


# MaxText's train-state tree (as `maxtext_ckpt` spells it): where each role's tree lives
MT_PARAMS: Path = ("params", "params")  # foreign: maxtext / optax tree
MT_ADAM: Path = ("opt_state", "0")  # foreign: maxtext / optax tree


def maxtext_root(role: str) -> Path:
    """Where a role's tree sits in MaxText's train state.

    >>> maxtext_root("params"), maxtext_root("mu")
    (('params', 'params'), ('opt_state', '0', 'mu', 'params'))
    """
    return MT_PARAMS if role == schema.PARAMS else MT_ADAM + (role, "params")  # foreign: maxtext / optax tree


def _whole(leaf) -> tuple[str, ...]:
    return ("D",) if leaf.rope else ()


def moves_to_maxtext(logical: Mapping[Path, object], dims: Dims, opts: Options, dtype: str = "float32") -> list[Move]:
    """One Move per MaxText array (masters, mu, nu) from the logical param paths (without role prefix)."""
    sizes = dims.sizes()
    out = []
    for role in schema.OPTIMIZER_ROLES:
        for leaf in active_table(dims):
            src = schema.role_path(role, find_logical(leaf, logical))
            for path, n in _maxtext_paths(leaf, dims, opts):
                dst = maxtext_root(role) + path
                if n is None:
                    out.append(Move(dst, leaf.dst, (src,), leaf.src, sizes, {}, role, leaf, dtype, _whole(leaf)))
                else:
                    out.append(Move(dst, _drop_l(leaf.dst), (src,), leaf.src, sizes, {"L": n}, role, leaf, dtype,
                                    _whole(leaf)))
    return out


def moves_from_maxtext(dims: Dims, opts: Options) -> list[Move]:
    """One Move per logical array (masters, mu, nu; canonical names) from MaxText's arrays."""
    sizes = dims.sizes()
    out = []
    for role in schema.OPTIMIZER_ROLES:
        for leaf in active_table(dims):
            dst = schema.role_path(role, _split(leaf.logical[0]))
            paths = _maxtext_paths(leaf, dims, opts)
            srcs = tuple(maxtext_root(role) + p for p, _ in paths)
            pattern = leaf.dst if paths[0][1] is None else _drop_l(leaf.dst)
            out.append(Move(dst, leaf.src, srcs, pattern, sizes, {}, role, leaf, "float32", _whole(leaf), True))
    return out
