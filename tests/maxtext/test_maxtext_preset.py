"""The maxtext preset (issue #22) on the CPU, without MaxText installed.

- the pure mapping (`bridge.jaxside.presets.maxtext`) against an independent element-by-element
  numpy computation of every table row (scanned and unscanned), the RoPE permutation and the
  llama2 query-scale fold on masters and moments;
- logical -> MaxText -> logical bit-exact where no value transform applies (in memory, and through
  MaxText's on-disk layout with Orbax);
- the tree we write equals, key for key and in key types, the tree of a checkpoint real MaxText 0.2.5
  saved (`tests/fixtures/maxtext/fresh_maxtext/`, made by `tests/support/maxtext_client.py fresh`), except the
  NNX rng state MaxText re-initialises;
- that MaxText checkpoint (one we did not write) read back into a logical checkpoint, its values
  checked against the stored arrays read with plain TensorStore and independent index formulas,
  and converted on by `to-megatron`;
- MaxText's adamw mask semantics (re.search on the '/'-joined path) exclude exactly Megatron's no-decay set;
- refusals: non-llama models (biases), LayerNorm / zero-centred gamma / learned positions.
"""

from __future__ import annotations

import json
import os
import re
import subprocess

import numpy as np
import pytest

from bridge.errors import BridgeError
from bridge.jaxside.presets import maxtext as mx

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/
FIX = os.path.join(HERE, "fixtures", "maxtext")
LLAMA = os.path.join(FIX, "llama")
FRESH = os.path.join(FIX, "fresh_maxtext")

DIMS = mx.Dims(layers=3, hidden=10, ffn=7, heads=4, kv_heads=2, head_dim=6, vocab=11)
ATT = ("decoder", "layers", "self_attention", "linear_qkv")


def logical_tree(dims: mx.Dims, seed: int = 0) -> dict[tuple[str, ...], np.ndarray]:
    """Random logical leaves of a llama-style model (distinct sizes so a wrong axis cannot pass)."""
    rng = np.random.default_rng(seed)
    L, E, F, H, K, D, V = dims.layers, dims.hidden, dims.ffn, dims.heads, dims.kv_heads, dims.head_dim, dims.vocab
    shapes = {
        ("embedding", "word_embeddings", "weight"): (V, E),
        ("decoder", "final_layernorm", "weight"): (E,),
        ATT + ("layer_norm_weight",): (L, E),
        ("decoder", "layers", "mlp", "linear_fc1", "layer_norm_weight"): (L, E),
        ATT + ("weight", "query"): (L, H * D, E),
        ATT + ("weight", "key"): (L, K * D, E),
        ATT + ("weight", "value"): (L, K * D, E),
        ("decoder", "layers", "self_attention", "linear_proj", "weight"): (L, E, H * D),
        ("decoder", "layers", "mlp", "linear_fc1", "weight", "gate"): (L, F, E),
        ("decoder", "layers", "mlp", "linear_fc1", "weight", "up"): (L, F, E),
        ("decoder", "layers", "mlp", "linear_fc2", "weight"): (L, E, F),
    }
    if not dims.tied:
        shapes[("output_layer", "weight")] = (V, E)
    return {p: rng.standard_normal(s).astype(np.float32) for p, s in shapes.items()}


