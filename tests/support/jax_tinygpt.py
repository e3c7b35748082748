"""The tiny Megatron-Core GPT of the fixtures (`tests/fixtures/megatron/tinygpt.py`) in JAX (test support).

A forward pass that consumes the logical checkpoint tree directly (the `model` subtree of bf16
weights, or fp32 masters cast to bf16), reproducing megatron-core 0.19.2's `GPTModel` math for the
dense config of `tinygpt.make_config` (local layer specs):

    h = word[tok] + pos[p]                                       LanguageModelEmbedding
    per layer (stacked on the leading axis of every `decoder/layers/...` array):
      x = LN(h)                   eps 1e-5, weight + bias        input_layernorm (saved as linear_qkv.layer_norm_*)
      q, k, v = x W^T + b         sections of the fused linear_qkv (query heads group-major, GQA)
      s = (q k^T) / sqrt(head_dim), causal, softmax in fp32      DotProductAttention + FusedScaleMaskSoftmax
      h = h + (ctx W_proj^T + b_proj)                            linear_proj (skip_bias_add) + bias_dropout_add
      x = LN(h)                                                  pre_mlp_layernorm (saved as linear_fc1.layer_norm_*)
      a = silu(x W_gate^T + b_gate) * (x W_up^T + b_up)          linear_fc1 (SwiGLU: chunk(2) -> gate, up)
      h = h + (a W_fc2^T + b_fc2)                                linear_fc2 + bias_dropout_add
    logits = LN_final(h) W_out^T                                 output_layer (untied; tied -> word embeddings)
    loss = mean over tokens of logsumexp(logits) - logits[label]  vocab_parallel_cross_entropy on logits.float()

`activations="fp32"` computes everything in float32 from the (bf16-valued) weights;
`activations="bf16"` rounds to bfloat16 exactly where Megatron's bf16 run materialises a bf16
tensor (every GEMM output, bias add, residual add, LayerNorm / SiLU / softmax output; softmax and
LayerNorm statistics in fp32; GEMMs accumulate in fp32), i.e. an emulation of the GPU run; with
`tp=2` it also rounds each TP rank's row-parallel partial product and their all-reduced sum
(a TP=2 run's loss differs from a TP=1 run's by ~5e-5 relative; the emulation gets 1e-7).
Backward (jax.grad) rounds cotangents at the same points, close to Megatron's bf16 backward.
Not modelled: TP / GTP replicas that 0.19.2 lets drift apart (tests pass each rank its own copy).

    w = weights_from_tree(restored.model)            # or weights_from_tree(restored.params, cast_bf16=True)
    inputs, labels = tinygpt_batch(3)
    loss = mean_loss(w, inputs, labels, GPTDims.from_manifest(manifest))
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

# How closely the JAX loss reproduces Megatron's bf16 run (tests/jaxside/test_jax_tinygpt.py, six real fixtures):
BF16_RTOL = 1e-6   # bf16-activation emulation: |rel| <= 2.2e-7 observed (about one float32 ulp of the loss)
FP32_RTOL = 6e-5   # float32 activations from the bf16 weights: |rel| <= 3.2e-5 observed (incl. the live dp2 run)
LN_EPS = 1e-5            # TransformerConfig.layernorm_epsilon default
MASK_VALUE = -10000.0    # megatron.core.transformer.utils.attention_mask_func
SIZES = dict(num_layers=2, hidden_size=24, ffn_hidden_size=40, num_attention_heads=4, num_query_groups=2,
             kv_channels=6, vocab_size=72, seq_length=16, global_batch=4)  # = tinygpt.SIZES (not importable on CPU)

QKV = ("decoder", "layers", "self_attention", "linear_qkv")
PROJ = ("decoder", "layers", "self_attention", "linear_proj")
FC1 = ("decoder", "layers", "mlp", "linear_fc1")
FC2 = ("decoder", "layers", "mlp", "linear_fc2")


@dataclass(frozen=True)
class GPTDims:
    """Attention head layout (the rest of the sizes come from the arrays' shapes)."""

    num_heads: int
    num_query_groups: int
    head_dim: int
    eps: float = LN_EPS

    @classmethod
    def from_manifest(cls, manifest: Any) -> "GPTDims":
        """Head layout from the manifest's qkv section table (`fused[...linear_qkv/weight].info`)."""
        from bridge.jaxside.manifest_view import as_manifest

        info = as_manifest(manifest).fused["/".join(QKV + ("weight",))]["info"]
        return cls(int(info["num_heads"]), int(info["num_query_groups"]), int(info["head_dim"]))


def tinygpt_batch(step: int, global_batch: int = SIZES["global_batch"], seq: int = SIZES["seq_length"],
                  vocab: int = SIZES["vocab_size"]) -> tuple[np.ndarray, np.ndarray]:
    """(inputs, labels) [global_batch, seq] of `tinygpt.batch(step)` before its per-rank split.

    The same torch generator call as the fixtures' run (CPU generator, seed 1000 + step).
    """
    import torch

    gen = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, vocab, (global_batch, seq + 1), generator=gen).numpy().astype(np.int32)
    return tokens[:, :-1], tokens[:, 1:]


