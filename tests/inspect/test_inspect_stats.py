"""`gtp-bridge inspect --stats`: streamed statistics checked against numpy on the original data."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bridge.inspect.stats import ArrayStats
from inspect_fixtures import REPO, assert_stats_match, numpy_stats, run_cli, save_plain_orbax, small_state


@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 400), cut=st.integers(1, 80), seed=st.integers(0, 10_000),
       dtype=st.sampled_from([np.float32, np.float64, ml_dtypes.bfloat16, np.int32]))
def test_stats_blockwise_and_merged_equal_whole_array(n, cut, seed, dtype):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n) * 10
    x[rng.random(n) < 0.2] = 0
    if np.dtype(dtype).kind != "i":
        x[rng.random(n) < 0.05] = np.nan
        x[rng.random(n) < 0.03] = np.inf
        x[rng.random(n) < 0.03] = -np.inf
    x = x.astype(dtype)
    streamed = ArrayStats()
    parts = []
    for lo in range(0, n, cut):
        streamed.update(x[lo:lo + cut])
        p = ArrayStats()
        p.update(x[lo:lo + cut])
        parts.append(p)
    merged = ArrayStats()
    for p in reversed(parts):  # order must not matter
        merged = merged.merge(p)
    want = numpy_stats(x.astype(np.float64))
    assert_stats_match(streamed.to_json(), want)
    assert_stats_match(merged.to_json(), want)


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    state = small_state(3)
    nu = state["opt_state"]["nu"]["decoder"]["layers"]["mlp"]["linear_fc2"]["weight"]
    nu[1, 2, 3] = np.nan
    nu[2, 0, 0] = np.nan
    master = state["params"]["embedding"]["word_embeddings"]["weight"]
    master[5, 5] = np.inf
    master[6, 1] = -np.inf
    path = str(tmp_path_factory.mktemp("stats") / "ck")
    save_plain_orbax(path, state, custom_metadata={"gtp_bridge": {"format_version": 1, "source": {"tp": 2}}})
    return path, state


def _flatten(tree, prefix=()):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _flatten(v, prefix + (k,))
    else:
        yield "/".join(prefix), tree


@pytest.mark.slow
def test_stats_report_planted_nans_in_right_array(planted):
    path, state = planted
    r = run_cli("inspect", path, "--stats", "--json", "--budget", "4K")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    got = {a["name"]: a for a in rep["arrays"]}
    want = dict(_flatten(state))
    assert set(got) == set(want)
    for name, x in want.items():
        x = np.asarray(x)
        assert got[name]["shape"] == list(x.shape) and got[name]["dtype"] == str(x.dtype)
        assert got[name]["bytes"] == x.nbytes
        assert_stats_match(got[name]["stats"], numpy_stats(x))
    nans = {n: a["stats"]["nan"] for n, a in got.items() if a["stats"]["nan"]}
    assert nans == {"opt_state/nu/decoder/layers/mlp/linear_fc2/weight": 2}
    infs = {n: (a["stats"]["posinf"], a["stats"]["neginf"]) for n, a in got.items()
            if a["stats"]["posinf"] or a["stats"]["neginf"]}
    assert infs == {"params/embedding/word_embeddings/weight": (1, 1)}
    assert rep["manifest"]["format_version"] == 1 and rep["manifest"]["source"]["tp"] == 2
    # the text table shows the same NaN count on that array's row
    text = run_cli("inspect", path, "--stats").stdout
    row = next(ln for ln in text.splitlines() if ln.startswith("opt_state/nu/decoder/"))
    assert row.split()[-2:] == ["2", "0"]
    assert "\r" not in text  # no progress bar when not a tty


@pytest.mark.parametrize("fmt", [dict(use_zarr3=False, use_compression=True),   # Orbax v0 default
                                 dict(use_ocdbt=False, use_zarr3=True),
                                 dict(use_ocdbt=False, use_zarr3=False)])
@pytest.mark.slow
def test_stats_on_other_orbax_layouts(tmp_path, fmt):
    state = small_state(9, layers=2)
    state["opt_state"]["mu"]["embedding"]["word_embeddings"]["weight"][3] = np.nan
    save_plain_orbax(str(tmp_path / "ck"), state, chunk_byte_size=512, **fmt)
    rep = json.loads(run_cli("inspect", str(tmp_path / "ck"), "--stats", "--json", "--budget", "2K").stdout)
    got = {a["name"]: a for a in rep["arrays"]}
    want = dict(_flatten(state))
    assert set(got) == set(want)
    for name, x in want.items():
        assert_stats_match(got[name]["stats"], numpy_stats(np.asarray(x)))
    assert rep["format"] == {"use_ocdbt": fmt.get("use_ocdbt", True), "use_zarr3": fmt["use_zarr3"]}


@pytest.mark.slow
def test_inspect_lists_layout_without_reading_data(planted):
    path, state = planted
    rep = json.loads(run_cli("inspect", path, "--json", "--only", "params/*").stdout)
    assert [a["name"] for a in rep["arrays"]] == ["params/decoder/layers/mlp/linear_fc2/weight",
                                                  "params/embedding/word_embeddings/weight"]
    assert all("stats" not in a for a in rep["arrays"])
    a = rep["arrays"][0]
    assert a["chunk"] is not None and len(a["chunk"]) == 3 and a["read_chunk"] is not None


@pytest.mark.slow
def test_inspect_bridge_checkpoint_shows_manifest_provenance(tmp_path):
    from bridge.store.commit import save_checkpoint
    from bridge.format.manifest import Manifest, OptimizerConfig, SourceLayout

    w = np.arange(96, dtype=np.float32).reshape(8, 12)
    w[3, 4] = np.nan
    man = Manifest(source=SourceLayout(framework="megatron", tp=2, gtp=4, dp=3, optimizer_format="fully_reshardable"),
                   optimizer=OptimizerConfig(lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, step=7),
                   fused={"mlp/fc1/weight": {"format": 1, "kind": "swiglu", "sections": [["gate", 4], ["up", 4]]}})
    gate = np.ones((4, 3), np.float32)
    save_checkpoint(str(tmp_path / "ck"), {"params/w": w, "step": np.int32(7), "params/mlp/fc1/weight/gate": gate,
                                           "opt_state/0/nu/mlp/fc1/weight/gate": gate}, man)
    # independent: the manifest as stored in _METADATA
    stored = json.load(open(tmp_path / "ck" / "_METADATA"))["custom_metadata"]["gtp_bridge"]
    rep = json.loads(run_cli("inspect", str(tmp_path / "ck"), "--json", "--stats").stdout)
    assert rep["manifest"]["source"]["gtp"] == 4 and rep["manifest"]["optimizer"]["lr"] == 3e-4
    rows = {a["name"]: a for a in rep["arrays"]}
    assert rows["params/w"]["manifest"]["digest"] == stored["arrays"]["params.w"]["digest"]
    assert rows["params/w"]["stats"]["nan"] == 1 and rows["params/w"]["stats"]["max"] == 95.0
    for n in ("params/mlp/fc1/weight/gate", "opt_state/0/nu/mlp/fc1/weight/gate"):
        assert rows[n]["fused"] == {"param": "mlp/fc1/weight", "section": "gate", "kind": "swiglu"}
    assert "fused" not in rows["params/w"]
    text = run_cli("inspect", str(tmp_path / "ck")).stdout
    assert "framework=megatron tp=2 gtp=4 dp=3" in text and "optimizer_format=fully_reshardable" in text
    assert stored["arrays"]["params.w"]["digest"][-12:] in text


_MEASURE = r"""
import json, sys, numpy as np
from bridge.inspect.open import open_for_inspection
from bridge.inspect.stream import stream_diff, stream_stats
path, budget, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
arr = open_for_inspection(path).get("params/big")
other = open_for_inspection(path).get("params/big")  # a second, independent view for the diff
def status(key):
    for ln in open("/proc/self/status"):
        if ln.startswith(key):
            return int(ln.split()[1]) * 1024
