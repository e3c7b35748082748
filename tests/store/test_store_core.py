"""Core store behaviour in one process: round trip, ownership refusals, bad input, tmp dirs."""

import json
import os

import ml_dtypes
import numpy as np
import pytest

from bridge.errors import BridgeError, IntegrityError
from bridge.layout.boxes import Box
from bridge.layout.chunks import ArrayOwnership, ownership_from_claims, regular_ownership
from bridge.store import (ArraySpec, CheckpointWriter, begin_checkpoint, commit_checkpoint, make_write_plan,
                          megatron_key_to_path, open_checkpoint, save_checkpoint, tmp_dir_for)
from bridge.store import digest as dg
from bridge.format.seal import seal_metadata
from bridge.format.tree import path_to_name


def _arrays(rng):
    return {
        ("params", "w"): rng.standard_normal((13, 7)).astype(np.float32),
        ("params", "b"): rng.standard_normal((5,)).astype(ml_dtypes.bfloat16),
        ("params", "h"): rng.standard_normal((3, 4, 5)).astype(np.float16),
        ("params", "i"): rng.integers(-9, 9, (6, 2)).astype(np.int32),
        ("step",): np.array(7, np.int32),
        ("extra", "u8"): rng.integers(0, 255, (9,)).astype(np.uint8),
        ("extra", "i8"): rng.integers(-128, 127, (2, 9)).astype(np.int8),
        ("extra", "f64"): rng.standard_normal((3, 3)),
        ("extra", "mask"): rng.integers(0, 2, (4, 4)).astype(bool),
        ("extra", "empty"): np.zeros((0, 6), np.float32),
    }


def test_round_trip_multi_writer_reads_back_bit_exact(tmp_path):
    arrays = _arrays(np.random.default_rng(0))
    dst = save_checkpoint(str(tmp_path / "ck"), arrays, num_writers=3)
    ck = open_checkpoint(dst)
    assert set(ck.paths()) == set(arrays)
    for p, a in arrays.items():
        got = ck.read(p)
        assert got.dtype == a.dtype and got.shape == a.shape
        assert got.tobytes() == a.tobytes(), p
        # Manifest digest equals an independent whole-array digest.
        assert ck.manifest.arrays[path_to_name(p)].digest == dg.to_hex(dg.digest_array(a))
    part = ck.read(("params", "w"), Box((2, 1), (9, 5)))
    assert np.array_equal(part, arrays[("params", "w")][2:9, 1:5])
    assert not os.path.exists(tmp_dir_for(dst))


def test_write_outside_owned_chunks_is_refused_naming_array_box_owner(tmp_path):
    plan = make_write_plan([ArraySpec(("params", "w"), (8, 2), "float32")], 2)
    tmp = begin_checkpoint(str(tmp_path / "ck")).tmp
    w0 = CheckpointWriter(tmp, plan, 0)
    with pytest.raises(BridgeError, match=r"params/w.*\[2:6, 0:2\].*owned by writer 1"):
        w0.write(("params", "w"), Box((2, 0), (6, 2)), np.zeros((4, 2), np.float32))
    with pytest.raises(BridgeError, match="dtype float64 does not match"):
        w0.write(("params", "w"), Box((0, 0), (4, 2)), np.zeros((4, 2)))
    with pytest.raises(BridgeError, match="data shape"):
        w0.write(("params", "w"), Box((0, 0), (4, 2)), np.zeros((3, 2), np.float32))


def test_gap_fails_commit_naming_region_and_nothing_appears(tmp_path):
    dst = str(tmp_path / "ck")
    plan = make_write_plan([ArraySpec(("params", "w"), (8, 2), "float32")], 2)
    claim = begin_checkpoint(dst)
    tmp = claim.tmp
    w0 = CheckpointWriter(tmp, plan, 0)
    w0.write(("params", "w"), Box((0, 0), (4, 2)), np.ones((4, 2), np.float32))
    w0.finish()
    w1 = CheckpointWriter(tmp, plan, 1)
    w1.write(("params", "w"), Box((4, 0), (7, 2)), np.ones((3, 2), np.float32))
    w1.finish()
    with pytest.raises(BridgeError, match=r"params/w: region \[4:8, 0:2\] was not fully written"):
        commit_checkpoint(claim, plan, timeout=5)
    assert not os.path.exists(dst)
    with pytest.raises(BridgeError, match="uncommitted"):
        open_checkpoint(tmp)


def test_overlapping_claims_rejected():
    with pytest.raises(BridgeError, match="both claim"):
        ownership_from_claims((8, 2), (2, 2), {0: [Box((0, 0), (4, 2))], 1: [Box((2, 0), (8, 2))]})


@pytest.mark.parametrize("bad", ["a.b", "a/b", "..", ""])
def test_bad_names_refused_before_anything_is_written(tmp_path, bad):
    dst = tmp_path / "ck"
    with pytest.raises(BridgeError, match="tree name component"):
        save_checkpoint(str(dst), {("params", bad): np.zeros(2, np.float32)})
    assert not os.path.exists(dst) and not os.path.exists(tmp_dir_for(str(dst)))


def test_unknown_dtype_and_existing_destination_refused(tmp_path):
    with pytest.raises(BridgeError, match="unsupported dtype 'complex64'"):
        save_checkpoint(str(tmp_path / "a"), {("x",): np.zeros(2, np.complex64)})
    (tmp_path / "b").mkdir()
    with pytest.raises(BridgeError, match="already exists"):
        save_checkpoint(str(tmp_path / "b"), {("x",): np.zeros(2, np.float32)})
    assert os.listdir(tmp_path / "b") == []


def test_regular_ownership_and_megatron_keys():
    own = regular_ownership((10, 3), 4)
    assert [b.size for w in range(4) for b in own.boxes_owned_by(w)] == [9, 9, 9, 3]
    assert own.owner_of(Box((3, 0), (6, 3))) == 1
    with pytest.raises(BridgeError, match="spans chunks owned by writers"):
        own.owner_of(Box((2, 0), (4, 3)))
    assert ArrayOwnership.from_json(own.to_json()) == own
    assert megatron_key_to_path("module.decoder.layers.0.mlp.linear_fc1.weight") == (
        "decoder", "layers", "0", "mlp", "linear_fc1", "weight")


def test_newer_manifest_version_is_refused(tmp_path):
    dst = save_checkpoint(str(tmp_path / "ck"), {("x",): np.zeros(2, np.float32)})
    meta = json.load(open(os.path.join(dst, "_METADATA")))
    meta["custom_metadata"]["gtp_bridge"]["format_version"] = 99
    json.dump(meta, open(os.path.join(dst, "_METADATA"), "w"))
    # an edit: refused by the checksum, and by the version once the reader is told to look anyway
    with pytest.raises(IntegrityError, match="checksum mismatch.*allow_edited_metadata=True"):
        open_checkpoint(dst)
    with pytest.raises(BridgeError, match="newer than this gtp-bridge supports"):
        open_checkpoint(dst, allow_edited_metadata=True)
    # a newer writer seals what it writes: refused by the version alone
    ckpt_meta = json.load(open(os.path.join(dst, "_CHECKPOINT_METADATA")))
    ckpt_meta["custom_metadata"]["gtp_bridge_checksum"] = seal_metadata(meta)
    json.dump(meta, open(os.path.join(dst, "_METADATA"), "w"))
    json.dump(ckpt_meta, open(os.path.join(dst, "_CHECKPOINT_METADATA"), "w"))
    with pytest.raises(BridgeError, match="newer than this gtp-bridge supports"):
        open_checkpoint(dst)
