"""A realistic-size Megatron-Core GPT (Llama-style: RMSNorm, RoPE, SwiGLU, GQA, no biases, untied
embeddings) for the scale probe. Reuses tests/fixtures/megatron/tinygpt.py for the training step,
save and Megatron's own load, with its SIZES replaced by ours.

Sizes come from the environment (SP_HIDDEN, SP_LAYERS, SP_FFN, SP_HEADS, SP_GROUPS, SP_VOCAB,
SP_SEQ, SP_BATCH) so a tiny run on the CPU machine and the big run on the GPU use the same code.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))  # repository root
for p in (ROOT, os.path.join(ROOT, "tests", "fixtures", "megatron")):
    if p not in sys.path:
        sys.path.insert(0, p)

import tinygpt  # noqa: E402


def _env(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


SIZES = dict(
    num_layers=_env("SP_LAYERS", 16),
    hidden_size=_env("SP_HIDDEN", 2048),
    ffn_hidden_size=_env("SP_FFN", 5632),
    num_attention_heads=_env("SP_HEADS", 16),
    num_query_groups=_env("SP_GROUPS", 4),
    kv_channels=_env("SP_HIDDEN", 2048) // _env("SP_HEADS", 16),
    vocab_size=_env("SP_VOCAB", 32000),
    seq_length=_env("SP_SEQ", 1024),
    global_batch=_env("SP_BATCH", 4),
)
# tinygpt.batch / make_args read tinygpt.SIZES at call time
tinygpt.SIZES.update(SIZES)

LR, BETAS, EPS, WEIGHT_DECAY = tinygpt.LR, tinygpt.BETAS, tinygpt.EPS, tinygpt.WEIGHT_DECAY


def n_params() -> int:
    s = SIZES
    h, f, L, v = s["hidden_size"], s["ffn_hidden_size"], s["num_layers"], s["vocab_size"]
    qkv = (s["num_attention_heads"] + 2 * s["num_query_groups"]) * s["kv_channels"] * h
    proj = s["num_attention_heads"] * s["kv_channels"] * h
    per_layer = qkv + proj + 2 * f * h + f * h + 2 * h
    return L * per_layer + 2 * v * h + h


def make_config(cpu_init: bool = False):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=SIZES["num_layers"],
        hidden_size=SIZES["hidden_size"],
        ffn_hidden_size=SIZES["ffn_hidden_size"],
        num_attention_heads=SIZES["num_attention_heads"],
        num_query_groups=SIZES["num_query_groups"],
        kv_channels=SIZES["kv_channels"],
        gated_linear_unit=True,
        activation_func=F.silu,
        normalization="RMSNorm",
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        add_bias_linear=False,
        bf16=True,
        params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16,
        use_cpu_initialization=cpu_init,
        init_method_std=0.02,
        tensor_model_parallel_size=1,
        sequence_parallel=False,
    )


def build_model(cpu: bool = False):
    """GPTModel -> Float16Module (no DDP): what the CPU mapping check needs."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.module import Float16Module

    config = make_config(cpu_init=cpu)
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=SIZES["vocab_size"],
        max_sequence_length=SIZES["seq_length"],
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
    )
    if not cpu:
        gpt = gpt.cuda()
    return Float16Module(config, gpt), gpt, config


