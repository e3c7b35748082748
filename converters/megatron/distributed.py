"""`convert` under torchrun: every rank writes a share of the blocks, rank 0 claims and commits once.

    torchrun --nnodes N --nproc-per-node P ... gtp-bridge convert SRC DST --workers W --budget B

Every rank plans alike (`plan_conversion` with the launch's rank count): each rank runs up to W
writers with B bytes of its own, exactly as one process would, and rank r runs a contiguous run of
writer ids (`ConvertPlan.writers_of`), hence of blocks, so it reads a compact part of SRC. Every
step goes through the launch's coordinator (`bridge.dist.TorchCoordinator`): a failure on any rank
raises the same one-line error on every rank, naming the rank, and nothing is committed.

  planning    every rank plans; the plans' fingerprints must agree (same source, flags, version)
  the claim   rank 0 claims DST, the one claim of the launch; the others see its temp directory
              (a file system every rank shares, or s3:// / gs://) and hold it while they write
  writing     each rank runs its writers (their reports are published into the temp directory)
              and checks the CRC-32s of the source records they read
  the commit  rank 0 merges every writer's database (`ocdbt.process_<w>.<s>`) and publishes

Progress is summed on rank 0 through the launch's store (`bridge.torchrun.RankCounter`); the
final report (bytes, seconds, per-rank skew) is gathered there too.
"""

from __future__ import annotations

import sys
import time
from contextlib import ExitStack
from dataclasses import asdict
from typing import Any, Mapping, Sequence

from bridge.errors import BridgeError
from bridge.location import basename
from bridge.progress import progress
from bridge.store import open_storage
from bridge.store.claim import claim_destination
from bridge.store.commit import commit_checkpoint
from bridge.torchrun import Ranks, _testing_fault, command_ranks
from bridge.units import human_bytes
from bridge.format.manifest import REPLICAS_KEY
from converters.megatron import replicas
from converters.megatron.cache import check_records
from converters.megatron.convert import (ConvertOptions, ConvertPlan, ConvertResult, budget_line, plan_conversion,
                                         record_replicas,
                                         write_share)


def convert_ranks(src_dir: str, dst: str, opts: ConvertOptions, budget: int, asked_workers: int) -> ConvertResult:
    """`convert` as one rank of a torchrun launch (every rank calls it alike); see the module doc."""
    with command_ranks(f"convert to {dst}") as ranks:
        if ranks is None:
            raise BridgeError("convert_ranks needs a torchrun launch of two or more processes")
        return _convert(ranks, src_dir, dst, opts, budget, asked_workers)


def _convert(ranks: Ranks, src_dir: str, dst: str, opts: ConvertOptions, budget: int,
             asked_workers: int) -> ConvertResult:
    coord = ranks.coord
    t_start = time.perf_counter()
    timings: dict[str, float] = {}
    mine: dict[str, Any] = {}

    def plan() -> str:
        mine["cp"] = plan_conversion(src_dir, opts, budget, asked_workers, ranks=coord.world)
        return mine["cp"].plan.fingerprint()

    check_same_plan(coord.all_gather("planning", plan))
    cp: ConvertPlan = mine["cp"]
    if opts.announce is not None and coord.rank == 0:
        opts.announce(ranks_line(coord.world, cp, budget, asked_workers))
    timings["plan"] = time.perf_counter() - t_start
    with ExitStack() as stack:
        def claim() -> str:
            mine["claim"] = stack.enter_context(claim_destination(dst, sources=[src_dir, str(cp.ck.root)]))
            return mine["claim"].tmp

        tmp = coord.broadcast("the claim", claim)
        coord.all_gather("the claim", lambda: coord.rank == 0 or _join(stack, tmp, dst))
        t0 = time.perf_counter()
        shares = coord.all_gather("writing", lambda: _write(ranks, cp, tmp, dst, opts))
        timings["write"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        # every rank records (and, with --strict-replicas, refuses) alike, from every rank's comparisons
        replica_rec = record_replicas(cp.manifest, cp.units, [replicas.BlockDiff(**d) for s in shares for d in s["replicas"]],
                                      opts.strict_replicas)
        coord.broadcast("the commit", lambda: commit_checkpoint(dst, cp.plan, cp.manifest, timeout=60.0,
                                                                claim=mine["claim"]))
        timings["commit"] = time.perf_counter() - t0
    warnings = [w for s in shares for w in s["warnings"]] + replicas.report_lines(replica_rec)
    if coord.rank == 0:
        for w in warnings:
            print(f"gtp-bridge: warning: {w}", file=sys.stderr)
    src = cp.src
    return ConvertResult(dst, src.format_label, src.layout.to_json(), len(cp.plan.arrays), cp.plan.total_bytes,
                         len(cp.units), cp.step, warnings, src.inferred, cp.workers, budget, timings,
                         rank=coord.rank, ranks=[{k: v for k, v in s.items() if k not in ("warnings", "replicas")}
                                                 for s in shares],
                         replicas=cp.manifest.extra[REPLICAS_KEY])


def check_same_plan(fingerprints: Sequence[str]) -> None:
    """Every rank must have planned the same conversion; else name the ranks that differ from rank 0.

    >>> check_same_plan(["a", "a"])
    >>> check_same_plan(["a", "b", "a"])
    Traceback (most recent call last):
    ...
    bridge.errors.BridgeError: ranks [1] planned another conversion than rank 0 (their source, flags or gtp-bridge version differ); start every rank with the same SRC, DST and flags
    """
    other = [r for r, f in enumerate(fingerprints) if f != fingerprints[0]]
    if other:
        raise BridgeError(f"ranks {other} planned another conversion than rank 0 (their source, flags or gtp-bridge "
                          f"version differ); start every rank with the same SRC, DST and flags")


def _join(stack: ExitStack, tmp: str, dst: str) -> bool:
    """On a rank other than 0: rank 0's temp directory must be visible here; hold it while writing
    (so no other run takes it for a stale one)."""
    storage = open_storage(tmp)
    if not storage.visible():
        raise BridgeError(f"rank 0's temporary directory {tmp} for {dst} is not visible here: under torchrun DST "
                          f"must be on a file system every rank shares, or on s3:// / gs://")
    stack.enter_context(storage.hold_claim())
    return True


def _write(ranks: Ranks, cp: ConvertPlan, tmp: str, dst: str, opts: ConvertOptions) -> dict:
    """This rank's writers, then the CRC check of what they read; returns this rank's report."""
    rank = ranks.rank
    writers = cp.writers_of(rank)
    t0 = time.perf_counter()
    timings: dict[str, float] = {}
    enabled = opts.show_progress if rank == 0 else False
    with progress(cp.total_bytes, f"convert {basename(dst)}", enabled=enabled) as bar, \
            ranks.counter.watch(bar) as update:
        results = write_share(cp, tmp, writers, opts.force, update, timings)
    check_records([r[2] for r in results], window=min(cp.share, 8 << 20))
    _testing_fault(rank)
    return {"rank": rank, "writers": len(writers), "bytes": sum(b.nbytes for w in writers for b in cp.blocks_of(w)),
            "read": sum(r[1] for r in results), "seconds": round(time.perf_counter() - t0, 3),
            "warnings": [f"rank {rank}: {w}" for r in results for w in r[0]],
            "replicas": [asdict(d) for r in results for d in r[3]]}


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
