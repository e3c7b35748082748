"""Reload through the adapter's mapping: a real run's logical checkpoint into other real layouts (CPU).

Source: `gtp-bridge convert` of the `tp2` fixture's `dp_reshardable` save (an independent writer of
the logical checkpoint). Targets: every rank of the `dp2`, `gtp2_local` (padded GTP shards) and `tp1`
(wrapped keys) fixtures, as `load_megatron` builds them: the adapter's `map_params` on the recorded
metadata, zero tensors of the live shard shapes and of each DistOpt fragment. After
`bridge.live.reload.reload_state`, every element must equal the `tp2` run's logical arrays (assembled
in `test_megatron_adapter` and checked there against Megatron's own saves) at the position the
target layout puts it, and every padding element must be zero.

Hybrid runs (Mamba / Gated DeltaNet, whose fused projections Megatron saves one key per section):
`gtp-bridge convert` of the run's own save reloaded into the same run's layout through the adapter's
mapping must give back, bit for bit, every live weight and optimizer fragment of its reference dump.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from bridge.live.api import LiveRun, LocalParam, OptimFragment
from converters.megatron.plan.naming import strip_wrappers
from bridge.live.reload import reload_state
from test_megatron_adapter import Run


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    run = Run("tp2")
    dst = str(tmp_path_factory.mktemp("reload") / "tp2_logical")
    res = subprocess.run([sys.executable, "-m", "bridge.cli", "convert", str(run.dir / "dp_reshardable"), dst],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    arrays, _ = run.assemble()
    return dst, arrays, run.info["steps"]


def _targets(run: Run, rank: int):
    """LocalParams of one target rank, zero-filled, every copy (reload fills replicas too)."""
    ref = run.refs[rank]
    ranges = {strip_wrappers(n): tuple(rec["range"]["param"]) for o in ref["optimizers"] for n, rec in o["params"].items()}
    out = []
    for m in run.mapping(rank):
        shape = ref["params"][m.param]["shape"]
        w = torch.zeros(shape, dtype=torch.bfloat16)
        r = ranges.get(strip_wrappers(m.param))
        frag = None
        if r is not None:
            n = r[1] - r[0]
            frag = OptimFragment(r[0], r[1], torch.zeros(n), torch.zeros(n), torch.zeros(n))
        out.append(LocalParam(m.key, m.geometry, w, frag, index=m.index))
    return out


def _expect(flat: np.ndarray, pieces, arrays: dict[str, np.ndarray], what: str) -> None:
    covered = np.zeros(flat.size, bool)
    for pc in pieces:
        got = flat[pc.local_start:pc.local_start + pc.logical.size].reshape(pc.logical.shape)
        assert np.array_equal(got, arrays[pc.array][pc.logical.slices]), f"{what}: {pc.array} {pc.logical}"
        covered[pc.local_start:pc.local_start + pc.logical.size] = True
    assert not flat[~covered].any(), f"{what}: padding elements are not zero"


@pytest.mark.slow
@pytest.mark.parametrize("target", ["dp2", "gtp2_local", "tp1"])
def test_reload_tp2_state_into_other_real_layouts(source, target):
    src, arrays, steps = source
    run = Run(target)
    for rank in range(run.info["world"]):
        params = _targets(run, rank)
        result = reload_state(src, LiveRun(layout=run.layout, rank=rank, step=0), params)
        assert result.step == steps
        for lp in params:
            g = lp.geometry
            tp, gtp, t, gg = g.placement(run.layout, rank)
            what = f"{target} rank {rank} {lp.key}{list(lp.index)}"
            _expect(lp.weight.to(torch.float32).numpy().reshape(-1), g.shard_pieces(tp, gtp, t, gg, lp.index),
                    arrays["model"], what + " weight")
            if lp.optim is not None:
                o = lp.optim
                pieces = g.fragment_pieces(tp, gtp, t, gg, o.f0, o.f1, lp.index)
                for root, ten in o.tensors().items():
                    _expect(ten.numpy(), pieces, arrays[root], f"{what} {root}")
        if target == "gtp2_local":
            pads = [lp for lp in params if lp.geometry.gtp and lp.geometry.split(1, 2).pad]
            assert pads and rank in (0, 1)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["hybrid", "hybrid_gdn"])
def test_reload_hybrid_run_gives_back_its_live_state(name, tmp_path):
    run = Run(name)
    src = str(tmp_path / "logical")
    res = subprocess.run([sys.executable, "-m", "bridge.cli", "convert", str(run.dir / "dp_reshardable"), src],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    ref = run.refs[0]
    frags = {strip_wrappers(n): rec for o in ref["optimizers"] for n, rec in o["params"].items()}
    params = _targets(run, 0)
    assert {lp.key for lp in params} >= {"decoder.layers.0.mixer.in_proj.weight"}
    result = reload_state(src, LiveRun(layout=run.layout, rank=0, step=0), params)
    assert result.step == run.info["steps"]
    by_key = {m.key: m.param for m in run.mapping(0)}
    assert len(by_key) == len(params) == len(ref["params"])
    for lp in params:
        name_ = by_key[lp.key]
        assert torch.equal(lp.weight.view(torch.int16), ref["params"][name_]["live"].view(torch.int16)), lp.key
        rec = frags[strip_wrappers(name_)]
        assert lp.optim is not None and (lp.optim.f0, lp.optim.f1) == tuple(rec["range"]["param"]), lp.key
        for got, want in ((lp.optim.master, "param"), (lp.optim.exp_avg, "exp_avg"), (lp.optim.exp_avg_sq, "exp_avg_sq")):
            assert torch.equal(got.view(torch.int32), rec[want].view(torch.int32)), f"{lp.key} {want}"


# Megatron's section order of each fused parameter (megatron-core 0.19.2: ssm/mamba_mixer.py,
# ssm/gated_delta_net, SwiGLU's [gate; up]); qkv is interleaved per query group instead.
ORDER = {"mixer.in_proj.weight": ("z", "x", "B", "C", "dt"), "mixer.conv1d.weight": ("x", "B", "C"),
         "mixer.conv1d.bias": ("x", "B", "C"), "self_attention.in_proj.weight": ("query", "key", "value", "z", "beta",
                                                                                  "alpha"),
         "self_attention.conv1d.weight": ("query", "key", "value"), "linear_fc1.weight": ("gate", "up")}


def _tp_shard(arrays: dict[str, np.ndarray], key: str, dim: int | None, t: int, tp: int, run: Run) -> np.ndarray:
    """TP rank t's tensor of `key` from the logical arrays, by Megatron's rules written out in numpy:
    each section of a fused parameter split on its own and the halves concatenated; qkv by query group."""
    def half(a):
        if dim is None:
            return a
        n = a.shape[dim] // tp
        return np.take(a, range(t * n, (t + 1) * n), axis=dim)

    if key.endswith("linear_qkv.weight"):
        d = run.dims
        per, hd = d.num_attention_heads // d.num_query_groups, d.kv_channels
        q, k, v = (arrays[f"{key}.{s}"] for s in ("query", "key", "value"))
        groups = range(t * d.num_query_groups // tp, (t + 1) * d.num_query_groups // tp)
        return np.concatenate([x for g in groups for x in (q[g * per * hd:(g + 1) * per * hd], k[g * hd:(g + 1) * hd],
                                                           v[g * hd:(g + 1) * hd])])
    order = next((o for suffix, o in ORDER.items() if key.endswith(suffix)), None)
    if order is None:
        return half(arrays[key])
    return np.concatenate([half(arrays[f"{key}.{s}"]) for s in order])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["hybrid", "hybrid_gdn"])
def test_reload_hybrid_state_into_tp2(name, tmp_path):
    """A TP=2 target of the hybrid runs (its metadata derived from the recorded TP1 rank: each
    tensor-parallel parameter's shard halved along its partition dim, entries as recorded): every
    rank's weights and whole-shard optimizer fragments after reload equal the numpy split above of
    `gtp-bridge convert`'s logical arrays of the run's own save."""
    from bridge.layout.parallel import ParallelLayout
    from bridge.store.reader import open_checkpoint
    from converters.megatron.live.adapter import ParamRecord, entries_from_description, map_params

    run = Run(name)
    src = str(tmp_path / "logical")
    res = subprocess.run([sys.executable, "-m", "bridge.cli", "convert", str(run.dir / "dp_reshardable"), src],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    ck = open_checkpoint(src)
    logical = {r: {".".join(p[1:]): ck.read(p) for p in ck.paths() if p[0] == r} for r in ("model", "params")}
    logical["mu"] = {".".join(p[3:]): ck.read(p) for p in ck.paths() if p[:3] == ("opt_state", "0", "mu")}
    logical["nu"] = {".".join(p[3:]): ck.read(p) for p in ck.paths() if p[:3] == ("opt_state", "0", "nu")}
    rec = run.ssd["ranks"][0]
    entries = entries_from_description(rec["formats"]["dp_reshardable"]["entries"])
    lay = ParallelLayout(tp=2)
    split_seen = 0
    for t in range(2):
        params, dims_of = [], {}
        for n, p in rec["params"].items():
            shape, attrs = list(p["shape"]), p["attrs"]
            dim = int(attrs["partition_dim"]) if attrs.get("tensor_model_parallel") else None
            if dim is not None:
                shape[dim] //= 2
            params.append(ParamRecord.from_attrs(n, shape, attrs))
            dims_of[n] = dim
        targets = []
        for m in map_params(entries, params, lay, run.dims, run.pad, rank=t):
            shape = next(p.shape for p in params if p.name == m.param)
            w = torch.zeros(shape, dtype=torch.bfloat16)
            n = w.numel()
            targets.append((m, LocalParam(m.key, m.geometry, w, OptimFragment(0, n, torch.zeros(n), torch.zeros(n),
                                                                            torch.zeros(n)), index=m.index)))
        result = reload_state(src, LiveRun(layout=lay, rank=t, step=0), [lp for _m, lp in targets])
        assert result.step == run.info["steps"]
        for m, lp in targets:
            dim = dims_of[m.param]
            want = _tp_shard(logical["model"], m.key, dim, t, 2, run)
            got = lp.weight.to(torch.float32).numpy()
            assert np.array_equal(got, want.astype(np.float32)), f"rank {t} {m.key}"
            for root, ten in lp.optim.tensors().items():
                want = _tp_shard(logical[root], m.key, dim, t, 2, run).reshape(-1)
                assert np.array_equal(ten.numpy(), want), f"rank {t} {m.key} {root}"
            split_seen += bool(m.geometry.fused is not None and m.geometry.fused.info.get("name") in
                               ("mamba_in_proj", "mamba_conv1d", "gdn_in_proj", "gdn_conv1d"))
    assert split_seen >= 4
