"""Reference GTP trainer: the tiny model of `reference_model` trained under TP x GTP x DP (x EP, with
expert GTP) with a Megatron-style distributed Adam, on gloo (CPU) or NCCL (GPU). World size 1 is
the reference.

All geometry comes from `bridge.layout` -- `ParallelLayout` (ranks, groups), `ParamGeometry`
(TP split, GTP split with tail padding, fused sections, expert axis), `bridge.layout.distopt`
(buffers, buckets, DP shard ranges) -- so training here exercises the same engine the exporter uses.

What each rank holds (as Megatron-Core does):

- experts: expert-parallel rank e holds experts [e·E/EP, (e+1)·E/EP) (expert TP = TP; expert GTP and
  expert DP from the layout's expert grid); tokens reach them through an all-gather dispatcher;
- weights: the padded physical shard of every parameter, a view into one contiguous param buffer
  per `BufferKey` (bf16 / fp32, or uint8 bytes viewed as `float8_e4m3fn` for native FP8 weights
  with a per-tensor fp32 `scale_inv`); GTP padding rows hold random values (as TransformerEngine
  initialises them) that never reach the math;
- grads: an fp32 grad buffer with the same layout; GTP weight grads are reduce-scattered over the
  GTP group (padding rows get zero), GTP-replicated grads all-reduced over it, and each bucket is
  reduce-scattered over the DistOpt group (DP, GTP excluded; expert DP for experts);
- optimizer: for its DP shard of each bucket, per owned parameter range `[f0, f1)`, an fp32 master,
  `exp_avg`, `exp_avg_sq` (`bridge.live.api.OptimFragment`), updated with TE/Apex FusedAdam's formula
  (decoupled weight decay on 2-D weights only, bias corrections in host double); then the updated
  params are cast (FP8: quantized with the parameter's logical amax, identical on every layout)
  and all-gathered over the DistOpt group.

`train(layout, steps, seed)` runs inside an initialized process group (or without one at world
size 1) and returns this rank's state in the live-export form (`RankState.params`: a list of
`LocalParam`, `RankState.run`: `LiveRun`). For reload, `ReferenceTrainer(layout, ..., init=False)`
allocates zeroed targets, `reload_state` fills `trainer.local_params()` in place, and
`trainer.resume(step)` re-derives the weights from the masters; `step(trainer)` continues.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field, replace
from typing import Sequence

import numpy as np
import torch

from bridge.errors import BridgeError
from bridge.layout import FusedSpec, ParallelLayout, ParamGeometry
from bridge.layout.assemble import assemble_shard, split_local
from bridge.layout.distopt import BufferKey, BufferLayout, DistOptParam, distopt_layouts, owned_ranges
from bridge.live.api import AdamConfig, LiveRun, LocalParam, OptimFragment, QuantizedWeight
from bridge.live.fp8 import bind_optimizer_state
from bridge.testing.collectives import (DistEPComm, DistTPComm, CommGroup, RankGroups, all_gather_into, all_reduce, gtp_gather,
                                               reduce_scatter_into)
from bridge.testing.model import EPComm, ModelConfig, ParamDef, batch, forward, init_logical, param_table

__all__ = ["TrainerConfig", "ReferenceTrainer", "RankState", "train", "step", "geometry_of", "DEFAULT_ADAM"]

DEFAULT_ADAM = AdamConfig(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
FP8_DTYPE = torch.float8_e4m3fn
_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp8": FP8_DTYPE}
_BUFFER_DTYPE_NAME = {torch.bfloat16: "bfloat16", torch.float32: "float32", FP8_DTYPE: "uint8"}


@dataclass(frozen=True)
class TrainerConfig:
    """Run settings besides the layout.

    `weights`: "bf16" (bf16 params, fp32 masters), "fp32" (fp32 params) or "fp8" (native FP8 for the
    TE-style linears, bf16 for embedding / output layer / norms / router / small params).
    `bucket_size`: DistOpt bucket size in elements (None = one bucket per buffer).
    """

    model: ModelConfig = field(default_factory=ModelConfig)
    adam: AdamConfig = DEFAULT_ADAM
    weights: str = "bf16"
    pad_for_alignment: int = 8
    bucket_size: int | None = None
    seed: int = 0
    data_seed: int | None = None  # None: same as `seed`
    pad_seed: int = 12345          # content of GTP padding rows (must not matter)

    def __post_init__(self) -> None:
        if self.weights not in _DTYPES:
            raise BridgeError(f"TrainerConfig.weights={self.weights!r}; use one of {sorted(_DTYPES)}")


def geometry_of(p: ParamDef, c: ModelConfig, pad_for_alignment: int) -> ParamGeometry:
    """The `ParamGeometry` of one model parameter (expert params: one expert, prepended axis).

    >>> g = geometry_of(param_table(ModelConfig())[2], ModelConfig(), 8)
    >>> g.split(tp=2, gtp=2)
    GtpSplit(rows=24, pad=8, shard_rows=16, size=2)
    """
    fused = None
    if p.fused == "qkv":
        fused = FusedSpec.qkv(c.num_heads, c.num_query_groups, c.head_dim)
    elif p.fused == "swiglu":
        fused = FusedSpec.swiglu(c.ffn)
    elif p.fused == "expert_swiglu":
        fused = FusedSpec.swiglu(c.expert_ffn)
    elif p.fused == "mamba":
        fused = FusedSpec.mamba_in_proj(c.d_inner, c.mamba_groups, c.mamba_state, c.mamba_heads)
    tp_kind = "column" if p.tp == "tp0" else p.tp
    shape = p.shape[1:] if p.experts else p.shape
    prepend = (p.experts,) if p.experts else ()
    return ParamGeometry(p.key, shape, tp_kind, gtp=p.gtp, pad_for_alignment=pad_for_alignment, prepend=prepend,
                         fused=fused, expert=bool(p.experts))


def logical_arrays(c: ModelConfig, seed: int, pad_for_alignment: int = 8) -> dict[str, np.ndarray]:
    """Seeded initial weights as logical arrays (fused projections split per section), fp32.

    >>> a = logical_arrays(ModelConfig(), 0)
    >>> a["decoder.layers.0.self_attention.linear_qkv.weight.key"].shape
    (12, 24)
    """
    init = init_logical(c, seed)
    out: dict[str, np.ndarray] = {}
    for p in param_table(c):
        geom = geometry_of(p, c, pad_for_alignment)
        for name, shape in geom.logical_arrays().items():
            out[name] = np.zeros(shape, np.float32)
        fused_global = init[p.key].numpy()
        for e in range(max(p.experts, 1)):
            index = (e,) if p.experts else ()
            local = fused_global[e] if p.experts else fused_global  # TP=1 physical = global fused order
            for array, box, data in split_local(geom.shard_pieces(1, 1, 0, 0, index), local.reshape(-1)):
                out[array][box.slices] = data
    return out


def local_experts(num_experts: int, ep: int, e: int) -> range:
    """Global indices of the experts held by expert-parallel rank `e` (Megatron: contiguous blocks).

    >>> list(local_experts(4, 2, 1))
    [2, 3]
    """
    ec = EPComm()
    ec.size, ec.rank = ep, e
    return ec.local_experts(num_experts)


@dataclass(eq=False)
class _Slot:
    """One physical parameter this rank holds."""

    pdef: ParamDef
    name: str                    # unique Megatron-style param name (experts: weight0, weight1)
    geometry: ParamGeometry
    index: tuple[int, ...]       # position on the prepended expert axis
    tp: int
    gtp: int
    t: int
    g: int
    dtype: torch.dtype
    shape: tuple[int, ...] = ()
    start: int = 0
    end: int = 0
    storage: torch.Tensor | None = None     # physical shard (view into its param buffer)
    quant: QuantizedWeight | None = None    # FP8: storage is quant.data
    frag: OptimFragment | None = None
    buffer: "_Buffer | None" = None
    logical_mask: torch.Tensor | None = None  # flat bool over the shard: True = logical element

    @property
    def gtp_sharded(self) -> bool:
        return self.geometry.gtp_active(self.gtp)

    @property
    def decay(self) -> bool:
        return self.pdef.decay


@dataclass(eq=False)
class _Buffer:
    key: BufferKey
    layout: BufferLayout
    group: CommGroup
    slots: list[_Slot]
    param_data: torch.Tensor
    grad_data: torch.Tensor


@dataclass
class RankState:
    """One rank's training state in the live-export form, plus the trainer that holds it."""

    params: list[LocalParam]
    run: LiveRun
    losses: list[float]
    trainer: "ReferenceTrainer"


