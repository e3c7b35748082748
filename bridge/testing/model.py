"""The reference GTP trainer's tiny model: parameter table, seeded init, data, and TP-local math.

One functional definition serves every layout. `forward` takes the **TP-local logical** weights
(GTP shards already gathered and their padding stripped, see `bridge.testing.trainer`) and a
`TPComm` that supplies the tensor-parallel collectives; with `TPComm()` (TP size 1, no process
group) it is the unsharded reference model.

Layers (hybrid-style keys, explicit layer index, as a Megatron `HybridStack` names them):

- 0: GQA self-attention, fused `linear_qkv` (per query group `[q_g | k_g | v_g]`), row-parallel `linear_proj`;
- 1: SwiGLU MLP, fused `linear_fc1 = [gate; up]`, row-parallel `linear_fc2`;
- 2: a Mamba-style mixer with fused `in_proj = [z | x | B | C | dt]` (a gated causal linear mixer,
  not a real SSM), TP-split `D` / `dt_bias`, row-parallel `out_proj`;
- 3: MoE with a replicated router and grouped experts (`experts.linear_fc1/fc2`, prepended expert axis),
  top-k routing;
- final RMSNorm and a column-parallel output layer; vocab-parallel embedding.

All arithmetic is fp32 (weights are upcast from their storage dtype before use).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

import torch
import torch.nn.functional as F

from bridge.errors import BridgeError

__all__ = ["ModelConfig", "ParamDef", "param_table", "init_logical", "batch", "forward", "TPComm", "EPComm"]


@dataclass(frozen=True)
class ModelConfig:
    """Sizes of the tiny model. Defaults divide by TP in {1, 2, 4} and pad under GTP.

    >>> c = ModelConfig()
    >>> c.qkv_rows, c.in_proj_rows, c.d_inner
    (48, 56, 16)
    """

    vocab: int = 48
    hidden: int = 24
    num_heads: int = 8
    num_query_groups: int = 4
    head_dim: int = 3
    ffn: int = 20
    mamba_heads: int = 8
    mamba_headdim: int = 2
    mamba_groups: int = 4
    mamba_state: int = 2
    num_experts: int = 2
    expert_ffn: int = 12
    topk: int = 1
    seq_len: int = 8
    batch: int = 8  # global batch (sequences per step), split over GTP x DP data ranks
    norm_eps: float = 1e-5

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_query_groups

    @property
    def qkv_rows(self) -> int:
        return self.num_query_groups * (self.heads_per_group + 2) * self.head_dim

    @property
    def d_inner(self) -> int:
        return self.mamba_heads * self.mamba_headdim

    @property
    def in_proj_rows(self) -> int:
        return 2 * self.d_inner + 2 * self.mamba_groups * self.mamba_state + self.mamba_heads

    def check_tp(self, tp: int) -> None:
        """Raise BridgeError when `tp` does not divide every TP-split size."""
        sizes = {"vocab": self.vocab, "num_query_groups": self.num_query_groups, "ffn": self.ffn,
                 "mamba_heads": self.mamba_heads, "mamba_groups": self.mamba_groups, "expert_ffn": self.expert_ffn}
        bad = [f"{k}={v}" for k, v in sizes.items() if v % tp]
        if bad:
            raise BridgeError(f"reference model: TP={tp} does not divide {', '.join(bad)}; pick a TP that divides them")

    def fused_sections(self, kind: str) -> list[tuple[str, int]]:
        """Global (TP=1) section table `[(name, rows)]` of a fused projection, in fused order.

        `qkv` is listed per semantic section; its physical order interleaves query groups.
        >>> ModelConfig().fused_sections("mamba")
        [('z', 16), ('x', 16), ('B', 8), ('C', 8), ('dt', 8)]
        """
        if kind == "swiglu":
            return [("gate", self.ffn), ("up", self.ffn)]
        if kind == "expert_swiglu":
            return [("gate", self.expert_ffn), ("up", self.expert_ffn)]
        if kind == "mamba":
            ngs = self.mamba_groups * self.mamba_state
            return [("z", self.d_inner), ("x", self.d_inner), ("B", ngs), ("C", ngs), ("dt", self.mamba_heads)]
        if kind == "qkv":
            return [("query", self.num_heads * self.head_dim), ("key", self.num_query_groups * self.head_dim),
                    ("value", self.num_query_groups * self.head_dim)]
        raise BridgeError(f"reference model: unknown fused kind {kind!r}; use swiglu, expert_swiglu, mamba or qkv")


@dataclass(frozen=True)
class ParamDef:
    """One logical parameter of the model.

    `tp`: how TP cuts it: "column" (dim 0; fused sections each cut), "row" (dim 1), "vocab"
    (dim 0), "tp0" (dim 0, 1-D, not GTP-sharded) or "replicated". `gtp`: GTP shards dim 0 of
    the TP-local tensor. `fused`: section kind or None. `experts`: size of the prepended expert
    axis (0 = none). `decay`: weight decay applies (2-D weights only). `fp8`: stored as native
    FP8 when the run asks for FP8 weights (TE linears; not embedding / output layer).
    """

    key: str
    shape: tuple[int, ...]
    tp: str
    gtp: bool
    fused: str | None = None
    experts: int = 0
    decay: bool = True
    fp8: bool = False


def param_table(c: ModelConfig) -> list[ParamDef]:
    """All parameters in registration order (DistOpt buffers are filled in reverse of this).

    >>> [p.key.split(".")[-2] for p in param_table(ModelConfig())][:3]
    ['word_embeddings', 'linear_qkv', 'linear_qkv']
    """
    H, E = c.hidden, c.num_experts
    L = "decoder.layers."
    return [
        ParamDef("embedding.word_embeddings.weight", (c.vocab, H), "vocab", True),
        ParamDef(L + "0.self_attention.linear_qkv.layer_norm_weight", (H,), "replicated", False, decay=False),
        ParamDef(L + "0.self_attention.linear_qkv.weight", (c.qkv_rows, H), "column", True, fused="qkv", fp8=True),
        ParamDef(L + "0.self_attention.linear_proj.weight", (H, c.num_heads * c.head_dim), "row", True, fp8=True),
        ParamDef(L + "1.mlp.linear_fc1.layer_norm_weight", (H,), "replicated", False, decay=False),
        ParamDef(L + "1.mlp.linear_fc1.weight", (2 * c.ffn, H), "column", True, fused="swiglu", fp8=True),
        ParamDef(L + "1.mlp.linear_fc2.weight", (H, c.ffn), "row", True, fp8=True),
        ParamDef(L + "2.mixer.in_proj.layer_norm_weight", (H,), "replicated", False, decay=False),
        ParamDef(L + "2.mixer.in_proj.weight", (c.in_proj_rows, H), "column", True, fused="mamba", fp8=True),
        ParamDef(L + "2.mixer.D", (c.mamba_heads,), "tp0", False, decay=False),
        ParamDef(L + "2.mixer.dt_bias", (c.mamba_heads,), "tp0", False, decay=False),
        ParamDef(L + "2.mixer.out_proj.weight", (H, c.d_inner), "row", True, fp8=True),
        ParamDef(L + "3.pre_mlp_layernorm.weight", (H,), "replicated", False, decay=False),
        ParamDef(L + "3.mlp.router.weight", (E, H), "replicated", False),
        ParamDef(L + "3.mlp.experts.linear_fc1.weight", (E, 2 * c.expert_ffn, H), "column", True,
                 fused="expert_swiglu", experts=E, fp8=True),
        ParamDef(L + "3.mlp.experts.linear_fc2.weight", (E, H, c.expert_ffn), "row", True, experts=E, fp8=True),
        ParamDef("decoder.final_layernorm.weight", (H,), "replicated", False, decay=False),
        ParamDef("output_layer.weight", (c.vocab, H), "column", True),
    ]


def init_logical(c: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Seeded fp32 logical (TP=1, unpadded, fused in Megatron's global order) initial weights.

    Identical for every layout: every rank draws the whole model and slices its own part.
    >>> w = init_logical(ModelConfig(), 0)
    >>> tuple(w["decoder.layers.3.mlp.experts.linear_fc2.weight"].shape)
    (2, 24, 12)
    """
    g = torch.Generator().manual_seed(int(seed))
    out: dict[str, torch.Tensor] = {}
    for p in param_table(c):
        if p.key.endswith(("layer_norm_weight", "layernorm.weight")):
            t = 1.0 + 0.1 * torch.randn(p.shape, generator=g)
        elif p.key.endswith("mixer.D"):
            t = 1.0 + 0.1 * torch.randn(p.shape, generator=g)
        elif p.key.endswith("dt_bias"):
            t = 0.5 * torch.randn(p.shape, generator=g)
        else:
            fan_in = p.shape[-1]
            t = torch.randn(p.shape, generator=g) / math.sqrt(fan_in)
        out[p.key] = t.float()
    return out


