"""Hostile and inexpressible MoE inputs of the maxtext preset (issue 31): each ends in one line naming what is
wrong (exit 1 or 2), nothing written, never a traceback.

MaxText-side damage is made with plain TensorStore (`test_maxtext_hostile.edit_zarr`) on a copy of a checkpoint
real MaxText 0.2.5 saved for the MoE fixture's model (`tests/fixtures/maxtext/fresh_maxtext_moe`: 4 experts,
qwen3_moe), so the code under test never makes its own inputs. Megatron-side: the MoE fixture's live export
(`tests/fixtures/maxtext/llama_moe/live`) and Megatron-LM argument sets.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from bridge.errors import BridgeError
from test_maxtext_hostile import assert_one_line, cli, edit_zarr

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/
FRESH_MOE = os.path.join(HERE, "fixtures", "maxtext", "fresh_maxtext_moe")
MOE_LIVE = os.path.join(HERE, "fixtures", "maxtext", "llama_moe", "live")
DENSE_LIVE = os.path.join(HERE, "fixtures", "maxtext", "llama", "live")
WI0 = "decoder.layers.moe_block.wi_0"
GATE = "decoder.layers.moe_block.gate.kernel"
PARAMS, MU, NU = "params.params.", "opt_state.0.mu.params.", "opt_state.0.nu.params."
FROM = ["--lr", "1e-2", "--num-experts-per-tok", "2"]


@pytest.fixture
def fresh(tmp_path) -> str:
    shutil.copytree(FRESH_MOE, tmp_path / "fresh")
    return str(tmp_path / "fresh")


def items(root: str) -> str:
    return os.path.join(root, "1", "items")


def test_the_untouched_copy_converts(fresh, tmp_path):
    """The control: the same copy, not damaged, converts."""
    assert cli("from-maxtext", fresh, str(tmp_path / "out"), *FROM).returncode == 0


@pytest.mark.parametrize("where,shape", [
    (PARAMS + GATE, [24, 2, 5]),          # the router claims a fifth expert
    (MU + WI0, [3, 2, 24, 40]),           # one moment has an expert fewer
    (NU + WI0, [4, 2, 24, 41]),           # ... or wider experts
])
def test_expert_count_disagreeing_between_leaves_is_refused(fresh, tmp_path, where, shape):
    edit_zarr(items(fresh), where, shape=shape)
    line = assert_one_line(cli("from-maxtext", fresh, str(tmp_path / "out"), *FROM), "zarr.json")
    assert where.replace(".", "/").split("/params/", 1)[-1].split("/")[-1] in line
    assert not os.path.exists(tmp_path / "out")


def test_experts_on_the_wrong_axis_are_refused(fresh, tmp_path):
    """Every role's experts stored (L, X, E, F) — the layer axis first, Megatron's order — not MaxText's (X, L, E, F):
    the sizes agree with each other but not with the attention's two layers."""
    for pre in (PARAMS, MU, NU):
        edit_zarr(items(fresh), pre + WI0, shape=[2, 4, 24, 40])
        edit_zarr(items(fresh), pre + "decoder.layers.moe_block.wi_1", shape=[2, 4, 24, 40])
    r = cli("from-maxtext", fresh, str(tmp_path / "out"), *FROM)
    assert_one_line(r, "moe_block/wi_", "(2, 4, 24, 40)", "give (4, 2, 24, 40)")
    assert not os.path.exists(tmp_path / "out")


@pytest.mark.parametrize("k,word", [(None, "--num-experts-per-tok"), ("5", "1..4"), ("0", "--num-experts-per-tok")])
def test_experts_per_token_missing_or_out_of_range_is_refused(fresh, tmp_path, k, word):
    extra = ["--num-experts-per-tok", k] if k is not None else []
    r = cli("from-maxtext", fresh, str(tmp_path / "out"), "--lr", "1e-2", *extra)
    assert_one_line(r, word)
    assert not os.path.exists(tmp_path / "out")


