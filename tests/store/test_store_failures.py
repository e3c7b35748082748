"""Crashes and damage: a SIGKILLed writer commits nothing; verify and reads name damaged arrays."""

import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from bridge.errors import BridgeError, IntegrityError
from bridge.layout.boxes import Box
from bridge.layout.chunks import ArrayOwnership
from bridge.store import (ArraySpec, CheckpointWriter, begin_checkpoint, commit_checkpoint, make_write_plan,
                          open_checkpoint, save_checkpoint, tmp_dir_for)
from bridge.store.verify import verify_checkpoint


def _data():
    rng = np.random.default_rng(3)
    return {("params", "x"): rng.standard_normal((64, 64)).astype(np.float32),    # writer 1 only
            ("params", "y"): rng.standard_normal((64, 32)).astype(np.float32),    # writer 0 only
            ("params", "z"): rng.standard_normal((32, 16)).astype(np.float32)}    # split 0/1


def _plan():
    data = _data()
    catalog = [ArraySpec(p, a.shape, a.dtype.name) for p, a in data.items()]
    own = {("params", "x"): ArrayOwnership((64, 64), (16, 64), np.ones((4, 1), np.int32)),
           ("params", "y"): ArrayOwnership((64, 32), (64, 32), np.zeros((1, 1), np.int32)),
           ("params", "z"): ArrayOwnership((32, 16), (16, 16), np.array([[0], [1]], np.int32))}
    return make_write_plan(catalog, 2, own), data


def _write(dst, writer_id, stall_file=None):
    """Writer process; with `stall_file`, writes (and flushes) half its data, signals, then hangs."""
    plan, data = _plan()
    w = CheckpointWriter(tmp_dir_for(dst), plan, writer_id, batch_bytes=1)
    boxes = [(ap, b) for ap in plan.arrays.values() for b in ap.ownership.boxes_owned_by(writer_id)]
    for i, (ap, box) in enumerate(boxes):
        if stall_file and i == len(boxes) // 2:
            open(stall_file, "w").close()
            time.sleep(600)
        w.write(ap.spec.path, box, data[ap.spec.path][box.slices])
    w.finish()


def _save_all(dst):
    plan, _ = _plan()
    begin_checkpoint(dst)
    for w in range(2):
        _write(dst, w)
    return commit_checkpoint(dst, plan, timeout=5)


@pytest.mark.slow
def test_sigkilled_writer_leaves_no_checkpoint_and_rerun_succeeds(tmp_path):
    earlier = _save_all(str(tmp_path / "step_1"))
    dst = str(tmp_path / "step_2")
    plan, data = _plan()
    begin_checkpoint(dst)
    stall = str(tmp_path / "stalled")
    ctx = mp.get_context("spawn")
    victim = ctx.Process(target=_write, args=(dst, 1, stall))
    victim.start()
    deadline = time.monotonic() + 300   # only bounds a writer that failed to start: not a race
    while not os.path.exists(stall) and victim.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert os.path.exists(stall), "writer 1 never reached the middle of its writes"
    os.kill(victim.pid, signal.SIGKILL)
    victim.join(120)
    assert victim.exitcode == -signal.SIGKILL
    _write(dst, 0)
    with pytest.raises(BridgeError, match=r"writers \[1\] did not finish"):
        commit_checkpoint(dst, plan, timeout=1)
    assert not os.path.exists(dst)
    with pytest.raises(BridgeError):
        open_checkpoint(dst)
    with pytest.raises(BridgeError, match="uncommitted"):
        open_checkpoint(tmp_dir_for(dst))
    assert verify_checkpoint(earlier).ok
    # Rerun from scratch: the stale tmp dir is replaced and the save commits.
    _save_all(dst)
    ck = open_checkpoint(dst)
    for p, a in data.items():
        assert np.array_equal(ck.read(p), a)


def _largest_data_file(ck_dir, writer):
    d = os.path.join(ck_dir, f"ocdbt.process_{writer}", "d")
    return max((os.path.join(d, f) for f in os.listdir(d)), key=os.path.getsize)


def _verify_cli(path):
    r = subprocess.run([sys.executable, "-m", "bridge.cli", "verify", path], capture_output=True, text=True)
    return r.returncode, r.stdout + r.stderr


def _flip(path):
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x10]))


def _truncate(path):
    os.truncate(path, os.path.getsize(path) // 2)


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["missing", "truncated", "flipped"])
def test_damaged_data_is_detected_by_verify_and_reads(tmp_path, damage):
    dst = _save_all(str(tmp_path / "ck"))
    assert _verify_cli(dst)[0] == 0
    victim = _largest_data_file(dst, 1)
    {"missing": os.remove, "truncated": _truncate, "flipped": _flip}[damage](victim)
    rc, out = _verify_cli(dst)
    assert rc == 1, out
    assert "DAMAGED params/x" in out
    assert "DAMAGED params/y" not in out            # writer 0's array is untouched
    with pytest.raises(IntegrityError, match="params/x"):
        open_checkpoint(dst).read(("params", "x"))
    assert np.array_equal(open_checkpoint(dst).read(("params", "y")), _data()[("params", "y")])


