"""`to-megatron` input checks and streaming: weights vs masters, weights derived from masters,
bounded work at any budget / worker count (same output, each array read once), layout limits."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

import convert_reference as cref
from bridge.cli import main

RUNS = cref.available_runs()
pytestmark = pytest.mark.skipif(not {"tp2", "moe_ep2"} <= set(RUNS), reason="needs the real fixtures")
QKV = ("model", "decoder", "layers", "self_attention", "linear_qkv", "weight", "query")


@pytest.fixture(scope="module")
def logical(tmp_path_factory):
    from converters.megatron.convert_entry import convert

    d = tmp_path_factory.mktemp("stream")
    out = {}
    for run in ("tp2", "moe_ep2"):
        out[run] = str(d / run)
        convert(os.path.join(cref.FIXTURES, run, "dp_reshardable"), out[run])
    return out


def _resave(src: str, dst: str, edit) -> None:
    """Re-save every array of logical checkpoint `src` (after `edit(dict)`) with its manifest, as a
    training loop's save would (bridge.store's plain whole-array save)."""
    from bridge.store.commit import save_checkpoint
    from bridge.store.reader import open_checkpoint

    ck = open_checkpoint(src)
    arrays = {p: ck.read(p) for p in ck.paths()}
    edit(arrays)
    save_checkpoint(dst, arrays, ck.manifest, empty_paths=ck.empty_paths)


def _load_all(mc: str) -> dict[str, torch.Tensor]:
    """Every tensor of a torch_dist directory through torch's own dcp.load."""
    md = dcp.FileSystemReader(mc).read_metadata()
    sd = {k: torch.zeros(tuple(m.size), dtype=m.properties.dtype) for k, m in md.state_dict_metadata.items()
          if hasattr(m, "size")}
    dcp.load(sd, checkpoint_id=mc, no_dist=True)
    return sd


@pytest.mark.slow
def test_stale_weights_are_refused_naming_the_element(logical, tmp_path, capsys):
    """Masters moved by an optimizer step, weights saved from before it: refused, without blaming Megatron."""
    def step(arrays):
        for p in list(arrays):
            if p[0] == "params" and arrays[p].ndim >= 2:
                arrays[p] = arrays[p] - np.float32(0.01) * np.sign(arrays[("opt_state", "0", "mu") + p[1:]])

    _resave(logical["tp2"], str(tmp_path / "stale"), step)
    assert main(["to-megatron", "--no-scheduler", str(tmp_path / "stale"), str(tmp_path / "out"), "--tp", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.count("model/") == 1
    assert "bf16 weights differ from bf16(params)" in err and "first at index (" in err
    assert "not updated after the optimizer step" in err and "model=None" in err
    assert "megatron-core" not in err.lower() and "defect" not in err
    assert not (tmp_path / "out").exists()
    # asked for: the weights are written as bf16(masters) instead
    assert main(["to-megatron", "--no-scheduler", str(tmp_path / "stale"), str(tmp_path / "out"), "--tp", "1",
                 "--weights-from-masters"]) == 0


def test_weights_derived_from_masters_when_the_checkpoint_has_none(logical, tmp_path, capsys):
    """No `model` arrays (the README's JAX save): weights = bf16(fp32 master), rounded to nearest even."""
    from bridge.store.reader import open_checkpoint

    def drop_model(arrays):
        for p in [p for p in arrays if p[0] == "model"]:
            del arrays[p]

    src = str(tmp_path / "nomodel")
    _resave(logical["tp2"], src, drop_model)
    assert main(["to-megatron", "--no-scheduler", src, str(tmp_path / "run"), "--tp", "2"]) == 0
    assert "derived from the fp32 masters" in capsys.readouterr().out
    got = _load_all(str(tmp_path / "run" / "iter_0000003"))
    ck = open_checkpoint(logical["tp2"])
    master = torch.from_numpy(ck.read(("params",) + QKV[1:]))
    # torch's own fp32 -> bf16 cast (round to nearest even), not ours
    want = master.to(torch.bfloat16)
    stored_bf16 = torch.from_numpy(ck.read(QKV).view(np.int16)).view(torch.bfloat16)
    assert torch.equal(want.view(torch.int16), stored_bf16.view(torch.int16))  # what Megatron's weights were
    assert got["decoder.layers.self_attention.linear_qkv.weight"].dtype == torch.bfloat16
    # converting the output back gives exactly the original logical checkpoint (weights included)
    assert main(["convert", str(tmp_path / "run"), str(tmp_path / "back"), "--workers", "1"]) == 0
    cref.assert_same_checkpoint(logical["tp2"], str(tmp_path / "back"))


@pytest.mark.parametrize("run,fmt,tp,ep,dp", [("tp2", "fully_reshardable", 2, 1, 1),
                                             ("moe_ep2", "dp_reshardable", 2, 2, 2)])
@pytest.mark.slow
def test_any_budget_and_workers_give_the_same_checkpoint_reading_each_element_once(logical, tmp_path, run, fmt,
                                                                                    tp, ep, dp):
    from bridge.store.reader import open_checkpoint
    from converters.megatron.write.torch_dist import MegatronTarget
    from converters.megatron.write.to_megatron import to_megatron

    target = MegatronTarget(tp=tp, ep=ep, dp=dp, fmt=fmt, bucket_size=3000 if fmt == "dp_reshardable" else None)
    ref = to_megatron(logical[run], str(tmp_path / "ref"), target, budget=1 << 30, workers=1)
    want = _load_all(ref["dst"])
    arrays = open_checkpoint(logical[run]).arrays()
    total = sum(int(np.prod(a.shape)) for p, a in arrays.items() if p[0] in ("model", "params", "opt_state")
                and p[-1] != "count")
    for budget, workers in [(4 << 10, 1), (16 << 10, 3), (1 << 20, 4)]:
        res = to_megatron(logical[run], str(tmp_path / f"b{budget}w{workers}"), target, budget=budget,
                          workers=workers)
        files = [n for n in os.listdir(res["dst"]) if n.endswith(".distcp")]
        assert len(files) == workers
        got = _load_all(res["dst"])
        assert set(got) == set(want)
        for k in want:
            assert torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8)), (budget, workers, k)
        if fmt == "fully_reshardable":  # every element of every array is needed exactly once
            assert res["elements_needed"] == total, (res, total)
        assert res["elements_read"] == res["elements_needed"], res


