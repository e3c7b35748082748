"""Live export / reload on spawned gloo process groups, against the independent sharding reference.

One spawned group per scenario does several checks (export, then reloads at other layouts), and
the parent restores the checkpoint with plain Orbax. Per-rank state is built from random logical
arrays by `live_reference` (tests/support; index arrays from the doc's formulas, no `bridge.layout`).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from live_model import FP8, MODEL, SPECIAL, STEP, expected_state, local_params
from live_reference import coords, physical_index, rank_raw_state, shard
from spawn_ranks import spawn

def _export_then_reload(rank, world, dst, src_layout, targets, fp8):
    """Export at src_layout, then reload at each target layout (same ranks) and compare."""
    import torch

    from bridge.layout import ParallelLayout
    from bridge.live.api import AdamConfig, LiveRun, QuantizedWeight
    from bridge.live.export import export_state
    from bridge.live.reload import reload_state

    tp, gtp, dp, a = src_layout
    params, _ = local_params(MODEL, tp, gtp, dp, a, rank, fp8)
    run = LiveRun(ParallelLayout(tp=tp, gtp=gtp, dp=dp), rank, STEP, AdamConfig(lr=1e-3, betas=(0.9, 0.95)))
    rep = export_state(dst, run, params, budget=4096, target_chunk_bytes=64)
    want = expected_state(MODEL, tp, gtp, dp, a, fp8)
    checked = 0
    for target in targets:
        tp2, gtp2, dp2, a2 = target[:4]
        fp8_target = target[4] if len(target) > 4 else None  # FP8 reload targets: re-quantized on reload
        tgt, raws = local_params(MODEL, tp2, gtp2, dp2, a2, rank, fp8=fp8_target, zeros=True)
        res = reload_state(dst, LiveRun(ParallelLayout(tp=tp2, gtp=gtp2, dp=dp2), rank, 0), tgt)
        assert res.step == STEP
        for lp, rp in zip(tgt, raws):
            p = next(q for q in MODEL.params if q.key == rp.key)
            from live_reference import flat_logical

            ix = physical_index(p, tp2, gtp2, a2, *coords(rank, tp2, gtp2)[:2])
            w = shard(flat_logical(want["model"], p, rp.index), ix, 0.0)
            if isinstance(lp.weight, QuantizedWeight):
                got = lp.weight.dequantize().float().numpy()
                tol = 2 ** -4 * np.abs(w) + 2 ** -9 * np.abs(w).max()  # e4m3: 3 mantissa bits, subnormals
                assert np.all(np.abs(got - w) <= tol), f"{rp.key}{rp.index} FP8 weight at {target}"
                assert np.all(got[ix < 0] == 0), "FP8 padding rows must reload as zeros"
            else:
                got = lp.weight.float().numpy()
                assert np.array_equal(got.view(np.uint32), w.view(np.uint32)), f"{rp.key}{rp.index} weight at {target}"
            f0, f1 = rp.frag
            if lp.optim is None:
                assert f0 == f1
                continue
            for root, t in (("params", lp.optim.master), ("mu", lp.optim.exp_avg), ("nu", lp.optim.exp_avg_sq)):
                ref = shard(flat_logical(want[root], p, rp.index), ix, 0.0).reshape(-1)[f0:f1]
                assert np.array_equal(t.numpy().view(np.uint32), ref.view(np.uint32)), f"{rp.key} {root} at {(tp2, gtp2)}"
            checked += 1
    del torch
    return {"checked": checked, "bytes_written": rep.bytes_written, "bytes_sent": rep.bytes_sent}


def _orbax_restore(path, want, with_model=True):
    import orbax.checkpoint as ocp

    from bridge.testing.scenario import abstract_tree

    abstract = abstract_tree({"master": want["params"], "weight": want.get("model")}, with_model=with_model)
    return ocp.StandardCheckpointer().restore(path, abstract)


def _leaf(tree, name):
    from bridge.format.tree import megatron_key_to_path

    for c in megatron_key_to_path(name):
        tree = tree[c]
    return np.asarray(tree)


@pytest.mark.slow
def test_export_world4_fp8_reload_other_layouts_and_orbax(tmp_path):
    """TP1xGTP2xDP2 (padding, FP8, DP cuts rows) -> export; reload at TP2xGTP1xDP2, TP1xGTP4xDP1, TP4xGTP1xDP1
    and TP2xGTP2xDP1 with FP8 targets (re-quantized);
    plain Orbax restore equals the state assembled independently from the ranks' raw shards."""
    src = (1, 2, 2, 4)
    dst = str(tmp_path / "ckpt")
    targets = [(2, 1, 2, 4), (1, 4, 1, 8), (4, 1, 1, 0), (2, 2, 1, 4, FP8)]
    # the scenario must contain a DP boundary inside a row of some GTP-sharded shard
    cut = False
    for r in range(4):
        raws, _ = rank_raw_state(MODEL, *src[:3], src[3], r, FP8)
        for rp in raws:
            cols = int(np.prod(rp.pindex.shape[1:])) if rp.pindex.ndim > 1 else 1
            cut |= rp.pindex.ndim > 1 and any(x % cols and 0 < x < rp.pindex.size for x in rp.frag)
    assert cut, "test scenario lost its DP boundary inside a row"
    results, _ = spawn(4, _export_then_reload, (dst, src, targets, FP8), tmp_path)
    assert all(r["checked"] > 0 for r in results)
    assert sum(r["bytes_sent"] for r in results) > 0  # pieces did move to chunk owners
    want = expected_state(MODEL, *src[:3], src[3], FP8)
    got = _orbax_restore(dst, want)
    for root in ("params", "model"):
        for name, arr in want[root].items():
            g = _leaf(got[root], name).astype(np.float32)
            assert np.array_equal(g.view(np.uint32), arr.view(np.uint32)), f"{root}/{name}"
    for root, key in (("mu", "mu"), ("nu", "nu")):
        for name, arr in want[root].items():
            g = _leaf(getattr(got["opt_state"][0], key), name)
            assert np.array_equal(g.view(np.uint32), arr.view(np.uint32)), f"{root}/{name}"
    assert int(got["opt_state"][0].count) == STEP and int(got["step"]) == STEP
    # FP8 entries are the dequantized values, which differ from the bf16 logical input
    logical = MODEL.logical()
    assert not np.array_equal(want["model"]["embedding.word_embeddings.weight"],
                              logical["model"]["embedding.word_embeddings.weight"].astype(np.float32))
    assert not os.path.exists(dst + ".orbax-checkpoint-tmp")
    # NaN, +-Inf, -0.0 and a subnormal went through bit-exactly (planted by RefModel.logical)
    mu = _leaf(got["opt_state"][0].mu, SPECIAL)
    assert np.isnan(mu.reshape(-1)[0]) and np.signbit(mu.reshape(-1)[3]) and mu.reshape(-1)[3] == 0


