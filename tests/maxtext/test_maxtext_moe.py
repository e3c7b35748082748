"""The maxtext preset for mixture-of-experts runs (issue 31, MoE part).

Data: tests/fixtures/maxtext/llama_moe, a llama-style MoE run made by real megatron-core 0.19.2 on an H200
(`make_llama.py --moe`: 4 SwiGLU experts, top-2, EP1; its `dp_reshardable/` save and the same state
exported live; the live export records no Megatron args, so top-2 is given as `num_experts_per_tok`). References are independent of the preset's table: MaxText's expected layout is written
here as explicit index formulas (MaxText 0.2.5 `moe.RoutedMoE`: `gate/kernel` (E, X), `wi_0|wi_1`
(X, E, F), `wo` (X, F, E); the scanned layer axis at 1), arrays are read back with plain TensorStore,
and the tree is compared key for key with what real MaxText saved for this model
(`tests/fixtures/maxtext/fresh_maxtext_moe`).
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from bridge.format import schema
from test_maxtext_preset import _tree_keys   # key names, key types, value types; not MaxText's rng state
from test_maxtext_stream import bits_equal, plain_read

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/
MOE = os.path.join(HERE, "fixtures", "maxtext", "llama_moe")
LIVE = os.path.join(MOE, "live")
FRESH_MOE = os.path.join(HERE, "fixtures", "maxtext", "fresh_maxtext_moe")
EXP = ("decoder", "layers", "mlp", "experts", "experts")
ROUTER = ("decoder", "layers", "mlp", "router", "weight")
ROLES = {"params": ("params", "params"), "mu": ("opt_state", "0", "mu", "params"),
         "nu": ("opt_state", "0", "nu", "params")}


def _tiny():
    from bridge.jaxside.presets.maxtext_stream import StreamOptions

    return StreamOptions(workers=2, budget=64 << 10, min_worker_bytes=1)   # many chunks, two writers


@pytest.mark.parametrize("scanned", [True, False], ids=["scanned", "unscanned"])
def test_experts_and_router_land_where_maxtext_keeps_them(tmp_path, scanned):
    """Masters and both moments of every expert and router, against explicit index formulas."""
    from bridge.jaxside.presets.maxtext_stream import write_maxtext

    w = write_maxtext(LIVE, str(tmp_path / "mt"), scan_layers=scanned, stream=_tiny(), num_experts_per_tok=2)
    assert w.options.decoder_block == "qwen3_moe" and (w.dims.experts, w.dims.topk) == (4, 2)
    src, got = plain_read(LIVE), plain_read(os.path.join(w.step_dir, "items"))
    n_layers, n_exp = 2, 4
    for role, root in ROLES.items():
        gate = src[schema.role_path(role, EXP + ("linear_fc1", "weight", "gate"))]   # (L, X, F, E)
        up = src[schema.role_path(role, EXP + ("linear_fc1", "weight", "up"))]
        fc2 = src[schema.role_path(role, EXP + ("linear_fc2", "weight"))]             # (L, X, E, F)
        router = src[schema.role_path(role, ROUTER)]                                   # (L, X, E)
        assert gate.shape == (n_layers, n_exp, 40, 24) and router.shape == (n_layers, n_exp, 24)
        for layer in range(n_layers):
            blk = root + (("decoder", "layers", "moe_block") if scanned else ("decoder", f"layers_{layer}", "moe_block"))
            sel = (lambda a, x: a[x, layer]) if scanned else (lambda a, x: a[x])
            for x in range(n_exp):
                assert bits_equal(sel(got[blk + ("wi_0",)], x), np.ascontiguousarray(gate[layer, x].T)), (role, layer, x)
                assert bits_equal(sel(got[blk + ("wi_1",)], x), np.ascontiguousarray(up[layer, x].T))
                assert bits_equal(sel(got[blk + ("wo",)], x), np.ascontiguousarray(fc2[layer, x].T))
            k = got[blk + ("gate", "kernel")]
            assert bits_equal(np.ascontiguousarray(k[:, layer] if scanned else k), np.ascontiguousarray(router[layer].T))
    # no dense MLP beside the experts
    assert not any("mlp" in p for p in got), [p for p in got if "mlp" in p]


@pytest.mark.parametrize("scanned", [True, False], ids=["scanned", "unscanned"])
def test_round_trip_from_megatrons_save_bit_exact(tmp_path, scanned):
    """Megatron's own save -> convert -> to-maxtext -> from-maxtext: masters, mu, nu, count and step equal
    the converted state bit for bit (CLI, streamed in many chunks); then to-megatron and convert again give
    every array of the first conversion (the bf16 weights are re-derived from the masters)."""
    from bridge.cli import main

    logical, back = str(tmp_path / "logical"), str(tmp_path / "back")
    assert main(["convert", os.path.join(MOE, "dp_reshardable"), logical]) == 0
    root = str(tmp_path / "mt" / "run" / "checkpoints")
    assert main(["to-maxtext", logical, root, "--budget", "64K", "--workers", "2"]
                + ([] if scanned else ["--unscanned"])) == 0
    assert main(["from-maxtext", root, back, "--budget", "64K", "--workers", "2"]) == 0
    a, b = plain_read(logical), plain_read(back)
    carried = [p for p in a if p[0] in ("params", "opt_state")]
    assert len([p for p in carried if any("experts" in c or "router" in c for c in p)]) == 3 * 4
    assert int(a[schema.STEP_PATH]) == int(b[schema.STEP_PATH]) == 3
    for p in carried + [schema.STEP_PATH]:
        assert bits_equal(a[p], b[p]), p
    assert set(carried) == {p for p in b if p[0] in ("params", "opt_state")}
    from bridge.store.reader import open_checkpoint

    args = open_checkpoint(back).manifest.megatron.args
    assert (args["num_experts"], args["moe_router_topk"]) == (4, 2)
    if scanned:   # on to Megatron-Core (to-megatron) and read again: every array, bf16 weights too, equal
        meg, again = str(tmp_path / "meg"), str(tmp_path / "again")
        assert main(["to-megatron", back, meg, "--tp", "1", "--no-scheduler"]) == 0
        assert main(["convert", os.path.join(meg, "iter_0000003"), again]) == 0
        c = plain_read(again)
        assert sorted(c) == sorted(a)
        for p in a:
            assert bits_equal(a[p], c[p]), p


def test_mixtral_block_folds_the_query_scale_and_keeps_the_experts(tmp_path):
    """`--decoder-block mixtral`: MaxText's MoeBlock_0 module; the query kernel is scaled by fp32(1/sqrt(6)),
    the experts are carried as they are."""
    from bridge.jaxside.presets.maxtext_stream import write_maxtext

    w = write_maxtext(LIVE, str(tmp_path / "mt"), decoder_block="mixtral", num_experts_per_tok=2)
    src, got = plain_read(LIVE), plain_read(os.path.join(w.step_dir, "items"))
    blk = ("params", "params", "decoder", "layers", "MoeBlock_0")
    gate = src[schema.role_path("params", EXP + ("linear_fc1", "weight", "gate"))]
    assert bits_equal(got[blk + ("wi_0",)][1, 0], np.ascontiguousarray(gate[0, 1].T))
    q = src[schema.role_path("params", ("decoder", "layers", "self_attention", "linear_qkv", "weight", "query"))]
    c = np.float32(1 / np.sqrt(6))
    mt_q = got[("params", "params", "decoder", "layers", "self_attention", "query", "kernel")]   # (E, L, H, D)
    assert bits_equal(mt_q[:, 0].reshape(24, 24), np.ascontiguousarray(q[0].T * c))
    assert w.overrides["decoder_block"] == "mixtral" and w.overrides["num_experts"] == 4


def test_written_tree_is_the_tree_real_maxtext_saves_for_this_moe_model(tmp_path):
    """Key for key what MaxText 0.2.5 itself saved (its own init and 2 steps, qwen3_moe, the same
    overrides), shapes too (plain TensorStore). Its NNX rng state (`nnx_aux`) is not written: MaxText
    re-initialises it when absent (as for dense models)."""
    from bridge.jaxside.presets.maxtext_ckpt import find_items
    from bridge.jaxside.presets.maxtext_stream import write_maxtext

    w = write_maxtext(LIVE, str(tmp_path / "mt"), num_experts_per_tok=2)
    ours_items, theirs_items = os.path.join(w.step_dir, "items"), find_items(FRESH_MOE)
    assert _tree_keys(ours_items) == _tree_keys(theirs_items)
    ours, theirs = plain_read(ours_items), plain_read(theirs_items)
    assert {p: a.shape for p, a in ours.items()} == {p: a.shape for p, a in theirs.items() if p[0] != "nnx_aux"}
    made_with = json.load(open(os.path.join(FRESH_MOE, "overrides.json")))
    assert made_with == {k: v for k, v in json.loads(json.dumps(w.overrides)).items() if k != "max_target_length"}


def test_real_maxtext_moe_checkpoint_converts_back(tmp_path):
    """A checkpoint real MaxText wrote (no sidecar) reads back given its AdamW settings and experts per token;
    the logical experts are MaxText's arrays transposed (plain TensorStore reads)."""
    from bridge.cli import main
    from bridge.jaxside.presets.maxtext_ckpt import find_items

    out = str(tmp_path / "logical")
    assert main(["from-maxtext", FRESH_MOE, out, "--lr", "1e-2", "--num-experts-per-tok", "2"]) == 0
    theirs, back = plain_read(find_items(FRESH_MOE)), plain_read(out)
    for role, root in ROLES.items():
        wi0 = theirs[root + ("decoder", "layers", "moe_block", "wi_0")]          # (X, L, E, F)
        gate = back[schema.role_path(role, EXP + ("linear_fc1", "weight", "gate"))]
        assert bits_equal(gate, np.ascontiguousarray(wi0.transpose(1, 0, 3, 2)))
        k = theirs[root + ("decoder", "layers", "moe_block", "gate", "kernel")]  # (E, L, X)
        assert bits_equal(back[schema.role_path(role, ROUTER)], np.ascontiguousarray(k.transpose(1, 2, 0)))
