"""The inspection notebooks run top to bottom and compute the right numbers (checked against numpy)."""

from __future__ import annotations

import json
import os

import ml_dtypes
import numpy as np
import pytest

from bridge.inspect_demo import adamw_steps, demo_params, logical_arrays
from bridge.store.commit import save_checkpoint
from bridge.store.tree import adamw_empty_paths
from inspect_fixtures import REPO, assert_stats_match, numpy_stats, run_notebook

NOTEBOOKS = os.path.join(REPO, "notebooks")


def test_notebooks_are_committed_without_outputs():
    import nbformat

    for name in ("inspect_checkpoint.ipynb",):
        nb = nbformat.read(os.path.join(NOTEBOOKS, name), as_version=4)
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert cell.outputs == [] and cell.execution_count is None, name


@pytest.mark.slow
def test_inspect_notebook_values(tmp_path):
    state = adamw_steps(demo_params(layers=4, seed=3), steps=4, seed=3, dead_rows=10, stale_layer=1)
    arrays = logical_arrays(state)
    nu_fc2 = "opt_state/0/nu/decoder/layers/mlp/linear_fc2/weight"
    arrays[nu_fc2][2, 5, 7] = np.nan  # planted: a NaN in one second moment
    arrays["params/embedding/word_embeddings/weight"][0, 1] = np.inf
    ck = str(tmp_path / "ck")
    save_checkpoint(ck, arrays, empty_paths=adamw_empty_paths())
    out = tmp_path / "results.json"
    run_notebook(os.path.join(NOTEBOOKS, "inspect_checkpoint.ipynb"),
                 {"GTP_BRIDGE_CKPT": ck, "GTP_BRIDGE_NB_RESULTS": str(out)})
    res = json.loads(out.read_text())

    # table and statistics, independently from the arrays we wrote
    assert set(res["arrays"]) == set(arrays)
    for name, x in arrays.items():
        x = np.asarray(x)
        assert res["arrays"][name] == {"shape": list(x.shape), "dtype": str(x.dtype), "bytes": x.nbytes}
        assert_stats_match(res["stats"][name], numpy_stats(x))
    assert res["nonfinite"] == {nu_fc2: [1, 0], "params/embedding/word_embeddings/weight": [0, 1]}

    nu_emb = arrays["opt_state/0/nu/embedding/word_embeddings/weight"]
    assert res["dead_rows"] == {"opt_state/0/nu/embedding/word_embeddings/weight":
                                np.flatnonzero(np.all(nu_emb == 0, axis=1)).tolist()}
    assert len(res["dead_rows"]["opt_state/0/nu/embedding/word_embeddings/weight"]) == 10

    # histogram of log10(nu) over all nu arrays, zeros apart
    nus = np.concatenate([np.asarray(v, np.float64).ravel() for k, v in arrays.items() if k.startswith("opt_state/0/nu/")])
    h = res["nu_histogram"]
    pos = nus[np.isfinite(nus) & (nus > 0)]
    assert h["counts"] == np.histogram(np.log10(pos), bins=np.array(h["edges"]))[0].tolist()
    assert sum(h["counts"]) == pos.size and h["zeros"] == int((nus == 0).sum())

    # per-layer RMS over finite values along the stacked axis
    for name, rms in res["layer_rms"].items():
        x = np.asarray(arrays[name], np.float64)
        want = [np.sqrt(np.mean(layer[np.isfinite(layer)] ** 2)) for layer in x]
        np.testing.assert_allclose(rms, want, rtol=1e-12)
    assert nu_fc2 in res["layer_rms"] and len(res["layer_rms"]) == 12  # 4 stacked params x (master, mu, nu)

    # master vs bf16: stale elements only in the stale layer
    for name, d in res["master_vs_bf16"].items():
        p, m = arrays["params/" + name], arrays["model/" + name]
        stale = p.astype(ml_dtypes.bfloat16) != m
        want = stale.reshape(stale.shape[0], -1).sum(axis=1).tolist() if name.startswith("decoder/") else [int(stale.sum())]
        assert d["stale_per_layer"] == want, name
        fin = np.isfinite(p) & np.isfinite(m.astype(np.float64))
        assert d["max_abs"] == float(np.max(np.abs(p[fin].astype(np.float64) - m[fin].astype(np.float64))))
        if name.startswith("decoder/"):
            assert [i for i, n in enumerate(want) if n] == [1]

    # JAX restore onto the 4x2 mesh
    s = res["sharding"]
    emb = arrays["params/embedding/word_embeddings/weight"]
    assert s["array"] == "params/embedding/word_embeddings/weight" and s["devices"] == 8
    assert s["shard_shapes"] == [[emb.shape[0] // 4, emb.shape[1] // 2]]
    assert s["sum"] == float(np.asarray(emb, np.float64).sum())


@pytest.mark.slow
def test_inspect_notebook_default_demo_finds_planted_problems(tmp_path):
    out = tmp_path / "results.json"
    env = {"GTP_BRIDGE_NB_RESULTS": str(out)}
    saved = os.environ.pop("GTP_BRIDGE_CKPT", None)
    try:
        run_notebook(os.path.join(NOTEBOOKS, "inspect_checkpoint.ipynb"), env)
    finally:
        if saved is not None:
            os.environ["GTP_BRIDGE_CKPT"] = saved
    res = json.loads(out.read_text())
    # the demo's planted problems (bridge.inspect_demo: 16 dead embedding rows, stale bf16 layer 2)
    assert [len(v) for v in res["dead_rows"].values()] == [16]
    for name, d in res["master_vs_bf16"].items():
        if name.startswith("decoder/layers/mlp/"):
            assert [i for i, n in enumerate(d["stale_per_layer"]) if n] == [2], name
    assert res["nonfinite"] == {}
