"""`convert` on what users have: every megatron-core release's optimizer formats, library-style saves
without `args`, Megatron-Bridge / NeMo 2 config files, and the refusal to drop optimizer state.

References are the per-rank live-optimizer dumps recorded on the GPU (`convert_reference`), never
the converter's own output. `tests/fixtures/megatron/release_<version>/` hold the tiny GPT saved by
megatron-core 0.14.0, 0.15.3, 0.16.1 and 0.19.2 in every format each release could save.

Library-style copies of a fixture drop what Megatron-LM's training loop adds to the common state
(`generate_state_dict` in megatron/training/checkpointing.py: `args`, `checkpoint_version`,
`iteration`; the fixtures hold no scheduler or RNG state) and the `content_metadata` a library need
not pass: what `dist_checkpointing.save({"model": ..., "optimizer": ...})` writes.
"""

from __future__ import annotations

import dataclasses
import glob
import io
import json
import os
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest

from bridge.cli import main
from bridge.errors import BridgeError
from bridge.store.reader import open_checkpoint
from converters.megatron.convert import ConvertOptions
from converters.megatron.convert_entry import convert
from converters.megatron.read.dcp import DcpCheckpoint
from converters.megatron.plan.format import Hints
import convert_reference as cref
from test_convert_megatron import assert_matches

torch = pytest.importorskip("torch")

RELEASES = sorted((d.split(os.sep)[-2], d.split(os.sep)[-1])
                  for d in glob.glob(os.path.join(cref.FIXTURES, "release_*", "*")) if os.path.isdir(d))
TRAINING_LOOP_KEYS = ("args", "checkpoint_version", "iteration", "content_metadata")


def library_copy(src: str | Path, dst: Path, drop=TRAINING_LOOP_KEYS, edit=None) -> Path:
    """`src` with the training loop's common-state keys removed (and `edit(common)` applied), as
    written by megatron-core: a `common.pt` (<= 0.16) or the `common_state` DCP object (0.19),
    re-serialised, appended to its .distcp file and re-pointed in .metadata."""
    from torch.distributed.checkpoint import FileSystemReader

    shutil.copytree(src, dst)
    cp = dst / "common.pt"
    if cp.exists():
        common = torch.load(cp, weights_only=False)  # the committed fixture, our own file
        for k in drop:
            common.pop(k, None)
        if edit:
            edit(common)
        torch.save(common, cp)
        return dst
    md = FileSystemReader(str(dst)).read_metadata()
    idx = next(k for k in md.storage_data if k.fqn.split("/")[0] == "common_state")
    info = md.storage_data[idx]
    f = dst / info.relative_path
    obj = torch.load(io.BytesIO(f.read_bytes()[info.offset:info.offset + info.length]), weights_only=False)
    common = obj[0] if isinstance(obj, list) else obj
    for k in drop:
        common.pop(k, None)
    if edit:
        edit(common)
    buf = io.BytesIO()
    torch.save(obj, buf)
    off = f.stat().st_size
    with open(f, "ab") as fh:
        fh.write(buf.getvalue())
    md.storage_data[idx] = dataclasses.replace(info, offset=off, length=len(buf.getvalue()))
    with open(dst / ".metadata", "wb") as fh:
        pickle.dump(md, fh)
    return dst


def without_object(src: str | Path, dst: Path, name: str) -> Path:
    """`src` with the byte object `name` gone from .metadata (an incomplete copy)."""
    from torch.distributed.checkpoint import FileSystemReader

    shutil.copytree(src, dst)
    md = FileSystemReader(str(dst)).read_metadata()
    for k in [k for k in md.storage_data if k.fqn.split("/")[0] == name]:
        del md.storage_data[k]
    for k in [k for k in md.state_dict_metadata if k.split("/")[0] == name]:
        del md.state_dict_metadata[k]
    with open(dst / ".metadata", "wb") as fh:
        pickle.dump(md, fh)
    return dst


def cli(capsys, *argv: str) -> tuple[int, str]:
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out + out.err


# ---------------------------------------------------------------------------------------------
# Every release x format


@pytest.mark.parametrize("run,fmt", RELEASES, ids=[f"{r}-{f}" for r, f in RELEASES])
def test_release_fixture_converts_bit_exact(run, fmt, tmp_path):
    ref, step = cref.load_reference(run)
    res = convert(os.path.join(cref.FIXTURES, run, fmt), str(tmp_path / "out"), ConvertOptions(workers=1))
    assert res.source_format == fmt
    assert_matches(str(tmp_path / "out"), ref, step)


