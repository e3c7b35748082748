"""Parameter geometry: logical shape, TP partition, GTP split with padding, stacked axes.

Three layouts of one weight (megatron-layout.md §2): *logical global* (TP=1, GTP=1, per fused
section), *TP-local* (what plain TP rank t holds), *physical GTP shard* (TP-local zero-padded at the
tail of dim 0 to P = S·G rows, rows [g·S, (g+1)·S) on GTP rank g). GTP applies only when the
group size is > 1 (Megatron wraps nothing otherwise).

>>> w = ParamGeometry("w", (10, 6), "column", gtp=True, pad_for_alignment=4)   # §2.4
>>> w.split(tp=2, gtp=2)
GtpSplit(rows=5, pad=3, shard_rows=4, size=2)
>>> [(p.logical, p.local_start) for p in w.shard_pieces(tp=2, gtp=2, t=1, g=1)]
[(Box(start=(9, 0), stop=(10, 6)), 0)]
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from math import prod
from typing import Sequence

from bridge.errors import BridgeError
from bridge.layout.boxes import Box
from bridge.layout.fused import FusedSpec, section_array
from bridge.layout.rectangles import Piece, RowRun, map_flat_range

TP_KINDS = ("column", "row", "vocab", "replicated")


def gtp_shard_dim0(rows: int, gtp: int, pad_for_alignment: int, param: str = "<param>") -> tuple[int, int]:
    """`(shard_rows, pad)` as Megatron's `gtp_remat_shard_dim0` (0.19.2 `generalized_tensor_parallelism.py:455`).

    >>> gtp_shard_dim0(1152, 4, 128)          # shard 3 is all padding
    (384, 384)
    >>> gtp_shard_dim0(10, 2, 0)
    (5, 0)
    """
    if pad_for_alignment < 0:
        raise BridgeError(f"{param}: pad_for_alignment={pad_for_alignment} must be >= 0")
    if pad_for_alignment > 0:
        align = pad_for_alignment * gtp
        pad = (align - rows % align) % align
    else:
        if rows % gtp:
            raise BridgeError(f"{param}: dim 0 of the TP-local tensor ({rows} rows) is not divisible by GTP={gtp} "
                              f"with pad_for_alignment=0; use pad_for_alignment > 0 or a GTP size dividing {rows}")
        pad = 0
    return (rows + pad) // gtp, pad


@dataclass(frozen=True)
class GtpSplit:
    """GTP split of the TP-local dim 0: L logical rows, `pad` tail rows, S rows per shard, G shards."""

    rows: int
    pad: int
    shard_rows: int
    size: int

    def keep(self, g: int) -> int:
        """Logical rows in GTP shard g: clamp(L - g·S, 0, S).

        >>> GtpSplit(1152, 384, 384, 4).keep(3)
        0
        """
        return max(0, min(self.shard_rows, self.rows - g * self.shard_rows))


@dataclass(frozen=True)
class ParamGeometry:
    """Geometry of one Megatron parameter (one layer / one expert instance).

    - `shape`: global logical shape of the instance, torch orientation (`[out, in]`); for a fused
      parameter the fused global shape (dim 0 = sum of section rows).
    - `tp_kind`: "column" / "vocab" (TP splits dim 0), "row" (TP splits dim 1), "replicated".
    - `gtp`: GTP-sharded (dim 0 of the TP-local tensor) when the GTP group size is > 1.
    - `prepend`: sizes of stacked leading axes (layers, experts) of the logical array; a physical
      shard belongs to one `index` into them.
    - `fused`: section table; logical arrays are then `section_array(name, section)`.
    - `expert`: sizes come from the expert grid (ETP, EGTP).
    - `index`: default stacked-axes index of this instance (layer, expert), used when a method's
      `index` argument is None; `at(index)` returns a copy for another instance.

    >>> ParamGeometry("l.w", (10, 6), "row", gtp=True, pad_for_alignment=4, prepend=(24,)).logical_arrays()
    {'l.w': (24, 10, 6)}
    """

    name: str
    shape: tuple[int, ...]
    tp_kind: str = "replicated"
    gtp: bool = False
    pad_for_alignment: int = 16
    prepend: tuple[int, ...] = ()
    fused: FusedSpec | None = None
    expert: bool = False
    index: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        object.__setattr__(self, "prepend", tuple(int(s) for s in self.prepend))
        object.__setattr__(self, "index", tuple(int(s) for s in self.index))
        n = self.name
        if self.index and (len(self.index) != len(self.prepend)
                           or any(not 0 <= i < k for i, k in zip(self.index, self.prepend))):
            raise BridgeError(f"{n}: stacked-axes index {self.index} does not fit prepend sizes {self.prepend}")
        if self.tp_kind not in TP_KINDS:
            raise BridgeError(f"{n}: unknown TP kind {self.tp_kind!r}; use one of {list(TP_KINDS)}")
        if any(s < 0 for s in self.shape) or any(s < 1 for s in self.prepend):
            raise BridgeError(f"{n}: negative shape {self.shape} or non-positive prepend sizes {self.prepend}")
        if self.tp_kind == "row" and len(self.shape) < 2:
            raise BridgeError(f"{n}: row-parallel needs >= 2 dims (TP splits dim 1), shape is {self.shape}")
        if self.tp_kind in ("column", "vocab") and len(self.shape) < 1:
            raise BridgeError(f"{n}: {self.tp_kind}-parallel needs >= 1 dim, shape is {self.shape}")
        if self.gtp and len(self.shape) < 1:
            raise BridgeError(f"{n}: GTP splits dim 0 but the shape is {self.shape}")
        if self.pad_for_alignment < 0:
            raise BridgeError(f"{n}: pad_for_alignment={self.pad_for_alignment} must be >= 0")
        if self.fused is not None:
            if self.tp_kind != "column":
                raise BridgeError(f"{n}: fused projections are column-parallel (TP splits each section's dim 0), got {self.tp_kind!r}")
            if self.fused.rows != self.shape[0]:
                raise BridgeError(f"{n}: fused sections sum to {self.fused.rows} rows but dim 0 of shape {self.shape} is {self.shape[0]}")

    # --- logical side ------------------------------------------------------------------------------
    def logical_arrays(self) -> dict[str, tuple[int, ...]]:
        """Logical array name -> full logical shape (prepended axes first)."""
        if self.fused is None:
            return {self.name: self.prepend + self.shape}
        return {section_array(self.name, s.name): self.prepend + (s.rows,) + self.shape[1:] for s in self.fused.sections}

    def at(self, index: Sequence[int]) -> "ParamGeometry":
        """The same geometry for the instance at stacked-axes `index`."""
        return replace(self, index=tuple(index))

    def sizes(self, layout) -> tuple[int, int]:
        """(TP, GTP) sizes that apply to this parameter in a `ParallelLayout`."""
        return layout.tp_gtp_sizes(self.expert)

    def placement(self, layout, rank: int) -> tuple[int, int, int, int]:
        """`(tp, gtp, t, g)` of `rank` for this parameter (expert grid for expert params).

        >>> from bridge.layout.parallel import ParallelLayout
        >>> ParamGeometry("w", (8, 4), "column", gtp=True).placement(ParallelLayout(tp=2, gtp=2, dp=2), 6)
        (2, 2, 0, 1)
        """
        tp, gtp = self.sizes(layout)
        t, g = layout.shard_coords(rank, self.expert)
        return tp, gtp, t, g

    def to_json(self) -> dict:
        """Plain JSON (fused spec included)."""
        return {"name": self.name, "shape": list(self.shape), "tp_kind": self.tp_kind, "gtp": self.gtp,
                "pad_for_alignment": self.pad_for_alignment, "prepend": list(self.prepend),
                "fused": None if self.fused is None else self.fused.to_json(), "expert": self.expert,
                "index": list(self.index)}

    @classmethod
    def from_json(cls, d: dict) -> "ParamGeometry":
        """Inverse of `to_json`.

        >>> w = ParamGeometry("fc1", (12, 4), "column", True, 4, (2,), FusedSpec.swiglu(6), index=(1,))
        >>> ParamGeometry.from_json(w.to_json()) == w
        True
        """
        try:
            fused = None if d.get("fused") is None else FusedSpec.from_json(d["fused"])
            return cls(str(d["name"]), tuple(d["shape"]), d.get("tp_kind", "replicated"), bool(d.get("gtp", False)),
                       int(d.get("pad_for_alignment", 16)), tuple(d.get("prepend", ())), fused,
                       bool(d.get("expert", False)), tuple(d.get("index", ())))
        except (KeyError, TypeError, ValueError) as e:
            raise BridgeError(f"parameter geometry JSON {d!r} is malformed ({e}); write it with ParamGeometry.to_json()") from None

    # --- TP / GTP ------------------------------------------------------------------------------------
    def tp_local_shape(self, tp: int) -> tuple[int, ...]:
        """Shape held by TP rank t of a plain TP run (same for every t)."""
        s = self.shape
        if tp < 1:
            raise BridgeError(f"{self.name}: TP={tp} must be >= 1")
        if self.tp_kind in ("column", "vocab"):
            if self.fused is not None:
                self.fused.check_tp(tp, self.name)
            elif s[0] % tp:
                raise BridgeError(f"{self.name}: dim 0 ({s[0]}) is not divisible by TP={tp} ({self.tp_kind}-parallel); "
                                  f"choose a TP that divides {s[0]}")
            return (s[0] // tp,) + s[1:]
        if self.tp_kind == "row":
            if s[1] % tp:
                raise BridgeError(f"{self.name}: dim 1 ({s[1]}) is not divisible by TP={tp} (row-parallel); "
                                  f"choose a TP that divides {s[1]}")
            return (s[0], s[1] // tp) + s[2:]
        return s

    def gtp_active(self, gtp: int) -> bool:
        return self.gtp and gtp > 1

    def _memo(self) -> dict:
        # per-instance cache of pure results (the dataclass is frozen, so they never go stale)
        m = self.__dict__.get("_memo_")
        if m is None:
            m = self.__dict__["_memo_"] = {}
        return m

    def _phys(self, tp: int, gtp: int) -> tuple[GtpSplit, tuple[int, ...], int]:
        key = ("phys", tp, gtp)
        m = self._memo()
        hit = m.get(key)
        if hit is None:
            local = self.tp_local_shape(tp)
            if gtp < 1:
                raise BridgeError(f"{self.name}: GTP={gtp} must be >= 1")
            if not self.gtp_active(gtp):
                rows = local[0] if local else 1
                sp, shape = GtpSplit(rows, 0, rows, 1), local
            else:
                srows, pad = gtp_shard_dim0(local[0], gtp, self.pad_for_alignment, self.name)
                sp, shape = GtpSplit(local[0], pad, srows, gtp), (srows,) + local[1:]
            hit = m[key] = (sp, shape, prod(shape))
        return hit

    def split(self, tp: int, gtp: int) -> GtpSplit:
        """GTP split of the TP-local dim 0 (G=1, pad 0 when GTP does not apply)."""
        return self._phys(tp, gtp)[0]

    def physical_shape(self, tp: int, gtp: int) -> tuple[int, ...]:
        """Shape of the physical shard a rank holds (padded GTP shard, or the TP-local tensor)."""
        return self._phys(tp, gtp)[1]

    def physical_numel(self, tp: int, gtp: int) -> int:
        """Element count of the physical shard (what the DistOpt buffer reserves)."""
        return self._phys(tp, gtp)[2]

    def row_runs(self, tp: int, t: int, index: Sequence[int] | None = None) -> list[RowRun]:
        """TP-local rows that hold data -> logical arrays, for TP rank t and stacked-axes `index`."""
        return list(self._runs(tp, t, self._check_index(index)))

    def _runs(self, tp: int, t: int, index: tuple[int, ...]) -> tuple[RowRun, ...]:
        key = ("runs", tp, t, index)
        m = self._memo()
        hit = m.get(key)
        if hit is not None:
            return hit
        if not 0 <= t < tp:
            raise BridgeError(f"{self.name}: TP rank {t} outside TP={tp}")
        local = self.tp_local_shape(tp)
        if not local:
            runs = [RowRun(0, 1, self.name, index + (0,))]
        else:
            zeros = (0,) * (len(local) - 1)
            if self.fused is not None:
                runs = [RowRun(sg.local_row, sg.rows, section_array(self.name, sg.section),
                               index + (t * sg.section_tp_rows + sg.section_row,) + zeros)
                        for sg in self.fused.segments(tp, self.name)]
            else:
                if self.tp_kind in ("column", "vocab"):
                    off = (t * local[0],) + zeros
                elif self.tp_kind == "row":
                    off = (0, t * local[1]) + zeros[1:]
                else:
                    off = (0,) + zeros
                runs = [RowRun(0, local[0], self.name, index + off)]
        hit = m[key] = tuple(runs)
        return hit

    def _check_index(self, index: Sequence[int] | None) -> tuple[int, ...]:
        if index is None or index == self.index:
            index = self.index
            if len(index) == len(self.prepend):  # the default was validated at construction
                return index
        else:
            index = tuple(int(i) for i in index)
        if len(index) != len(self.prepend) or any(not 0 <= i < n for i, n in zip(index, self.prepend)):
            raise BridgeError(f"{self.name}: stacked-axes index {index} does not fit prepend sizes {self.prepend}")
        return index

    # --- pieces -------------------------------------------------------------------------------------
    def fragment_pieces(self, tp: int, gtp: int, t: int, g: int, f0: int, f1: int,
                        index: Sequence[int] | None = None) -> list[Piece]:
        """Pieces of flat fragment [f0, f1) of the physical shard on (TP rank t, GTP rank g).

        `local_start` is relative to f0. Padding rows give no Piece.

        >>> w = ParamGeometry("w", (10, 60), "column", gtp=True, pad_for_alignment=4)  # §6.6
        >>> [(str(p.logical), p.local_start) for p in w.fragment_pieces(2, 2, 0, 0, 0, 128)]
        [('[0:2, 0:60]', 0), ('[2:3, 0:8]', 120)]
        """
        sp, shape, numel = self._phys(tp, gtp)
        if sp.size == 1:
            g = 0  # GTP peers hold identical copies of a GTP-replicated parameter
        elif not 0 <= g < gtp:
            raise BridgeError(f"{self.name}: GTP rank {g} outside GTP={gtp}")
        if not 0 <= f0 <= f1 <= numel:
            raise BridgeError(f"{self.name}: flat range [{f0}, {f1}) outside the physical shard of {numel} elements")
        index = self._check_index(index)
        runs = self._runs(tp, t, index)
        if not shape:  # 0-d parameter: one element
            return [Piece(self.name, Box(index, tuple(i + 1 for i in index)), 0)] if f1 > f0 else []
        k = numel // shape[0] if shape[0] else prod(shape[1:])
        base = g * sp.shard_rows * k
        return map_flat_range(runs, shape[1:], base + f0, base + f1)

    def shard_pieces(self, tp: int, gtp: int, t: int, g: int, index: Sequence[int] | None = None) -> list[Piece]:
        """Pieces of the whole physical shard on (TP rank t, GTP rank g)."""
        return self.fragment_pieces(tp, gtp, t, g, 0, self.physical_numel(tp, gtp), index)
