"""Independent logical reference of a real fixture run, from the per-rank dumps the GPU run recorded.

Each `reference_rank<r>.pt` holds what rank r's model held (`live` bf16 physical shard) and what
its distributed optimizer owned (flat range `[f0, f1)` of each param with fp32 master and moments).
This module assembles the logical arrays from those dumps with its own simple code: flat ranges
overlaid per (param, TP rank, EP rank), TP shards placed by `partition_dim` (SwiGLU fc1 by halves),
layers and experts stacked, qkv and fc1 split by the model sizes in `run.json`. It never calls the
converter or bridge.layout. GTP runs are not handled here (their dumps carry padded shards).
"""

from __future__ import annotations

import glob
import json
import os
import re

import ml_dtypes
import numpy as np
import torch

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures", "megatron")

# Megatron's local layer spec checkpoints the norms under the fused linear that follows them.
RENAMES = [(".input_layernorm.", ".self_attention.linear_qkv.layer_norm_"),
           (".pre_mlp_layernorm.", ".mlp.linear_fc1.layer_norm_")]


def bits(a: np.ndarray) -> np.ndarray:
    """The raw bytes of `a` (bitwise comparison: NaN payloads, -0.0)."""
    return np.ascontiguousarray(a).view(np.uint8)


def assert_same_checkpoint(a: str, b: str) -> None:
    """Two logical checkpoints hold the same arrays, bit for bit."""
    from bridge.store.reader import open_checkpoint

    ca, cb = open_checkpoint(a), open_checkpoint(b)
    assert set(ca.arrays()) == set(cb.arrays())
    for p in ca.arrays():
        assert np.array_equal(bits(ca.read(p)), bits(cb.read(p))), p


