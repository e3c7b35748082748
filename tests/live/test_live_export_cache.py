"""The export plan cache: repeated exports of one layout reuse the plan and still write the new values.

World 2 on gloo. One spawned group exports five times: (1) a fresh plan, (2) new tensors of the same
geometry (other values) -> plan reused, (3) the same tensors modified in place -> reused, (4) another
TP / GTP layout -> replanned, (5) the first layout again -> reused. Each checkpoint is compared
bit-exactly with the state assembled independently from the ranks' raw shards
(`tests/support/live_reference.py`), so a stale plan or stale data would show.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from live_model import FP8, MODEL, STEP, expected_state, local_params
from spawn_ranks import spawn

MODEL_B = dataclasses.replace(MODEL, seed=11)
MODEL_C = dataclasses.replace(MODEL, seed=12)
LAYOUT_1 = (1, 2, 1, 4)  # tp, gtp, dp, pad_for_alignment
LAYOUT_2 = (2, 1, 1, 4)
EXPORTS = [("a", MODEL, LAYOUT_1), ("b", MODEL_B, LAYOUT_1), ("c", MODEL_C, LAYOUT_1), ("d", MODEL, LAYOUT_2),
           ("e", MODEL, LAYOUT_1)]


def _copy_into(dst_params, src_params) -> None:
    """In-place update (what a training step does): same tensors, new values."""
    from bridge.live.api import QuantizedWeight

    for d, s in zip(dst_params, src_params):
        if isinstance(d.weight, QuantizedWeight):
            d.weight.data.copy_(s.weight.data)
            d.weight.scale_inv.copy_(s.weight.scale_inv)
        else:
            d.weight.copy_(s.weight)
        if d.optim is not None:
            for name, t in d.optim.tensors().items():
                t.copy_(s.optim.tensors()[name])


def _export_series(rank, world, root):
    from bridge.layout import ParallelLayout
    from bridge.live.api import AdamConfig, LiveRun
    from bridge.live.export import Exporter, ExportOptions

    exporter = Exporter()
    opts = ExportOptions(budget=4096, target_chunk_bytes=64)
    out = []
    kept = {}
    for tag, model, (tp, gtp, dp, a) in EXPORTS:
        run = LiveRun(ParallelLayout(tp=tp, gtp=gtp, dp=dp), rank, STEP, AdamConfig(lr=1e-3))
        if tag == "c":  # the tensors of export b, updated in place
            params = kept["b"]
            _copy_into(params, local_params(model, tp, gtp, dp, a, rank, FP8)[0])
        else:
            params, _ = local_params(model, tp, gtp, dp, a, rank, FP8)
        kept[tag] = params
        rep = exporter.export(f"{root}/{tag}", run, params, opts)
        out.append({"tag": tag, "cached": rep.plan_cached, "plan_s": rep.timings["plan"]})
    return out


@pytest.mark.slow
def test_plan_cache_reuses_plans_writes_new_values_and_replans_on_layout_change(tmp_path):
    from bridge.store.reader import open_checkpoint
    from bridge.format.tree import megatron_key_to_path

    results, _ = spawn(2, _export_series, (str(tmp_path),), tmp_path, timeout_s=240)
    for r in results:
        assert [e["cached"] for e in r] == [False, True, True, False, True], r
    roots = {"model": ("model",), "params": ("params",), "mu": ("opt_state", "0", "mu"), "nu": ("opt_state", "0", "nu")}
    for tag, model, (tp, gtp, dp, a) in EXPORTS:
        want = expected_state(model, tp, gtp, dp, a, FP8)
        ck = open_checkpoint(str(tmp_path / tag))
        for root, arrays in want.items():
            for name, arr in arrays.items():
                got = ck.read(roots[root] + megatron_key_to_path(name)).astype(np.float32)
                assert np.array_equal(got.view(np.uint32), arr.view(np.uint32)), f"export {tag}: {root}/{name}"
        assert int(ck.read(("step",))) == STEP


def test_plan_key_separates_options_and_rank_order():
    from bridge.live.plan import PlanCache, plan_key

    base = plan_key(["x", "y"], world=2, chunk=64, compression=None, inner=1024, optim=True)
    variants = [plan_key(["y", "x"], world=2, chunk=64, compression=None, inner=1024, optim=True),
                plan_key(["x", "y"], world=2, chunk=128, compression=None, inner=1024, optim=True),
                plan_key(["x", "y"], world=2, chunk=64, compression="zstd", inner=1024, optim=True),
                plan_key(["x", "y"], world=2, chunk=64, compression=None, inner=None, optim=True),
                plan_key(["x", "y"], world=2, chunk=64, compression=None, inner=1024, optim=False)]
    assert base not in variants and len(set(variants)) == len(variants)
    cache = PlanCache(size=1)
    cache.put(base, "plan")
    cache.put(variants[0], "other")
    assert cache.get(base) is None and cache.get(variants[0]) == "other"