with open("/proc/self/clear_refs", "w") as f:   # reset the peak-RSS high-water mark
    f.write("5")
base = status("VmRSS:")
if mode == "stats":
    s = stream_stats(arr.view, budget, arr.read_chunk)
    count, top = s.count, s.max
else:  # the array against itself through two views: both sides share the budget
    d = stream_diff(arr.view, other.view, budget=budget, chunk=arr.read_chunk)
    count, top = d.elements, (999.0 if d.differing == 0 else None)
print(json.dumps({"growth": status("VmHWM:") - base, "count": count, "max": top,
                  "read_chunk_bytes": int(np.prod(arr.read_chunk)) * 4}))
"""


def _peak_growth(path: str, budget: int, mode: str = "stats") -> dict:
    env = dict(os.environ, PYTHONPATH=REPO)
    out = subprocess.run([sys.executable, "-c", _MEASURE, path, str(budget), mode], capture_output=True, text=True,
                         env=env, cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.slow
def test_stats_memory_bounded_by_budget_not_array_size(tmp_path):
    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("needs Linux /proc peak-RSS reset")
    rows, cols = 8192, 4096  # 128 MiB fp32
    big = np.arange(rows * cols, dtype=np.float32).reshape(rows, cols) % 1000.0
    # TensorStore decodes whole read chunks, so the bound is max(budget, chunk): store 4 MiB chunks
    save_plain_orbax(str(tmp_path / "ck"), {"params": {"big": big}}, chunk_byte_size=4 << 20)
    array_bytes = big.nbytes
    del big
    budget = 16 << 20
    small = _peak_growth(str(tmp_path / "ck"), budget)
    assert small["count"] == rows * cols and small["max"] == 999.0 and small["read_chunk_bytes"] <= 4 << 20
    # the control shows the measurement sees a whole-array read
    whole = _peak_growth(str(tmp_path / "ck"), 4 * array_bytes)
    assert whole["growth"] > array_bytes * 0.9, whole
    # budget + a few read chunks that TensorStore decodes whole + allocator/thread slack; not 128 MiB
    allowance = budget + 4 * small["read_chunk_bytes"] + (16 << 20)
    assert small["growth"] < allowance, (small, allowance)
    diff = _peak_growth(str(tmp_path / "ck"), budget, mode="diff")
    assert diff["count"] == rows * cols and diff["max"] == 999.0  # compared everything, found it equal
    assert diff["growth"] < allowance + 4 * small["read_chunk_bytes"], (diff, allowance)  # two sides' chunks