def batch(c: ModelConfig, seed: int, step: int) -> torch.Tensor:
    """Global token batch `[batch, seq_len + 1]` (int64) of optimizer step `step` (0-based).

    Depends only on (seed, step): the same on every layout and after a reload.
    >>> tuple(batch(ModelConfig(), 0, 3).shape)
    (8, 9)
    """
    g = torch.Generator().manual_seed(1_000_003 * int(seed) + 7919 * int(step) + 17)
    # a learnable pattern (next token = f(previous)) plus noise, so the loss actually moves
    start = torch.randint(0, c.vocab, (c.batch, 1), generator=g)
    steps = torch.arange(c.seq_len + 1).unsqueeze(0)
    toks = (start + 5 * steps) % c.vocab
    noise = torch.randint(0, c.vocab, toks.shape, generator=g)
    flip = torch.rand(toks.shape, generator=g) < 0.2
    return torch.where(flip, noise, toks)


class TPComm:
    """Tensor-parallel collectives used by `forward`; the base class is TP size 1 (no-ops).

    `bridge.testing.trainer.DistTPComm` implements them over a TP process group.
    """

    size: int = 1
    rank: int = 0

    def copy_to_tp(self, x: torch.Tensor) -> torch.Tensor:
        """Identity forward, all-reduce of the gradient backward (Megatron's `f`)."""
        return x

    def reduce_from_tp(self, x: torch.Tensor) -> torch.Tensor:
        """All-reduce forward, identity backward (Megatron's `g`)."""
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """All-gather along the last dim forward, take this rank's slice backward."""
        return x


