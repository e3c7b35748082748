"""Coordinators on real gloo process groups: errors reach every rank, exports run on subgroups.

World 4 throughout. The exported checkpoints are compared with the state assembled independently
from the ranks' raw shards (`tests/support/live_reference.py`), read back with the store reader.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from live_model import FP8, MODEL, STEP, expected_state, local_params
from spawn_ranks import spawn

ROOTS = {"model": ("model",), "params": ("params",), "mu": ("opt_state", "0", "mu"), "nu": ("opt_state", "0", "nu")}


def _gather_in_halves(rank, world):
    """Two subgroups gather independently; in the second, group rank 1 (world rank 3) fails."""
    import torch.distributed as dist

    from bridge.dist import CollectiveError, TorchCoordinator

    halves = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    coord = TorchCoordinator(halves[rank // 2], job=f"half {rank // 2}")

    def work():
        if rank == 3:
            raise OSError("disk\nfull")
        return {"world_rank": rank}

    try:
        got = coord.all_gather("the test step", work)
    except CollectiveError as e:
        return {"error": str(e), "failures": {str(k): v for k, v in e.failures.items()}}
    return {"got": got, "rank": coord.rank, "world": coord.world}


@pytest.mark.slow
def test_gather_on_subgroups_raises_on_every_rank_of_the_failing_group_only(tmp_path):
    results, _ = spawn(4, _gather_in_halves, (), tmp_path, timeout_s=120)
    assert results[0] == {"got": [{"world_rank": 0}, {"world_rank": 1}], "rank": 0, "world": 2}
    assert results[1] == {"got": [{"world_rank": 0}, {"world_rank": 1}], "rank": 1, "world": 2}
    want = "half 1: rank 1 failed during the test step: OSError: disk full"
    assert results[2] == results[3] == {"error": want, "failures": {"1": "OSError: disk full"}}


def _export_half(rank, world, root):
    """Ranks {0, 1} and {2, 3} each export their own run (TP1 x GTP2) over their own subgroup."""
    import torch.distributed as dist

    from bridge.layout import ParallelLayout
    from bridge.live.api import AdamConfig, LiveRun
    from bridge.live.export import export_state

    halves = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    half, grank = rank // 2, rank % 2
    params, _ = local_params(MODEL, 1, 2, 1, 4, grank, FP8)
    run = LiveRun(ParallelLayout(tp=1, gtp=2, dp=1), grank, STEP + half, AdamConfig(lr=1e-3), group=halves[half])
    rep = export_state(os.path.join(root, f"half{half}"), run, params, target_chunk_bytes=64)
    return {"path": rep.path, "rank": rep.rank}


@pytest.mark.slow
def test_export_state_on_two_subgroups_at_once(tmp_path):
    """Two independent exports on the two halves of a world of 4: each checkpoint holds exactly the
    state of its half (its own step), as assembled from the raw shards."""
    from bridge.store.reader import open_checkpoint
    from bridge.format.tree import megatron_key_to_path

    root = str(tmp_path / "out")
    results, _ = spawn(4, _export_half, (root,), tmp_path, timeout_s=240)
    assert [r["rank"] for r in results] == [0, 1, 0, 1]
    want = expected_state(MODEL, 1, 2, 1, 4, FP8)
    for half in (0, 1):
        dst = os.path.join(root, f"half{half}")
        assert results[2 * half]["path"] == results[2 * half + 1]["path"] == dst
        ck = open_checkpoint(dst)
        assert int(ck.read(("step",))) == STEP + half
        for r, arrays in want.items():
            for name, arr in arrays.items():
                got = ck.read(ROOTS[r] + megatron_key_to_path(name)).astype(np.float32)
                assert np.array_equal(got.view(np.uint32), arr.view(np.uint32)), f"half {half}: {r}/{name}"
        assert not os.path.exists(dst + ".orbax-checkpoint-tmp")


def _export_failing(rank, world, dst, victim, stage, action):
    """Export at TP1 x GTP2 x DP2; on rank `victim` at `stage` the hook fails (`raise`) or creates
    the destination (`occupy`, so that rank 0's commit fails)."""
    import gc

    from bridge.dist import TorchCoordinator
    from bridge.errors import BridgeError
    from bridge.layout import ParallelLayout
    from bridge.live.api import AdamConfig, LiveRun
    from bridge.live.export import export_state

    def hook(name):
        if rank == victim and name == stage:
            if action == "raise":
                raise BridgeError("injected failure: the disk is full")
            os.makedirs(dst)

    params, _ = local_params(MODEL, 1, 2, 2, 4, rank, None)
    run = LiveRun(ParallelLayout(tp=1, gtp=2, dp=2), rank, STEP, AdamConfig(lr=1e-3))
    gc.disable()  # what is still alive below is held by references, not waiting for a collection
    try:
        export_state(dst, run, params, target_chunk_bytes=64, on_stage=hook)
        error = None
    except BridgeError as e:
        error = str(e)
    # A failed export must not keep its coordinator (hence the process group) alive in a reference
    # cycle: the group would outlive destroy_process_group and gloo abort the process at exit.
    alive = sum(isinstance(o, TorchCoordinator) for o in gc.get_objects())
    gc.enable()
    return {"error": error, "coordinators_alive": alive}


@pytest.mark.slow
def test_a_rank_failing_while_writing_fails_every_rank_naming_it(tmp_path):
    """Rank 2 fails after the exchange: every rank raises one line naming rank 2 and the stage, at
    once (no rank waits for a timeout), and nothing of the export stays."""
    dst = str(tmp_path / "ck")
    results, errors = spawn(4, _export_failing, (dst, 2, "exchanged", "raise"), tmp_path, timeout_s=150,
                            pg_timeout_s=60, allow_fail=True)
    assert not errors, errors
    for r in results:
        msg = r["error"]
        assert msg and "\n" not in msg, results
        assert "rank 2 failed during writing" in msg and "injected failure: the disk is full" in msg, msg
        assert r["coordinators_alive"] == 0, results
    assert not os.path.exists(dst) and not os.path.exists(dst + ".orbax-checkpoint-tmp")


@pytest.mark.slow
def test_a_failing_commit_fails_every_rank_naming_rank_0(tmp_path):
    """The destination appears while the ranks write: rank 0's commit refuses to replace it, and
    every rank raises that, naming rank 0 and the commit; the run's temporary directory is gone."""
    dst = str(tmp_path / "ck")
    results, errors = spawn(4, _export_failing, (dst, 0, "written", "occupy"), tmp_path, timeout_s=150,
                            allow_fail=True)
    assert not errors, errors
    for r in results:
        msg = r["error"]
        assert msg and "\n" not in msg, results
        assert "rank 0 failed during the commit" in msg and "appeared while this run was writing" in msg, msg
        assert r["coordinators_alive"] == 0, results
    assert os.listdir(dst) == [] and not os.path.exists(dst + ".orbax-checkpoint-tmp")


def test_the_store_never_reads_torch_distributed_state():
    """The store takes a coordinator; it never looks torch up (sys.modules) nor calls a world-wide
    collective itself (the old commit did both)."""
    import pathlib
    import re

    store = pathlib.Path(__file__).resolve().parents[2] / "bridge" / "store"
    offending = [f"{p.name}:{i}: {line.strip()}" for p in sorted(store.glob("*.py"))
                 for i, line in enumerate(p.read_text().splitlines(), 1)
                 if re.search(r"sys\.modules|import torch|torch\.distributed|dist\.(barrier|broadcast)", line)
                 and not line.lstrip().startswith("#")]
    assert not offending, offending