def expected_maxtext(t: dict, dims: mx.Dims, interleaved: bool = False) -> dict[str, np.ndarray]:
    """MaxText leaves computed element by element from the logical ones (scanned layout), by the
    definitions: kernel[in, ..., out] = W[out, in]; layer axis at position 1; head h, dim d of
    Megatron's row h*D + d; interleaved RoPE pair (2i, 2i+1) -> MaxText (i, i + D/2)."""
    L, E, F, H, K, D, V = dims.layers, dims.hidden, dims.ffn, dims.heads, dims.kv_heads, dims.head_dim, dims.vocab
    src_d = [2 * j if j < D // 2 else 2 * (j - D // 2) + 1 for j in range(D)] if interleaved else list(range(D))
    q, k, v = (t[ATT + ("weight", n)] for n in ("query", "key", "value"))
    proj = t[("decoder", "layers", "self_attention", "linear_proj", "weight")]
    out = {
        "token_embedder/embedding": t[("embedding", "word_embeddings", "weight")].copy(),
        "decoder/decoder_norm/scale": t[("decoder", "final_layernorm", "weight")].copy(),
        "decoder/layers/pre_self_attention_layer_norm/scale": np.empty((E, L), np.float32),
        "decoder/layers/post_self_attention_layer_norm/scale": np.empty((E, L), np.float32),
        "decoder/layers/self_attention/query/kernel": np.empty((E, L, H, D), np.float32),
        "decoder/layers/self_attention/key/kernel": np.empty((E, L, K, D), np.float32),
        "decoder/layers/self_attention/value/kernel": np.empty((E, L, K, D), np.float32),
        "decoder/layers/self_attention/out/kernel": np.empty((H, L, D, E), np.float32),
        "decoder/layers/mlp/wi_0/kernel": np.empty((E, L, F), np.float32),
        "decoder/layers/mlp/wi_1/kernel": np.empty((E, L, F), np.float32),
        "decoder/layers/mlp/wo/kernel": np.empty((F, L, E), np.float32),
    }
    if not dims.tied:
        out["decoder/logits_dense/kernel"] = np.empty((E, V), np.float32)
        for e in range(E):
            for w in range(V):
                out["decoder/logits_dense/kernel"][e, w] = t[("output_layer", "weight")][w, e]
    fc1 = ("decoder", "layers", "mlp", "linear_fc1")
    for l in range(L):
        for e in range(E):
            out["decoder/layers/pre_self_attention_layer_norm/scale"][e, l] = t[ATT + ("layer_norm_weight",)][l, e]
            out["decoder/layers/post_self_attention_layer_norm/scale"][e, l] = t[fc1 + ("layer_norm_weight",)][l, e]
            for h in range(H):
                for d in range(D):
                    out["decoder/layers/self_attention/query/kernel"][e, l, h, d] = q[l, h * D + src_d[d], e]
                    out["decoder/layers/self_attention/out/kernel"][h, l, d, e] = proj[l, e, h * D + d]
            for g in range(K):
                for d in range(D):
                    out["decoder/layers/self_attention/key/kernel"][e, l, g, d] = k[l, g * D + src_d[d], e]
                    out["decoder/layers/self_attention/value/kernel"][e, l, g, d] = v[l, g * D + d, e]
            for f in range(F):
                out["decoder/layers/mlp/wi_0/kernel"][e, l, f] = t[fc1 + ("weight", "gate")][l, f, e]
                out["decoder/layers/mlp/wi_1/kernel"][e, l, f] = t[fc1 + ("weight", "up")][l, f, e]
                out["decoder/layers/mlp/wo/kernel"][f, l, e] = t[("decoder", "layers", "mlp", "linear_fc2", "weight")][l, e, f]
    return out


def as_str(tree: dict) -> dict[str, np.ndarray]:
    return {"/".join(p): a for p, a in tree.items()}


def test_doctests():
    import doctest

    res = doctest.testmod(mx)
    assert res.attempted >= 10 and res.failed == 0, res


def test_schedule_note_says_when_maxtexts_constant_lr_departs_from_megatrons_schedule():
    """Worked examples in `schedule_note`'s docstring: warmup, cosine decay, and a constant run (no note)."""
    import doctest

    from bridge.jaxside.presets import maxtext_schedule

    out = doctest.testmod(maxtext_schedule)
    assert out.attempted >= 5 and out.failed == 0, out


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("interleaved", [False, True])
def test_mapping_matches_independent_index_formulas(tied, interleaved):
    dims = mx.Dims(**{**DIMS.__dict__, "tied": tied})
    t = logical_tree(dims)
    want = expected_maxtext(t, dims, interleaved)
    for kind in ("params", "mu", "nu"):
        got = as_str(mx.to_maxtext(t, kind, dims, mx.Options(rotary_interleaved=interleaved)))
        assert sorted(got) == sorted(want)
        for k in want:
            assert got[k].dtype == np.float32 and np.array_equal(got[k], want[k]), (kind, k)


def test_unscanned_is_the_scanned_layer_slices():
    t = logical_tree(DIMS, seed=1)
    scanned = as_str(mx.to_maxtext(t, "params", DIMS, mx.Options()))
    flat = as_str(mx.to_maxtext(t, "params", DIMS, mx.Options(scan_layers=False)))
    n = 0
    for k, a in scanned.items():
        if "/layers/" not in k:
            assert np.array_equal(flat[k], a)
            n += 1
            continue
        for i in range(DIMS.layers):
            assert np.array_equal(flat[k.replace("/layers/", f"/layers_{i}/")], np.take(a, i, axis=1)), k
            n += 1
    assert n == len(flat)


@pytest.mark.parametrize("opts", [mx.Options(), mx.Options(scan_layers=False), mx.Options(rotary_interleaved=True),
                                  mx.Options(decoder_block="llama2")])
def test_round_trip(opts):
    t = logical_tree(mx.Dims(**{**DIMS.__dict__, "tied": True}), seed=2)
    dims = mx.Dims(**{**DIMS.__dict__, "tied": True})
    for kind in ("params", "mu", "nu"):
        back = mx.from_maxtext(mx.to_maxtext(t, kind, dims, opts), kind, dims, opts)
        assert sorted(back) == sorted(t)
        for p in t:
            if opts.fold_query_scale and p[-1] == "query":
                np.testing.assert_allclose(back[p], t[p], rtol=2e-7)  # x * c / c: rounding only
            else:
                assert np.array_equal(back[p], t[p]), (kind, p)   # exact: reshape / transpose / permutation


def test_llama2_fold_scales_masters_grads_and_moments_consistently():
    t = logical_tree(DIMS, seed=3)
    c = np.float32(1 / np.sqrt(DIMS.head_dim))
    kinds = ("params", "grad", "mu", "nu")
    plain = {k: as_str(mx.to_maxtext(t, k, DIMS, mx.Options())) for k in kinds}
    fold = {k: as_str(mx.to_maxtext(t, k, DIMS, mx.Options(decoder_block="llama2"))) for k in kinds}
    q = "decoder/layers/self_attention/query/kernel"
    # W' = c W: dL/dW' = dL/dW / c, so the gradient and mu scale by 1/c and nu by 1/c^2
    assert np.array_equal(fold["params"][q], plain["params"][q] * c)
    assert np.array_equal(fold["grad"][q], plain["grad"][q] * (1 / c))
    assert np.array_equal(fold["mu"][q], plain["mu"][q] * (1 / c))
    assert np.array_equal(fold["nu"][q], plain["nu"][q] * (1 / (c * c)))
    for k in plain["params"]:
        if k != q:
            assert np.array_equal(fold["params"][k], plain["params"][k]), k


def test_adamw_mask_matches_megatrons_no_decay_set():
    """MaxText's get_adamw_mask: keystr(path, simple=True, separator='/') searched by each regex;
    a match means no decay. Both MaxText trees (Linen `params/...`, NNX module paths) must agree."""
    t = logical_tree(DIMS)
    nd = [("decoder", "final_layernorm", "weight"), ATT + ("layer_norm_weight",),
          ("decoder", "layers", "mlp", "linear_fc1", "layer_norm_weight")]
    for opts in (mx.Options(), mx.Options(scan_layers=False)):
        pats = mx.adamw_mask_patterns(nd, DIMS, opts)
        tree = mx.to_maxtext(t, "params", DIMS, opts)
        for path in tree:
            norm = path[-1] == "scale"
            for prefix in ((), ("params",)):
                s = "/".join(prefix + path)
                assert any(re.search(p, s) for p in pats) == norm, s


def test_refuses_non_llama_models(tmp_path):
    t = logical_tree(DIMS)
    t[ATT + ("bias", "query")] = np.zeros((DIMS.layers, DIMS.heads * DIMS.head_dim), np.float32)
    with pytest.raises(BridgeError, match="bias.*no MaxText counterpart"):
        mx.to_maxtext(t, "params", DIMS, mx.Options())
    with pytest.raises(BridgeError, match="decoder_block"):
        mx.Options(decoder_block="gemma")
    from bridge.jaxside.presets.maxtext_ckpt import _check_megatron_args

    for args, msg in (({"normalization": "LayerNorm"}, "RMSNorm"), ({"apply_layernorm_1p": True}, "zero-centred"),
                      ({"position_embedding_type": "learned_absolute"}, "RoPE"),
                      ({"num_experts": 8, "moe_shared_expert_intermediate_size": 64}, "shared experts")):
        with pytest.raises(BridgeError, match=msg):
            _check_megatron_args(args)


# --------------------------------------------------------------------------- through Orbax (no MaxText)


def read_all(path: str) -> dict:
    from bridge.store.reader import open_checkpoint

    ck = open_checkpoint(path)
    return {p: ck.read(p) for p in ck.paths()}


def test_write_read_round_trip_bit_exact(tmp_path):
    from bridge.jaxside.presets.maxtext_stream import read_maxtext, write_maxtext

    w = write_maxtext(os.path.join(LLAMA, "live"), str(tmp_path / "mt"))
    assert os.path.basename(w.step_dir) == "2"       # MaxText's name for the state after 3 steps
    res = read_maxtext(str(tmp_path / "mt"), str(tmp_path / "back"))
    assert res["sidecar"] and res["trained_steps"] == 3
    src, back = read_all(os.path.join(LLAMA, "live")), read_all(str(tmp_path / "back"))
    src = {p: a for p, a in src.items() if p[0] != "model"}
    assert sorted(src) == sorted(back)
    for p in src:
        assert back[p].dtype == src[p].dtype and np.array_equal(back[p], src[p]), p


def _tree_keys(items: str) -> dict[str, list]:
    meta = json.load(open(os.path.join(items, "_METADATA")))["tree_metadata"]
    return {k: [(m["key"], m["key_type"]) for m in v["key_metadata"]] + [v["value_metadata"]["value_type"]]
            for k, v in meta.items() if not k.startswith("('nnx_aux'")}


def test_written_tree_is_the_tree_maxtext_saves(tmp_path):
    """Key for key (names, key types, value types) what MaxText 0.2.5 itself saved for this model."""
    from bridge.jaxside.presets.maxtext_ckpt import find_items
    from bridge.jaxside.presets.maxtext_stream import write_maxtext

    w = write_maxtext(os.path.join(LLAMA, "live"), str(tmp_path / "mt"))
    ours, theirs = _tree_keys(os.path.join(w.step_dir, "items")), _tree_keys(find_items(FRESH))
    assert sorted(ours) == sorted(theirs)
    assert ours == theirs
    side = json.load(open(os.path.join(FRESH, "overrides.json")))
    assert side == json.loads(json.dumps(w.overrides))   # the fixture was made with these very settings
    ck = json.load(open(os.path.join(w.step_dir, "_CHECKPOINT_METADATA")))
    theirs_ck = json.load(open(os.path.join(os.path.dirname(find_items(FRESH)), "_CHECKPOINT_METADATA")))
    assert ck["item_handlers"] == theirs_ck["item_handlers"] and ck["custom_metadata"] == theirs_ck["custom_metadata"]


def _plain_read(items: str) -> dict[str, np.ndarray]:
    """A MaxText checkpoint's arrays read with TensorStore directly (zarr3 in OCDBT), not our reader."""
    import tensorstore as ts

    meta = json.load(open(os.path.join(items, "_METADATA")))["tree_metadata"]
    out = {}
    for v in meta.values():
        if v["value_metadata"]["value_type"] != "jax.Array":
            continue
        name = ".".join(m["key"] for m in v["key_metadata"])
        spec = {"driver": "zarr3", "kvstore": {"driver": "ocdbt", "base": f"file://{items}/", "path": name + "/"}}
        out["/".join(m["key"] for m in v["key_metadata"])] = ts.open(spec, open=True).result().read().result()
    return out


@pytest.mark.slow
def test_foreign_maxtext_checkpoint_reads_and_converts_to_megatron(tmp_path):
    """A checkpoint MaxText saved on its own (fresh CPU run) -> logical (values checked independently) ->
    to-megatron -> the converter reads it back equal."""
    pytest.importorskip("torch")
    from bridge.jaxside.presets.maxtext_ckpt import find_items
    from bridge.jaxside.presets.maxtext_stream import read_maxtext
    from converters.megatron.convert_entry import convert
    from converters.megatron.write.torch_dist import MegatronTarget
    from converters.megatron.write.to_megatron import to_megatron

    hyper = mx.Hyper(lr=0.01, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, clip_grad=1.0)
    res = read_maxtext(FRESH, str(tmp_path / "logical"), hyper=hyper)
    assert not res["sidecar"] and res["trained_steps"] == 2 and res["adam_count"] == 2
    raw = _plain_read(find_items(FRESH))
    back = read_all(str(tmp_path / "logical"))
    E, L, H, D, K, F, V = 24, 2, 4, 6, 2, 40, 72
    pp = "params/params/decoder/layers/"
    for kind, pre in (("params", ("params",)), ("mu", ("opt_state", "0", "mu")), ("nu", ("opt_state", "0", "nu"))):
        src = "params/params/" if kind == "params" else f"opt_state/0/{kind}/params/"
        lp = pp.replace("params/params/", src)
        q = raw[lp + "self_attention/query/kernel"]
        want_q = np.empty((L, H * D, E), np.float32)
        for l in range(L):
            for h in range(H):
                for d in range(D):
                    want_q[l, h * D + d, :] = q[:, l, h, d]
        assert np.array_equal(back[pre + ATT + ("weight", "query")], want_q), kind
        o = raw[lp + "self_attention/out/kernel"]
        want_o = np.empty((L, E, H * D), np.float32)
        for l in range(L):
            for h in range(H):
                for d in range(D):
                    want_o[l, :, h * D + d] = o[h, l, d, :]
        assert np.array_equal(back[pre + ("decoder", "layers", "self_attention", "linear_proj", "weight")], want_o)
        wo = raw[lp + "mlp/wo/kernel"]
        assert np.array_equal(back[pre + ("decoder", "layers", "mlp", "linear_fc2", "weight")],
                              np.stack([wo[:, l, :].T for l in range(L)]))
        emb = raw[src + "token_embedder/embedding"]
        assert emb.shape == (V, E)
        assert np.array_equal(back[pre + ("embedding", "word_embeddings", "weight")], emb)
        assert np.array_equal(back[pre + ("output_layer", "weight")], raw[src + "decoder/logits_dense/kernel"].T)
        assert back[pre + ("decoder", "layers", "mlp", "linear_fc1", "weight", "gate")].shape == (L, F, E)
        assert back[pre + ("decoder", "layers", "self_attention", "linear_qkv", "weight", "key")].shape == (L, K * D, E)
    assert int(back[("opt_state", "0", "count")]) == int(raw["opt_state/0/count"])

    run_dir = str(tmp_path / "meg")
    to_megatron(str(tmp_path / "logical"), run_dir, MegatronTarget(tp=1, fmt="fully_reshardable"))
    iters = [d for d in os.listdir(run_dir) if d.startswith("iter_")]
    assert iters == ["iter_0000002"]
    convert(os.path.join(run_dir, iters[0]), str(tmp_path / "again"))
    again = read_all(str(tmp_path / "again"))
    for p, a in back.items():
        if p[0] in ("params", "opt_state") and a.dtype == np.float32:
            assert np.array_equal(again[p], a), p


def _cli(*args: str) -> "subprocess.CompletedProcess":
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=os.path.dirname(HERE))
    return subprocess.run([sys.executable, "-m", "bridge.cli", *args], capture_output=True, text=True, env=env,
                          timeout=600)


