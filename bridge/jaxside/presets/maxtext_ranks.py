"""`from-maxtext` under torchrun: every rank writes a share of the writers, rank 0 claims and commits once.

    torchrun --nnodes N --nproc-per-node P ... gtp-bridge from-maxtext gs://run/checkpoints/1000 DST --workers W

Every rank plans alike (`maxtext_stream.plan_job` for W writers per rank, so the job has W x ranks
writers in all) and runs the writers of its contiguous share of writer ids
(`bridge.layout.shares.contiguous_parts`, the rule the blocks go to writers by), with its own budget.
The steps go through the launch's coordinator (`bridge.dist.TorchCoordinator`), as `convert`'s do
(`converters.megatron.distributed`): the plans' fingerprints must agree; rank 0 claims DST, the other
ranks see and hold its temp directory (a shared file system, or s3:// / gs://); each rank's writers'
reports are gathered and rank 0 commits them after the barrier. A failure on any rank raises the same
one-line error on every rank, naming the rank, and nothing is committed.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any, Callable, Sequence

from bridge.errors import BridgeError
from bridge.layout.shares import contiguous_parts
from bridge.torchrun import Ranks, _testing_fault, check_same_plan, join_claim


def writers_of(rank: int, world: int, writers: int) -> list[int]:
    """The writer ids rank `rank` of `world` runs: a contiguous run of about writers/world ids.

    >>> [writers_of(r, 2, 4) for r in range(2)], writers_of(1, 2, 1)
    ([[0, 1], [2, 3]], [])
    """
    parts = contiguous_parts([1] * writers, world)
    return [w for w, r in enumerate(parts) if r == rank]


def run_job_ranks(ranks: Ranks, src: str, dst: str, plan: Any, total: int, label: str, show_progress: bool | None,
                  write_share: Callable[[str, Sequence[int], Any], list[dict]],
                  commit: Callable[[str, Any, list[dict]], str]) -> str:
    """One rank's part of a streamed MaxText move into `dst` (`plan`: the job's `WritePlan`);
    `write_share(tmp, writer_ids, bar)` runs this rank's writers and returns their reports,
    `commit(dst, claim, reports)` is rank 0's commit. Returns dst on every rank."""
    from bridge.progress import progress
    from bridge.store.claim import claim_destination

    coord = ranks.coord
    check_same_plan(coord.all_gather("planning", plan.fingerprint))
    mine: dict[str, Any] = {}
    with ExitStack() as stack:
        def claim() -> str:
            mine["claim"] = stack.enter_context(claim_destination(dst, sources=[src]))
            return mine["claim"].tmp

        tmp = coord.broadcast("the claim", claim)
        coord.all_gather("the claim", lambda: coord.rank == 0 or join_claim(stack, tmp, dst))
        ids = writers_of(coord.rank, coord.world, plan.num_writers)

        def write() -> list[dict]:
            enabled = show_progress if coord.rank == 0 else False
            with progress(total, label, enabled=enabled) as bar, ranks.counter.watch(bar) as update:
                reports = write_share(tmp, ids, update)
            _testing_fault(coord.rank)
            return reports

        reports = [r for share in coord.all_gather("writing", write) for r in share]
        if len(reports) != plan.num_writers:
            raise BridgeError(f"{dst}: {len(reports)} writer reports for {plan.num_writers} writers")
        coord.broadcast("the commit", lambda: commit(dst, mine["claim"], reports))
    return dst