def _rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _swiglu(h: torch.Tensor, fc1: torch.Tensor, fc2: torch.Tensor) -> torch.Tensor:
    gate, up = (h @ fc1.t()).chunk(2, dim=-1)  # TP-local fc1 = [gate_t; up_t]
    return (F.silu(gate) * up) @ fc2.t()


def _attention(c: ModelConfig, tp: int, h: torch.Tensor, qkv_w: torch.Tensor, proj_w: torch.Tensor) -> torch.Tensor:
    b, T, _ = h.shape
    ng, hpg, hd = c.num_query_groups // tp, c.heads_per_group, c.head_dim
    qkv = (h @ qkv_w.t()).view(b, T, ng, hpg + 2, hd)  # per group [q_g (hpg heads) | k_g | v_g]
    q = qkv[:, :, :, :hpg].reshape(b, T, ng * hpg, hd).transpose(1, 2)
    k = qkv[:, :, :, hpg].repeat_interleave(hpg, dim=2).transpose(1, 2)
    v = qkv[:, :, :, hpg + 1].repeat_interleave(hpg, dim=2).transpose(1, 2)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
    causal = torch.ones(T, T, dtype=torch.bool, device=h.device).tril()
    att = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    o = (att @ v).transpose(1, 2).reshape(b, T, ng * hpg * hd)
    return o @ proj_w.t()