@pytest.mark.slow
def test_cli_to_and_from_maxtext(tmp_path):
    root, back = str(tmp_path / "root"), str(tmp_path / "back")
    r = _cli("to-maxtext", os.path.join(LLAMA, "live"), root, "--overrides-json", str(tmp_path / "ov.json"))
    assert r.returncode == 0, r.stderr
    assert "decoder_block=qwen2" in r.stdout and json.load(open(tmp_path / "ov.json"))["vocab_size"] == 72
    r = _cli("from-maxtext", root, back)
    assert r.returncode == 0, r.stderr
    src, got = read_all(os.path.join(LLAMA, "live")), read_all(back)
    assert all(np.array_equal(got[p], src[p]) for p in got)
    # bad input: one line, exit 2, nothing written
    r = _cli("to-maxtext", os.path.join(LLAMA, "live"), root)                  # the step exists
    assert r.returncode == 2 and "exists" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = _cli("from-maxtext", FRESH, str(tmp_path / "x"))                       # foreign: settings needed
    assert r.returncode == 2 and "--lr" in r.stderr and not os.path.exists(tmp_path / "x")
    r = _cli("from-maxtext", str(tmp_path), str(tmp_path / "y"))               # not a MaxText checkpoint
    assert r.returncode == 2 and "not a MaxText checkpoint" in r.stderr and not os.path.exists(tmp_path / "y")
    dp2 = os.path.join(HERE, "fixtures", "megatron", "dp2", "dp_reshardable")  # biases, learned positions
    from converters.megatron.convert_entry import convert

    convert(dp2, str(tmp_path / "gpt"))
    r = _cli("to-maxtext", str(tmp_path / "gpt"), str(tmp_path / "z"))
    assert r.returncode == 2 and "RoPE" in r.stderr and not os.path.exists(tmp_path / "z")


def test_default_no_decay_rule_without_a_recorded_set():
    """A manifest without a no-decay list: Megatron's default rule on the logical shapes (norms only)."""
    from bridge.format.manifest import Manifest, OptimizerConfig
    from bridge.jaxside.presets.maxtext_ckpt import hyper_of

    t = logical_tree(DIMS)
    h = hyper_of(Manifest(optimizer=OptimizerConfig(lr=1e-3)), {p: a.shape for p, a in t.items()})
    assert set(h.no_decay) == {("decoder", "final_layernorm", "weight"), ATT + ("layer_norm_weight",),
                               ("decoder", "layers", "mlp", "linear_fc1", "layer_norm_weight")}
