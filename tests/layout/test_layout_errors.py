"""Invalid layouts get one-line BridgeErrors naming the parameter and the constraint."""

import pytest

from bridge.errors import BridgeError
from bridge.layout import FusedSpec, ParallelLayout, ParamGeometry
from bridge.layout.distopt import BufferParam, buffer_layout


def err(fn, *words):
    with pytest.raises(BridgeError) as ei:
        fn()
    msg = str(ei.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg, f"{w!r} not in {msg!r}"
    return msg


def test_parallel_layout_errors():
    err(lambda: ParallelLayout.from_world(12, tp=8), "world size 12", "tp·gtp·cp·pp = 8")
    err(lambda: ParallelLayout(tp=2, dp=3, ep=4, etp=1), "world size 6", "etp·ep·egtp·pp", "= 4")
    err(lambda: ParallelLayout(tp=0), "tp=0", "positive")
    err(lambda: ParallelLayout(tp=2, order="tp-xp-dp-pp"), "unknown token", "xp")
    err(lambda: ParallelLayout(cp=2, order="tp-dp-pp"), "lacks 'cp'", "size is 2")
    err(lambda: ParallelLayout(tp=2, order="tp-tp-dp-pp"), "twice")
    err(lambda: ParallelLayout(pp=2, dp=2, ep=2, etp=1, order="tp-cp-ep-pp-dp"), "does not end with 'pp'")
    err(lambda: ParallelLayout(tp=2, gtp=2).coords(4), "rank 4", "world size 4")


def test_param_geometry_errors():
    err(lambda: ParamGeometry("dec.fc1.weight", (10, 6), "column").tp_local_shape(4), "dec.fc1.weight", "dim 0 (10)", "TP=4")
    err(lambda: ParamGeometry("dec.fc2.weight", (10, 6), "row").tp_local_shape(4), "dec.fc2.weight", "dim 1 (6)", "TP=4")
    err(lambda: ParamGeometry("x.weight", (10, 6), "diagonal"), "x.weight", "unknown TP kind", "diagonal")
    err(lambda: ParamGeometry("b", (10,), "row"), "b", "row-parallel needs >= 2 dims")
    err(lambda: ParamGeometry("w", (10, 6), "column", gtp=True, pad_for_alignment=0).split(1, 4),
        "w", "10 rows", "not divisible by GTP=4", "pad_for_alignment=0")
    err(lambda: ParamGeometry("w", (10, 6), "column", gtp=True, pad_for_alignment=-1), "w", "pad_for_alignment=-1")
    err(lambda: ParamGeometry("fc1", (11, 4), "column", fused=FusedSpec.swiglu(6)), "fc1", "sum to 12", "11")
    err(lambda: ParamGeometry("fc1", (12, 4), "row", fused=FusedSpec.swiglu(6)), "fc1", "column-parallel")
    w = ParamGeometry("w", (10, 6), "column", prepend=(4,))
    err(lambda: w.shard_pieces(1, 1, 0, 0, index=(4,)), "w", "index (4,)", "prepend sizes (4,)")
    err(lambda: w.fragment_pieces(1, 1, 0, 0, 0, 61, index=(0,)), "w", "[0, 61)", "60 elements")
    err(lambda: w.shard_pieces(2, 1, 2, 0, index=(0,)), "w", "TP rank 2")


def test_fused_errors():
    err(lambda: FusedSpec.from_json({"kind": "zigzag", "sections": [["a", 2]]}), "unknown kind", "zigzag")
    err(lambda: FusedSpec.from_json({"sections": []}), "lacks 'kind'")
    err(lambda: FusedSpec.from_json({"kind": "concat", "sections": "ab"}), "[[name, rows]")
    err(lambda: FusedSpec.qkv(6, 4, 2), "num_heads=6", "num_query_groups=4")
    err(lambda: FusedSpec.concat([("a", 2), ("a", 2)]), "unique")
    err(lambda: FusedSpec.qkv(8, 2, 4).segments(4, "attn.qkv"), "attn.qkv", "2 query groups", "TP=4")
    err(lambda: ParamGeometry("m.in_proj", (14, 3), "column",
                              fused=FusedSpec.mamba_in_proj(4, 1, 2, 2)).tp_local_shape(4),
        "m.in_proj", "not divisible by TP=4", "'B'")


def test_distopt_errors():
    err(lambda: buffer_layout([BufferParam("a", 4), BufferParam("a", 4)], None, 2), "['a']", "twice")
    err(lambda: buffer_layout([BufferParam("a", 4)], 0, 2), "bucket_size=0")
    err(lambda: buffer_layout([BufferParam("a", 4)], None, 2).dp_range(0, 2), "DP rank 2", "size 2")


def test_default_index_validated_at_construction():
    err(lambda: ParamGeometry("l.w", (4, 4), "column", prepend=(3,), index=(3,)), "l.w", "index (3,)", "(3,)")
    err(lambda: ParamGeometry("l.w", (4, 4), "column", prepend=(3,)).shard_pieces(1, 1, 0, 0), "l.w", "index ()")
    w = ParamGeometry("l.w", (4, 4), "column", prepend=(3,), index=(2,))
    assert w.shard_pieces(1, 1, 0, 0)[0].logical.start == (2, 0, 0)
    assert w.at((1,)).shard_pieces(1, 1, 0, 0)[0].logical.start == (1, 0, 0)
