"""Synthetic Megatron-shaped torch_dist checkpoints for the converter tests, built independently.

A tiny GQA + SwiGLU GPT's *logical* arrays are drawn at random; this module then computes, with
its own straightforward code (not bridge.layout), what Megatron-Core stores: group-interleaved
qkv, [gate; up] fc1, stacked layer axes, TP chunks, and for `dp_reshardable` the DistOpt bucket
buffers (reverse order, 64-element alignment, bucket end padding to lcm(DP, 128), DP shards).
Real `torch.distributed.checkpoint.save` writes it from real gloo processes (one per rank).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import math
import os
import shutil
from typing import Any

import ml_dtypes
import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import megatron_pp_reference
from servers import free_port

L, H, NQ, NG, HD, F, V = 2, 8, 4, 2, 2, 12, 32
QKV = (NQ + 2 * NG) * HD


@contextlib.contextmanager
def dims(**sizes: int):
    """Build checkpoints of other sizes inside this block, e.g. `dims(L=4, H=64, F=192, V=512)`
    (names as the module constants; the defaults come back on exit)."""
    global L, H, NQ, NG, HD, F, V, QKV
    old = (L, H, NQ, NG, HD, F, V)
    g = globals()
    for k, v in sizes.items():
        if k not in ("L", "H", "NQ", "NG", "HD", "F", "V"):
            raise TypeError(f"unknown dimension {k}")
        g[k] = int(v)
    QKV = (NQ + 2 * NG) * HD
    try:
        yield
    finally:
        L, H, NQ, NG, HD, F, V = old
        QKV = (NQ + 2 * NG) * HD
LR, BETAS, EPS, WD = 0.01, (0.9, 0.95), 1e-8, 0.1


def logical_arrays(seed: int = 0) -> dict[str, np.ndarray]:
    """name -> fp32 logical array (sections split, stacked layer axis first)."""
    r = np.random.default_rng(seed)
    f = lambda *s: r.standard_normal(s).astype(np.float32)  # noqa: E731
    return {
        "embedding.word_embeddings.weight": f(V, H),
        "decoder.layers.input_layernorm.weight": f(L, H),
        "decoder.layers.self_attention.linear_qkv.weight.query": f(L, NQ * HD, H),
        "decoder.layers.self_attention.linear_qkv.weight.key": f(L, NG * HD, H),
        "decoder.layers.self_attention.linear_qkv.weight.value": f(L, NG * HD, H),
        "decoder.layers.self_attention.linear_qkv.bias.query": f(L, NQ * HD),
        "decoder.layers.self_attention.linear_qkv.bias.key": f(L, NG * HD),
        "decoder.layers.self_attention.linear_qkv.bias.value": f(L, NG * HD),
        "decoder.layers.self_attention.linear_proj.weight": f(L, H, NQ * HD),
        "decoder.layers.self_attention.linear_proj.bias": f(L, H),
        "decoder.layers.pre_mlp_layernorm.weight": f(L, H),
        "decoder.layers.mlp.linear_fc1.weight.gate": f(L, F, H),
        "decoder.layers.mlp.linear_fc1.weight.up": f(L, F, H),
        "decoder.layers.mlp.linear_fc2.weight": f(L, H, F),
        "decoder.final_layernorm.weight": f(H),
        "output_layer.weight": f(V, H),
    }


def fuse(logical: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Megatron's stored global tensors (one key per parameter) from the logical arrays."""
    out: dict[str, np.ndarray] = {}
    for name, a in logical.items():
        base, _, sec = name.rpartition(".")
        if sec in ("query", "key", "value", "gate", "up"):
            continue
        out[name] = a
    for kind in ("weight", "bias"):
        q = logical[f"decoder.layers.self_attention.linear_qkv.{kind}.query"]
        k = logical[f"decoder.layers.self_attention.linear_qkv.{kind}.key"]
        v = logical[f"decoder.layers.self_attention.linear_qkv.{kind}.value"]
        rest = q.shape[2:]
        qg = q.reshape((L, NG, NQ // NG * HD) + rest)
        kg = k.reshape((L, NG, HD) + rest)
        vg = v.reshape((L, NG, HD) + rest)
        out[f"decoder.layers.self_attention.linear_qkv.{kind}"] = np.concatenate([qg, kg, vg], axis=2).reshape((L, QKV) + rest)
    g, u = logical["decoder.layers.mlp.linear_fc1.weight.gate"], logical["decoder.layers.mlp.linear_fc1.weight.up"]
    out["decoder.layers.mlp.linear_fc1.weight"] = np.concatenate([g, u], axis=1)
    return out


ORDER = [  # registration order (named_parameters) of one layer, and the model
    "embedding.word_embeddings.weight",
    "decoder.layers.input_layernorm.weight",
    "decoder.layers.self_attention.linear_proj.weight",
    "decoder.layers.self_attention.linear_proj.bias",
    "decoder.layers.self_attention.linear_qkv.weight",
    "decoder.layers.self_attention.linear_qkv.bias",
    "decoder.layers.pre_mlp_layernorm.weight",
    "decoder.layers.mlp.linear_fc1.weight",
    "decoder.layers.mlp.linear_fc2.weight",
    "decoder.final_layernorm.weight",
    "output_layer.weight",
]
COLUMN = {"linear_qkv", "linear_fc1", "output_layer", "word_embeddings"}
ROW = {"linear_proj", "linear_fc2"}


def tp_axis(name: str) -> int | None:
    """Axis TP splits in the per-instance tensor (None: replicated)."""
    mod = name.split(".")[-2]
    leaf = name.split(".")[-1]
    if mod in COLUMN:
        return 0
    if mod in ROW and leaf == "weight":
        return 1
    return None


def bf16(a: np.ndarray) -> np.ndarray:
    return a.astype(ml_dtypes.bfloat16)


def state(seed: int = 0, tied: bool = False) -> dict[str, dict[str, np.ndarray]]:
    """role -> logical arrays: params (fp32 master), mu, nu, model = bf16(master). A `tied` model has no
    output layer (it uses the word embeddings)."""
    p = logical_arrays(seed)
    mu = {k: v * 0.1 for k, v in logical_arrays(seed + 1).items()}
    nu = {k: np.abs(v) * 0.01 for k, v in logical_arrays(seed + 2).items()}
    st = {"params": p, "mu": mu, "nu": nu, "model": {k: bf16(v) for k, v in p.items()}}
    if tied:
        for arrays in st.values():
            del arrays["output_layer.weight"]
    return st


def _to_torch(a: np.ndarray) -> torch.Tensor:
    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(a))


# --- chunking -------------------------------------------------------------------------------


#: the pipeline split of the checkpoint being built: (first stage's layers, last stage's layers, embedding
#: counted as a layer, loss counted as a layer); None / False = Megatron's even split
SPLIT: tuple[int | None, int | None, bool, bool] = (None, None, False, False)


@contextlib.contextmanager
def uneven(first: int | None = None, last: int | None = None, embedding: bool = False, loss: bool = False):
    """Build checkpoints whose first / last pipeline stage hold `first` / `last` layers (Megatron's
    decoder_first/last_pipeline_num_layers), or that count the embedding / loss as a layer of the first /
    last stage (account_for_embedding/loss_in_pipeline_split), inside this block."""
    global SPLIT
    old, SPLIT = SPLIT, (first, last, embedding, loss)
    try:
        yield
    finally:
        SPLIT = old


def stage_sizes(pp: int) -> list[int]:
    """Layers per stage: the uneven first / last stage as set, the others share the rest; or, counting the
    embedding / loss as layers, L + those over pp each, less the embedding / loss on the first / last."""
    first, last, emb, loss = SPLIT
    if emb or loss:
        each = (L + emb + loss) // pp
        out = [each] * pp
        out[0] -= emb
        out[-1] -= loss
        assert sum(out) == L, (out, L)
        return out
    sizes: list[int | None] = [None] * pp
    if first is not None:
        sizes[0] = first
    if last is not None:
        sizes[-1] = last
    fixed = [n for n in sizes if n is not None]
    free = sizes.count(None)
    each = (L - sum(fixed)) // free if free else 0
    out = [each if n is None else n for n in sizes]
    assert sum(out) == L, (out, L)
    return out


def stage_of(name: str, layer: int | None, pp: int) -> int:
    """Pipeline stage holding a param: layers by `stage_sizes`, the embedding first, the rest last."""
    if layer is not None:
        ends = np.cumsum(stage_sizes(pp))
        return int(np.searchsorted(ends, layer, side="right"))
    return 0 if name.startswith("embedding.") else pp - 1


def tp_chunks(name: str, full: np.ndarray, tp: int, dp: int = 1, pp: int = 1,
              vpp: int = 1) -> list[tuple[int, tuple[int, ...], np.ndarray]]:
    """(writer rank, offsets, data) chunks: per layer instance (stacked keys) and TP rank; the writer
    is rank t of the stage holding the instance (ranks: t + tp·d + tp·dp·p; with `vpp` virtual chunks
    the stage megatron-core places the layer on, `chunk_of`).

    SwiGLU fc1 is split per TP rank as Megatron does: rank t stores gate rows t·F/tp.. and up rows F + t·F/tp..
    """
    npre = 1 if name.startswith("decoder.layers.") else 0
    ax = tp_axis(name)
    out = []
    layers = range(full.shape[0]) if npre else [None]
    for layer in layers:
        inst = full[layer] if npre else full
        pre = (layer,) if npre else ()
        base_rank = tp * dp * chunk_of(name, layer, pp, vpp)[0]
        for t in range(tp):
            if ax is None:
                if t == 0:
                    out.append((base_rank, pre + (0,) * inst.ndim, inst[None] if npre else inst))
                continue
            if name.endswith("linear_fc1.weight"):
                n = F // tp
                for base in (0, F):
                    sl = inst[base + t * n: base + (t + 1) * n]
                    out.append((base_rank + t, pre + (base + t * n,) + (0,) * (inst.ndim - 1), sl[None] if npre else sl))
                continue
            n = inst.shape[ax] // tp
            idx = [slice(None)] * inst.ndim
            idx[ax] = slice(t * n, (t + 1) * n)
            offs = [0] * inst.ndim
            offs[ax] = t * n
            sl = inst[tuple(idx)]
            out.append((base_rank + t, pre + tuple(offs), sl[None] if npre else sl))
    return out


def model_space_entries(st: dict[str, dict[str, np.ndarray]], tp: int, fully: bool, dp: int = 1,
                        pp: int = 1, vpp: int = 1) -> dict[str, list]:
    """key -> [(writer rank, offsets, data)] for the model (and fully_reshardable optimizer) keys."""
    entries: dict[str, list] = {}
    roles = [("model", "")] + ([("params", "optimizer.state.param."), ("mu", "optimizer.state.exp_avg."),
                                ("nu", "optimizer.state.exp_avg_sq.")] if fully else [])
    for role, prefix in roles:
        fused = fuse(st[role])
        for name in ORDER:
            if name not in fused:   # tied: no output layer entry (the last stage's copy is never saved)
                continue
            full = fused[name]
            entries[prefix + name] = tp_chunks(name, full, tp, dp, pp, vpp)
    return entries


def chunk_of(name: str, layer: int | None, pp: int, vpp: int) -> tuple[int, int]:
    """(stage, virtual chunk) holding a param: with vpp chunks per stage, where megatron-core's own
    get_transformer_layer_offset / get_num_layers_to_build put the layer (`megatron_pp_reference`, the
    split of `uneven(...)`; even: the layers cut into pp·vpp equal runs, run c on stage c % pp as its
    chunk c // pp); the embedding in the first chunk of the first stage, the rest in the last of the last."""
    if vpp == 1:
        return stage_of(name, layer, pp), 0
    if layer is None:
        return (0, 0) if name.startswith("embedding.") else (pp - 1, vpp - 1)
    first, last, emb, loss = SPLIT
    placed = megatron_pp_reference.placement(megatron_pp_reference.Config(L, pp, vpp, first, last, emb, loss))
    assert not isinstance(placed, str), f"megatron-core refuses this split ({placed})"
    return next(k for k, layers in placed.items() if layer in layers)


def dp_buffers(st, tp: int, dp: int, bucket_size: int | None = None,
               pp: int = 1, bucket_space: bool = False, per_rank: bool = False,
               vpp: int = 1) -> tuple[dict[str, list], dict[str, Any]]:
    """dp_reshardable bucket tensors and per_bucket_numel objects, computed directly (one
    DistOpt group per TP rank t and pipeline stage: dp_group_idx t + tp·stage; with `vpp` virtual
    chunks, one buffer per chunk: gbuf_idx = chunk)."""
    entries: dict[str, list] = {}
    objects: dict[str, Any] = {}
    div = math.lcm(dp, 128)
    fused = {r: fuse(st[r]) for r in ("params", "mu", "nu")}
    for t, stage, v in [(t, q, v) for q in range(pp) for t in range(tp) for v in range(vpp)]:
        # the TP-local flat tensor of each runtime param instance of the stage, registration order
        inst: list[tuple[str, dict[str, np.ndarray]]] = []
        stacked = [n for n in ORDER if n.startswith("decoder.layers.")]
        runtime = ([(ORDER[0], None)] + [(n, layer) for layer in range(L) for n in stacked]
                   + [(n, None) for n in ORDER[1 + len(stacked):]])
        tied = "output_layer.weight" not in fused["params"]
        runtime = [(n, layer) for n, layer in runtime if chunk_of(n, layer, pp, vpp) == (stage, v)
                   and (n in fused["params"] or pp > 1)]
        # tied at PP > 1: the first stage's embedding and the last stage's output layer (a copy of the
        # embedding, kept in sync by Megatron) each sit in a DDP bucket of their own
        shared = {n for n, _ in runtime if tied and pp > 1 and n in ("embedding.word_embeddings.weight",
                                                                      "output_layer.weight")}
        k = t + tp * stage
        # Megatron-LM's training loop buckets the first model chunk of the first stage only
        # (megatron/training/training.py, 0.19.2: per_chunk_bucket_sizes)
        bs = bucket_size if stage == 0 and v == 0 else None
        for name, layer in runtime:
            npre = 1 if layer is not None else 0
            if True:
                local = {}
                for r in ("params", "mu", "nu"):
                    full = fused[r][name if name in fused[r] else "embedding.word_embeddings.weight"]
                    x = full[layer] if npre else full
                    if name.endswith("linear_fc1.weight"):
                        n = F // tp
                        x = np.concatenate([x[t * n:(t + 1) * n], x[F + t * n:F + (t + 1) * n]])
                    else:
                        ax = tp_axis(name)
                        if ax is not None:
                            n = x.shape[ax] // tp
                            x = np.take(x, range(t * n, (t + 1) * n), axis=ax)
                    local[r] = x.reshape(-1)
                inst.append((name, local))
        # reverse order, 64-aligned starts, buckets; a bucket's end is its last param's end, or, when a
        # shared param closes it, the (64-aligned) start that param would have had
        buckets: list[list[tuple[int, dict]]] = [[]]
        starts: list[int] = [0]
        ends: list[int] = []
        pos = 0
        bstart = 0

        def close(end: int) -> int:
            ends.append(end)
            bend = -(-end // div) * div
            buckets.append([])
            starts.append(bend)
            return bend

        for i, (n_, local) in enumerate(reversed(inst)):
            pos = -(-pos // 64) * 64
            if n_ in shared and buckets[-1]:          # a shared param starts a bucket
                pos = bstart = close(pos)
            buckets[-1].append((pos, local))
            pos += local["params"].size
            more = i < len(inst) - 1
            if more and (n_ in shared or (bs is not None and pos - bstart >= bs)):
                pos = bstart = close(pos)             # ... and ends it; or the bucket is full
        ends.append(pos)
        unpadded, padded = [], []
        for b, items in enumerate(buckets):
            b0 = starts[b]
            unp = ends[b] - b0
            pad_end = -(-ends[b] // div) * div
            unpadded.append(unp)
            padded.append(pad_end - b0)
            s = (pad_end - b0) // dp
            # fully_sharded_bucket_space (megatron-core <= 0.14) stores the padded bucket, with
            # whatever the padding held (torch.empty); dp_reshardable the unpadded one
            n = pad_end - b0 if bucket_space else unp
            for r, stname in (("params", "param"), ("mu", "exp_avg"), ("nu", "exp_avg_sq")):
                world = np.full(n, -7.5e30 if bucket_space else 0.0, dtype=np.float32)
                for p, loc in items:
                    world[p - b0:p - b0 + loc[r].size] = loc[r]
                key = (f"optimizer.distributed.dp_group_idx_{k}.gbuf_idx_{v}.dtype_(torch.bfloat16, torch.float32)"
                       f".bucket_idx_{b}.{stname}")
                chunks = []
                for d in range(dp):
                    lo, hi = d * s, min((d + 1) * s, n)
                    w = t + tp * d + tp * dp * stage
                    if per_rank:   # megatron-core 0.14's torch_dist: (dp, s), each rank's row in pieces
                        mid = lo + (hi - lo) // 3
                        chunks += [(w, (d, 0), world[lo:mid].reshape(1, -1)), (w, (d, mid - lo), world[mid:hi].reshape(1, -1))]
                    elif hi > lo:
                        chunks.append((w, (lo,), world[lo:hi]))
                entries[key] = chunks
        pre = f"optimizer.distributed.dp_group_idx_{k}."
        objects.setdefault(pre + "per_bucket_numel", []).append({(torch.bfloat16, torch.float32): padded})
        objects.setdefault(pre + "per_bucket_numel_unpadded", []).append({(torch.bfloat16, torch.float32): unpadded})
        objects[pre + "optimizer"] = {"param_groups": param_groups(step=3)}
    return entries, objects


def gathered(entries: dict[str, list], objects: dict[str, Any]) -> tuple[dict[str, list], dict[str, Any]]:
    """dp_reshardable's buckets (`dp_buffers`) as dp_zero_gather_scatter saves them: per DistOpt group,
    one `param_state` object holding each state's unpadded buckets end to end (what DP rank 0
    gathers, `buckets_coalesced`), no bucket tensors and no per_bucket_numel objects."""
    per: dict[str, dict[int, dict[str, list]]] = {}
    for key, chunks in entries.items():
        pre, rest = key.split(".gbuf_idx_", 1)
        j, rest = rest.split(".", 1)
        b, stname = rest.split(".bucket_idx_", 1)[1].split(".")
        world = np.concatenate([d for _w, _o, d in sorted(chunks, key=lambda c: c[1])])
        per.setdefault(pre, {}).setdefault(int(j), {}).setdefault(stname, []).append((int(b), world))
    out = {k: v for k, v in objects.items() if k.endswith(".optimizer")}
    for pre, bufs in per.items():
        obj: dict[Any, Any] = {"buckets_coalesced": True}
        for j, states in bufs.items():   # one buffer per model chunk (virtual pipeline), else gbuf 0 alone
            tensors: dict[str, Any] = {st: torch.from_numpy(np.concatenate([w for _b, w in sorted(bs, key=lambda x: x[0])]))
                                       for st, bs in states.items()}
            tensors["numel_unpadded"] = int(tensors["param"].numel())
            obj[j] = {(torch.bfloat16, torch.float32): tensors}
        out[pre + ".param_state"] = [obj]
    return {}, out


def param_groups(step: int) -> list[dict]:
    return [{"lr": LR, "betas": BETAS, "eps": EPS, "weight_decay": WD, "wd_mult": 1.0, "lr_mult": 1.0,
             "step": step, "params": list(range(12))},
            {"lr": LR, "betas": BETAS, "eps": EPS, "weight_decay": 0.0, "wd_mult": 0.0, "lr_mult": 1.0,
             "step": step, "params": list(range(10))}]


def common_state(tp: int, dp: int, fmt: str, with_args: bool = True, pp: int = 1, tied: bool = False,
                 extra_args: dict | None = None, scheduler: dict | None = None) -> dict:
    cs: dict[str, Any] = {"iteration": 3, "checkpoint_version": 3.0}
    if scheduler is not None:   # what Megatron-LM's training loop saves: OptimizerParamScheduler.state_dict()
        cs["opt_param_scheduler"] = dict(scheduler)
    if with_args:
        cs["args"] = argparse.Namespace(tensor_model_parallel_size=tp, data_parallel_size=dp, world_size=tp * dp * pp,
                                        pipeline_model_parallel_size=pp, num_attention_heads=NQ, num_query_groups=NG,
                                        group_query_attention=True, kv_channels=HD, hidden_size=H, ffn_hidden_size=F,
                                        swiglu=True, padded_vocab_size=V, num_layers=L, params_dtype=torch.bfloat16,
                                        untie_embeddings_and_output_weights=not tied,
                                        decoder_first_pipeline_num_layers=SPLIT[0],
                                        decoder_last_pipeline_num_layers=SPLIT[1],
                                        account_for_embedding_in_pipeline_split=SPLIT[2],
                                        account_for_loss_in_pipeline_split=SPLIT[3], **(extra_args or {}))
    if fmt == "fully_reshardable":
        cs["optimizer"] = {"optimizer": {"param_groups": param_groups(step=3)}, "param_state_sharding_type": fmt}
    elif fmt in ("fully_sharded_bucket_space", "dp_zero_gather_scatter"):
        cs["optimizer"] = {"param_state_sharding_type": fmt}
    return cs


# --- saving with real DCP from real gloo ranks ------------------------------------------------



def _save_rank(rank: int, world: int, port: int, path: str, entries: dict, shapes: dict, objects: dict,
               common: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed._shard.sharded_tensor import Shard, ShardMetadata, init_from_local_shards

    sd: dict[str, Any] = {}
    for key, chunks in entries.items():
        mine = [Shard(_to_torch(np.ascontiguousarray(d)).clone(), ShardMetadata(list(o), list(d.shape), f"rank:{rank}/cpu"))
                for w, o, d in chunks if w == rank]
        sd[key] = init_from_local_shards(mine, list(shapes[key]))
    if rank == 0:
        for k, obj in list(objects.items()) + [("common_state", common)]:
            buf = io.BytesIO()
            torch.save(obj, buf)
            sd[k] = buf
    dist.barrier()
    from torch.distributed.checkpoint import DefaultSavePlanner, save

    class Planner(DefaultSavePlanner):
        """dp_zero_gather_scatter's gathered objects stored as Megatron's planner (MCoreSavePlanner)
        stores every ShardedObject: the archive itself, not torch.save'd again into a pickled BytesIO."""

        def transform_object(self, write_item, object):
            if write_item.index.fqn.endswith(".param_state"):
                return object
            return super().transform_object(write_item, object)

    save(sd, checkpoint_id=path, planner=Planner())
    # Every rank leaves DCP's last collective before any tears gloo down: an early destroy while a
    # peer is still inside it aborts that peer ("terminate called without an active exception").
    dist.barrier()
    dist.destroy_process_group()


def save(path: str, entries: dict, objects: dict, common: dict, world: int) -> None:
    """Write `entries` (key -> [(rank, offsets, data)]) with real dcp.save from `world` gloo ranks."""
    shapes = {}
    for key, chunks in entries.items():
        shape = None
        for _w, o, d in chunks:
            end = tuple(a + b for a, b in zip(o, d.shape))
            shape = end if shape is None else tuple(max(a, b) for a, b in zip(shape, end))
        shapes[key] = shape
    # gloo on a loaded machine now and then aborts a rank at set-up or tear-down: try again, afresh
    for attempt in range(3):
        try:
            mp.start_processes(_save_rank, args=(world, free_port(), path, entries, shapes, objects, common),
                               nprocs=world, start_method="spawn")
            return
        except mp.ProcessExitedException:
            if attempt == 2:
                raise
            shutil.rmtree(path, ignore_errors=True)


def make_checkpoint(path: str, fmt: str, tp: int = 1, dp: int = 1, seed: int = 0, bucket_size: int | None = None,
                    with_args: bool = True, dp_shapes: dict | None = None, pp: int = 1,
                    per_rank: bool = False, tied: bool = False, extra_args: dict | None = None,
                    edit=None, vpp: int = 1, scheduler: dict | None = None) -> dict[str, dict[str, np.ndarray]]:
    """Write a synthetic Megatron checkpoint and return its logical state (the reference). `per_rank`:
    fully_sharded_bucket_space's buckets stored (dp, bucket numel / dp) as megatron-core 0.14 does.
    `tied`: the output layer shares the word embeddings (no output_layer entry; at PP > 1 the last
    stage's DistOpt buffer holds a copy of the embedding's state). Uneven pipeline stages:
    `uneven(...)`; `vpp` virtual pipeline chunks per stage. `edit(entries)` may change the stored
    chunks (key -> [(rank, offsets, data)]) before the save."""
    st = state(seed, tied)
    entries = model_space_entries(st, tp, fmt == "fully_reshardable", dp, pp, vpp)
    objects: dict[str, Any] = {}
    if fmt in ("dp_reshardable", "fully_sharded_bucket_space", "dp_zero_gather_scatter"):
        e2, objects = dp_buffers(st, tp, dp, bucket_size, pp, bucket_space=fmt == "fully_sharded_bucket_space",
                                 per_rank=per_rank, vpp=vpp)
        if fmt == "dp_zero_gather_scatter":
            e2, objects = gathered(e2, objects)
        entries.update(e2)
    if vpp > 1:
        extra_args = {"virtual_pipeline_model_parallel_size": vpp, **(extra_args or {})}
    if edit is not None:
        edit(entries)
    # dp bucket tensors' global length = unpadded numel
    save(path, entries, objects, common_state(tp, dp, fmt, with_args, pp, tied, extra_args, scheduler), tp * dp * pp)
    with open(os.path.join(path, "metadata.json"), "w") as f:  # what dist_checkpointing.save adds
        f.write('{"sharded_backend": "torch_dist", "sharded_backend_version": 1}')
    return st