def build(overlap: bool = True, bucket_size: int | None = None):
    """Model + DDP (overlap-grad-reduce, default bucket size) + distributed optimizer (GPU)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    model, gpt, config = build_model(cpu=False)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=overlap,
        use_distributed_optimizer=True,
        bucket_size=bucket_size if bucket_size is not None else (_env("SP_BUCKET", 0) or None),
        average_in_collective=False,
    )
    model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    opt_config = OptimizerConfig(
        optimizer="adam", lr=LR, min_lr=LR, weight_decay=WEIGHT_DECAY, adam_beta1=BETAS[0],
        adam_beta2=BETAS[1], adam_eps=EPS, bf16=True, params_dtype=torch.bfloat16,
        use_distributed_optimizer=True, clip_grad=1.0,
    )
    optimizer = get_megatron_optimizer(opt_config, [model])
    optimizer.param_scheduler = OptimizerParamScheduler(
        optimizer, init_lr=LR, max_lr=LR, min_lr=LR, lr_warmup_steps=0, lr_decay_steps=100,
        lr_decay_style="constant", start_wd=WEIGHT_DECAY, end_wd=WEIGHT_DECAY, wd_incr_steps=100,
        wd_incr_style="constant",
    )
    return model, gpt, optimizer, config


def make_args(fmt: str, iteration: int, overlap: bool = True) -> argparse.Namespace:
    """Megatron-LM style args (what a training-loop save puts in common_state)."""
    a = tinygpt.make_args({"overlap": overlap}, fmt, iteration)
    a.position_embedding_type = "rope"
    a.add_bias_linear = False
    a.normalization = "RMSNorm"
    a.max_position_embeddings = SIZES["seq_length"]
    return a


def build_state_dict(model, gpt, optimizer, fmt: str, iteration: int) -> dict:
    md = tinygpt.sharded_metadata(fmt)
    sd: dict[str, Any] = {"model": gpt.sharded_state_dict(metadata=md)}
    sd["args"] = make_args(fmt, iteration)
    sd["checkpoint_version"] = 3.0
    sd["iteration"] = iteration
    sd["optimizer"] = optimizer.sharded_state_dict(sd, is_loading=False, metadata=md)
    return sd


def buckets(model) -> list[dict]:
    """Bucket summary of the DDP buffers (count, numels)."""
    out = []
    for buf in list(getattr(model, "buffers", [])) + list(getattr(model, "expert_parallel_buffers", [])):
        out.append({"param_dtype": str(buf.param_dtype), "grad_dtype": str(buf.grad_dtype),
                    "numel": int(buf.numel), "buckets": len(buf.buckets),
                    "bucket_numels": [int(b.grad_data.numel()) for b in buf.buckets]})
    return out


def state_tensors(model, optimizer) -> dict[str, dict[str, torch.Tensor]]:
    """Every parameter's bf16 weight and its optimizer fragment (master, exp_avg, exp_avg_sq),
    keyed by parameter name: for comparing two live runs on the GPU."""
    names = {p: n for n, p in model.named_parameters()}
    out: dict[str, dict[str, torch.Tensor]] = {}
    for n, p in model.named_parameters():
        out[n] = {"weight": p.detach()}
    for opt in tinygpt.optimizer_list(optimizer):
        for p in opt.model_param_gbuf_map:
            st = opt._get_main_param_and_optimizer_states(p)
            for k in ("param", "exp_avg", "exp_avg_sq"):
                out[names[p]][k] = st[k].detach()
    return out


def compare_states(a: dict, b: dict) -> dict:
    """Bit-exact comparison of two `state_tensors` results (same layout)."""
    res = {"tensors": 0, "elements": 0, "mismatch": [], "max_abs": 0.0}
    for n in sorted(set(a) | set(b)):
        if n not in a or n not in b:
            res["mismatch"].append(f"{n}: missing")
            continue
        for k in sorted(set(a[n]) | set(b[n])):
            x, y = a[n].get(k), b[n].get(k)
            if x is None or y is None or x.shape != y.shape or x.dtype != y.dtype:
                res["mismatch"].append(f"{n}.{k}: shape/dtype")
                continue
            res["tensors"] += 1
            res["elements"] += x.numel()
            # bitwise: view as ints (NaN-safe, -0.0 distinguished)
            iv = torch.int16 if x.element_size() == 2 else torch.int32
            if not torch.equal(x.contiguous().view(iv), y.contiguous().view(iv)):
                d = float((x.float() - y.float()).abs().max())
                res["max_abs"] = max(res["max_abs"], d)
                res["mismatch"].append(f"{n}.{k}: max_abs {d:.3g}")
    res["ok"] = not res["mismatch"]
    res["mismatch_count"] = len(res["mismatch"])
    res["mismatch"] = res["mismatch"][:20]
    return res