class ReferenceTrainer:
    """The reference GTP trainer on one rank (see the module docstring)."""

    def __init__(self, layout: ParallelLayout, config: TrainerConfig = TrainerConfig(), *, init: bool = True,
                 device: torch.device | str | None = None, groups: RankGroups | None = None):
        for name in ("cp", "pp"):
            if getattr(layout, name) != 1:
                raise BridgeError(f"reference trainer supports {name}=1 only (got {name}={getattr(layout, name)}); "
                                  f"use TP, GTP, DP, EP and expert GTP")
        if config.model.num_experts % layout.ep:
            raise BridgeError(f"EP={layout.ep} does not divide the {config.model.num_experts} experts; pick EP dividing it")
        if layout.etp != layout.tp:
            raise BridgeError(f"reference trainer needs etp == tp (got etp={layout.etp}, tp={layout.tp})")
        self.layout = layout
        self.config = config
        self.model = config.model
        self.model.check_tp(layout.tp)
        if self.model.batch % (layout.gtp * layout.dp):
            raise BridgeError(f"global batch {self.model.batch} is not divisible by GTP x DP = {layout.gtp * layout.dp}")
        self.groups = groups or RankGroups.build(layout)
        self.rank = self.groups.rank
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.step_count = 0
        self.coords = layout.coords(self.rank)
        self._slots: list[_Slot] = []
        self._buffers: list[_Buffer] = []
        self._build_slots()
        self._build_buffers()
        # one amax slot per logical FP8 parameter instance of the whole model (not just this rank's),
        # so the world all-reduce lines up on every rank whatever it holds
        self._fp8_index = {} if config.weights != "fp8" else {
            (p.key, (e,) if p.experts else ()): None for p in param_table(self.model) if p.fp8
            for e in range(max(p.experts, 1))}
        self._fp8_index = {k: i for i, k in enumerate(self._fp8_index)}
        if init:
            self._init_from_seed()

    # --- construction --------------------------------------------------------------------------------
    def _build_slots(self) -> None:
        c, lay = self.model, self.layout
        for p in param_table(c):
            geom = geometry_of(p, c, self.config.pad_for_alignment)
            tp, gtp = geom.sizes(lay)
            t, g = lay.shard_coords(self.rank, geom.expert)
            if not geom.gtp_active(gtp):
                g = 0
            dtype = _DTYPES[self.config.weights]
            if dtype == FP8_DTYPE and not p.fp8:
                dtype = torch.bfloat16
            experts = local_experts(p.experts, lay.ep, self.coords.e) if p.experts else range(1)
            for e in experts:
                name = p.key + (str(e) if p.experts else "")  # global expert index: unique across ranks
                self._slots.append(_Slot(p, name, geom, (e,) if p.experts else (), tp, gtp, t, g, dtype,
                                         shape=geom.physical_shape(tp, gtp)))

    def _build_buffers(self) -> None:
        params = [DistOptParam(s.name, math.prod(s.shape), _BUFFER_DTYPE_NAME[s.dtype], expert=s.geometry.expert)
                  for s in self._slots]
        lay = self.layout
        layouts = distopt_layouts(params, self.config.bucket_size, lay.distopt_size, lay.edp)
        by_name = {s.name: s for s in self._slots}
        for key, blay in layouts.items():
            group = self.groups.expert_distopt if key.expert else self.groups.distopt
            if group.size != blay.dp_size:
                raise BridgeError(f"DistOpt group of rank {self.rank} has {group.size} ranks, layout says {blay.dp_size}")
            storage_dtype = torch.uint8 if key.param_dtype == "uint8" else getattr(torch, key.param_dtype)
            pdata = torch.zeros(blay.numel, dtype=storage_dtype, device=self.device)
            gdata = torch.zeros(blay.numel, dtype=torch.float32, device=self.device)
            buf = _Buffer(key, blay, group, [by_name[n] for n in blay.order], pdata, gdata)
            for s in buf.slots:
                s.start, s.end, _ = blay.index[s.name]
                s.buffer = buf
                view = pdata[s.start:s.end]
                if s.dtype == FP8_DTYPE:
                    s.quant = QuantizedWeight(view.view(FP8_DTYPE).view(s.shape),
                                              torch.ones(1, dtype=torch.float32, device=self.device))
                    s.storage = s.quant.data
                else:
                    s.storage = view.view(s.shape)
                s.logical_mask = self._logical_mask(s)
            for o in owned_ranges(blay, group.rank):
                s = by_name[o.name]
                n = o.param[1] - o.param[0]
                z = lambda: torch.zeros(n, dtype=torch.float32, device=self.device)  # noqa: E731
                s.frag = OptimFragment(o.param[0], o.param[1], z(), z(), z())
            self._buffers.append(buf)

    def _logical_mask(self, s: _Slot) -> torch.Tensor:
        mask = torch.zeros(math.prod(s.shape), dtype=torch.bool, device=self.device)
        for piece in s.geometry.shard_pieces(s.tp, s.gtp, s.t, s.g, s.index):
            mask[piece.local_start:piece.local_stop] = True
        return mask

    def _init_from_seed(self) -> None:
        """Physical shards and masters from the seeded logical weights (same on every layout)."""
        arrays = logical_arrays(self.model, self.config.seed, self.config.pad_for_alignment)
        read = lambda a, b: arrays[a][b.slices]  # noqa: E731
        if self._fp8_index:  # per-tensor scales from each logical tensor's amax
            amax = torch.zeros(len(self._fp8_index), dtype=torch.float32, device=self.device)
            for s in self._slots:
                if s.quant is not None:
                    logical = [arrays[n][s.index] if s.index else arrays[n] for n in s.geometry.logical_arrays()]
                    amax[self._fp8_index[(s.pdef.key, s.index)]] = float(max(np.abs(x).max() for x in logical))
            self._set_fp8_scales(amax)
        for s in self._slots:
            shard = torch.from_numpy(assemble_shard(s.geometry, s.tp, s.gtp, s.t, s.g, read, np.float32, s.index))
            pad = ~s.logical_mask.cpu()
            if pad.any():  # TE initialises padding rows with the shard's own RNG (same on DP replicas): never data
                seed = self.config.pad_seed + 7919 * (s.t * s.gtp + s.g) + zlib.crc32(s.name.encode())
                shard.view(-1)[pad] = torch.randn(int(pad.sum()), generator=torch.Generator().manual_seed(seed))
            flat = shard.view(-1).to(self.device)
            if s.frag is not None:
                hi = flat[s.frag.f0:s.frag.f1]
                # Megatron: master = param.float() for bf16 / fp32; the high-precision init value for FP8
                s.frag.master.copy_(hi if s.quant is not None else hi.to(s.dtype).float())
            if s.quant is None:
                s.storage.view(-1).copy_(flat.to(s.dtype))
            else:
                s.quant.data.view(-1).copy_(self._quantize(flat, s.quant.scale_inv))

    # --- FP8 ------------------------------------------------------------------------------------------
    @staticmethod
    def _quantize(x: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
        fmax = torch.finfo(FP8_DTYPE).max
        return (x.float() / scale_inv).clamp(-fmax, fmax).to(FP8_DTYPE)

    def _set_fp8_scales(self, amax: torch.Tensor) -> None:
        fmax = torch.finfo(FP8_DTYPE).max
        scale_inv = torch.where(amax > 0, amax / fmax, torch.ones_like(amax))
        for s in self._slots:
            if s.quant is not None:
                s.quant.scale_inv.copy_(scale_inv[self._fp8_index[(s.pdef.key, s.index)]].reshape(1))

    # --- views ----------------------------------------------------------------------------------------
    def weight_fp32(self, s: _Slot) -> torch.Tensor:
        """The physical shard as fp32 (FP8 dequantized)."""
        if s.quant is not None:
            return s.quant.data.float() * s.quant.scale_inv
        return s.storage.float()

    @property
    def slots(self) -> list[_Slot]:
        return list(self._slots)

    @property
    def buffers(self) -> list[_Buffer]:
        return list(self._buffers)

    # --- one optimizer step ------------------------------------------------------------------------------
    def train_step(self) -> float:
        """Forward + backward on this step's batch, grad reduction, distributed Adam, param all-gather."""
        c = self.model
        tokens_global = batch(c, self.config.seed if self.config.data_seed is None else self.config.data_seed,
                              self.step_count)
        data = self.groups.data
        b = c.batch // data.size
        tokens = tokens_global[data.rank * b:(data.rank + 1) * b].to(self.device)

        leaves, weights = self._compute_weights()
        comm = DistTPComm(self.groups.tp)
        vocab_local = c.vocab // self.layout.tp
        loss_sum = forward(c, weights, tokens, comm, vocab_start=self.coords.t * vocab_local,
                           ep=DistEPComm(self.groups.ep))
        n_tokens = c.batch * c.seq_len
        (loss_sum / n_tokens).backward()

        for buf in self._buffers:
            buf.grad_data.zero_()
        for s, leaf in zip(self._slots, leaves):
            grad = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
            if not s.gtp_sharded and not s.geometry.expert:
                all_reduce(grad, self.groups.gtp)  # GTP-replicated: GTP peers saw different data
            s.buffer.grad_data[s.start:s.end].copy_(grad.reshape(-1))
        self.last_grads = {s.name: s.buffer.grad_data[s.start:s.end].clone() for s in self._slots}
        for buf in self._buffers:
            for b_idx, (b0, b1) in enumerate(buf.layout.buckets):
                w0, w1 = buf.layout.dp_range(b_idx, buf.group.rank)
                shard = torch.empty(w1 - w0, dtype=torch.float32, device=self.device)
                reduce_scatter_into(shard, buf.grad_data[b0:b1], buf.group)
                buf.grad_data[w0:w1].copy_(shard)

        self._adam()
        self._publish_params()
        self.step_count += 1
        loss = loss_sum.detach().reshape(1).clone()
        all_reduce(loss, data)
        return float(loss) / n_tokens

    def _compute_weights(self) -> tuple[list[torch.Tensor], dict[str, object]]:
        """fp32 autograd leaves of the physical shards, and the TP-local logical weights built from them."""
        leaves, weights = [], {}
        for s in self._slots:
            leaf = self.weight_fp32(s).detach().requires_grad_()
            leaves.append(leaf)
            if s.gtp_sharded:
                group = self.groups.expert_gtp if s.geometry.expert else self.groups.gtp
                w = gtp_gather(leaf, group, s.geometry.split(s.tp, s.gtp).rows)
            else:
                w = leaf
            if s.pdef.experts:
                weights.setdefault(s.pdef.key, []).append(w)
            else:
                weights[s.pdef.key] = w
        return leaves, weights

    def _adam(self) -> None:
        """TE/Apex FusedAdam (adam_w_mode=1) on every owned fragment; fp32 math, host-double bias corrections."""
        a = self.config.adam
        t = self.step_count + 1
        f32 = lambda x: torch.tensor(x, dtype=torch.float32, device=self.device)  # noqa: E731
        b1, b2, eps, lr = f32(a.betas[0]), f32(a.betas[1]), f32(a.eps), f32(a.lr)
        one = f32(1.0)
        bc1, bc2 = f32(1.0 - a.betas[0] ** t), f32(1.0 - a.betas[1] ** t)
        for s in self._slots:
            fr = s.frag
            if fr is None:
                continue
            g = s.buffer.grad_data[s.start + fr.f0:s.start + fr.f1]
            decay = f32(a.weight_decay if s.decay and s.pdef.key not in a.no_decay else 0.0)
            lr_s = f32(a.lr * a.lr_mult[s.pdef.key]) if s.pdef.key in a.lr_mult else lr  # host double, as per group
            m = b1 * fr.exp_avg + (one - b1) * g
            v = b2 * fr.exp_avg_sq + (one - b2) * g * g
            denom = torch.sqrt(v / bc2) + eps
            update = (m / bc1) / denom + decay * fr.master
            fr.master.copy_(fr.master - lr_s * update)
            fr.exp_avg.copy_(m)
            fr.exp_avg_sq.copy_(v)

    def _publish_params(self) -> None:
        """Cast (FP8: quantize) the owned masters into the param buffers and all-gather each bucket."""
        if self._fp8_index:
            amax = torch.zeros(len(self._fp8_index), dtype=torch.float32, device=self.device)
            for s in self._slots:
                if s.quant is not None and s.frag is not None:
                    logical = s.frag.master[s.logical_mask[s.frag.f0:s.frag.f1]]
                    if logical.numel():
                        i = self._fp8_index[(s.pdef.key, s.index)]
                        amax[i] = torch.maximum(amax[i], logical.abs().max())
            all_reduce(amax, self.groups.world_group, op="max")  # the logical tensor's amax: layout-independent
            self._set_fp8_scales(amax)
        for s in self._slots:
            if s.frag is None:
                continue
            flat = s.storage.view(-1)
            if s.quant is not None:
                flat[s.frag.f0:s.frag.f1] = self._quantize(s.frag.master, s.quant.scale_inv)
            else:
                flat[s.frag.f0:s.frag.f1] = s.frag.master.to(s.dtype)
        for buf in self._buffers:
            for b_idx, (b0, b1) in enumerate(buf.layout.buckets):
                w0, w1 = buf.layout.dp_range(b_idx, buf.group.rank)
                mine = buf.param_data[w0:w1].clone()
                all_gather_into(buf.param_data[b0:b1], mine, buf.group)

    # --- live-export form -------------------------------------------------------------------------------
    def local_params(self) -> list[LocalParam]:
        """This rank's parameters as `LocalParam`s whose tensors are the live storage (export input /
        reload target). FP8 weights are bound to their fragments through the dequantized copy's
        `_gtp_dequant_src` backlink, as Megatron's checkpoint entries are."""
        entries, pairs = [], []
        for s in self._slots:
            live = s.quant if s.quant is not None else s.storage
            entries.append((s.pdef.key, s.geometry, s.quant.dequantize() if s.quant is not None else s.storage))
            if s.frag is not None:
                pairs.append((live, s.frag))
        out = bind_optimizer_state(entries, pairs)
        for lp, s in zip(out, self._slots):
            if s.index:
                lp.index = s.index  # position on the prepended expert axis
        return out

    def live_run(self, group=None) -> LiveRun:
        """Run-level facts for `export_state` / `reload_state`."""
        return LiveRun(layout=self.layout, rank=self.rank, step=self.step_count, optimizer=self.adam_config(),
                       group=group, device=self.device,
                       extra={"reference_trainer": {"weights": self.config.weights, "seed": self.config.seed,
                                                    "pad_for_alignment": self.config.pad_for_alignment}})

    def adam_config(self) -> AdamConfig:
        """The optimizer settings as applied: `no_decay` lists every key trained without weight decay."""
        a = self.config.adam
        no_decay = set(a.no_decay) | {p.key for p in param_table(self.model) if not p.decay}
        return replace(a, no_decay=tuple(sorted(no_decay)))

    def state(self, losses: Sequence[float] = ()) -> RankState:
        return RankState(self.local_params(), self.live_run(), list(losses), self)

    def resume(self, step: int) -> None:
        """After `reload_state` filled `local_params()`: set the step and re-derive the weights from the
        reloaded fp32 masters (the precise values; FP8 scales are recomputed as in training)."""
        self.step_count = int(step)
        self._publish_params()


def train(layout: ParallelLayout, steps: int, seed: int = 0, config: TrainerConfig | None = None, *,
          device: torch.device | str | None = None, groups: RankGroups | None = None) -> RankState:
    """Build the trainer on this rank, train `steps` optimizer steps, return the rank's state.

    Runs inside an initialized process group of `layout.world` ranks (any size-1 layout runs
    without one: the unsharded reference).
    """
    cfg = replace(config or TrainerConfig(), seed=seed)
    trainer = ReferenceTrainer(layout, cfg, device=device, groups=groups)
    losses = [trainer.train_step() for _ in range(steps)]
    return trainer.state(losses)


def step(trainer: ReferenceTrainer, steps: int = 1) -> list[float]:
    """Continue training (e.g. after `resume`); returns the losses."""
    return [trainer.train_step() for _ in range(steps)]
