"""`convert`: the entry of `gtp-bridge convert` and `bridge.convert` (Megatron-Core `torch_dist` -> logical).

It plans (`convert.plan_conversion`) and writes in this process (`convert.write_share`: one spawned
process per writer), or, under a torchrun launch of two or more processes, hands off to
`distributed.convert_ranks`, where every rank writes a share of the blocks and rank 0 commits once.
The dispatch sits here, above both, so neither imports the other's caller.
"""

from __future__ import annotations

import sys
import time

from bridge.format.manifest import REPLICAS_KEY
from bridge.phases import seconds_since_start
from bridge.location import absolute, basename, location
from bridge.progress import progress
from bridge.store import check_destination_free, check_sources, claim_destination, commit_checkpoint
from bridge.torchrun import launched_world
from converters.megatron import replicas
from converters.megatron.cache import check_records
from converters.megatron.convert import (ConvertOptions, ConvertResult, budget_line, plan_conversion, record_replicas,
                                         resources, write_share)
from converters.megatron.distributed import convert_ranks


def convert(src_dir: str, dst: str, opts: ConvertOptions | None = None) -> ConvertResult:
    """Convert a torch_dist checkpoint at `src_dir` into a logical checkpoint at `dst`.

    Under torchrun (WORLD_SIZE > 1) every rank calls it alike and converts a share of the blocks
    (`converters.megatron.distributed`); the commit is one, after every rank's share is written."""
    started = seconds_since_start() or 0.0   # the phase before this call (interpreter, imports, parsing)
    src_dir, dst = location(src_dir, "source"), location(dst, "destination")
    opts = opts or ConvertOptions()
    dst = absolute(dst)
    check_destination_free(dst)  # s3:// / gs:// too (bridge.store.remote.check_remote_free)
    check_sources(dst, [src_dir])
    t_start = time.perf_counter()
    timings: dict[str, float] = {}
    budget, asked_workers = resources(opts)
    if launched_world() > 1:
        return convert_ranks(src_dir, dst, opts, budget, asked_workers, started=started)
    cp = plan_conversion(src_dir, opts, budget, asked_workers)
    ck, src, units, plan, manifest, workers = cp.ck, cp.src, cp.units, cp.plan, cp.manifest, cp.workers
    step, total_bytes = cp.step, cp.total_bytes
    share = cp.share
    if opts.announce is not None:
        opts.announce(budget_line(workers, budget, opts.workers))
    warnings: list[str] = []
    # The claim makes DST this run's alone; leaving the block by an error, Ctrl-C or SIGTERM removes
    # the temp directory (after run_parallel has killed the workers writing into it).
    with claim_destination(dst, sources=[src_dir, str(ck.root)]) as claim:
        timings["plan"] = time.perf_counter() - t_start
        t0 = time.perf_counter()
        with progress(total_bytes, f"convert {basename(dst)}", enabled=opts.show_progress) as bar:
            results = write_share(cp, claim.tmp, range(workers), opts.force, bar, timings)
        timings["write"] = time.perf_counter() - t0
        warnings += [w for r in results for w in r[0]]
        # Records read by ranges were CRC'd span by span as their bytes came in (one read of each
        # byte); their CRC-32s are complete and compared here, before anything is committed.
        t0 = time.perf_counter()
        check_records([r[2] for r in results], window=min(share, 8 << 20))
        timings["check_records"] = time.perf_counter() - t0
        replica_rec = record_replicas(manifest, units, [d for r in results for d in r[3]], opts.strict_replicas)
        warnings += replicas.report_lines(replica_rec)
        t0 = time.perf_counter()
        commit_checkpoint(claim, plan, manifest, timeout=60.0)
        timings["commit"] = time.perf_counter() - t0
    for w in warnings:
        print(f"gtp-bridge: warning: {w}", file=sys.stderr)
    return ConvertResult(dst, src.format_label, src.layout.to_json(), len(plan.arrays), plan.total_bytes,
                         len(units), step, warnings, src.inferred, workers, budget, timings,
                         replicas=manifest.extra[REPLICAS_KEY],
                         phases={"start": started, **{k: round(v, 3) for k, v in timings.items()}})