def weights_from_tree(tree: Mapping, cast_bf16: bool = False) -> dict:
    """Nested dict of float32 jax arrays on one device from a logical (sub)tree (e.g. restored onto a
    mesh); `cast_bf16` rounds fp32 masters to the bf16 weights Megatron's forward uses
    (`bf16(master) == model`, checked by the converter).

    One device on purpose: the model is tiny, and SPMD collectives over 8 virtual CPU devices can
    stall past XLA's rendezvous timeout on a loaded 2-core machine.
    """
    def one(x):
        x = jnp.asarray(np.asarray(x))
        return (x.astype(jnp.bfloat16) if cast_bf16 else x).astype(jnp.float32)

    return jax.tree.map(one, dict(tree))


def _get(tree: Mapping, path: tuple[str, ...], default: Any = None) -> Any:
    node: Any = tree
    for c in path:
        if not isinstance(node, Mapping) or c not in node:
            return default
        node = node[c]
    return node


def _norm_params(w: Mapping, module: tuple[str, ...], fallback: tuple[str, ...]) -> tuple[Any, Any]:
    """LayerNorm (weight, bias) fused into `module` (`layer_norm_weight`), else a separate norm module."""
    lw = _get(w, module + ("layer_norm_weight",))
    if lw is not None:
        return lw, _get(w, module + ("layer_norm_bias",))
    return _get(w, fallback + ("weight",)), _get(w, fallback + ("bias",))


def _sections(w: Mapping, module: tuple[str, ...], names: tuple[str, ...], what: str) -> list[tuple[Any, Any]]:
    weight, bias = _get(w, module + ("weight",)), _get(w, module + ("bias",))
    if not isinstance(weight, Mapping) or set(weight) != set(names):
        raise ValueError(f"{'/'.join(module)}/weight must have sections {names} ({what}); got {weight!r:.80}")
    return [(weight[n], None if bias is None else bias[n]) for n in names]