def _mamba_like(c: ModelConfig, tp: int, h: torch.Tensor, in_w: torch.Tensor, D: torch.Tensor,
                dt_bias: torch.Tensor, out_w: torch.Tensor) -> torch.Tensor:
    b, T, _ = h.shape
    nh, hd, ng, ds = c.mamba_heads // tp, c.mamba_headdim, c.mamba_groups // tp, c.mamba_state
    z, x, B, C, dt = (h @ in_w.t()).split([nh * hd, nh * hd, ng * ds, ng * ds, nh], dim=-1)
    dt = F.softplus(dt + dt_bias)                                       # [b, T, nh]
    s = torch.tanh((B.view(b, T, ng, ds) * C.view(b, T, ng, ds)).sum(-1))  # [b, T, ng]
    s = s.repeat_interleave(nh // ng, dim=-1)                            # heads of a group share it
    xh = x.view(b, T, nh, hd)
    a = xh * (dt * s).unsqueeze(-1)
    counts = torch.arange(1, T + 1, dtype=h.dtype, device=h.device).view(1, T, 1, 1)
    y = a.cumsum(dim=1) / counts + D.view(1, 1, nh, 1) * xh             # causal mean + skip
    y = y.reshape(b, T, nh * hd) * F.silu(z)
    return y @ out_w.t()


def _moe(c: ModelConfig, comm: TPComm, h: torch.Tensor, router: torch.Tensor,
         fc1: list[torch.Tensor], fc2: list[torch.Tensor], ep: "EPComm") -> torch.Tensor:
    h_all = ep.gather_tokens(h)                                          # tokens of the whole EP group
    probs = (h_all @ router.t()).softmax(-1)                             # [b, T, E]
    top_p, top_i = probs.topk(c.topk, dim=-1)
    if c.topk > 1:
        top_p = top_p / top_p.sum(-1, keepdim=True)
    hp = comm.copy_to_tp(h_all)
    out = torch.zeros_like(h_all)
    for i, e in enumerate(ep.local_experts(c.num_experts)):
        gate = (top_p * (top_i == e)).sum(-1, keepdim=True)             # 0 for tokens not routed to e
        y = comm.reduce_from_tp(_swiglu(hp, fc1[i], fc2[i]))
        out = out + gate * y
    return ep.scatter_tokens(out)                                        # sum over the EP group's experts


class EPComm:
    """Expert-parallel token exchange used by `forward` (all-gather dispatcher); base class = EP size 1."""

    size: int = 1
    rank: int = 0

    def local_experts(self, num_experts: int) -> range:
        """Global indices of the experts this EP rank holds."""
        n = num_experts // self.size
        return range(self.rank * n, (self.rank + 1) * n)

    def gather_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """All-gather along dim 0 over the EP group forward, reduce-scatter backward."""
        return x

    def scatter_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """Reduce-scatter along dim 0 over the EP group forward, all-gather backward."""
        return x


def forward(c: ModelConfig, w: Mapping[str, torch.Tensor | list[torch.Tensor]], tokens: torch.Tensor,
            comm: TPComm | None = None, vocab_start: int = 0, ep: EPComm | None = None) -> torch.Tensor:
    """Sum of next-token cross-entropy over `tokens[:, 1:]` (fp32 scalar).

    `w` maps each key of `param_table` to its TP-local logical weight (expert keys: a list, one
    tensor per local expert, see `EPComm.local_experts`). `vocab_start` is this TP rank's first
    embedding row.
    """
    comm = comm or TPComm()
    tp = comm.size
    inp, target = tokens[:, :-1], tokens[:, 1:]
    L = "decoder.layers."
    emb = w["embedding.word_embeddings.weight"]
    local = inp - vocab_start
    inside = (local >= 0) & (local < emb.shape[0])
    x = comm.reduce_from_tp(F.embedding(local.clamp(0, emb.shape[0] - 1), emb) * inside.unsqueeze(-1))
    eps = c.norm_eps

    h = comm.copy_to_tp(_rmsnorm(x, w[L + "0.self_attention.linear_qkv.layer_norm_weight"], eps))
    x = x + comm.reduce_from_tp(_attention(c, tp, h, w[L + "0.self_attention.linear_qkv.weight"],
                                           w[L + "0.self_attention.linear_proj.weight"]))
    h = comm.copy_to_tp(_rmsnorm(x, w[L + "1.mlp.linear_fc1.layer_norm_weight"], eps))
    x = x + comm.reduce_from_tp(_swiglu(h, w[L + "1.mlp.linear_fc1.weight"], w[L + "1.mlp.linear_fc2.weight"]))
    h = comm.copy_to_tp(_rmsnorm(x, w[L + "2.mixer.in_proj.layer_norm_weight"], eps))
    x = x + comm.reduce_from_tp(_mamba_like(c, tp, h, w[L + "2.mixer.in_proj.weight"], w[L + "2.mixer.D"],
                                            w[L + "2.mixer.dt_bias"], w[L + "2.mixer.out_proj.weight"]))
    h = _rmsnorm(x, w[L + "3.pre_mlp_layernorm.weight"], eps)
    x = x + _moe(c, comm, h, w[L + "3.mlp.router.weight"], list(w[L + "3.mlp.experts.linear_fc1.weight"]),
                 list(w[L + "3.mlp.experts.linear_fc2.weight"]), ep or EPComm())
    h = comm.copy_to_tp(_rmsnorm(x, w["decoder.final_layernorm.weight"], eps))
    logits = comm.gather_last_dim(h @ w["output_layer.weight"].t())
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="sum")


def tp_local(c: ModelConfig, p: ParamDef, logical: torch.Tensor, tp: int, t: int) -> torch.Tensor:
    """TP rank `t`'s logical slice of a (TP=1) logical weight: the TP-local tensor before GTP.

    Fused projections take every section's TP slice and concatenate them (Megatron's TP-local
    order); `qkv` is TP-split by whole query groups, i.e. contiguously. Used for the unsharded
    reference's independent cross-check; the trainer takes its geometry from `bridge.layout`.
    >>> c = ModelConfig(); p = param_table(c)[5]
    >>> x = torch.arange(40.).view(40, 1).expand(40, 24)
    >>> tp_local(c, p, x, 2, 1)[:, 0].tolist()[:12]
    [10.0, 11.0, 12.0, 13.0, 14.0, 15.0, 16.0, 17.0, 18.0, 19.0, 30.0, 31.0]
    """
    if tp == 1 or p.tp == "replicated":
        return logical
    ax = 1 if p.experts else 0  # the expert axis is prepended
    if p.tp == "row":
        n = logical.shape[ax + 1] // tp
        return logical.narrow(ax + 1, t * n, n)
    if p.fused and p.fused != "qkv":
        parts, start = [], 0
        for _, rows in c.fused_sections(p.fused):
            n = rows // tp
            parts.append(logical.narrow(ax, start + t * n, n))
            start += rows
        return torch.cat(parts, dim=ax)
    n = logical.shape[ax] // tp
    return logical.narrow(ax, t * n, n)


