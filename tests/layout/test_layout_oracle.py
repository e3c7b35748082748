"""The layout engine against megatron-core 0.19.2's own answers, recorded on the GPU machine by
tests/fixtures/oracle/make_oracle.py (see tests/fixtures/oracle/README.md)."""

import json
from math import prod
from pathlib import Path

import pytest

from bridge.errors import BridgeError
from bridge.layout import FusedSpec, ParallelLayout, ParamGeometry
from bridge.layout.distopt import BufferParam, buffer_layout, owned_ranges
from bridge.layout.params import gtp_shard_dim0

ORACLE = Path(__file__).parents[1] / "fixtures" / "oracle"


def load(name):
    return json.loads((ORACLE / name).read_text())


def test_gtp_shard_dim0_matches_megatron():
    rows = load("gtp_shard_dim0.json")["rows"]
    assert len(rows) > 300
    for r in rows:
        if "error" in r:
            with pytest.raises(BridgeError, match="not divisible by GTP"):
                gtp_shard_dim0(r["L"], r["G"], r["a"])
        else:
            assert gtp_shard_dim0(r["L"], r["G"], r["a"]) == (r["S"], r["pad"]), r


@pytest.mark.parametrize("case", load("rank_groups.json")["cases"], ids=lambda c: json.dumps(c["config"]))
def test_rank_groups_match_megatron(case):
    lay = ParallelLayout(**case["config"])
    assert lay.world == case["world"]
    assert "-".join(lay.dense.order) == case["dense_order"]
    assert "-".join(lay.expert.order) == case["expert_order"]
    for tokens, groups in case["dense"].items():
        assert lay.dense.groups(tokens) == groups, ("dense", tokens)
    for tokens, groups in case["expert"].items():
        assert lay.expert.groups(tokens) == groups, ("expert", tokens)
    # the named accessors agree with the recorded groups
    for r in range(lay.world):
        assert lay.distopt_group(r) in case["dense"]["dp-cp"]
        assert lay.gtp_group(r) in case["dense"]["gtp_remat"]
        mp = [g for g in case["dense"]["tp-gtp_remat-pp"] if r in g][0]
        assert lay.dp_group_idx(r) == mp.index(r)
        emp = [g for g in case["expert"]["tp-ep-gtp_remat-pp"] if r in g][0]
        assert lay.expert_dp_group_idx(r) == emp.index(r)
        assert lay.expert_distopt_group(r) in case["expert"]["dp"]


def _param_at(index, world_start):
    """Recorded parameter whose recorded buffer range holds `world_start`.

    The static fixture's owned entries carry Megatron's flat 'param' range (it overwrote the
    parameter position in the recording), so the parameter is identified by its buffer range.
    """
    (i,) = [i for i, (s, e, _) in enumerate(index) if s <= world_start < e]
    return i


def test_distopt_static_matches_megatron():
    cases = load("distopt_static.json")["cases"]
    assert len(cases) >= 50
    for c in cases:
        params = [BufferParam(str(i), n, i in c["shared"]) for i, n in enumerate(c["numels"])]
        lay = buffer_layout(params, c["bucket_size"], c["dp"], pad_for_high_nccl_busbw=c["busbw"])
        assert [list(lay.index[str(i)]) for i in range(len(params))] == c["index"], c
        assert [list(b) for b in lay.buckets] == c["buckets"]
        assert lay.numel_unpadded == c["unpadded"]
        for r, owned in c["ranks"].items():
            got = sorted((int(o.name), o.bucket, list(o.param), list(o.gbuf_world), list(o.gbuf_local))
                         for o in owned_ranges(lay, int(r)))
            want = sorted((_param_at(c["index"], o["gbuf_world"][0]), o["bucket"], o["param"], o["gbuf_world"],
                           o["gbuf_local"]) for o in owned)
            assert got == want, (c["numels"], c["dp"], r)


def test_distopt_live_runs_match_megatron():
    data = load("distopt_live_w1_nccl.json")
    assert data["runs"]
    for ranks in data["runs"]:
        for rec in ranks:
            run = rec["run"]
            bucket_size = run["bucket_size"] if run["overlap"] else None
            for opt in rec["optimizers"]:
                dp = len(opt["dp_group"])
                for buf in opt["buffers"]:
                    params = [BufferParam(n, prod(shape), shared) for n, shape, shared, _ in buf["params"]]
                    lay = buffer_layout(params, bucket_size, dp)
                    assert {k: list(v) for k, v in lay.index.items()} == buf["index"], run["name"]
                    assert [list(b) for b in lay.buckets] == buf["bucket_indices"]
                    assert lay.per_bucket_numel() == buf["bucket_numel"]
                    assert [s for s, _ in lay.buckets] == buf["bucket_offset"]
                    assert lay.numel_unpadded == buf["bucket_numel_unpadded"]
                    got = sorted((o.name, o.bucket, list(o.param), list(o.gbuf_world), list(o.gbuf_local))
                                 for o in owned_ranges(lay, opt["dp_rank"]))
                    want = sorted((o["name"], o["bucket"], o["param"], o["gbuf_world"], o["gbuf_local"])
                                  for o in buf["owned"])
                    assert got == want, run["name"]


def tiny_gpt_geometry(name: str, s: dict) -> ParamGeometry:
    """Geometry of the oracle's tiny GPT parameters (an independent check of TP-local shapes)."""
    h, f, kv = s["hidden_size"], s["ffn_hidden_size"], s["kv_channels"]
    short = name.replace("module.module.", "")
    if short.endswith(("layernorm.weight", "layernorm.bias", "linear_proj.bias", "linear_fc2.bias", "router.weight")):
        return ParamGeometry(short, (h,), "replicated")
    if "word_embeddings" in short:
        return ParamGeometry(short, (s["vocab_size"], h), "vocab")
    if "position_embeddings" in short:
        return ParamGeometry(short, (s["seq_length"], h), "replicated")
    if short.endswith("output_layer.weight"):
        return ParamGeometry(short, (s["vocab_size"], h), "column")
    qkv = FusedSpec.qkv(s["num_attention_heads"], s["num_query_groups"], kv)
    if "linear_qkv" in short:
        return ParamGeometry(short, (qkv.rows, h)[: 2 if short.endswith("weight") else 1], "column", fused=qkv)
    if "linear_fc1" in short:
        return ParamGeometry(short, (2 * f, h)[: 2 if short.endswith("weight") else 1], "column",
                             fused=FusedSpec.swiglu(f))
    if short.endswith("linear_proj.weight"):
        return ParamGeometry(short, (h, s["num_attention_heads"] * kv), "row")
    if short.endswith("linear_fc2.weight"):
        return ParamGeometry(short, (h, f), "row")
    raise KeyError(short)


def test_live_param_shapes_match_geometry():
    data = load("distopt_live_w1_nccl.json")
    s = data["sizes"]
    checked = 0
    for ranks in data["runs"]:
        for rec in ranks:
            if rec["run"]["moe"]:
                continue
            tp = rec["run"]["tp"]
            for opt in rec["optimizers"]:
                for buf in opt["buffers"]:
                    for name, shape, _, _ in buf["params"]:
                        geom = tiny_gpt_geometry(name, s)
                        assert geom.physical_shape(tp, 1) == tuple(shape), name
                        checked += 1
    assert checked >= 29
