"""`convert`: real Megatron-Core fixtures and synthetic multi-rank saves against independent references."""

from __future__ import annotations

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
from converters.megatron.plan.format import Hints
from converters.megatron.plan.convert_plan import role_path
import convert_reference as cref
import convert_synth as synth

RUNS = cref.available_runs()
LIBRARY_STYLE = {"tp1": Hints(kv_channels=6)}          # saved without args: the head dim is a flag
MULTI_BUCKET = {"tp1_buckets", "dp2_buckets"}           # 0.19.2 fully_reshardable defect applies


def assert_matches(dst: str, ref: dict, step: int) -> None:
    ck = open_checkpoint(dst)
    n = 0
    for role, arrays in ref.items():
        for name, want in arrays.items():
            got = ck.read(role_path(role, name))
            assert got.dtype == want.dtype and got.shape == want.shape, (role, name, got.dtype, got.shape)
            assert np.array_equal(cref.bits(got), cref.bits(want)), f"{role} {name} differs from the reference"
            n += 1
    assert n and int(ck.read(("step",))) == step and int(ck.read(("opt_state", "0", "count"))) == step
    # nothing beyond the reference + count + step
    assert len(ck.arrays()) == n + 2


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    out = tmp_path_factory.mktemp("fx")
    done = {}
    for run in RUNS:
        for fmt in ("dp_reshardable", "fully_reshardable"):
            if fmt == "fully_reshardable" and run in MULTI_BUCKET:
                continue
            dst = str(out / f"{run}_{fmt}")
            convert(os.path.join(cref.FIXTURES, run, fmt), dst, ConvertOptions(workers=1, hints=LIBRARY_STYLE.get(run)))
            done[(run, fmt)] = dst
    return done


@pytest.mark.slow
@pytest.mark.parametrize("run", RUNS)
def test_fixture_converts_bit_exact_to_reference(run, converted):
    ref, step = cref.load_reference(run)
    for fmt in ("dp_reshardable", "fully_reshardable"):
        if (run, fmt) in converted:
            assert_matches(converted[(run, fmt)], ref, step)


@pytest.mark.slow
@pytest.mark.parametrize("run", [r for r in RUNS if r not in MULTI_BUCKET])
def test_both_formats_convert_identically(run, converted):
    cref.assert_same_checkpoint(converted[(run, "dp_reshardable")], converted[(run, "fully_reshardable")])


@pytest.mark.parametrize("run", [r for r in RUNS if r in MULTI_BUCKET])
def test_multi_bucket_fully_reshardable_defect_refused(run, tmp_path, converted):
    src = os.path.join(cref.FIXTURES, run, "fully_reshardable")
    with pytest.raises(BridgeError, match=r"masters disagree with the bf16 weights.*--force"):
        convert(src, str(tmp_path / "x"))
    assert not os.path.lexists(tmp_path / "x") and not list(tmp_path.iterdir())
    # --force converts, and the independent reference confirms the masters really are corrupt
    convert(src, str(tmp_path / "forced"), ConvertOptions(force=True))
    ref, _ = cref.load_reference(run)
    ck = open_checkpoint(str(tmp_path / "forced"))
    corrupt = [n for n, a in ref["params"].items() if not np.array_equal(cref.bits(ck.read(role_path("params", n))), cref.bits(a))]
    assert corrupt
    for n, a in ref["model"].items():  # the model weights themselves are intact
        assert np.array_equal(cref.bits(ck.read(role_path("model", n))), cref.bits(a))


def test_manifest_records_source_and_hyperparameters(converted):
    run = "moe_ep1" if "moe_ep1" in RUNS else RUNS[0]
    from bridge.format.manifest import MANIFEST_KEY, Manifest
    import json

    meta = json.load(open(os.path.join(converted[(run, "dp_reshardable")], "_METADATA")))
    m = Manifest.from_json(meta["custom_metadata"][MANIFEST_KEY])
    assert m.source.framework == "megatron" and m.source.optimizer_format == "dp_reshardable"
    assert m.optimizer.lr == 0.01 and m.optimizer.betas == (0.9, 0.95) and m.optimizer.eps == 1e-8
    assert m.optimizer.weight_decay == 0.1 and m.optimizer.step == 3
    assert "decoder/layers/self_attention/linear_qkv/weight" in m.fused
    fc1 = "decoder/layers/mlp/experts/experts/linear_fc1/weight" if run == "moe_ep1" else "decoder/layers/mlp/linear_fc1/weight"
    assert [s[0] for s in m.fused[fc1]["sections"]] == ["gate", "up"]
    assert len(m.optimizer.groups) == 2 and {g["wd_mult"] for g in m.optimizer.groups} == {0.0, 1.0}
    # clip_grad: what the run's saved args say (tinygpt.build trains with clip_grad=1.0)
    from converters.megatron.read.dcp import DcpCheckpoint

    args = DcpCheckpoint(os.path.join(cref.FIXTURES, run, "dp_reshardable")).common_state()["args"]
    assert args.clip_grad == 1.0 and m.optimizer.clip_grad == args.clip_grad


