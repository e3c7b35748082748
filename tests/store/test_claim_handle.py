"""`begin_checkpoint` returns what `commit_checkpoint` needs (issue 32): the claim is an object handed
down from the begin to the commit, never found again by its location.

- in one process the handle is committed (or released) as it is, locally and on object storage;
- a process that did not begin (writers started apart) commits DST: the claim is read from what it
  recorded (`Storage.claimed`), and a failed commit there removes nothing of the claimant's;
- another rank's handle (`Storage.handle`, built from the claim's record as `begin_checkpoint` sends
  it to every rank) never removes what the run wrote; only the claimant's does;
- nothing in the product looks a claim up by its location (no registry lookup, no private
  `_load_claim` outside its module).
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "support"))
from servers import remote_servers  # noqa: E402

from bridge.errors import BridgeError  # noqa: E402
from bridge.store import (ArraySpec, CheckpointWriter, begin_checkpoint, commit_checkpoint,  # noqa: E402
                          make_write_plan, open_checkpoint)
from bridge.store import held  # noqa: E402
from bridge.store.storage import open_storage  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[2]
PATH = ("params", "w")


def _plan():
    return make_write_plan([ArraySpec(PATH, (8, 4), "float32")], 1)


def _write(tmp: str, plan, a: np.ndarray) -> dict:
    """Writer 0 writes all of `a` into `tmp`; returns its report (nothing published)."""
    w = CheckpointWriter(tmp, plan, 0)
    for box in plan.lookup(PATH).ownership.boxes_owned_by(0):
        w.write(PATH, box, a[box.slices])
    return w.finish(publish=False)


def _data(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((8, 4)).astype(np.float32)


def test_the_claim_begin_returns_is_what_commit_takes(tmp_path):
    dst = str(tmp_path / "ck")
    plan, a = _plan(), _data(1)
    claim = begin_checkpoint(dst)
    assert claim.dst == os.path.abspath(dst) and os.path.isdir(claim.tmp) and claim in held.all_held()
    report = _write(claim.tmp, plan, a)
    assert commit_checkpoint(claim, plan, reports=[report]) == os.path.abspath(dst)
    assert claim.published and claim not in held.all_held() and not os.path.exists(claim.tmp)
    np.testing.assert_array_equal(open_checkpoint(dst).read(PATH), a)


def test_two_claims_of_one_process_commit_each_their_own(tmp_path):
    """Two destinations in flight at once: each handle commits its own (nothing is looked up)."""
    plan = _plan()
    claims = {d: begin_checkpoint(str(tmp_path / d)) for d in ("a", "b")}
    reports = {d: _write(c.tmp, plan, _data(ord(d))) for d, c in claims.items()}
    for d in ("b", "a"):
        commit_checkpoint(claims[d], plan, reports=[reports[d]])
    for d in ("a", "b"):
        np.testing.assert_array_equal(open_checkpoint(str(tmp_path / d)).read(PATH), _data(ord(d)))


def test_another_ranks_handle_removes_nothing_the_claimants_does(tmp_path):
    """The handle a rank other than 0 gets (the claim's record, as `begin_checkpoint` sends it) never
    removes the run's files, even with the claimant's pid (another host); the claimant's release does."""
    dst = str(tmp_path / "ck")
    claim = begin_checkpoint(dst)
    _write(claim.tmp, _plan(), _data(2))
    other = open_storage(claim.dst).handle(dataclasses.replace(claim.info, host="another-host"))
    assert other.tmp == claim.tmp and other.run_id == claim.run_id
    other.release(reason="a peer failed")
    assert os.path.isdir(claim.tmp) and claim.owned()
    claim.release()
    assert not os.path.exists(claim.tmp)


CHILD = textwrap.dedent("""
    import sys
    import numpy as np
    from bridge.store import ArraySpec, CheckpointWriter, commit_checkpoint, make_write_plan
    from bridge.errors import BridgeError
    dst, tmp, mode = sys.argv[1:]
    plan = make_write_plan([ArraySpec(("params", "w"), (8, 4), "float32")], 1)
    a = np.random.default_rng(3).standard_normal((8, 4)).astype(np.float32)
    if mode == "write":
        w = CheckpointWriter(tmp, plan, 0)
        for box in plan.lookup(("params", "w")).ownership.boxes_owned_by(0):
            w.write(("params", "w"), box, a[box.slices])
        w.finish()
    try:
        print(commit_checkpoint(dst, plan, timeout=0.5))   # a committer that did not begin: DST
    except BridgeError as e:
        print("refused:", e)
""")


def _child(dst: str, tmp: str, mode: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-c", CHILD, dst, tmp, mode], capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_a_committer_that_did_not_begin_reads_the_recorded_claim(tmp_path):
    """Writers started apart: the committing process passes DST; the claim comes from its record. A
    failed commit there (writer missing) removes nothing of the claimant's; a good one publishes."""
    dst = str(tmp_path / "ck")
    claim = begin_checkpoint(dst)
    out = _child(dst, claim.tmp, "missing")
    assert out.startswith("refused:") and "writer" in out and os.path.isdir(claim.tmp) and claim.owned()
    assert _child(dst, claim.tmp, "write") == os.path.abspath(dst)
    np.testing.assert_array_equal(open_checkpoint(dst).read(PATH), np.random.default_rng(3).standard_normal(
        (8, 4)).astype(np.float32))
    claim.release()   # published by the other process: nothing left to remove, and no longer held
    assert claim not in held.all_held() and os.path.isdir(dst)


def test_commit_of_a_destination_nobody_claimed_is_refused(tmp_path):
    with pytest.raises(BridgeError, match="no checkpoint in progress"):
        commit_checkpoint(str(tmp_path / "ck"), _plan())
    assert not os.path.exists(tmp_path / "ck")


@pytest.fixture(scope="module")
def stores():
    with remote_servers() as servers:
        yield servers


@pytest.mark.parametrize("scheme", ["s3", "gs"])
def test_object_storage_claim_is_handed_to_the_commit(stores, scheme):
    url = stores[scheme].url("handle/ck")
    plan, a = _plan(), _data(4)
    claim = begin_checkpoint(url)
    assert claim.tmp == claim.dst == url and claim in held.all_held()
    other = open_storage(url).handle(dataclasses.replace(claim.info, host="another-host"))
    other.release(reason="a peer failed")   # another rank's handle: the claim object stays
    assert open_storage(url).claimed().run_id == claim.run_id
    report = _write(claim.tmp, plan, a)
    assert commit_checkpoint(claim, plan, reports=[report]) == url
    assert claim not in held.all_held()
    np.testing.assert_array_equal(open_checkpoint(url).read(PATH), a)
    with pytest.raises(BridgeError, match="holds no gtp-bridge claim"):
        open_storage(url).claimed()   # published: the claim object is gone


def test_no_claim_is_looked_up_by_its_location():
    """The registry lookups (`held_destination`, `held_claim`, `held_remote`, `held.lookup`) are gone,
    and `bridge.store.remote._load_claim` is used only inside its module."""
    gone = re.compile(r"\b(held_destination|held_claim|held_remote|held\.lookup)\b")
    offenders = []
    for root in ("bridge", "converters"):
        for p in sorted((REPO / root).rglob("*.py")):
            text = p.read_text()
            rel = p.relative_to(REPO).as_posix()
            if gone.search(text) or (rel != "bridge/store/remote.py" and "_load_claim" in text):
                offenders.append(rel)
    assert offenders == []
