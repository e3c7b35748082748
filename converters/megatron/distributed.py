"""`convert` under torchrun: every rank writes a share of the blocks, rank 0 claims and commits once.

    torchrun --nnodes N --nproc-per-node P ... gtp-bridge convert SRC DST --workers W --budget B

Every rank plans alike (`plan_conversion` with the launch's rank count): each rank runs up to W
writers with B bytes of its own, exactly as one process would, and rank r runs a contiguous run of
writer ids (`ConvertPlan.writers_of`), hence of blocks, so it reads a compact part of SRC. Every
step goes through the launch's coordinator (`bridge.dist.TorchCoordinator`): a failure on any rank
raises the same one-line error on every rank, naming the rank, and nothing is committed.

  planning    every rank plans; the plans' fingerprints must agree (same source, flags, version)
  the claim   rank 0 claims DST, the one claim of the launch, and sends the claim's record; the
              others join that claim (`bridge.torchrun.launch_claim`: its temp directory on a file
              system every rank shares, or s3:// / gs://) and hold it while they write
  writing     each rank runs its writers (their reports are published into the temp directory)
              and checks the CRC-32s of the source records they read
  the commit  rank 0 merges every writer's database (`ocdbt.process_<w>.<s>`) and publishes

Progress is summed on rank 0 through the launch's store (`bridge.torchrun.RankCounter`); the
final report (bytes, seconds, per-rank skew) is gathered there too.
"""

from __future__ import annotations

import sys
import os
import time
from contextlib import ExitStack, closing, contextmanager
from dataclasses import asdict
from typing import Any, Iterator, Mapping, Sequence

from bridge.errors import BridgeError
from bridge.location import basename
from bridge.progress import progress
from bridge.store import claim_destination, commit_checkpoint
from bridge.torchrun import Ranks, _testing_fault, check_same_plan, command_ranks, launch_claim, launched_world
from bridge.units import human_bytes
from bridge.format.manifest import REPLICAS_KEY
from converters.megatron import replicas
from converters.megatron.cache import check_records
from converters.megatron.convert import (ConvertOptions, ConvertPlan, ConvertResult, budget_line, plan_conversion,
                                         record_replicas, run_blocks, write_share)
from converters.megatron.writer_procs import Prestarted


def convert_ranks(src_dir: str, dst: str, opts: ConvertOptions, budget: int, asked_workers: int,
                  started: float = 0.0) -> ConvertResult:
    """`convert` as one rank of a torchrun launch (every rank calls it alike); see the module doc.
    `started`: this process's seconds before `convert` was called (its phase "start").

    Planning reads SRC only, so it comes before joining the launch, and this rank's writer processes
    start right after it: their start-up (interpreter, imports) overlaps the launch's own cost
    (importing torch, the rendezvous, the claim) instead of following it. A planning error is kept
    and raised inside the first exchange, so every rank reports it with the rank named."""
    world = launched_world()
    rank = int(os.environ.get("RANK", "0"))
    phases: dict[str, float] = {"start": started}
    cp: ConvertPlan | None = None
    plan_error: BaseException | None = None
    with _phase(phases, "plan"):
        try:
            cp = plan_conversion(src_dir, opts, budget, asked_workers, ranks=world)
        except Exception as e:  # noqa: BLE001 - reported by the exchange, on every rank
            plan_error = e
    writers = cp.writers_of(rank) if cp is not None else []
    with ExitStack() as stack:
        pool = stack.enter_context(closing(Prestarted(len(writers), run_blocks))) if len(writers) > 1 else None
        ranks = stack.enter_context(command_ranks(f"convert to {dst}"))
        if ranks is None:
            raise BridgeError("convert_ranks needs a torchrun launch of two or more processes")
        phases.update(ranks.phases)
        return _convert(ranks, cp, plan_error, src_dir, dst, opts, budget, asked_workers, phases, pool)


def _convert(ranks: Ranks, cp: ConvertPlan | None, plan_error: BaseException | None, src_dir: str, dst: str,
             opts: ConvertOptions, budget: int, asked_workers: int, phases: dict[str, float],
             pool: Prestarted | None) -> ConvertResult:
    coord = ranks.coord
    t_start = time.perf_counter()
    timings: dict[str, float] = {}

    def plan() -> str:
        if plan_error is not None:
            raise plan_error
        return cp.plan.fingerprint()

    with _phase(phases, "plan_exchange"):
        fingerprints = coord.all_gather("planning", plan)
    check_same_plan(fingerprints)
    if opts.announce is not None and coord.rank == 0:
        opts.announce(ranks_line(coord.world, cp, budget, asked_workers))
    timings["plan"] = phases["plan"] + time.perf_counter() - t_start
    with ExitStack() as stack:
        with _phase(phases, "claim"):
            claim = launch_claim(coord, stack, dst, lambda: claim_destination(dst, sources=[src_dir, str(cp.ck.root)]))
        t0 = time.perf_counter()
        with _phase(phases, "barrier"):
            shares = coord.all_gather("writing", lambda: _write(ranks, cp, claim.tmp, dst, opts, phases, pool))
        timings["write"] = time.perf_counter() - t0
        # the barrier is the wait for the slowest rank after this one's share was written
        phases["barrier"] = round(phases["barrier"] - phases["write"], 3)
        t0 = time.perf_counter()
        # every rank records (and, with --strict-replicas, refuses) alike, from every rank's comparisons
        replica_rec = record_replicas(cp.manifest, cp.units, [replicas.BlockDiff(**d) for s in shares for d in s["replicas"]],
                                      opts.strict_replicas)
        with _phase(phases, "commit"):
            coord.broadcast("the commit", lambda: commit_checkpoint(claim, cp.plan, cp.manifest, timeout=60.0))
        timings["commit"] = time.perf_counter() - t0
    warnings = [w for s in shares for w in s["warnings"]] + replicas.report_lines(replica_rec)
    if coord.rank == 0:
        for w in warnings:
            print(f"gtp-bridge: warning: {w}", file=sys.stderr)
    src = cp.src
    return ConvertResult(dst, src.format_label, src.layout.to_json(), len(cp.plan.arrays), cp.plan.total_bytes,
                         len(cp.units), cp.step, warnings, src.inferred, cp.workers, budget, timings,
                         rank=coord.rank, ranks=[{**{k: v for k, v in s.items() if k not in ("warnings", "replicas")},
                                                  "phases": s["phases"] if s["rank"] != coord.rank else phases}
                                                 for s in shares],
                         replicas=cp.manifest.extra[REPLICAS_KEY], phases=phases)