def _np(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.bfloat16:
        return t.contiguous().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.contiguous().numpy()


# Hybrid models (tinyhybrid.py): layers are not stacked (`decoder.layers.<i>.` keys); the Mamba
# layer's norm is checkpointed under its mixer's in_proj, its conv parameters under `conv1d.`; a
# Gated DeltaNet layer's input norm under its in_proj.
HYBRID_RENAMES = [(".norm.", ".mixer.in_proj.layer_norm_"), (".mixer.conv1d_weight", ".mixer.conv1d.weight"),
                  (".mixer.conv1d_bias", ".mixer.conv1d.bias")]
GDN_RENAMES = [(".input_layernorm.", ".self_attention.in_proj.layer_norm_")]


def checkpoint_key(name: str, moe: bool, hybrid: str = "") -> tuple[str, tuple[int, ...]]:
    """DDP param name -> (checkpoint key, stacked index). Experts: (layer, global expert).
    `hybrid`: the layer pattern of a hybrid model (M Mamba, G Gated DeltaNet, * attention, - MLP)."""
    n = re.sub(r"^(module\.)+", "", name)
    m = re.match(r"decoder\.layers\.(\d+)\.(.*)$", n)
    if not m:
        return n, ()
    if hybrid:
        rest = "." + m.group(2)
        gdn = hybrid[int(m.group(1))] == "G"
        for a, b in (GDN_RENAMES if gdn else []) + RENAMES + HYBRID_RENAMES:
            if rest.startswith(a):
                rest = b + rest[len(a):]
        return f"decoder.layers.{m.group(1)}{rest}", ()
    layer, rest = int(m.group(1)), "." + m.group(2)
    e = re.match(r"\.mlp\.experts\.local_experts\.(\d+)\.(.*)$", rest)
    if e:
        return f"decoder.layers.mlp.experts.experts.{e.group(2)}", (layer, int(e.group(1)))
    for a, b in RENAMES:
        if rest.startswith(a) and not (moe and a == ".pre_mlp_layernorm."):
            rest = b + rest[len(a):]
    if moe and rest.startswith(".pre_mlp_layernorm."):
        rest = ".mlp.linear_fc1.layer_norm_" + rest[len(".pre_mlp_layernorm."):]
    return "decoder.layers" + rest, (layer,)


def sections(key: str, full: np.ndarray, sizes: dict) -> dict[str, np.ndarray]:
    """Split fused qkv / SwiGLU fc1 per-instance tensors into logical sections."""
    if key.endswith("linear_qkv.weight") or key.endswith("linear_qkv.bias"):
        nq, ng, hd = sizes["num_attention_heads"], sizes["num_query_groups"], sizes["kv_channels"]
        per = (nq // ng + 2) * hd
        g = full.reshape((ng, per) + full.shape[1:])
        q = g[:, : nq // ng * hd].reshape((nq * hd,) + full.shape[1:])
        k = g[:, nq // ng * hd: nq // ng * hd + hd].reshape((ng * hd,) + full.shape[1:])
        v = g[:, nq // ng * hd + hd:].reshape((ng * hd,) + full.shape[1:])
        return {key + ".query": q, key + ".key": k, key + ".value": v}
    if key.endswith("linear_fc1.weight") or key.endswith("linear_fc1.bias"):
        f = full.shape[0] // 2
        return {key + ".gate": full[:f], key + ".up": full[f:]}
    if key.endswith("mixer.in_proj.weight") or key.endswith("mixer.conv1d.weight") or key.endswith("mixer.conv1d.bias"):
        d_inner = sizes["mamba_num_heads"] * sizes["mamba_head_dim"]
        gs = sizes["mamba_num_groups"] * sizes["mamba_state_dim"]
        names, rows = (("z", "x", "B", "C", "dt"), (d_inner, d_inner, gs, gs, sizes["mamba_num_heads"])) \
            if key.endswith("in_proj.weight") else (("x", "B", "C"), (d_inner, gs, gs))
        return _split(key, full, names, rows)
    if key.endswith("self_attention.in_proj.weight") or key.endswith("self_attention.conv1d.weight"):
        qk = sizes["linear_num_key_heads"] * sizes["linear_key_head_dim"]
        nv = sizes["linear_num_value_heads"]
        v = nv * sizes["linear_value_head_dim"]
        if key.endswith("in_proj.weight"):
            return _split(key, full, ("query", "key", "value", "z", "beta", "alpha"), (qk, qk, v, v, nv, nv))
        return _split(key, full, ("query", "key", "value"), (qk, qk, v))
    return {key: full}


def _split(key: str, full: np.ndarray, names: tuple[str, ...], rows: tuple[int, ...]) -> dict[str, np.ndarray]:
    assert sum(rows) == full.shape[0], (key, rows, full.shape)
    ends = np.cumsum(rows)
    return {f"{key}.{n}": full[e - r:e] for n, r, e in zip(names, rows, ends)}


def load_reference(run: str) -> tuple[dict[str, dict[str, np.ndarray]], int]:
    """role -> logical array name -> array (model bf16; params, mu, nu fp32), and the step."""
    d = os.path.join(FIXTURES, run)
    info = json.load(open(os.path.join(d, "run.json")))
    sizes = dict(info["sizes"], **info["layout"].get("extra_args", {}))
    moe = bool(info["layout"].get("moe"))
    hybrid = info["layout"].get("hybrid") or ""
    refs = [torch.load(f, weights_only=True) for f in sorted(glob.glob(os.path.join(d, "reference_rank*.pt")))]
    # (key, index) -> role -> global per-instance array
    inst: dict[tuple[str, tuple[int, ...]], dict[str, np.ndarray]] = {}
    step = None
    # DP ranks own disjoint flat ranges of the same shard: overlay them per (TP, GTP, EP rank)
    flats: dict[tuple[int, int, int], dict[str, dict[str, np.ndarray]]] = {}
    for ref in refs:
        flat = flats.setdefault((ref["tp_rank"], ref.get("gtp_rank", 0), ref["ep_rank"]), {})
        for o in ref["optimizers"]:
            for name, rec in o["params"].items():
                f0, f1 = rec["range"]["param"]
                numel = int(np.prod(ref["params"][name]["shape"]))
                fl = flat.setdefault(name, {r: np.full(numel, np.nan, np.float32) for r in ("params", "mu", "nu")})
                for role, k in (("params", "param"), ("mu", "exp_avg"), ("nu", "exp_avg_sq")):
                    fl[role][f0:f1] = _np(rec[k])
    # TP-local tensors: GTP shards concatenated in GTP-rank order, tail padding dropped
    shards: dict[tuple[str, int, int], dict[int, dict[str, np.ndarray]]] = {}
    meta: dict[tuple[str, int, int], tuple[dict, int]] = {}
    for ref in refs:
        t, e = ref["tp_rank"], ref["ep_rank"]
        g = ref.get("gtp_rank", 0)
        step = ref["step"]
        flat = flats[(t, g, e)]
        for name, p in ref["params"].items():
            live = _np(p["live"])
            locs = {"model": live}
            if name in flat:
                locs.update({r: flat[name][r].reshape(live.shape) for r in ("params", "mu", "nu")})
            gtp_sharded = bool(p["attrs"].get("is_gtp_weight_remat"))
            if not gtp_sharded and g != 0:
                continue  # GTP peers hold copies of GTP-replicated params
            shards.setdefault((name, t, e), {})[p.get("gtp_rank", 0) if gtp_sharded else 0] = locs
            meta[(name, t, e)] = (p, ref["tp_size"])
    for (name, t, e), by_g in shards.items():
        p, tps = meta[(name, t, e)]
        key, idx = checkpoint_key(name, moe, hybrid)
        if len(idx) == 2:  # local expert -> global expert
            idx = (idx[0], e * _num_local_names(shards, t, e) + idx[1])
        attrs = p["attrs"]
        split = attrs.get("tensor_model_parallel") and tps > 1
        if not split and t != 0:
            continue  # TP replicas may differ in the last bits; Megatron saves TP rank 0's copy
        logical_rows = p["gtp_remat_shard_dim0"][2] if "gtp_remat_shard_dim0" in p else None
        for role in by_g[0]:
            loc = np.concatenate([by_g[gg][role] for gg in sorted(by_g)], axis=0)
            if logical_rows is not None:
                loc = loc[:logical_rows]
            pdim = attrs.get("partition_dim", 0)
            gshape = list(loc.shape)
            if split:
                gshape[pdim] *= tps
            slot = inst.setdefault((key, idx), {})
            if role not in slot:
                slot[role] = np.zeros(gshape, dtype=loc.dtype)
            gl = slot[role]
            if not split:
                gl[...] = loc
            elif attrs.get("partition_stride", 1) == 2:  # SwiGLU fc1: [gate_t; up_t]
                h = loc.shape[0] // 2
                F = h * tps
                gl[t * h:(t + 1) * h] = loc[:h]
                gl[F + t * h:F + (t + 1) * h] = loc[h:]
            else:
                n = loc.shape[pdim]
                sl = [slice(None)] * loc.ndim
                sl[pdim] = slice(t * n, (t + 1) * n)
                gl[tuple(sl)] = loc
    out: dict[str, dict[str, np.ndarray]] = {r: {} for r in ("model", "params", "mu", "nu")}
    keys = sorted({k for k, _ in inst})
    for key in keys:
        idxs = sorted(i for k, i in inst if k == key)
        roles = inst[(key, idxs[0])].keys()
        for role in roles:
            per = [sections(key, inst[(key, i)][role], sizes) for i in idxs]
            for arr in per[0]:
                if idxs[0] == ():
                    out[role][arr] = per[0][arr]
                else:
                    shape = tuple(max(i[a] for i in idxs) + 1 for a in range(len(idxs[0])))
                    stacked = np.zeros(shape + per[0][arr].shape, dtype=per[0][arr].dtype)
                    for i, s in zip(idxs, per):
                        stacked[i] = s[arr]
                    out[role][arr] = stacked
    return out, int(step)


def _num_local(ref: dict) -> int:
    n = 0
    for name in ref["params"]:
        m = re.search(r"local_experts\.(\d+)\.", name)
        if m:
            n = max(n, int(m.group(1)) + 1)
    return n


def available_runs() -> list[str]:
    """Runs with both formats and at least one reference dump."""
    out = []
    for d in sorted(glob.glob(os.path.join(FIXTURES, "*"))):
        if os.path.isdir(os.path.join(d, "dp_reshardable")) and glob.glob(os.path.join(d, "reference_rank*.pt")):
            out.append(os.path.basename(d))
    return out


def _num_local_names(shards: dict, t: int, e: int) -> int:
    n = 0
    for name, tt, ee in shards:
        m = re.search(r"local_experts\.(\d+)\.", name)
        if m and tt == t and ee == e:
            n = max(n, int(m.group(1)) + 1)
    return n