def test_release_fixtures_cover_every_format_each_release_saves():
    """What the GPU run recorded: saved formats per release, and the ones the release refused."""
    have = {}
    for run, fmt in RELEASES:
        have.setdefault(run, set()).add(fmt)
    assert have["release_0_14_0"] == {"fully_sharded_model_space", "dp_zero_gather_scatter"}
    assert have["release_0_15_3"] == {"fully_sharded_model_space", "dp_zero_gather_scatter", "dp_reshardable",
                                      "fully_reshardable"}
    assert have["release_0_16_1"] == {"dp_zero_gather_scatter", "dp_reshardable", "fully_reshardable"}
    errors = {r: json.load(open(os.path.join(cref.FIXTURES, r, "run.json")))["save_errors"] for r in have}
    assert "flattened_range is not supported" in errors["release_0_16_1"]["fully_sharded_model_space"][0]
    assert "flattened_range is not supported" in errors["release_0_19_2"]["fully_sharded_model_space"][0]
    assert errors["release_0_14_0"]["fully_sharded_bucket_space"]   # 0.14's torch_dist save asserts
    # ... unless each bucket holds one parameter and no padding (run.json: bucket_size 1, sizes x 128),
    # the layout its torch_dist conversion takes; stored per DP rank, (1, bucket numel)
    assert have["release_0_14_0_bucket_space"] == {"fully_sharded_bucket_space"}
    assert errors["release_0_14_0_bucket_space"] == {"fully_sharded_bucket_space": []}
    md = DcpCheckpoint(os.path.join(cref.FIXTURES, "release_0_14_0_bucket_space", "fully_sharded_bucket_space"))
    shapes = {tuple(md.tensors[k].shape) for k in md.tensors if ".bucket_idx_" in k}
    assert len(shapes) > 1 and all(len(s) == 2 and s[0] == 1 for s in shapes), shapes


@pytest.mark.parametrize("run", ["release_0_14_0", "release_0_15_3"])
def test_library_model_space_save_converts_with_the_head_dim(run, tmp_path, capsys):
    """fully_sharded_model_space is what `optimizer.sharded_state_dict(sd)` saves without metadata
    (<= 0.15): a library's save. Without args only the head dim is ambiguous."""
    src = library_copy(os.path.join(cref.FIXTURES, run, "fully_sharded_model_space"), tmp_path / "lib")
    rc, out = cli(capsys, "convert", str(src), str(tmp_path / "bad"))
    assert rc == 2 and "--kv-channels" in out and "--num-attention-heads" in out
    assert not (tmp_path / "bad").exists()
    rc, out = cli(capsys, "convert", str(src), str(tmp_path / "out"), "--kv-channels", "6")
    assert rc == 0, out
    ref, step = cref.load_reference(run)
    assert_matches(str(tmp_path / "out"), ref, step)


# ---------------------------------------------------------------------------------------------
# Library-style GTP and MoE saves: only the flags a user knows


@pytest.mark.parametrize("fmt", ["dp_reshardable", "fully_reshardable"])
def test_library_gtp_save_converts_given_heads_groups_vocab(fmt, tmp_path, capsys):
    src = library_copy(os.path.join(cref.FIXTURES, "gtp2_te", fmt), tmp_path / "lib")
    rc, out = cli(capsys, "convert", str(src), str(tmp_path / "bad"))
    assert rc == 2 and "--vocab-size" in out and "padded rows" in out, out
    rc, out = cli(capsys, "convert", str(src), str(tmp_path / "bad"), "--vocab-size", "72")
    assert rc == 2 and "--num-attention-heads --num-query-groups" in out, out
    rc, out = cli(capsys, "convert", str(src), str(tmp_path / "out"), "--vocab-size", "72",
                  "--num-attention-heads", "4", "--num-query-groups", "2")
    assert rc == 0, out
    # GTP from chunk offsets, the rest from unpadded axes: each said
    for fact in ("gtp=2", "hidden_size=24", "ffn_hidden_size=40", "kv_channels=6", "swiglu=True"):
        assert fact in out, (fact, out)
    ref, step = cref.load_reference("gtp2_te")
    assert_matches(str(tmp_path / "out"), ref, step)


@pytest.mark.parametrize("fmt", ["dp_reshardable", "fully_reshardable"])
def test_library_moe_ep2_save_infers_ep(fmt, tmp_path, capsys):
    src = library_copy(os.path.join(cref.FIXTURES, "moe_ep2", fmt), tmp_path / "lib")
    rc, out = cli(capsys, "convert", str(src), str(tmp_path / "out"), "--kv-channels", "6")
    assert rc == 0, out
    if fmt == "dp_reshardable":
        assert "ep=2 (dp_group_idx of the expert optimizer)" in out and "EP=2" in out
    ref, step = cref.load_reference("moe_ep2")
    assert_matches(str(tmp_path / "out"), ref, step)


