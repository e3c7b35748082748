"""The inspection notebooks run top to bottom and compute the right numbers (checked against numpy)."""

from __future__ import annotations

import json
import os
import shutil

import ml_dtypes
import numpy as np
import pytest

from bridge.testing.demo_state import EXPLODED, adamw_steps, demo_params, logical_arrays
from bridge.store.commit import save_checkpoint
from bridge.format.schema import adamw_empty_paths
from inspect_fixtures import REPO, assert_stats_match, numpy_stats, run_notebook

NOTEBOOKS = os.path.join(REPO, "notebooks")


# PNG figures each committed notebook must show (the pictures are what the notebooks are for)
FIGURES = {"inspect_checkpoint.ipynb": 5, "megatron_to_jax.ipynb": 2}


def test_notebooks_are_committed_executed_with_their_figures():
    import nbformat

    for name, figures in FIGURES.items():
        path = os.path.join(NOTEBOOKS, name)
        nb = nbformat.read(path, as_version=4)
        code = [c for c in nb.cells if c.cell_type == "code"]
        # executed top to bottom in one kernel session, no cell skipped
        assert [c.execution_count for c in code] == list(range(1, len(code) + 1)), name
        outputs = [o for c in code for o in c.outputs]
        assert not [o for o in outputs if o.output_type == "error"], name
        assert not [o for o in outputs if o.output_type == "stream" and o.name == "stderr"
                    and ("Traceback" in o.text or "Warning" in o.text)], name
        pngs = [o for o in outputs if "image/png" in o.get("data", {})]
        assert len(pngs) == figures, (name, len(pngs))
        assert os.path.getsize(path) < 400_000, name  # low-dpi figures keep the repository small


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
    # the demo's planted problems (bridge.testing.demo_state: 16 dead embedding rows, stale bf16 layer 2,
    # an exploded nu block with one NaN in layer 3 of linear_fc2)
    assert [len(v) for v in res["dead_rows"].values()] == [16]
    for name, d in res["master_vs_bf16"].items():
        if name.startswith("decoder/layers/mlp/"):
            assert [i for i, n in enumerate(d["stale_per_layer"]) if n] == [2], name
    exploded, layer, _ = EXPLODED
    assert res["nonfinite"] == {exploded: [1, 0]}
    for name, rms in res["layer_rms"].items():
        others = [r for i, r in enumerate(rms) if i != layer]
        if name == exploded:
            assert rms[layer] > 1e6 * max(others), rms
        elif name.startswith("opt_state/0/nu/"):
            assert rms[layer] < 100 * max(others), (name, rms)


# bridge/demo_data/gtp2_local is a copy of this run's fully_reshardable save; its reference is here
FIXTURE = os.path.join(REPO, "tests", "fixtures", "megatron", "gtp2_local")


def _read_all(directory: str) -> dict[str, np.ndarray]:
    """Every array of a checkpoint by '/'-joined path, read with TensorStore (no JAX)."""
    from bridge.store.reader import open_checkpoint

    ck = open_checkpoint(directory)
    return {"/".join(p): ck.read(p) for p in ck.paths()}


def _no_decay(name: str) -> bool:
    """Independent no-weight-decay rule for the fixture (biases and norms), checked against its reference."""
    return name.endswith(".bias") or "layernorm" in name or "layer_norm" in name or "/bias" in name


@pytest.fixture(scope="module")
def m2j(tmp_path_factory):
    """Run megatron_to_jax.ipynb once as shipped (on bridge/demo_data); its results, the reference and run.json."""
    torch = pytest.importorskip("torch")
    out = tmp_path_factory.mktemp("m2j") / "results.json"
    saved = os.environ.pop("GTP_BRIDGE_MEGATRON_SRC", None)
    try:
        run_notebook(os.path.join(NOTEBOOKS, "megatron_to_jax.ipynb"), {"GTP_BRIDGE_NB_RESULTS": str(out)})
    finally:
        if saved is not None:
            os.environ["GTP_BRIDGE_MEGATRON_SRC"] = saved
    res = json.loads(out.read_text())
    assert res["src"].endswith(os.path.join("bridge", "demo_data", "gtp2_local"))
    with open(os.path.join(res["src"], ".metadata"), "rb") as a, \
            open(os.path.join(FIXTURE, "fully_reshardable", ".metadata"), "rb") as b:
        assert a.read() == b.read()  # the demo data is that fixture run, so its reference applies
    ref = torch.load(os.path.join(FIXTURE, "reference_rank0.pt"), weights_only=True)
    run = json.load(open(os.path.join(FIXTURE, "run.json")))
    groups = {n: v["group_index"] for o in ref["optimizers"] for n, v in o["params"].items()}
    assert groups and all(_no_decay(n) == (g == 1) for n, g in groups.items())
    before, after = _read_all(res["dst"]), _read_all(res["step1"])
    shutil.rmtree(os.path.dirname(res["dst"]))  # the notebook's work directory, kept for us to read
    return res, ref, run, before, after