def test_manifest_json_keeps_its_key_order(converted):
    """_METADATA is written with JSON keys unsorted: the manifest keeps the order convert always wrote,
    so checkpoints stay byte-identical across refactors (read raw, not through bridge.format)."""
    import json

    run = RUNS[0]
    meta = json.load(open(os.path.join(converted[(run, "dp_reshardable")], "_METADATA")))
    man = meta["custom_metadata"]["gtp_bridge"]
    assert list(man) == ["format_version", "source", "optimizer", "fused", "arrays", "digest_algorithm", "extra"]
    assert list(man["source"]) == ["framework", "tp", "gtp", "dp", "ep", "etp", "egtp", "pp", "cp", "pad_for_alignment",
                                   "optimizer_format", "world_size"]
    assert list(man["extra"]) == ["megatron", "replicas"]  # replicas: appended last (issue 30)
    assert list(man["extra"]["megatron"])[:10] == [
        "source_dir", "params", "param_groups", "extra_state_keys", "extra_state_payload", "args", "inferred",
        "wd_mult_zero_params", "iteration", "checkpoint_version"]
    assert man["extra"]["megatron"]["source_dir"].endswith(os.path.join(run, "dp_reshardable"))


# --- synthetic multi-rank saves (real gloo ranks + dcp.save), built independently -----------------


@pytest.fixture(scope="module")
def synth_tp2_dp2(tmp_path_factory):
    d = tmp_path_factory.mktemp("synth")
    st = synth.make_checkpoint(str(d / "dp"), "dp_reshardable", tp=2, dp=2, bucket_size=300)
    synth.make_checkpoint(str(d / "fr"), "fully_reshardable", tp=2, dp=1)
    return d, st


def _synth_ref(st):
    return {r: dict(v) for r, v in st.items()}


@pytest.mark.slow
def test_synthetic_tp2_dp2_multibucket_dp_reshardable(synth_tp2_dp2, tmp_path):
    d, st = synth_tp2_dp2
    convert(str(d / "dp"), str(tmp_path / "a"), ConvertOptions(workers=2, min_worker_bytes=1))  # 2 processes
    assert_matches(str(tmp_path / "a"), _synth_ref(st), 3)
    convert(str(d / "fr"), str(tmp_path / "b"))
    cref.assert_same_checkpoint(str(tmp_path / "a"), str(tmp_path / "b"))


@pytest.mark.skipif("tp2" not in RUNS, reason="needs the tp2 fixture")
def test_small_budget_streams_in_blocks_identically(tmp_path):
    """A 64k budget cuts parameters into many outer chunks; the result still equals the reference."""
    from bridge.budget import split_share
    from converters.megatron.read.dcp import DcpCheckpoint
    from converters.megatron.convert import build_units
    from converters.megatron.plan.format import describe
    from converters.megatron.plan.convert_plan import plan_blocks

    src = os.path.join(cref.FIXTURES, "tp2", "dp_reshardable")
    units = build_units(describe(DcpCheckpoint(src)), Hints())
    blocks, _ = plan_blocks(units, split_share(64 << 10).block)
    assert len(blocks) >= len(units) + 3     # the budget really splits
    convert(src, str(tmp_path / "small"), ConvertOptions(budget=64 << 10))
    ref, step = cref.load_reference("tp2")
    assert_matches(str(tmp_path / "small"), ref, step)


@pytest.mark.slow
def test_synthetic_wrong_bucket_size_is_refused(synth_tp2_dp2, tmp_path):
    d, _ = synth_tp2_dp2
    with pytest.raises(BridgeError, match="per_bucket_numel_unpadded"):
        convert(str(d / "dp"), str(tmp_path / "x"), ConvertOptions(hints=Hints(bucket_size=10_000)))
    assert not list(tmp_path.iterdir())


# --- bad input: one line, exit 2, nothing at DST ----------------------------------------------------