def _write(ranks: Ranks, cp: ConvertPlan, tmp: str, dst: str, opts: ConvertOptions, phases: dict[str, float],
           pool: Prestarted | None) -> dict:
    """This rank's writers, then the CRC check of what they read; returns this rank's report (its
    phases so far included: the ones after the barrier stay on the rank)."""
    rank = ranks.rank
    writers = cp.writers_of(rank)
    t0 = time.perf_counter()
    timings: dict[str, float] = {}
    enabled = opts.show_progress if rank == 0 else False
    with _phase(phases, "write"):
        with progress(cp.total_bytes, f"convert {basename(dst)}", enabled=enabled) as bar, \
                ranks.counter.watch(bar) as update:
            results = write_share(cp, tmp, writers, opts.force, update, timings, pool)
        phases.update({k: round(v, 3) for k, v in timings.items() if k.startswith("worker_")})
        with _phase(phases, "check_records"):
            check_records([r[2] for r in results], window=min(cp.share, 8 << 20))
    _testing_fault(rank)
    return {"rank": rank, "writers": len(writers), "bytes": sum(b.nbytes for w in writers for b in cp.blocks_of(w)),
            "read": sum(r[1] for r in results), "seconds": round(time.perf_counter() - t0, 3),
            "warnings": [f"rank {rank}: {w}" for r in results for w in r[0]],
            "replicas": [asdict(d) for r in results for d in r[3]], "phases": dict(phases)}


@contextmanager
def _phase(phases: dict[str, float], name: str) -> Iterator[None]:
    """Record the seconds the block takes as `phases[name]` (also when it raises)."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        phases[name] = round(time.perf_counter() - t0, 3)


def ranks_line(world: int, cp: ConvertPlan, budget: int, asked: int) -> str:
    """What the launch will run, printed by rank 0 before it starts.

    >>> from types import SimpleNamespace as NS
    >>> ranks_line(2, NS(workers=6, per_rank=4), 1 << 30, 4)
    'convert: 2 ranks, 6 writers in all; each rank: convert: 4 workers, budget 1.0 GiB (256.0 MiB each)'
    """
    return f"convert: {world} ranks, {cp.workers} writers in all; each rank: {budget_line(cp.per_rank, budget, asked)}"


def rank_summary(ranks: Sequence[Mapping[str, Any]], seconds: float) -> str:
    """The launch's final report, on rank 0: bytes, rate, and the ranks' spread (skew = slowest /
    mean write time; a rank with no writers is not counted).

    >>> rank_summary([{"rank": 0, "writers": 2, "bytes": 3 << 30, "seconds": 10.0},
    ...               {"rank": 1, "writers": 2, "bytes": 1 << 30, "seconds": 6.0}], 12.0)
    'ranks: 2 (4 writers), 4.0 GiB in 12.0 s (341.3 MiB/s); per rank 1.0 GiB..3.0 GiB written in 6.0..10.0 s, slowest rank 0 (skew 1.25x)'
    """
    busy = [r for r in ranks if r["writers"]] or list(ranks)
    total = sum(r["bytes"] for r in ranks)
    secs = [float(r["seconds"]) for r in busy]
    slow = max(busy, key=lambda r: float(r["seconds"]))
    mean = sum(secs) / len(secs)
    skew = max(secs) / mean if mean > 0 else 1.0
    rate = human_bytes(int(total / seconds)) + "/s" if seconds > 0 else "-"
    lo, hi = min(r["bytes"] for r in busy), max(r["bytes"] for r in busy)
    return (f"ranks: {len(ranks)} ({sum(r['writers'] for r in ranks)} writers), {human_bytes(total)} in {seconds:.1f} s "
            f"({rate}); per rank {human_bytes(lo)}..{human_bytes(hi)} written in {min(secs):.1f}..{max(secs):.1f} s, "
            f"slowest rank {slow['rank']} (skew {skew:.2f}x)")


def phases_line(ranks: Sequence[Mapping[str, Any]]) -> str:
    """Rank 0's line of where the launch's time went: each phase's seconds on the slowest rank
    (phases a rank reports after the barrier are rank 0's own).

    >>> phases_line([{"rank": 0, "phases": {"start": 1.0, "rendezvous": 0.25, "write": 9.0}},
    ...              {"rank": 1, "phases": {"start": 1.5, "rendezvous": 0.5, "write": 8.0}}])
    'phases (slowest rank): start 1.50 s (rank 1), rendezvous 0.50 s (rank 1), write 9.00 s (rank 0)'
    """
    names: list[str] = []
    for r in ranks:
        names += [n for n in r.get("phases", {}) if n not in names]
    parts = []
    for n in names:
        slow = max((r for r in ranks if n in r.get("phases", {})), key=lambda r: r["phases"][n])
        parts.append(f"{n} {slow['phases'][n]:.2f} s (rank {slow['rank']})")
    return "phases (slowest rank): " + ", ".join(parts)
