"""Adapter mapping + live exporter on real Megatron-Core state, on spawned gloo ranks (CPU).

Each rank of a recorded fixture run (`tests/fixtures/megatron/<run>`) is replayed: its live bf16
shards and distributed-optimizer fragments (the reference dump) become `LocalParam`s through the
adapter's mapping (`map_params` on the recorded sharded-state-dict metadata, TP / GTP replica copies
left out as `export_megatron` does), and `bridge.live.export.export_state` writes the logical
checkpoint over a real gloo group of the run's world size. The result must equal, bit for bit,
(a) the logical arrays assembled in `test_megatron_adapter` (themselves checked against
Megatron's own saves) and (b) what `gtp-bridge convert` makes of the same run's `dp_reshardable` save.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from bridge.live.holdings import tree_name
from bridge.store.reader import open_checkpoint
from spawn_ranks import spawn
from test_megatron_adapter import Run

pytestmark = pytest.mark.slow


def replay_local_params(run: Run, rank: int):
    """This rank's `LocalParam`s + `LiveRun` from the recorded reference, via the adapter's mapping."""
    from bridge.live.api import LiveRun, LocalParam, OptimFragment
    from converters.megatron.live.adapter import adam_config_from_groups, common_step
    from converters.megatron.plan.naming import strip_wrappers

    ref = run.refs[rank]
    frags, groups, keys, steps = {}, [], [], []
    maps = run.mapping(rank)
    key_of = {strip_wrappers(m.param): m.key for m in maps}
    for o in ref["optimizers"]:
        per = [[] for _ in o["param_groups"]]
        for n, rec in o["params"].items():
            f0, f1 = rec["range"]["param"]
            frags[strip_wrappers(n)] = OptimFragment(f0, f1, rec["param"], rec["exp_avg"], rec["exp_avg_sq"])
            per[rec["group_index"]].append(key_of[strip_wrappers(n)])
            if "step" in rec:
                steps.append(float(rec["step"]))
        groups += o["param_groups"]
        keys += per
        steps += [g["step"] for g in o["param_groups"] if "step" in g]
    params = [LocalParam(m.key, m.geometry, ref["params"][m.param]["live"], frags.get(strip_wrappers(m.param)),
                         index=m.index) for m in maps if m.model_parallel_main]
    lrun = LiveRun(layout=run.layout, rank=rank, step=common_step(steps), optimizer=adam_config_from_groups(groups, keys))
    return params, lrun


def _export_worker(rank, world, name, dst):
    from bridge.live.export import export_state

    run = Run(name)
    params, lrun = replay_local_params(run, rank)
    rep = export_state(dst, lrun, params)
    return {"bytes_written": rep.bytes_written}


def _read_all(path: str) -> dict[str, np.ndarray]:
    ck = open_checkpoint(path)
    return {".".join(p): ck.read(p) for p in ck.paths()}


@pytest.mark.parametrize("name", ["tp2", "moe_ep2", "gtp2_local", "hybrid", "hybrid_gdn"])
def test_replayed_export_equals_reference_and_converter(name, tmp_path):
    run = Run(name)
    dst = str(tmp_path / "live")
    spawn(run.info["world"], _export_worker, (name, dst), tmp_path, timeout_s=300)
    got = _read_all(dst)

    arrays, _ = run.assemble()
    want = {}
    for root, arrs in arrays.items():
        for a, v in arrs.items():
            want[tree_name(root, a)] = v
    for n, v in want.items():
        g = got[n]
        assert g.shape == v.shape, n
        assert np.array_equal(g.astype(np.float32), v), n
    assert int(got["step"]) == run.info["steps"] and int(got["opt_state.0.count"]) == run.info["steps"]

    conv = str(tmp_path / "converted")
    res = subprocess.run([sys.executable, "-m", "bridge.cli", "convert", str(run.dir / "dp_reshardable"), conv],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    other = _read_all(conv)
    assert set(other) == set(got)
    for n, v in other.items():
        assert v.dtype == got[n].dtype and v.tobytes() == got[n].tobytes(), n
    # Both record the run's no-decay set the same way: logical array paths (fused sections split).
    live_opt, conv_opt = open_checkpoint(dst).manifest.optimizer, open_checkpoint(conv).manifest.optimizer
    assert live_opt.no_decay and sorted(live_opt.no_decay) == sorted(conv_opt.no_decay)
    assert all(("params", *p.split("/")) in set(map(tuple, open_checkpoint(dst).paths())) for p in live_opt.no_decay)
    assert live_opt.clip_grad is None  # the replayed LiveRun records none (the converter: the saved args')
    # Fused parameters (qkv, SwiGLU, Mamba / GDN per-section keys) carry the same section tables.
    live_fused, conv_fused = open_checkpoint(dst).manifest.fused, open_checkpoint(conv).manifest.fused
    assert live_fused and live_fused == conv_fused
