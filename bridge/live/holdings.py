"""What one rank holds, as flat local tensors cut into logical pieces (export side, per rank).

Every `LocalParam` gives up to four local flat tensors: the model weight shard (root `model`;
FP8 dequantized to bf16) and the optimizer fragment's master / exp_avg / exp_avg_sq (roots
`params`, `mu`, `nu`). The layout engine cuts each into `Piece`s (contiguous runs that are one
box of one logical array; padding gives none). `Holding.describe()` gives its `HoldingSummary`;
a rank's `RankSummary` (holdings, catalog, fused sections, pads) is what all ranks exchange (as
JSON) so that every rank computes the same global plan.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from math import prod
from typing import Sequence

import torch

from bridge.dtypes import FLOAT_NAMES, name_of_torch
from bridge.errors import BridgeError
from bridge.layout.rectangles import Piece
from bridge.live.api import LocalParam, QuantizedWeight
from bridge.format.schema import MODEL, OPTIMIZER_ROLES, role_path
from bridge.format.tree import megatron_key_to_path, path_to_name



@lru_cache(maxsize=None)
def tree_name(root: str, array: str) -> str:
    """Orbax name of logical array `array` under `root`.

    >>> tree_name("mu", "module.decoder.layers.mlp.linear_fc1.weight.gate")
    'opt_state.0.mu.decoder.layers.mlp.linear_fc1.weight.gate'
    """
    return path_to_name(role_path(root, megatron_key_to_path(array)))


def dtype_name(t: torch.dtype, what: str) -> str:
    """Store dtype name of a torch float dtype (BridgeError for anything else)."""
    name = name_of_torch(t)
    if name not in FLOAT_NAMES:  # exported state is weights, masters and moments: floats only
        raise BridgeError(f"{what}: dtype {t} cannot be stored; pass bf16/fp16/fp32 tensors or a QuantizedWeight")
    return name


@dataclass(frozen=True)
class PieceSummary:
    """One piece of a holding: elements [local_start, local_start + box size) are box [start, stop)
    of logical array `array` (name without root)."""

    array: str
    start: tuple[int, ...]
    stop: tuple[int, ...]
    local_start: int


@dataclass(frozen=True)
class HoldingSummary:
    """What another rank needs to know about one holding: no data."""

    root: str
    param: str
    dtype: str
    main: bool | None  # the holding's main_replica
    pieces: tuple[PieceSummary, ...]


@dataclass(frozen=True)
class RankSummary:
    """Everything one rank contributes to the global plan.

    `catalog`: Orbax name -> (shape, dtype) of every array its params belong to; `fused`: logical
    path -> fused section table (JSON) of its fused params; `pads`: GTP pad_for_alignment values.

    >>> s = RankSummary({tree_name(MODEL, "w"): ((4,), "bfloat16")},
    ...                 (HoldingSummary(MODEL, "w", "bfloat16", None, (PieceSummary("w", (0,), (4,), 0),)),))
    >>> RankSummary.from_json(s.to_json()) == s
    True
    """

    catalog: dict[str, tuple[tuple[int, ...], str]]
    holdings: tuple[HoldingSummary, ...]
    fused: dict[str, dict] = field(default_factory=dict)
    pads: tuple[int, ...] = ()

    def to_json(self) -> dict:
        """JSON-safe form for the all-gather (pieces as [array, start, stop, local_start])."""
        return {"catalog": {n: [list(shape), dtype] for n, (shape, dtype) in self.catalog.items()},
                "holdings": [{"root": h.root, "param": h.param, "dtype": h.dtype, "main": h.main,
                              "pieces": [[p.array, list(p.start), list(p.stop), p.local_start] for p in h.pieces]}
                             for h in self.holdings],
                "fused": self.fused, "pads": list(self.pads)}

    @classmethod
    def from_json(cls, d: dict) -> "RankSummary":
        return cls({n: (tuple(int(x) for x in shape), dtype) for n, (shape, dtype) in d["catalog"].items()},
                   tuple(HoldingSummary(h["root"], h["param"], h["dtype"], h["main"],
                                        tuple(PieceSummary(a, tuple(st), tuple(sp), int(ls))
                                              for a, st, sp, ls in h["pieces"]))
                         for h in d["holdings"]),
                   dict(d.get("fused", {})), tuple(d.get("pads", ())))


@dataclass(eq=False)
class Holding:
    """One local flat tensor of this rank and its logical pieces (array names without root)."""

    root: str
    param: str  # the LocalParam key, for messages
    data: torch.Tensor  # 1-D contiguous, the dtype that is stored
    pieces: list[Piece]
    main_replica: bool | None
    slot: int = -1  # position of its LocalParam in the list passed to export (for refreshing data)

    @property
    def dtype(self) -> str:
        return name_of_torch(self.data.dtype)

    def describe(self) -> HoldingSummary:
        """This holding without its data."""
        return HoldingSummary(self.root, self.param, self.dtype, self.main_replica,
                              tuple(PieceSummary(p.array, tuple(p.logical.start), tuple(p.logical.stop), p.local_start)
                                    for p in self.pieces))


def _flat(t: torch.Tensor, what: str) -> torch.Tensor:
    if not t.is_contiguous():
        raise BridgeError(f"{what} is not contiguous; pass the shard tensor itself (or .contiguous())")
    return t.reshape(-1)


def weight_tensor(p: LocalParam) -> torch.Tensor | None:
    """The weight as stored: FP8 dequantized to bf16, other dtypes as held."""
    w = p.weight
    if w is None:
        return None
    if isinstance(w, QuantizedWeight):
        return w.dequantize()
    if w.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise BridgeError(f"{p.key}: FP8 weight passed as a bare tensor; wrap it in QuantizedWeight(data, scale_inv, block)")
    return w


def param_holdings(p: LocalParam, run_layout, rank: int) -> list[Holding]:
    """Holdings of one LocalParam on `rank` (validates shapes and ranges, naming param and rank)."""
    geom = p.geometry
    where = f"rank {rank}: {p.key}"
    tp, gtp, t, g = geom.placement(run_layout, rank)
    index = tuple(p.index) or None  # None: the geometry's own default index
    shape = geom.physical_shape(tp, gtp)
    numel = prod(shape)
    out: list[Holding] = []
    w = weight_tensor(p)
    if w is not None:
        if tuple(w.shape) != tuple(shape):
            raise BridgeError(f"{where}: weight shard has shape {tuple(w.shape)}, the layout (TP={tp}, GTP={gtp}, "
                              f"t={t}, g={g}) gives {tuple(shape)}; pass the padded physical shard")
        dtype_name(w.dtype, where)
        out.append(Holding(MODEL, p.key, _flat(w, f"{where} weight"),
                           geom.shard_pieces(tp, gtp, t, g, index), p.main_replica))
    o = p.optim
    if o is not None:
        o.check(where, numel)
        pieces = geom.fragment_pieces(tp, gtp, t, g, o.f0, o.f1, index)
        for root, tensor in o.tensors().items():
            dtype_name(tensor.dtype, where)
            out.append(Holding(root, p.key, _flat(tensor, f"{where} {root}"), pieces, p.main_replica))
    return out


def rank_holdings(params: Sequence[LocalParam], run_layout, rank: int,
                  with_optim: bool) -> tuple[list[Holding], dict[str, tuple[tuple[int, ...], str]]]:
    """This rank's holdings (params as given, roles in `bridge.format.schema.ROLES` order) and its logical catalog.

    The catalog maps Orbax name -> (shape, dtype) for every array these params belong to: `model/...`
    when a weight is given, `params`/`mu`/`nu` when `with_optim` (even where this rank owns no
    fragment: the global coverage check then finds state nobody holds).
    """
    seen: set[tuple[str, tuple[int, ...]]] = set()
    out: list[Holding] = []
    catalog: dict[str, tuple[tuple[int, ...], str]] = {}
    for i, p in enumerate(params):
        ident = (p.key, tuple(p.index) or p.geometry.index)
        if ident in seen:
            raise BridgeError(f"rank {rank}: parameter {p.key} (index {tuple(p.index)}) is listed twice; pass each once")
        seen.add(ident)
        if p.geometry.name != p.key:
            raise BridgeError(f"rank {rank}: LocalParam key {p.key!r} differs from its geometry name {p.geometry.name!r}")
        mine = param_holdings(p, run_layout, rank)
        for h in mine:
            h.slot = i
        if mine and not with_optim and any(h.root != MODEL for h in mine):
            raise BridgeError(f"rank {rank}: {p.key} carries optimizer state but the run has no optimizer config; "
                              "set LiveRun.optimizer (AdamConfig)")
        out.extend(mine)
        dtypes = {h.root: h.dtype for h in mine}
        for array, shape in p.geometry.logical_arrays().items():
            if MODEL in dtypes:
                catalog[tree_name(MODEL, array)] = (tuple(shape), dtypes[MODEL])
            if with_optim:
                for root in OPTIMIZER_ROLES:
                    name = tree_name(root, array)
                    if root in dtypes or name not in catalog:
                        catalog[name] = (tuple(shape), dtypes.get(root, "float32"))
    return out, catalog


def _tensor_signature(t) -> tuple:
    return (tuple(t.shape), t.dtype, t.is_contiguous())


def param_signature(p: LocalParam) -> tuple:
    """Everything about a LocalParam that shapes its pieces and checks, none of its values.

    Two parameter lists with equal signatures (at the same layout and rank) cut into the same
    pieces and pass the same checks, so a plan made for one serves the other. Hashable.
    """
    w = p.weight
    if w is None:
        ws = None
    elif isinstance(w, QuantizedWeight):
        ws = ("fp8", _tensor_signature(w.data), _tensor_signature(w.scale_inv),
              None if w.block is None else tuple(w.block))
    else:
        ws = _tensor_signature(w)
    o = p.optim
    os_ = None if o is None else (int(o.f0), int(o.f1)) + tuple(_tensor_signature(t) for t in o.tensors().values())
    return (p.key, p.geometry, tuple(p.index), ws, os_, p.main_replica)


def holdings_signature(params: Sequence[LocalParam], run_layout, rank: int, with_optim: bool) -> tuple:
    """Hashable key of `rank_holdings(params, run_layout, rank, with_optim)`'s pieces and catalog."""
    return (run_layout, int(rank), bool(with_optim), tuple(param_signature(p) for p in params))


def refresh_holdings(template: Sequence[Holding], params: Sequence[LocalParam]) -> list[Holding]:
    """Holdings with `template`'s pieces and the current tensors of `params` (same signature).

    Used when the parameter list has the signature the template was cut for: the pieces are
    reused, the data (and FP8 dequantization) is taken afresh, so new values are exported.
    """
    weights: dict[int, torch.Tensor] = {}
    out = []
    for h in template:
        p = params[h.slot]
        if h.root == MODEL:
            if h.slot not in weights:
                weights[h.slot] = _flat(weight_tensor(p), f"{p.key} weight")
            data = weights[h.slot]
        else:
            data = _flat(p.optim.tensors()[h.root], f"{p.key} {h.root}")
        out.append(Holding(h.root, h.param, data, h.pieces, h.main_replica, h.slot))
    return out
