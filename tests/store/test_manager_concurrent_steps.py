"""Two saves of one step into a CheckpointManager root never delete each other's work.

A save stages its step in a hidden directory of the root before renaming it to `root/<step>`.
A second save of the same step starting while the first still writes must stage apart (the
first's staging directory, its claim and data, stay), the first commits the step, and the second
is refused without touching it. Staging left by a killed writer (a real process that claimed and
died) is removed by the next save; a live writer's is not.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from bridge.errors import BridgeError

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _arrays(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {"params/w": rng.standard_normal((32, 16)).astype(np.float32), "step": np.array(5, np.int64)}


def test_second_save_of_a_step_leaves_the_first_writers_staging(tmp_path):
    from bridge.store import manager
    from bridge.store.claim import claim_destination
    from bridge.store.commit import catalog_of, commit_checkpoint, save_checkpoint
    from bridge.store.plan import make_write_plan
    from bridge.store.reader import open_checkpoint
    from bridge.store.verify import verify_checkpoint
    from bridge.store.writer import CheckpointWriter

    root = str(tmp_path / "root")
    ours, theirs = _arrays(1), _arrays(2)
    item_a = manager.begin_step(root, 5)
    plan = make_write_plan(catalog_of(ours), 1)
    with claim_destination(item_a) as claim:
        writer = CheckpointWriter(claim.tmp, plan, 0)
        for name, a in ours.items():
            path = tuple(name.split("/"))
            for box in plan.lookup(path).ownership.boxes_owned_by(0):
                writer.write(path, box, a[box.slices])
        report = writer.finish(publish=False)

        item_b = manager.begin_step(root, 5)  # the second save starts while the first writes
        assert claim.owned() and os.path.isdir(claim.tmp) and item_b != item_a
        commit_checkpoint(claim, plan, reports=[report])
    final = manager.commit_step(item_a, 5)

    save_checkpoint(item_b, theirs)
    with pytest.raises(BridgeError, match="already has step 5"):
        manager.commit_step(item_b, 5)
    assert sorted(os.listdir(root)) == ["5"]  # the refused save removed its own staging only
    ck = open_checkpoint(os.path.join(final, manager.ITEM))
    for k, a in ours.items():
        assert np.array_equal(ck.read(tuple(k.split("/"))), a), k
    assert verify_checkpoint(os.path.join(final, manager.ITEM)).ok


def test_staging_of_a_killed_writer_is_removed_a_live_ones_kept(tmp_path):
    from bridge.store import manager
    from bridge.store.claim import claim_destination

    root = str(tmp_path / "root")
    killed = ("import os, sys\n"
              "from bridge.store import manager\n"
              "from bridge.store.claim import claim_destination\n"
              "c = claim_destination(manager.begin_step(sys.argv[1], 7))\n"
              "open(os.path.join(c.tmp, 'partial'), 'w').write('x')\n"
              "os._exit(0)  # no cleanup: as if killed\n")
    subprocess.run([sys.executable, "-c", killed, root], check=True, env={**os.environ, "PYTHONPATH": REPO})
    (dead,) = os.listdir(root)
    with claim_destination(manager.begin_step(root, 7)):
        assert dead not in os.listdir(root)  # provably dead: removed
        (live,) = os.listdir(root)
        manager.begin_step(root, 7)
        assert live in os.listdir(root) and len(os.listdir(root)) == 2  # ours, alive: kept
