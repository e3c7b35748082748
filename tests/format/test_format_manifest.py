"""bridge.format.manifest: the one builder / reader of the manifest, against hand-written JSON."""

from __future__ import annotations

import json

import pytest

from bridge.errors import IntegrityError
from bridge.format.manifest import (Manifest, MegatronParam, MegatronRecord, OptimizerConfig, SourceLayout,
                                    custom_metadata, manifest_from_custom)

# What convert writes under extra.megatron (key order as on disk), written out by hand.
MEGATRON_JSON = {
    "source_dir": "/ck/iter_0000003", "params": [
        {"name": "decoder.layers.mlp.linear_fc1.weight", "key": "decoder.layers.mlp.linear_fc1.weight",
         "shape": [16, 8], "prepend": [2], "tp_kind": "column", "gtp": True, "expert": False, "dtype": "bfloat16",
         "optimized": True}],
    "param_groups": [[{"wd_mult": 1.0, "lr": 0.01, "betas": [0.9, 0.95]}]],
    "extra_state_keys": ["decoder.layers.mlp.linear_fc1._extra_state/shard_0_2"],
    "extra_state_payload": "empty_uint8_tensor", "args": {"fp16": False}, "inferred": [],
    "wd_mult_zero_params": ["decoder/final_layernorm/weight"], "iteration": 3, "checkpoint_version": 3.0,
}


def test_megatron_record_round_trips_byte_for_byte():
    rec = MegatronRecord.from_json(MEGATRON_JSON)
    assert rec.params[0] == MegatronParam("decoder.layers.mlp.linear_fc1.weight", "decoder.layers.mlp.linear_fc1.weight",
                                          [16, 8], [2], "column", gtp=True, expert=False, dtype="bfloat16")
    assert json.dumps(rec.to_json()) == json.dumps(MEGATRON_JSON)   # same keys, same order: same bytes
    with_sched = dict(MEGATRON_JSON, scheduler={"max_lr": 1.0})
    assert json.dumps(MegatronRecord.from_json(with_sched).to_json()) == json.dumps(with_sched)


def test_manifest_megatron_is_typed_or_none():
    m = Manifest(extra={"megatron": MEGATRON_JSON})
    assert m.megatron.iteration == 3 and m.megatron.params[0].tp_kind == "column" and m.megatron.scheduler is None
    assert Manifest().megatron is None and Manifest(extra={"megatron": "junk"}).megatron is None


def test_malformed_parameter_record_is_one_line_integrity_error():
    bad = dict(MEGATRON_JSON, params=[{"name": "w"}])
    with pytest.raises(IntegrityError, match="megatron parameter list is malformed") as e:
        Manifest(extra={"megatron": bad}).megatron
    assert "\n" not in str(e.value)


def test_optimizer_defaults_fill_only_what_is_missing():
    o = OptimizerConfig(lr=0.1, betas=None, eps=None, weight_decay=None).with_defaults()
    assert (o.betas, o.eps, o.weight_decay) == ((0.9, 0.999), 1e-8, 0.01)
    o = OptimizerConfig(betas=[0.8, 0.9], eps=1e-6, weight_decay=0.0).with_defaults()
    assert (o.betas, o.eps, o.weight_decay) == ((0.8, 0.9), 1e-6, 0.0)   # a recorded 0.0 stays 0.0


def test_source_layout_of_a_layout():
    from bridge.layout import ParallelLayout

    s = SourceLayout.of(ParallelLayout(tp=2, gtp=2, dp=3), "megatron", "dp_reshardable", 16)
    assert (s.framework, s.tp, s.gtp, s.dp, s.world_size, s.optimizer_format, s.pad_for_alignment) == \
        ("megatron", 2, 2, 3, 12, "dp_reshardable", 16)


def test_manifest_in_and_out_of_custom_metadata():
    m = Manifest(optimizer=OptimizerConfig(lr=0.5, step=7))
    custom = json.loads(json.dumps(custom_metadata(m)))          # as it reads back from _METADATA
    assert list(custom) == ["gtp_bridge"]
    back = manifest_from_custom(custom)
    assert back.optimizer.lr == 0.5 and back.optimizer.step == 7
    assert manifest_from_custom({}) is None and manifest_from_custom(None) is None
    with pytest.raises(IntegrityError):
        manifest_from_custom({"gtp_bridge": {"format_version": "one"}})