def _cli_fails(capsys, tmp_path, src, *extra) -> str:
    dst = tmp_path / "dst"
    rc = main(["convert", str(src), str(dst), *extra])
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert err.startswith("gtp-bridge: error: ") and "\n" not in err, err
    assert not os.path.lexists(dst) and not os.path.lexists(str(dst) + ".orbax-checkpoint-tmp")
    return err


def _copy_fixture(tmp_path, run="moe_ep1", fmt="dp_reshardable") -> Path:
    src = tmp_path / "src"
    shutil.copytree(os.path.join(cref.FIXTURES, run, fmt), src)
    return src


pytestmark_fixture = pytest.mark.skipif(not RUNS, reason="no real fixtures committed")


@pytestmark_fixture
def test_bad_not_a_checkpoint(capsys, tmp_path):
    (tmp_path / "empty").mkdir()
    assert "not a torch_dist checkpoint" in _cli_fails(capsys, tmp_path, tmp_path / "empty")


@pytestmark_fixture
def test_bad_truncated_distcp(capsys, tmp_path):
    src = _copy_fixture(tmp_path)
    f = next(src.glob("*.distcp"))
    f.write_bytes(f.read_bytes()[:1000])
    assert "truncated shard file" in _cli_fails(capsys, tmp_path, src)


@pytestmark_fixture
def test_bad_missing_shard(capsys, tmp_path):
    src = _copy_fixture(tmp_path)
    next(src.glob("*.distcp")).unlink()
    assert "missing shard file" in _cli_fails(capsys, tmp_path, src)


@pytestmark_fixture
def test_bad_malicious_pickle(capsys, tmp_path):
    src = _copy_fixture(tmp_path)
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (src / ".metadata").write_bytes(pickle.dumps(Evil()))
    assert "refusing to unpickle" in _cli_fails(capsys, tmp_path, src)
    assert not marker.exists()


@pytestmark_fixture
def test_bad_unknown_format(capsys, tmp_path):
    import torch
    import torch.distributed.checkpoint as dcp

    dcp.save({"foo": torch.ones(3)}, checkpoint_id=str(tmp_path / "plain"))
    assert "unknown format" in _cli_fails(capsys, tmp_path, tmp_path / "plain")
    src = _copy_fixture(tmp_path)
    (src / "metadata.json").write_text('{"sharded_backend": "zarr"}')
    assert "only torch_dist" in _cli_fails(capsys, tmp_path, src)


@pytestmark_fixture
def test_bad_unrebuildable_layout(capsys, tmp_path):
    src = _copy_fixture(tmp_path)
    err = _cli_fails(capsys, tmp_path, src, "--bucket-size", "100")
    assert "per_bucket_numel_unpadded" in err and "--bucket-size" in err


@pytestmark_fixture
def test_bad_destination_exists(capsys, tmp_path):
    (tmp_path / "dst").mkdir()
    rc = main(["convert", os.path.join(cref.FIXTURES, RUNS[0], "dp_reshardable"), str(tmp_path / "dst")])
    assert rc == 2 and "already exists" in capsys.readouterr().err


@pytest.mark.parametrize("run", [r for r in ("dp2", "moe_ep2", "gtp2_te") if r in RUNS])
def test_no_decay_mask_matches_the_runs_param_groups(run, converted):
    """Manifest no_decay == the params the live optimizer put in its weight-decay-0 group (reference dumps)."""
    import glob
    import json

    import torch

    from bridge.format.manifest import MANIFEST_KEY, Manifest

    moe = "moe" in run
    want = set()
    for f in glob.glob(os.path.join(cref.FIXTURES, run, "reference_rank*.pt")):
        ref = torch.load(f, weights_only=True)
        for o in ref["optimizers"]:
            for name, rec in o["params"].items():
                if float(o["param_groups"][rec["group_index"]]["weight_decay"]) == 0.0:
                    want.add(cref.checkpoint_key(name, moe)[0].replace(".", "/"))
    meta = json.load(open(os.path.join(converted[(run, "dp_reshardable")], "_METADATA")))
    m = Manifest.from_json(meta["custom_metadata"][MANIFEST_KEY])
    got = set()
    for p in m.optimizer.no_decay:
        for fused in m.fused:
            if p.startswith(fused + "/"):
                p = fused
        got.add(p)
    assert want and got == want


@pytestmark_fixture
def test_bad_tp_flag_contradicting_chunks(capsys, tmp_path):
    if "tp2" not in RUNS:
        pytest.skip("needs tp2")
    err = _cli_fails(capsys, tmp_path, os.path.join(cref.FIXTURES, "tp2", "fully_reshardable"), "--tp", "1")
    assert "chunk offsets" in err and "TP=2" in err

