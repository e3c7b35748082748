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
from converters.megatron.naming import strip_wrappers
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