def _adamw_reference(before: dict, name: str, t: int, opt: dict) -> tuple[tuple, tuple]:
    """optax.adamw's step emulated in float64 with the notebook's stand-in gradient: (p, mu, nu), tolerances.

    optax multiplies float32 arrays by Python floats, so the constants are float32 roundings of b1, 1 - b1
    (computed in double first), b2, 1 - b2, lr, eps, wd; bias corrections are 1 - b**t in float32.
    """
    f32 = lambda x: float(np.float32(x))  # noqa: E731
    b1_, b2_ = opt["betas"]
    lr, b1, b2, eps, wd = f32(opt["lr"]), f32(b1_), f32(b2_), f32(opt["eps"]), f32(opt["weight_decay"])
    omb1, omb2 = f32(1 - b1_), f32(1 - b2_)
    c1 = f32(np.float32(1) - np.float32(b1) ** np.float32(t))
    c2 = f32(np.float32(1) - np.float32(b2) ** np.float32(t))
    key = name[len("params/"):]
    p, mu, nu = before[name], before[f"opt_state/0/mu/{key}"], before[f"opt_state/0/nu/{key}"]
    g = ((np.arange(p.size) % 17 - 8) * 2.0 ** -13).astype(np.float32).reshape(p.shape)  # the notebook's, exact
    p64, mu64, nu64, g64 = (x.astype(np.float64) for x in (p, mu, nu, g))
    mu_new = b1 * mu64 + omb1 * g64
    nu_new = b2 * nu64 + omb2 * g64 * g64
    den = np.sqrt(nu_new / c2) + eps
    upd = (mu_new / c1) / den
    step = lr * (upd + (0.0 if _no_decay(name) else wd) * p64)
    p_new = p64 - step
    # Tolerances by propagating float32 rounding (u = 2**-24 relative per operation): each moment is a
    # sum of two rounded products, so a couple of ulps of its larger term; that error and ~6 roundings
    # in the update reach the params through lr * d(update). (A wrong count moves the update by ~8%.)
    u = 2.0 ** -24
    big = lambda *xs: np.maximum.reduce([abs(x) for x in xs])  # noqa: E731
    d_mu = 4 * u * big(b1 * mu64, omb1 * g64)
    d_nu = 4 * u * big(b2 * nu64, omb2 * g64 * g64)
    sq = np.sqrt(nu_new / c2)
    d_upd = 8 * u * abs(upd) + (d_mu / c1) / den + abs(mu_new / c1) * (d_nu / c2) / (2 * np.maximum(sq, 1e-300) * den ** 2)
    d_p = 4 * u * big(p64, p_new, lr * upd, lr * wd * p64) + lr * d_upd
    return (p_new, mu_new, nu_new), (d_p, d_mu, d_nu)


def _check_step(m2j, decayed: bool) -> int:
    res, ref, run, before, after = m2j
    t = res["count"] + 1
    checked = 0
    for name in before:
        if not name.startswith("params/") or _no_decay(name) == decayed:
            continue
        key = name[len("params/"):]
        wants, tols = _adamw_reference(before, name, t, run["optimizer"])
        for got, want, tol in zip((after[name], after[f"opt_state/0/mu/{key}"], after[f"opt_state/0/nu/{key}"]),
                                  wants, tols):
            assert got.dtype == np.float32
            bad = np.abs(got.astype(np.float64) - want) > tol
            assert not bad.any(), (name, np.argwhere(bad)[:3].tolist(), got[bad][:3], want[bad][:3])
        checked += 1
    return checked


@pytest.mark.slow
def test_megatron_to_jax_notebook_restore_roundtrip_and_step(m2j):
    res, ref, run, before, after = m2j
    assert res["step"] == res["count"] == int(ref["step"]) == run["steps"]
    assert res["roundtrip_diff_rc"] == 0 and res["step_diff_rc"] == 1
    # shards of the word embedding follow its PartitionSpec on the (data=2, model=4) mesh
    axis = {"data": 2, "model": 4, "None": 1}
    spec = [a.strip(" '") for a in res["emb_spec"][2:-1].split(",")]
    assert res["emb_shards"] == [[72 // axis[spec[0]], 24 // axis[spec[1]]]]
    # masters and moments follow AdamW from the converted state, with and without weight decay
    assert _check_step(m2j, decayed=True) >= 8
    assert _check_step(m2j, decayed=False) >= 8
    t = res["count"] + 1
    assert int(after["opt_state/0/count"]) == t and int(after["step"]) == t
    for name in before:  # the bf16 weights saved with the step are the new masters rounded to nearest even
        if name.startswith("model/"):
            want = after["params/" + name[len("model/"):]].astype(ml_dtypes.bfloat16)
            assert after[name].dtype == want.dtype and np.array_equal(after[name].view(np.uint16), want.view(np.uint16)), name
    # what the notebook plots: every master and moment within a few ulp of the FusedAdam formula, far
    # below the error of a step with the wrong count (checked here independently above)
    ulp = res["fused_adam_max_ulp"]
    names = {n[len("params/"):] for n in before if n.startswith("params/")}
    assert all(set(d) == names for d in ulp.values()) and set(ulp) == {"params", "mu", "nu"}
    worst = max(max(d.values()) for d in ulp.values())
    assert worst <= 8 and res["off_by_one_ulp"] > 1000 * max(worst, 1.0), (worst, res["off_by_one_ulp"])
