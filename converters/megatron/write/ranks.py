"""`to-megatron` under torchrun: every rank writes the `.distcp` files of a share of the work.

    torchrun --nnodes N --nproc-per-node P ... gtp-bridge to-megatron SRC DST --tp T ... --workers W

Every rank plans alike (`plan_megatron`). The jobs (chunk groups and DistOpt bucket jobs, in plan
order) are cut into contiguous runs of about equal bytes, one per rank (`contiguous_parts`); rank r
runs its run on W threads, each writing its own file `__<r*W + i>_0.distcp`. Through the launch's
coordinator, so a failure on any rank raises the same line on every rank and nothing is published:

  planning    every rank plans; the plans must agree (same iteration, same chunks)
  the claim   rank 0 claims the iteration directory (one claim for the launch) and sends the claim's
              record; the other ranks join it (`bridge.torchrun.launch_claim`: its temp directory on
              a shared file system, or s3:// / gs://) and hold it while writing
  writing     each rank writes its files (rank 0 also the common state and DistOpt objects) and
              sends where every blob went (`Written`, JSON) to the others
  the commit  rank 0 writes `.metadata` / `metadata.json` over every rank's blobs, publishes the
              iteration, then sets the tracker
"""

from __future__ import annotations

import hashlib
import json
import time
from contextlib import ExitStack
from typing import Any

from bridge.errors import BridgeError
from bridge.layout.shares import contiguous_parts
from bridge.progress import progress
from bridge.store import open_storage
from bridge.torchrun import Ranks, _testing_fault, command_ranks, launch_claim
from converters.megatron.read.rundir import write_tracker
from converters.megatron.write.torch_dist import (MegatronPlan, OpenFile, Stats, Written, publish_iteration, take_back,
                                                  write_files)


def to_megatron_ranks(mp: MegatronPlan, open_file: OpenFile | None, show_progress: bool | None) -> dict:
    """`to_megatron` as one rank of a torchrun launch (every rank calls it alike); see the module doc."""
    with command_ranks(f"to-megatron {mp.where.iter_dir}") as ranks:
        if ranks is None:
            raise BridgeError("to_megatron_ranks needs a torchrun launch of two or more processes")
        return _write(ranks, mp, open_file, show_progress)


def plan_fingerprint(mp: MegatronPlan) -> str:
    """What every rank must agree on: the iteration written and every chunk's name, shape and bytes."""
    chunks = [[c.fqn, list(c.global_shape), c.nbytes] for g in mp.groups for c in g.chunks]
    dp = [[j.fqn, j.numel] for j in mp.dp_jobs]
    text = json.dumps([mp.where.iter_dir, mp.step, mp.workers, chunks, dp], separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def _write(ranks: Ranks, mp: MegatronPlan, open_file: OpenFile | None, show_progress: bool | None) -> dict:
    coord = ranks.coord
    t_start = time.perf_counter()
    prints = coord.all_gather("planning", lambda: plan_fingerprint(mp))
    other = [r for r, f in enumerate(prints) if f != prints[0]]
    if other:
        raise BridgeError(f"ranks {other} planned another to-megatron than rank 0 (their source, flags or version "
                          f"differ); start every rank with the same SRC, DST and flags")
    where = mp.where
    jobs = mp.jobs()
    owner = contiguous_parts([n for _, _, n in jobs], coord.world)
    mine = [j for j, o in zip(jobs, owner) if o == coord.rank]
    state: dict[str, Any] = {"published": False, "created_run": False}
    try:
        with ExitStack() as stack:  # leaving it by an error releases rank 0's claim (its temp directory)
            def claim():
                state["created_run"] = open_storage(where.run_dir).make_dirs()
                return mp.claim()

            state["claim"] = launch_claim(coord, stack, where.iter_dir, claim, marker=".metadata")
            tmp = state["claim"].tmp
            shares = coord.all_gather("writing", lambda: _write_share(ranks, mp, tmp, open_file, mine, show_progress))
            coord.broadcast("the commit", lambda: _commit(mp, state, shares))
    except BaseException:
        if coord.rank == 0:
            take_back(mp, state["published"], state["created_run"])
        raise
    stats = Stats()
    for s in shares:
        stats.add(Stats(*s["stats"]))
    res = mp.result(sum(s["bytes"] for s in shares), stats)
    res.update(rank=coord.rank, ranks=[{k: s[k] for k in ("rank", "writers", "bytes", "seconds")} for s in shares],
               seconds=round(time.perf_counter() - t_start, 3))
    return res


def _write_share(ranks: Ranks, mp: MegatronPlan, tmp: str, open_file: OpenFile | None, jobs: list,
                 show_progress: bool | None) -> dict:
    """This rank's files (numbered after the lower ranks'); returns where each blob went, as JSON."""
    rank = ranks.rank
    t0 = time.perf_counter()
    enabled = show_progress if rank == 0 else False
    with progress(mp.total_bytes, f"to-megatron {mp.where.iter_dir}", enabled=enabled) as bar, \
            ranks.counter.watch(bar) as update:
        written, stats, nbytes = write_files(mp, tmp, open_file, rank * mp.workers, jobs, rank == 0, update)
    _testing_fault(rank)
    return {"rank": rank, "writers": mp.workers if jobs else 0, "bytes": nbytes,
            "seconds": round(time.perf_counter() - t0, 3), "stats": [stats.read, stats.needed, stats.read_bytes],
            "written": [[w.fqn, w.offsets, w.sizes, w.rel, w.offset, w.length] for w in written]}


def _commit(mp: MegatronPlan, state: dict, shares: list[dict]) -> str:
    """Rank 0: the DCP metadata over every rank's blobs, the publish, then the tracker."""
    index = mp.index()
    for s in shares:
        index.written += [Written(fqn, None if off is None else tuple(off), None if sizes is None else tuple(sizes),
                                  rel, at, n) for fqn, off, sizes, rel, at, n in s["written"]]
    publish_iteration(state["claim"], index)
    state["published"] = True
    write_tracker(mp.where.run_dir, mp.step)  # only now: the iteration directory is complete
    return mp.where.iter_dir