def test_a_dense_block_named_for_an_moe_checkpoint_is_refused(fresh, tmp_path):
    for block in ("qwen2", "mixtral"):
        r = cli("from-maxtext", fresh, str(tmp_path / "out"), *FROM, "--decoder-block", block)
        assert_one_line(r, block)
    assert not os.path.exists(tmp_path / "out")


def test_sidecar_claiming_other_experts_is_refused(tmp_path):
    from bridge.jaxside.presets.maxtext_stream import write_maxtext

    root = str(tmp_path / "mt")
    w = write_maxtext(MOE_LIVE, root, num_experts_per_tok=2)
    side = os.path.join(w.step_dir, "gtp_bridge_maxtext.json")
    d = json.load(open(side))
    d["dims"]["experts"] = 8
    json.dump(d, open(side, "w"))
    r = cli("from-maxtext", root, str(tmp_path / "out"))
    assert_one_line(r, "sidecar")
    assert not os.path.exists(tmp_path / "out")


@pytest.mark.parametrize("src,block,word", [(MOE_LIVE, "qwen2", "qwen3_moe"), (MOE_LIVE, "llama2", "routed experts"),
                                            (DENSE_LIVE, "qwen3_moe", "dense")])
def test_to_maxtext_refuses_a_block_that_does_not_fit_the_model(tmp_path, src, block, word):
    r = cli("to-maxtext", src, str(tmp_path / "mt"), "--decoder-block", block, "--num-experts-per-tok", "2"
            if src == MOE_LIVE else "0")
    assert_one_line(r, word)
    assert not os.path.exists(tmp_path / "mt")


def test_to_maxtext_without_experts_per_token_is_refused(tmp_path):
    r = cli("to-maxtext", MOE_LIVE, str(tmp_path / "mt"))     # the live export records no Megatron args
    assert_one_line(r, "--num-experts-per-tok")
    assert not os.path.exists(tmp_path / "mt")


@pytest.mark.parametrize("args,word", [
    ({"moe_shared_expert_intermediate_size": 64}, "shared experts"),
    ({"moe_router_pre_softmax": True}, "pre-softmax"),
    ({"moe_router_score_function": "sigmoid"}, "score function"),
    ({"moe_router_enable_expert_bias": True}, "expert bias"),
    ({"moe_router_num_groups": 2}, "group-limited"),
    ({"moe_router_topk_scaling_factor": 2.5}, "scaling factor"),
    ({"moe_expert_capacity_factor": 1.25}, "token dropping"),
    ({"moe_aux_loss_coeff": 0.01}, "auxiliary"),
    ({"moe_z_loss_coeff": 1e-3}, "z-loss"),
    ({"moe_layer_freq": [1, 0]}, "dense and MoE layers"),
])
def test_megatron_moe_features_maxtext_cannot_express_are_named(args, word):
    from bridge.jaxside.presets.maxtext_ckpt import _check_megatron_args

    _check_megatron_args({"num_experts": 4, "moe_router_topk": 2})        # the plain top-k router passes
    with pytest.raises(BridgeError, match=word) as e:
        _check_megatron_args({"num_experts": 4, "moe_router_topk": 2, **args})
    assert "\n" not in str(e.value) and next(iter(args)) in str(e.value)


def test_a_shared_expert_array_is_named():
    from bridge.jaxside.presets import maxtext as mx

    dims = mx.Dims(layers=1, hidden=4, ffn=6, heads=2, kv_heads=1, head_dim=2, vocab=8, experts=2, topk=1)
    t = {p: np.zeros(s, np.float32) for p, s in mx.maxtext_shapes(dims, mx.Options("qwen3_moe")).items()}
    logical = mx.from_maxtext(t, "params", dims, mx.Options("qwen3_moe"))
    logical[("decoder", "layers", "mlp", "shared_experts", "linear_fc1", "weight")] = np.zeros((1, 12, 4), np.float32)
    with pytest.raises(BridgeError, match="shared_experts.*shared experts"):
        mx.to_maxtext(logical, "params", dims, mx.Options("qwen3_moe"))