def test_wrong_ep_flag_is_refused(tmp_path, capsys):
    src = os.path.join(cref.FIXTURES, "moe_ep2", "dp_reshardable")
    rc, out = cli(capsys, "convert", src, str(tmp_path / "out"), "--ep", "1")
    assert rc == 2 and not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------
# Facts from trainer config files and --model-config


def _bridge_run_config(vocab: int = 72, pad: bool = False) -> str:
    # Megatron-Bridge's ConfigContainer as its checkpointing writes it (OmegaConf YAML, `_target_`
    # entries; model = GPT provider / TransformerConfig fields)
    return f"""\
_target_: megatron.bridge.training.config.ConfigContainer
model:
  _target_: megatron.bridge.models.gpt_provider.GPTModelProvider
  num_layers: 2
  hidden_size: 24
  ffn_hidden_size: 40
  num_attention_heads: 4
  num_query_groups: 2
  kv_channels: 6
  gated_linear_unit: true
  activation_func:
    _target_: torch.nn.functional.silu
    _call_: false
  vocab_size: {vocab}
  should_pad_vocab: {str(pad).lower()}
  make_vocab_size_divisible_by: 8
  tensor_model_parallel_size: 1
  gtp_weight_remat_size: 2
  pipeline_model_parallel_size: 1
  add_bias_linear: false
ddp:
  _target_: megatron.core.distributed.distributed_data_parallel_config.DistributedDataParallelConfig
  overlap_grad_reduce: false
  use_distributed_optimizer: true
checkpoint:
  save: /ckpts/run
  ckpt_format: torch_dist
"""


def test_megatron_bridge_run_config_supplies_the_facts(tmp_path, capsys):
    src = library_copy(os.path.join(cref.FIXTURES, "gtp2_te", "dp_reshardable"), tmp_path / "iter_0000003")
    (src / "run_config.yaml").write_text(_bridge_run_config(vocab=67, pad=True))   # 67 -> 72 (multiple of 8)
    rc, out = cli(capsys, "convert", str(src), str(tmp_path / "out"))
    assert rc == 0, out
    assert "padded_vocab_size=72 (Megatron-Bridge run_config.yaml)" in out
    ref, step = cref.load_reference("gtp2_te")
    assert_matches(str(tmp_path / "out"), ref, step)


def test_nemo2_context_supplies_the_facts(tmp_path, capsys):
    ck = tmp_path / "nemo_ckpt"
    src = library_copy(os.path.join(cref.FIXTURES, "gtp2_te", "fully_reshardable"), ck / "weights")
    (ck / "context").mkdir()
    (ck / "context" / "model.yaml").write_text(
        "_target_: nemo.collections.llm.gpt.model.base.GPTModel\nconfig:\n"
        "  _target_: nemo.collections.llm.gpt.model.base.GPTConfig\n  num_layers: 2\n  hidden_size: 24\n"
        "  ffn_hidden_size: 40\n  num_attention_heads: 4\n  num_query_groups: 2\n  kv_channels: 6\n"
        "  gated_linear_unit: true\n  gtp_weight_remat_size: 2\n  vocab_size: 72\n"
        "tokenizer:\n  _target_: nemo.collections.common.tokenizers.huggingface.auto_tokenizer.AutoTokenizer\n")
    rc, out = cli(capsys, "convert", str(src), str(tmp_path / "out"))
    assert rc == 0, out
    assert "(NeMo context/model.yaml)" in out
    ref, step = cref.load_reference("gtp2_te")
    assert_matches(str(tmp_path / "out"), ref, step)


def test_model_config_file_and_flag_precedence(tmp_path, capsys):
    src = library_copy(os.path.join(cref.FIXTURES, "gtp2_te", "dp_reshardable"), tmp_path / "lib")
    cfg = tmp_path / "model.json"
    cfg.write_text(json.dumps({"model": {"num_attention_heads": 4, "num_query_groups": 2, "padded_vocab_size": 80}}))
    # the file's vocab is wrong; the flag wins over the file
    rc, out = cli(capsys, "convert", str(src), str(tmp_path / "out"), "--model-config", str(cfg), "--vocab-size", "72")
    assert rc == 0, out
    assert "num_attention_heads=4 (--model-config model.json)" in out
    ref, step = cref.load_reference("gtp2_te")
    assert_matches(str(tmp_path / "out"), ref, step)
    cfg.write_text("{not json")
    rc, out = cli(capsys, "convert", str(src), str(tmp_path / "out2"), "--model-config", str(cfg))
    assert rc == 2 and "not valid JSON" in out


