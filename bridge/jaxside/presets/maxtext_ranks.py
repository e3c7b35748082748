"""`to-maxtext` / `from-maxtext` under torchrun: every rank writes a share of the writers, rank 0 claims
and commits once.

    torchrun --nnodes N --nproc-per-node P ... gtp-bridge from-maxtext gs://run/checkpoints/1000 DST --workers W
    torchrun --nnodes N --nproc-per-node P ... gtp-bridge to-maxtext s3://ckpts/logical gs://run/checkpoints

Every rank plans alike (`maxtext_job.plan_job` for W writers per rank, so the job has W x ranks
writers in all) and runs the writers of its contiguous share of writer ids
(`bridge.layout.shares.contiguous_parts`, the rule the blocks go to writers by), with its own budget.
The steps go through the launch's coordinator (`bridge.dist.TorchCoordinator`), as `convert`'s do
(`converters.megatron.distributed`): the plans' fingerprints must agree; rank 0 claims DST and sends
the claim's record, the other ranks join and hold that claim (`bridge.torchrun.launch_claim`: a
shared file system, or s3:// / gs://); each rank's writers' reports are gathered and rank 0 commits
them after the barrier. A failure on any rank raises the same one-line error on every rank, naming
the rank, and nothing is committed. `to-maxtext` writes a step of
a MaxText root: rank 0 alone makes the step (`write_step_ranks`), the ranks write its item together.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any, Callable, Sequence

from bridge.errors import BridgeError
from bridge.layout.shares import contiguous_parts
from bridge.jaxside.presets.maxtext_job import StreamOutput, StreamWriterJob
from bridge.torchrun import Ranks, _testing_fault, check_same_plan, command_ranks, launch_claim


def writers_of(rank: int, world: int, writers: int) -> list[int]:
    """The writer ids rank `rank` of `world` runs: a contiguous run of about writers/world ids.

    >>> [writers_of(r, 2, 4) for r in range(2)], [writers_of(r, 2, 1) for r in range(2)]
    ([[0, 1], [2, 3]], [[], [0]])
    """
    parts = contiguous_parts([1] * writers, world)
    return [w for w, r in enumerate(parts) if r == rank]


def run_job_ranks(ranks: Ranks, wj: StreamWriterJob, out: StreamOutput,
                  write_share: Callable[[str, Sequence[int], Any], list[dict]],
                  commit: Callable[[Any, list[dict]], str]) -> str:
    """One rank's part of the streamed MaxText move `wj` into `out.dst`: `write_share(tmp, writer_ids,
    bar)` runs this rank's writers and returns their reports, `commit(claim, reports)` is rank 0's
    commit. Returns dst on every rank."""
    from bridge.progress import progress
    from bridge.store import claim_destination

    coord, plan, dst = ranks.coord, wj.job.plan, out.dst
    check_same_plan(coord.all_gather("planning", plan.fingerprint))
    with ExitStack() as stack:
        claim = launch_claim(coord, stack, dst, lambda: claim_destination(dst, sources=[wj.src]))
        ids = writers_of(coord.rank, coord.world, plan.num_writers)

        def write() -> list[dict]:
            enabled = out.show_progress if coord.rank == 0 else False
            with progress(wj.job.nbytes, out.label, enabled=enabled) as bar, ranks.counter.watch(bar) as update:
                reports = write_share(claim.tmp, ids, update)
            _testing_fault(coord.rank)
            return reports

        reports = [r for share in coord.all_gather("writing", write) for r in share]
        if len(reports) != plan.num_writers:
            raise BridgeError(f"{dst}: {len(reports)} writer reports for {plan.num_writers} writers")
        coord.broadcast("the commit", lambda: commit(claim, reports))
    return dst


def write_step_ranks(job: str, write_item: Callable[[str, Ranks], int],
                     write_step: Callable[[Callable[[str], int]], str]) -> str:
    """A step of a checkpoint root written by every rank of the launch: rank 0 runs `write_step(write)`
    (which stages the step, calls `write(item_dir)` and commits the step; `bridge.store.manager.
    write_step`), and every rank runs `write_item(item_dir, ranks)` on the item rank 0 staged. Returns
    the step directory on every rank. Rank 0's failure outside the item's own collectives (staging the
    step, committing it) is sent to the other ranks through the stage they wait in."""
    with command_ranks(job) as ranks:
        coord = ranks.coord
        if coord.rank != 0:
            item = coord.broadcast("the step", lambda: None)
            write_item(item, ranks)
            return coord.broadcast("the step's commit", lambda: None)
        stage = ["the step"]

        def write(item: str) -> int:
            coord.broadcast("the step", lambda: item)
            stage[0] = ""   # inside the item's collectives: every rank learns a failure there
            out = write_item(item, ranks)
            stage[0] = "the step's commit"
            return out

        try:
            step_dir = write_step(write)
        except Exception as e:  # noqa: BLE001 - told to the ranks waiting in that stage, then raised
            if not stage[0]:
                raise
            coord.broadcast(stage[0], _raising(e))
            raise
        return coord.broadcast("the step's commit", lambda: step_dir)


def _raising(err: BaseException) -> Callable[[], None]:
    """A stage's function that fails with `err` (so the coordinator tells every rank)."""
    def fail() -> None:
        raise err
    return fail