def test_plan_groups_fit_the_budget_and_read_exact_boxes(logical):
    from bridge.layout.parallel import ParallelLayout
    from bridge.store.reader import open_checkpoint
    from converters.megatron.write.torch_dist import manifest_of, params_from_manifest
    from converters.megatron.plan.write_plan import plan_groups

    ck = open_checkpoint(logical["moe_ep2"])
    params = params_from_manifest(manifest_of(ck), ck.arrays(), 16, 1)
    lay = ParallelLayout(tp=2, dp=2, ep=2)
    for limit in (2 << 10, 64 << 10, 1 << 30):
        groups = plan_groups(params, lay, "fully_reshardable", derive=False, limit=limit)
        for g in groups:
            if g.nbytes > limit:  # only one item (all roles of one chunk slab) that is a single row
                assert len({c.start for c in g.chunks}) == 1, (g.name, limit)
                assert all(int(np.prod(c.shape[:-1])) == 1 for c in g.chunks), (g.name, limit)
            need = g.needed()
            for a, box in g.reads().items():
                assert box.size == need[a], (g.name, a)   # no element read that nothing takes
        # each element of each array taken once over all groups
        taken: dict = {}
        for g in groups:
            for a, n in g.needed().items():
                taken[a] = taken.get(a, 0) + n
        for p, info in ck.arrays().items():
            if p[0] in ("model", "params") or p[:3] in (("opt_state", "0", "mu"), ("opt_state", "0", "nu")):
                assert taken.get(p) == int(np.prod(info.shape)), p


@pytest.mark.parametrize("flags,needle", [
    (["--tp", "1", "--dp", "100000000"], "--dp 100000000"),
    (["--tp", "1", "--dp", "100000000", "--format", "dp_reshardable"], "--dp 100000000"),
    (["--tp", "1000000"], "--tp 1000000"),
    (["--tp", "1", "--ep", "2"], "--ep 2"),
    (["--tp", "0"], "--tp 0"),
])
@pytest.mark.slow
def test_layout_flags_beyond_the_checkpoint_are_refused_before_any_work(logical, tmp_path, flags, needle):
    dst = tmp_path / "out"
    code = f"import sys; from bridge.cli import main; sys.exit(main({['to-megatron', '--no-scheduler', logical['tp2'], str(dst)] + flags!r}))"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    try:
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{flags}: still running after 240 s")
    err = proc.stderr.strip()
    assert proc.returncode == 2 and "\n" not in err and needle in err, err[-500:]
    assert not dst.exists() and not list(tmp_path.iterdir())
