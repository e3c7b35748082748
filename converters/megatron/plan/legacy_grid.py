"""megatron-core 0.19.2 legacy GTP checkpoint grids -> logical coordinates.

Two stored layouts (megatron-layout.md §2.5 A and §6.3):
- *padded grid* (`allow_shape_mismatch` entries): column-parallel (tp_axis 0) stores physical shard
  (t, g) at rows [(t·G+g)·S, +S) of a (TP·G·S, K...) tensor; row-parallel (tp_axis 1) stores it at
  rows [g·S, +S), columns [t·I/TP, +I/TP) of a (G·S, I, ...) tensor. Pad rows are inside.
- *scrambled SwiGLU* (`linear_fc1` under GTP): the factory `torch.chunk`ed each GTP shard in two
  halves h = S/2 and stored first halves of all B = TP·G shards, then all second halves.
Both are described as `StoredRun`s (stored rows <-> physical shard rows); `legacy_box_map` maps any
stored box to logical boxes through the parameter's geometry (fused sections included).

>>> from bridge.layout.params import ParamGeometry
>>> w = ParamGeometry("w", (10, 6), "column", gtp=True, pad_for_alignment=4)
>>> legacy_shape(w, 2, 2), [(r.row, r.t, r.g) for r in padded_grid_runs(w, 2, 2)]
((16, 6), [(0, 0, 0), (4, 0, 1), (8, 1, 0), (12, 1, 1)])
>>> [(str(m.src), str(m.logical)) for m in legacy_box_map(w, 2, 2, Box((0, 0), (16, 6)))]
[('[0:4, 0:6]', '[0:4, 0:6]'), ('[4:5, 0:6]', '[4:5, 0:6]'), ('[8:12, 0:6]', '[5:9, 0:6]'), ('[12:13, 0:6]', '[9:10, 0:6]')]
"""

from __future__ import annotations

from dataclasses import dataclass

from bridge.errors import BridgeError
from bridge.layout.boxes import Box
from bridge.layout.params import ParamGeometry


@dataclass(frozen=True)
class StoredRun:
    """Stored rows [row, row+rows) (and, row-parallel, columns from `col`) hold rows
    [shard_row, shard_row+rows) of physical shard (t, g)."""

    row: int
    rows: int
    t: int
    g: int
    shard_row: int
    col: int = 0


@dataclass(frozen=True)
class BoxMap:
    """Stored data at `src` (relative to the stored box given) is logical `array`[`logical`]; same shape."""

    array: str
    logical: Box
    src: Box


def _sizes(geom: ParamGeometry, tp: int, gtp: int) -> tuple[int, int, tuple[int, ...]]:
    shape = geom.physical_shape(tp, gtp)
    if not shape:
        raise BridgeError(f"{geom.name}: a 0-d parameter has no legacy GTP grid")
    return shape[0], (gtp if geom.gtp_active(gtp) else 1), shape


def legacy_shape(geom: ParamGeometry, tp: int, gtp: int) -> tuple[int, ...]:
    """Global shape of the 0.19.2 padded grid (prepended axes first).

    >>> legacy_shape(ParamGeometry("w", (6, 10), "row", gtp=True, pad_for_alignment=4), 2, 2)
    (8, 10)
    """
    S, G, shape = _sizes(geom, tp, gtp)
    if geom.tp_kind == "row":
        return geom.prepend + (G * S, geom.shape[1]) + shape[2:]
    if geom.tp_kind == "replicated":
        return geom.prepend + (G * S,) + shape[1:]
    return geom.prepend + (tp * G * S,) + shape[1:]


def padded_grid_runs(geom: ParamGeometry, tp: int, gtp: int) -> list[StoredRun]:
    """Where each physical shard sits in the padded grid (§2.5 A)."""
    S, G, shape = _sizes(geom, tp, gtp)
    if geom.tp_kind == "row":
        width = shape[1]
        return [StoredRun(g * S, S, t, g, 0, t * width) for t in range(tp) for g in range(G)]
    if geom.tp_kind == "replicated":
        return [StoredRun(g * S, S, 0, g, 0) for g in range(G)]
    return [StoredRun((t * G + g) * S, S, t, g, 0) for t in range(tp) for g in range(G)]