@functools.partial(jax.jit, static_argnums=(3, 4, 5))
def per_token_loss(w: Mapping, inputs: Any, labels: Any, dims: GPTDims, activations: str = "fp32",
                   tp: int = 1) -> jax.Array:
    """Cross entropy of every token [batch, seq] (float32), Megatron's GPTModel forward on `w`.

    `tp` (bf16 emulation only) mimics tensor parallelism's arithmetic: each TP rank's row-parallel
    partial product (linear_proj, linear_fc2) is rounded to bf16 and the all-reduce sums them in bf16.
    """
    if activations not in ("fp32", "bf16"):
        raise ValueError(f"activations must be 'fp32' or 'bf16', not {activations!r}")
    bf16 = activations == "bf16"

    def r(x):  # materialise as Megatron's bf16 run does
        return x.astype(jnp.bfloat16).astype(jnp.float32) if bf16 else x

    def mm(x, weight):  # x [..., in] @ weight[out, in]^T, fp32 accumulation
        return jnp.einsum("...i,oi->...o", x, weight, precision=jax.lax.Precision.HIGHEST)

    def linear(x, weight, bias):  # ColumnParallel (bias inside) / RowParallel (bias in bias_dropout_add)
        y = r(mm(x, weight))
        return y if bias is None else r(y + bias)

    def row_linear(x, weight, bias):  # RowParallelLinear: TP ranks' partial sums, all-reduced in bf16
        if tp == 1:
            return linear(x, weight, bias)
        k = x.shape[-1] // tp
        y = r(mm(x[..., :k], weight[:, :k]))
        for t in range(1, tp):
            y = r(y + r(mm(x[..., t * k:(t + 1) * k], weight[:, t * k:(t + 1) * k])))
        return y if bias is None else r(y + bias)

    def layer_norm(x, weight, bias):
        mean = jnp.mean(x, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
        y = (x - mean) * jax.lax.rsqrt(var + dims.eps) * weight
        return r(y if bias is None else y + bias)

    inputs, labels = jnp.asarray(inputs), jnp.asarray(labels)
    b, s = inputs.shape
    word = w["embedding"]["word_embeddings"]["weight"]
    h = word[inputs]
    pos = _get(w, ("embedding", "position_embeddings", "weight"))
    if pos is not None:
        h = r(h + pos[jnp.arange(s)][None])

    nh, ng, hd = dims.num_heads, dims.num_query_groups, dims.head_dim
    causal = jnp.triu(jnp.ones((s, s), bool), 1)
    ln1 = _norm_params(w, QKV, ("decoder", "layers", "input_layernorm"))
    ln2 = _norm_params(w, FC1, ("decoder", "layers", "pre_mlp_layernorm"))
    qkv = _sections(w, QKV, ("query", "key", "value"), "the converter's de-interleaved GQA sections")
    fc1 = _sections(w, FC1, ("gate", "up"), "the converter's SwiGLU halves")
    proj = (_get(w, PROJ + ("weight",)), _get(w, PROJ + ("bias",)))
    fc2 = (_get(w, FC2 + ("weight",)), _get(w, FC2 + ("bias",)))
    num_layers = qkv[0][0].shape[0]

    def at(pair, i):
        return tuple(None if a is None else a[i] for a in pair)

    for i in range(num_layers):
        x = layer_norm(h, *at(ln1, i))
        q, k, v = (linear(x, *at(sec, i)) for sec in qkv)
        # query rows are heads in group-major order (Megatron's [ng, np/ng, hn] split); head j reads
        # key/value group j // (np/ng) (DotProductAttention's repeat_interleave)
        q = q.reshape(b, s, nh, hd)
        k = jnp.repeat(k.reshape(b, s, ng, hd), nh // ng, axis=2)
        v = jnp.repeat(v.reshape(b, s, ng, hd), nh // ng, axis=2)
        scores = r(jnp.einsum("bqnd,bknd->bnqk", q, k, precision=jax.lax.Precision.HIGHEST) / np.sqrt(hd))
        probs = r(jax.nn.softmax(jnp.where(causal, MASK_VALUE, scores), axis=-1))
        ctx = r(jnp.einsum("bnqk,bknd->bqnd", probs, v, precision=jax.lax.Precision.HIGHEST)).reshape(b, s, nh * hd)
        h = r(h + row_linear(ctx, *at(proj, i)))
        x = layer_norm(h, *at(ln2, i))
        gate, up = (linear(x, *at(sec, i)) for sec in fc1)
        a = r(r(jax.nn.silu(gate)) * up)
        h = r(h + row_linear(a, *at(fc2, i)))

    final = ("decoder", "final_layernorm")
    h = layer_norm(h, _get(w, final + ("weight",)), _get(w, final + ("bias",)))
    out = _get(w, ("output_layer", "weight"), word)  # share_embeddings_and_output_weights -> word embeddings
    logits = r(mm(h, out))
    return jax.nn.logsumexp(logits, axis=-1) - jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]


def mean_loss(w: Mapping, inputs: Any, labels: Any, dims: GPTDims, activations: str = "fp32",
              tp: int = 1) -> jax.Array:
    """The loss `tinygpt.train_step` reports: the token mean (every DP rank holds equal batch slices)."""
    return jnp.mean(per_token_loss(w, inputs, labels, dims, activations, tp))


def loss_and_grads(w: Mapping, inputs: Any, labels: Any, dims: GPTDims,
                   activations: str = "fp32", tp: int = 1) -> tuple[jax.Array, dict]:
    """(mean loss, d loss / d weights) — Megatron's main grads of the step (average over DP ranks)."""
    return _loss_and_grads(w, inputs, labels, dims, activations, tp)


_loss_and_grads = jax.jit(jax.value_and_grad(mean_loss), static_argnums=(3, 4, 5))


# ------------------------------------------------------------------ the committed Megatron fixtures, converted

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures", "megatron")
_CONVERTED: dict[str, str] = {}


def converted_fixture(run: str) -> str:
    """`gtp-bridge convert` of fixture `run`'s dp_reshardable save, once per process (a temp dir)."""
    if run not in _CONVERTED:
        from converters.megatron.convert import ConvertOptions
        from converters.megatron.convert_entry import convert
        from converters.megatron.plan.format import Hints

        base = tempfile.mkdtemp(prefix="jax_tinygpt_")
        atexit.register(shutil.rmtree, base, True)
        hints = Hints(kv_channels=SIZES["kv_channels"]) if run == "tp1" else None  # tp1 was saved without args
        dst = os.path.join(base, run)
        convert(os.path.join(FIXTURES, run, "dp_reshardable"), dst, ConvertOptions(workers=1, hints=hints))
        _CONVERTED[run] = dst
    return _CONVERTED[run]


def fixture_run(run: str) -> dict:
    """The fixture's run.json (layout, losses, `next_losses` = losses of steps 3 and 4 after the save)."""
    with open(os.path.join(FIXTURES, run, "run.json")) as f:
        return json.load(f)


def rank_param(run: str, rank: int, name: str) -> np.ndarray:
    """Rank `rank`'s own live copy of parameter `name` (Megatron's DDP name) from the fixture's reference dump."""
    import torch

    ref = torch.load(os.path.join(FIXTURES, run, f"reference_rank{rank}.pt"), weights_only=True)
    return ref["params"][name]["live"].float().numpy()