@pytest.mark.slow
def test_edited_metadata_is_detected(tmp_path):
    dst = _save_all(str(tmp_path / "ck"))
    meta_path = os.path.join(dst, "_METADATA")
    meta = json.load(open(meta_path))
    meta["custom_metadata"]["gtp_bridge"]["arrays"]["params.z"]["shape"] = [32, 17]
    json.dump(meta, open(meta_path, "w"))
    rc, out = _verify_cli(dst)
    assert rc == 1 and "DAMAGED metadata" in out and "DAMAGED params/z" in out, out
    # An edit that keeps every record consistent (a dropped tree entry) is still caught by the checksum.
    dst2 = _save_all(str(tmp_path / "ck2"))
    meta = json.load(open(os.path.join(dst2, "_METADATA")))
    meta["tree_metadata"].pop("('params', 'y')")
    json.dump(meta, open(os.path.join(dst2, "_METADATA"), "w"))
    rc, out = _verify_cli(dst2)
    assert rc == 1 and "DAMAGED metadata" in out and "params/y" in out, out


def test_overlapping_ownership_rejected_before_any_byte_is_written(tmp_path):
    from bridge.layout.chunks import ownership_from_claims

    dst = tmp_path / "ck"
    with pytest.raises(BridgeError, match="both claim"):
        own = ownership_from_claims((8, 4), (2, 4), {0: [Box((0, 0), (4, 4))], 1: [Box((2, 0), (8, 4))]})
        make_write_plan([ArraySpec(("params", "w"), (8, 4), "float32")], 2, {("params", "w"): own})
    assert not dst.exists() and not os.path.exists(tmp_dir_for(str(dst)))


def test_bad_input_writes_nothing(tmp_path):
    dst = tmp_path / "ck"
    # data/catalog mismatch in a writer: refused, and the commit then refuses the gap.
    plan = make_write_plan([ArraySpec(("params", "w"), (8, 4), "float32")], 1)
    claim = begin_checkpoint(str(dst))
    tmp = claim.tmp
    w = CheckpointWriter(tmp, plan, 0)
    with pytest.raises(BridgeError, match="params/w: data shape"):
        w.write(("params", "w"), Box((0, 0), (8, 4)), np.zeros((8, 5), np.float32))
    with pytest.raises(BridgeError, match="not in the write plan"):
        w.write(("params", "v"), Box((0, 0), (8, 4)), np.zeros((8, 4), np.float32))
    w.finish()
    with pytest.raises(BridgeError, match="not fully written"):
        commit_checkpoint(claim, plan, timeout=1)
    assert not dst.exists()
    with pytest.raises(BridgeError, match="unsupported dtype"):
        make_write_plan([ArraySpec(("params", "w"), (8, 4), "float8")], 1)
    with pytest.raises(BridgeError, match="is a leaf and also the parent"):
        save_checkpoint(str(tmp_path / "c2"), {("a",): np.zeros(1, np.float32), ("a", "b"): np.zeros(1, np.float32)})
    assert not (tmp_path / "c2").exists() and not os.path.exists(tmp_dir_for(str(tmp_path / "c2")))


def test_overlapping_writes_are_refused_and_the_rest_commits(tmp_path):
    # Chunks of 2 rows. A box over chunks 0 and 1, then overlaps in its second chunk and in its
    # first: both refused, naming both boxes; the disjoint rest is written and reads back exactly.
    dst = str(tmp_path / "ck")
    path = ("params", "w")
    a = np.random.default_rng(5).standard_normal((8, 4)).astype(np.float32)
    plan = make_write_plan([ArraySpec(path, (8, 4), "float32")], 1,
                           {path: ArrayOwnership((8, 4), (2, 4), np.zeros((4, 1), np.int32))})
    claim = begin_checkpoint(dst)
    w = CheckpointWriter(claim.tmp, plan, 0)
    w.write(path, Box((0, 0), (3, 2)), a[0:3, 0:2])
    with pytest.raises(BridgeError, match=r"params/w: box \[2:4, 1:2\] overlaps box \[0:3, 0:2\] written before"):
        w.write(path, Box((2, 1), (4, 2)), a[2:4, 1:2])
    with pytest.raises(BridgeError, match=r"box \[0:1, 1:3\] overlaps box \[0:3, 0:2\]"):
        w.write(path, Box((0, 1), (1, 3)), a[0:1, 1:3])
    w.write(path, Box((3, 0), (8, 2)), a[3:8, 0:2])
    for r in range(8):  # one box per row: the boxes of a chunk add up
        w.write(path, Box((r, 2), (r + 1, 4)), a[r:r + 1, 2:4])
    w.finish()
    commit_checkpoint(claim, plan, timeout=5)
    np.testing.assert_array_equal(open_checkpoint(dst).read(path), a)