def scrambled_swiglu_runs(geom: ParamGeometry, tp: int, gtp: int) -> list[StoredRun]:
    """Where each physical-shard half sits in a 0.19.2 GTP SwiGLU `linear_fc1` entry (§6.3).

    >>> from bridge.layout.fused import FusedSpec
    >>> fc1 = ParamGeometry("fc1", (12, 2), "column", gtp=True, pad_for_alignment=4, fused=FusedSpec.swiglu(6))
    >>> [(r.row, r.t, r.g, r.shard_row) for r in scrambled_swiglu_runs(fc1, 2, 2)][:3]
    [(0, 0, 0, 0), (2, 0, 1, 0), (4, 1, 0, 0)]
    """
    S, G, _ = _sizes(geom, tp, gtp)
    if geom.tp_kind not in ("column", "vocab"):
        raise BridgeError(f"{geom.name}: scrambled SwiGLU halves exist only for column-parallel fc1, got {geom.tp_kind!r}")
    if S % 2:
        raise BridgeError(f"{geom.name}: GTP shard rows S={S} are odd; 0.19.2 could not have saved scrambled halves")
    h, B = S // 2, tp * G
    out = []
    for half in range(2):
        for blk in range(B):
            out.append(StoredRun(half * B * h + blk * h, h, blk // G, blk % G, half * h))
    return out


def legacy_box_map(geom: ParamGeometry, tp: int, gtp: int, stored: Box, scrambled_swiglu: bool = False) -> list[BoxMap]:
    """Logical boxes of a box of the stored legacy tensor (prepended axes first); padding maps to nothing."""
    npre = len(geom.prepend)
    full = Box.full(legacy_shape(geom, tp, gtp))
    if stored.ndim != full.ndim or not full.contains(stored):
        raise BridgeError(f"{geom.name}: stored box {stored} is not inside the legacy grid {full.shape}")
    runs = scrambled_swiglu_runs(geom, tp, gtp) if scrambled_swiglu else padded_grid_runs(geom, tp, gtp)
    S, _, pshape = _sizes(geom, tp, gtp)
    trailing = pshape[1:]
    pre_lo, pre_hi = stored.start[:npre], stored.stop[:npre]
    out: list[BoxMap] = []
    for idx in _ndindex(pre_lo, pre_hi):
        for run in runs:
            r0 = max(stored.start[npre], run.row)
            r1 = min(stored.stop[npre], run.row + run.rows)
            if r1 <= r0:
                continue
            # trailing extent of this run in stored coordinates, clipped to the stored box
            lo = (run.col,) + (0,) * (len(trailing) - 1) if trailing else ()
            t_lo = tuple(max(a, b) for a, b in zip(stored.start[npre + 1:], lo))
            t_hi = tuple(min(a, b + n) for a, b, n in zip(stored.stop[npre + 1:], lo, trailing))
            if any(b <= a for a, b in zip(t_lo, t_hi)):
                continue
            g_off = (run.g * S if geom.gtp_active(gtp) else 0)
            i0 = run.shard_row + (r0 - run.row)             # physical shard rows [i0, i1)
            i1 = i0 + (r1 - r0)
            for rr in geom.row_runs(tp, run.t, idx):
                j0 = max(g_off + i0, rr.row)                # TP-local rows
                j1 = min(g_off + i1, rr.row + rr.rows)
                if j1 <= j0:
                    continue
                srow = run.row + (j0 - g_off - run.shard_row)
                src_start = tuple(i - s for i, s in zip(idx, stored.start)) + (srow - stored.start[npre],) + \
                    tuple(a - s for a, s in zip(t_lo, stored.start[npre + 1:]))
                shape = (1,) * npre + (j1 - j0,) + tuple(b - a for a, b in zip(t_lo, t_hi))
                off = rr.offset
                log_start = off[:npre] + (off[npre] + j0 - rr.row,) + tuple(
                    o + a - c for o, a, c in zip(off[npre + 1:], t_lo, lo))
                out.append(BoxMap(rr.array, Box.of(log_start, shape), Box.of(src_start, shape)))
    return out


def _ndindex(lo: tuple[int, ...], hi: tuple[int, ...]):
    if not lo:
        yield ()
        return
    for i in range(lo[0], hi[0]):
        for rest in _ndindex(lo[1:], hi[1:]):
            yield (i,) + rest
