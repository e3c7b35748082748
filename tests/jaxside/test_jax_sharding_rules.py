"""Default PartitionSpecs (1-D, 2-D column/row, stacked layers, experts) and user rules."""

from __future__ import annotations

import pytest
from jax.sharding import PartitionSpec as P

from bridge.errors import BridgeError
from bridge.jaxside.sharding_rules import MeshAxes, ShardingRules, default_spec

SIZES = {"ep": 2, "fsdp": 2, "tp": 4}


@pytest.mark.parametrize("path, shape, want", [
    # stacked layers: layer axis replicated, then Megatron's column / row split
    ("decoder/layers/self_attention/linear_qkv/weight/query", (4, 64, 32), P(None, "tp", "fsdp")),
    ("decoder/layers/self_attention/linear_proj/weight", (4, 32, 64), P(None, "fsdp", "tp")),
    # hybrid block (explicit layer index): no layer axis
    ("decoder/layers/3/mixer/in_proj/weight/z", (64, 32), P("tp", "fsdp")),
    ("decoder/layers/3/mixer/out_proj/weight", (32, 64), P("fsdp", "tp")),
    # routed experts: [layers, experts, out, in] with the expert axis over `ep`
    ("decoder/layers/mlp/experts/linear_fc1/weight/gate", (4, 8, 64, 32), P(None, "ep", "tp", "fsdp")),
    ("decoder/layers/mlp/experts/linear_fc2/weight", (4, 8, 32, 64), P(None, "ep", "fsdp", "tp")),
    ("decoder/layers/5/mlp/experts/linear_fc2/weight", (8, 32, 64), P("ep", "fsdp", "tp")),
    # 1-D and stacked 1-D: replicated
    ("decoder/final_layernorm/weight", (32,), P(None)),
    ("decoder/layers/mlp/linear_fc1/layer_norm_weight", (4, 32), P(None, None)),
    ("decoder/layers/mlp/experts/linear_fc1/bias", (4, 8, 64), P(None, "ep", None)),
    # scalars
    ("step", (), P()),
    # axes that do not divide are dropped: vocab 10 over tp 4 replicated, hidden 6 over fsdp 2 kept
    ("embedding/word_embeddings/weight", (10, 6), P(None, "fsdp")),
    ("decoder/layers/mlp/experts/linear_fc2/weight", (4, 3, 32, 64), P(None, None, "fsdp", "tp")),
])
def test_default_specs(path, shape, want):
    assert default_spec(tuple(path.split("/")), shape, SIZES) == want


def test_mesh_axis_roles_and_missing_axes():
    sizes = {"data": 2, "model": 4}
    assert default_spec(("output_layer", "weight"), (64, 32), sizes) == P("model", "data")
    assert default_spec(("x", "experts", "w"), (8, 64, 32), sizes) == P(None, "model", "data")
    axes = MeshAxes(tp=("mp",), fsdp=("dp",))
    assert default_spec(("output_layer", "weight"), (64, 32), {"mp": 4, "dp": 2}, axes) == P("mp", "dp")


def test_rules_first_match_glob_regex_callable():
    rules = ShardingRules([
        ("*/linear_fc2/weight", (None, None, "tp")),
        ("re:decoder/layers/.*layer_norm_weight", lambda path, shape: (None, "tp")),
        ("*", ()),                                   # everything else replicated
    ])
    assert rules.spec_for(("decoder", "layers", "mlp", "linear_fc2", "weight"), (4, 32, 64), SIZES) == \
        P(None, None, "tp")
    assert rules.spec_for(("decoder", "layers", "mlp", "linear_fc1", "layer_norm_weight"), (4, 32), SIZES) == \
        P(None, "tp")
    assert rules.spec_for(("output_layer", "weight"), (64, 32), SIZES) == P(None, None)
    assert ShardingRules([("*", (("fsdp", "tp"),))]).spec_for(("w",), (16, 3), SIZES) == P(("fsdp", "tp"), None)


def test_rule_errors_name_the_array():
    with pytest.raises(BridgeError, match=r"array w \(6,\): dim 0 \(6\) is not divisible by mesh axes 'tp' \(4\)"):
        ShardingRules([("*", ("tp",))]).spec_for(("w",), (6,), SIZES)
    with pytest.raises(BridgeError, match="more entries than dims"):
        ShardingRules([("*", ("tp", None))]).spec_for(("w",), (8,), SIZES)
    with pytest.raises(BridgeError, match="mesh has no axis 'x'"):
        ShardingRules([("*", (("x", "tp"),))]).spec_for(("w",), (8,), SIZES)