# ---------------------------------------------------------------------------------------------
# Never without the optimizer state, unless asked


def test_dp_zero_without_its_state_object_is_refused(tmp_path, capsys):
    src = without_object(os.path.join(cref.FIXTURES, "release_0_14_0", "dp_zero_gather_scatter"), tmp_path / "cut",
                         "optimizer.distributed.dp_group_idx_0.param_state")
    rc, out = cli(capsys, "convert", str(src), str(tmp_path / "out"))
    assert rc == 2 and "dp_zero_gather_scatter" in out and "--model-only" in out, out
    assert not (tmp_path / "out").exists()


def test_unreadable_format_is_refused_naming_it(tmp_path, capsys):
    def fsdp(common):
        common["optimizer"]["param_state_sharding_type"] = "fsdp_dtensor"

    src = library_copy(os.path.join(cref.FIXTURES, "release_0_15_3", "fully_reshardable"), tmp_path / "x", drop=(),
                       edit=fsdp)
    rc, out = cli(capsys, "convert", str(src), str(tmp_path / "out"))
    assert rc == 2 and "'fsdp_dtensor'" in out and "Megatron-FSDP" in out, out


def test_model_only_converts_the_weights_alone(tmp_path, capsys):
    src = os.path.join(cref.FIXTURES, "release_0_14_0", "fully_sharded_model_space")
    rc, out = cli(capsys, "convert", src, str(tmp_path / "out"), "--model-only")
    assert rc == 0 and "model_only" in out and "left out (--model-only)" in out, out
    ref, _ = cref.load_reference("release_0_14_0")
    ck = open_checkpoint(str(tmp_path / "out"))
    assert not [p for p in ck.arrays() if p[0] in ("params",) or p[:3] in (("opt_state", "0", "mu"),)]
    from converters.megatron.plan.convert_plan import role_path

    for name, want in ref["model"].items():
        assert np.array_equal(cref.bits(ck.read(role_path("model", name))), cref.bits(want)), name


def test_mismatched_recorded_format_is_refused(tmp_path):
    def lie(common):
        common["optimizer"]["param_state_sharding_type"] = "dp_reshardable"

    src = library_copy(os.path.join(cref.FIXTURES, "release_0_15_3", "fully_sharded_model_space"), tmp_path / "x",
                       drop=(), edit=lie)
    with pytest.raises(BridgeError, match="records optimizer format 'dp_reshardable'"):
        convert(str(src), str(tmp_path / "out"), ConvertOptions(workers=1, hints=Hints()))


# ---------------------------------------------------------------------------------------------
# Pipeline parallelism (CPU only: synthetic saves; real PP2 fixtures need two GPUs, issue #23)


@pytest.fixture(scope="module")
def synth_pp2(tmp_path_factory):
    import convert_synth as synth

    d = tmp_path_factory.mktemp("pp")
    with synth.dims(L=4):
        st = synth.make_checkpoint(str(d / "dp"), "dp_reshardable", tp=2, dp=1, pp=2, bucket_size=300)
    return d, st


@pytest.mark.slow
def test_pp2_dp_reshardable_converts_per_stage_buffers(synth_pp2, tmp_path):
    """TP2 x PP2, several buckets: each stage's DistOpt buffers hold its two layers, the embedding the first
    stage's, the final norm and output layer the last stage's."""
    d, st = synth_pp2
    res = convert(str(d / "dp"), str(tmp_path / "a"), ConvertOptions(workers=1))
    assert res.layout["pp"] == 2 and res.layout["tp"] == 2 and res.layout["dp"] == 1
    assert_matches(str(tmp_path / "a"), {r: dict(v) for r, v in st.items()}, 3)


@pytest.mark.slow
def test_pp2_dp_reshardable_without_pp_is_refused(synth_pp2, tmp_path):
    d, _ = synth_pp2
    with pytest.raises(BridgeError):
        convert(str(d / "dp"), str(tmp_path / "x"), ConvertOptions(workers=1, hints=Hints(pp=1)))
    assert not (tmp_path / "x").exists()


# ---------------------------------------------------------------------------------------------
# to-megatron for older releases


