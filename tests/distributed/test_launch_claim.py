"""The ranks of a torchrun launch share rank 0's claim as an object (issue 32): rank 0 sends the claim's
record, every other rank builds its handle from it (`bridge.torchrun.launch_claim`, which convert,
to-megatron and to-maxtext / from-maxtext call; `Storage.joined` on the receiving side), never from a
temporary path it is told.

- two gloo ranks: rank 1's handle is rank 0's claim (same run, same temporary directory), both
  write a share of one checkpoint into it and rank 0 commits; rank 1's release removed nothing;
- a rank whose destination differs from rank 0's is refused on every rank in one line naming it,
  and nothing is left at either destination;
- a forged or foreign record (another run id, the receiver's own pid, another destination, not a
  claim at all, a claim already gone) is refused in one line, locally and on object storage, and
  the real claim is untouched.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest

from servers import remote_servers
from spawn_ranks import spawn

from bridge.errors import BridgeError
from bridge.store import ArraySpec, CheckpointWriter, claim_destination, make_write_plan, open_storage

PATH = ("params", "w")
DATA = np.arange(8 * 4, dtype=np.float32).reshape(8, 4) * -1.5


def _launch(rank: int, world: int, dsts: list[str]) -> dict:
    """A rank of a launch: join the claim, write this rank's rows, rank 0 commits; what each rank saw."""
    from contextlib import ExitStack

    import torch.distributed as dist

    from bridge.dist import CollectiveError, TorchCoordinator
    from bridge.store import commit_checkpoint
    from bridge.torchrun import launch_claim

    coord = TorchCoordinator(dist.group.WORLD, job="test launch")
    dst = dsts[rank]
    plan = make_write_plan([ArraySpec(PATH, DATA.shape, "float32")], world)
    try:
        with ExitStack() as stack:
            claim = launch_claim(coord, stack, dst, lambda: claim_destination(dst))
            seen = {"tmp": claim.tmp, "run_id": claim.run_id, "made_here": claim.made_here()}

            def write() -> dict:
                w = CheckpointWriter(claim.tmp, plan, rank)
                for box in plan.lookup(PATH).ownership.boxes_owned_by(rank):
                    w.write(PATH, box, DATA[box.slices])
                return w.finish(publish=False)

            reports = coord.all_gather("writing", write)
            if rank != 0:
                claim.release()   # what an error on this rank does: removes nothing of rank 0's
            kept = coord.all_gather("released", lambda: os.path.isdir(claim.tmp) and claim.owned())
            coord.broadcast("the commit", lambda: commit_checkpoint(claim, plan, reports=reports))
        return {**seen, "kept_after_rank_1_released": kept[0]}
    except CollectiveError as e:
        return {"error": str(e)}


@pytest.mark.slow
def test_ranks_write_into_the_claim_rank_0_sent(tmp_path):
    from bridge.store import open_checkpoint

    dst = str(tmp_path / "ck")
    results, _ = spawn(2, _launch, ([dst, dst],), tmp_path)
    assert results[0]["tmp"] == results[1]["tmp"] == os.path.abspath(dst) + ".orbax-checkpoint-tmp"
    assert results[0]["run_id"] == results[1]["run_id"]
    assert [r["made_here"] for r in results] == [True, False]
    assert results[0]["kept_after_rank_1_released"] is True
    np.testing.assert_array_equal(open_checkpoint(dst).read(PATH), DATA)
    assert not os.path.exists(results[0]["tmp"])


@pytest.mark.slow
def test_a_rank_with_another_destination_is_refused_on_every_rank(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    results, _ = spawn(2, _launch, ([a, b],), tmp_path)
    for r in results:
        assert "rank 1" in r["error"] and f"is a claim of {a}" in r["error"] and "\n" not in r["error"], r
    assert results[0]["error"] == results[1]["error"]
    assert [n for n in os.listdir(tmp_path) if not n.startswith("spawn_")] == []   # nothing at a, b or their temps


# -- the receiving side, one process ------------------------------------------------------------------
@pytest.fixture(scope="module")
def stores():
    with remote_servers() as servers:
        yield servers


@pytest.fixture(params=["local", "s3"])
def claimed(request, tmp_path):
    """(dst, the claim rank 0 made there); released after the test."""
    if request.param == "local":
        dst = str(tmp_path / "ck")
    else:
        dst = request.getfixturevalue("stores")["s3"].url(f"launch-claim/{os.path.basename(str(tmp_path))}")
    claim = claim_destination(dst)
    yield dst, claim
    claim.release()


def _refused(dst: str, record, match: str) -> str:
    with pytest.raises(BridgeError, match=match) as e:
        with open_storage(dst).joined(record):
            pass
    assert "\n" not in str(e.value)
    return str(e.value)


def test_the_record_rank_0_sends_is_joined(claimed):
    dst, claim = claimed
    with open_storage(dst).joined(claim.info.record()) as handle:
        assert (handle.dst, handle.tmp, handle.info) == (claim.dst, claim.tmp, claim.info)


def test_a_forged_record_is_refused(claimed):
    dst, claim = claimed
    rec = claim.info.record()
    _refused(dst, {**rec, "run_id": "f" * 32}, "is not the claim at")
    # the receiver's own pid would make its handle's release remove the run's files: refused
    _refused(dst, {**rec, "pid": os.getpid() + 1}, "is not the claim at")
    for bad in ({**rec, "pid": "1"}, {k: v for k, v in rec.items() if k != "host"}, {**rec, "tool": "other"},
                [rec], None):
        _refused(dst, bad, "is not a gtp-bridge claim")
    assert claim.owned()


def test_a_claim_of_another_destination_is_refused(claimed, tmp_path):
    dst, claim = claimed
    other = claim_destination(str(tmp_path / "other"))
    try:
        msg = _refused(dst, other.info.record(), "is a claim of")
        assert other.dst in msg
        # the other claim's record relabelled with this destination: not the claim recorded here
        _refused(dst, dataclasses.replace(other.info, dst=claim.info.dst).record(), "is not the claim at")
    finally:
        other.release()
    assert claim.owned()


def test_a_claim_already_gone_is_refused(claimed):
    dst, claim = claimed
    rec = claim.info.record()
    claim.release()
    _refused(dst, rec, "is not visible here" if open_storage(dst).file_system else "is not the claim at")


def test_docstring_examples():
    import doctest

    from bridge.store import claim_info

    res = doctest.testmod(claim_info)
    assert res.attempted > 0 and res.failed == 0