def _export_and_die(rank, world, dst, victim, stage):
    """Export at TP1 x GTP2 x DP(world/2); rank `victim` is killed (SIGKILL) at `stage`."""
    from bridge.layout import ParallelLayout
    from bridge.live.api import AdamConfig, LiveRun
    from bridge.live.export import export_state

    def hook(name):
        if rank == victim and name == stage:
            import signal

            os.kill(os.getpid(), signal.SIGKILL)

    dp = world // 2
    params, _ = local_params(MODEL, 1, 2, dp, 4, rank, None)
    run = LiveRun(ParallelLayout(tp=1, gtp=2, dp=dp), rank, STEP, AdamConfig(lr=1e-3))
    export_state(dst, run, params, target_chunk_bytes=64, timeout=20, on_stage=hook)
    return {"exported": True}


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["exchanged", "written"])
def test_killed_rank_leaves_no_checkpoint_and_others_fail(tmp_path, stage):
    """A rank killed mid-export: no loadable checkpoint, every other rank fails with an error (no hang)."""
    from bridge.errors import BridgeError
    from bridge.store.reader import open_checkpoint

    dst = str(tmp_path / "ckpt")
    results, errors = spawn(4, _export_and_die, (dst, 2, stage), tmp_path, timeout_s=150, pg_timeout_s=20,
                            allow_fail=True)
    assert set(errors) == {0, 1, 2, 3}, errors
    assert errors[2] == "exit code -9"
    for r in (0, 1, 3):
        last = errors[r].strip().splitlines()[-1]
        assert last.startswith("bridge.errors.BridgeError: rank") and "nothing was committed" in last, errors[r]
    assert not os.path.exists(dst)
    with pytest.raises(BridgeError):
        open_checkpoint(dst)
    tmp = dst + ".orbax-checkpoint-tmp"
    if os.path.exists(tmp):
        with pytest.raises(BridgeError):
            open_checkpoint(tmp)


def _export_bad_input(rank, world, dst):
    """Rank 1 passes a weight of the wrong shape: every rank must raise the same BridgeError."""
    import torch

    from bridge.errors import BridgeError
    from bridge.layout import ParallelLayout
    from bridge.live.api import AdamConfig, LiveRun
    from bridge.live.export import export_state

    params, _ = local_params(MODEL, 1, 2, 1, 4, rank, None)
    if rank == 1:
        params[0].weight = torch.zeros(3, 3, dtype=torch.bfloat16)
    run = LiveRun(ParallelLayout(tp=1, gtp=2, dp=1), rank, STEP, AdamConfig(lr=1e-3))
    try:
        export_state(dst, run, params)
    except BridgeError as e:
        return {"error": str(e)}
    return {"error": None}


@pytest.mark.slow
def test_bad_input_on_one_rank_fails_everywhere_and_writes_nothing(tmp_path):
    dst = str(tmp_path / "ckpt")
    results, _ = spawn(2, _export_bad_input, (dst,), tmp_path, timeout_s=120)
    msgs = [r["error"] for r in results]
    assert all(msgs), msgs
    assert "rank 1" in msgs[0] and "decoder.layers.mlp.linear_fc1.weight" in msgs[0] and "\n" not in msgs[0]
    assert "shape" in msgs[1]
    assert not os.path.exists(dst) and not os.path.exists(dst + ".orbax-checkpoint-tmp")