def test_to_megatron_for_016_writes_common_pt_and_round_trips(tmp_path, capsys):
    """0.15 / 0.16 read the common state from common.pt (0.19 from a DCP object); the output
    converts back to the same logical arrays. (Loaded by megatron-core 0.16.1 on the GPU:
    records/gpu/2026-12-01_savers/load/.)"""
    src = os.path.join(cref.FIXTURES, "release_0_14_0", "fully_sharded_model_space")
    assert cli(capsys, "convert", src, str(tmp_path / "l"))[0] == 0
    rc, out = cli(capsys, "to-megatron", "--no-scheduler", str(tmp_path / "l"), str(tmp_path / "run"), "--tp", "1",
                  "--format", "dp_reshardable", "--megatron-core", "0.16")
    assert rc == 0, out
    it = tmp_path / "run" / "iter_0000003"
    assert (it / "common.pt").is_file()
    from converters.megatron.read.dcp import DcpCheckpoint

    ck = DcpCheckpoint(str(it))
    assert ck.object_key("common_state") is None and ck.common_state()["iteration"] == 3
    assert cli(capsys, "convert", str(it), str(tmp_path / "back"))[0] == 0
    ref, step = cref.load_reference("release_0_14_0")
    assert_matches(str(tmp_path / "back"), ref, step)
    with pytest.raises(SystemExit) as stop:   # 0.14 is not offered by --help: refused while parsing, with the reason
        cli(capsys, "to-megatron", "--no-scheduler", str(tmp_path / "l"), str(tmp_path / "run14"), "--tp", "1", "--megatron-core", "0.14")
    out = capsys.readouterr().err
    assert stop.value.code == 2 and "does not load" in out and not (tmp_path / "run14").exists()


@pytest.mark.parametrize("fmt", ["dp_reshardable", "fully_reshardable"])
def test_to_megatron_pp2_round_trips(fmt, tmp_path, capsys):
    """to-megatron at TP2 x PP2 (one layer per stage; each stage's DistOpt buffers its own params)
    converts back to the run's reference. CPU only: no real PP2 save to compare with (issue #23)."""
    src = os.path.join(cref.FIXTURES, "tp2", "dp_reshardable")
    assert cli(capsys, "convert", src, str(tmp_path / "l"))[0] == 0
    rc, out = cli(capsys, "to-megatron", "--no-scheduler", str(tmp_path / "l"), str(tmp_path / "run"), "--tp", "2", "--pp", "2",
                  "--format", fmt)
    assert rc == 0 and "PP=2" in out, out
    it = tmp_path / "run" / "iter_0000003"
    from converters.megatron.read.dcp import DcpCheckpoint

    ck = DcpCheckpoint(str(it))
    assert ck.common_state()["args"].pipeline_model_parallel_size == 2
    if fmt == "dp_reshardable":   # one DistOpt group per (TP rank, stage)
        assert {k.split(".")[2] for k in ck.tensors if k.startswith("optimizer.")} == \
            {f"dp_group_idx_{i}" for i in range(4)}
    res = convert(str(it), str(tmp_path / "back"), ConvertOptions(workers=1))
    assert res.layout["pp"] == 2 and res.layout["tp"] == 2
    ref, step = cref.load_reference("tp2")
    assert_matches(str(tmp_path / "back"), ref, step)


@pytest.mark.slow
@pytest.mark.parametrize("per_rank", [False, True], ids=["1d", "per_rank"])
def test_synthetic_fully_sharded_bucket_space_converts(tmp_path, per_rank):
    """fully_sharded_bucket_space beyond the real save (`release_0_14_0_bucket_space`: DP1, one
    parameter per bucket): padded buckets, garbage in the padding, DP-sharded, several buckets, stored
    1-D or per DP rank, (dp, bucket numel / dp) with each row in pieces, as megatron-core 0.14 does."""
    import convert_synth as synth

    st = synth.make_checkpoint(str(tmp_path / "bs"), "fully_sharded_bucket_space", tp=1, dp=2, bucket_size=300,
                               per_rank=per_rank)
    res = convert(str(tmp_path / "bs"), str(tmp_path / "out"), ConvertOptions(workers=1))
    assert res.source_format == "fully_sharded_bucket_space"
    assert_matches(str(tmp_path / "out"), {r: dict(v) for r, v in st.items()}, 3)


@pytest.mark.parametrize("module", ["converters.megatron.plan.format", "converters.megatron.plan.convert_plan",
                                    "converters.megatron.plan.model_facts"])
def test_docstring_examples(module):
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(module))
    assert result.attempted > 0 and result.failed == 0
