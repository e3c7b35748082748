"""Writer processes of `convert`: one spawned process per writer, each running its blocks with the
`run_blocks` it is given (`converters.megatron.convert.run_blocks`: passed in, so this module does not
import its caller), reporting progress and its result through a queue; any error, Ctrl-C or SIGTERM
in the parent kills them all before the temp directory goes."""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import time
import traceback
from typing import Any, Callable, Sequence

from bridge.errors import BridgeError
from bridge.worker_life import die_with_parent
from converters.megatron.plan.convert_plan import Block, Unit
from converters.megatron.writer_job import WriterJob


def _worker_main(q, run_blocks, job: WriterJob, units, blocks, w) -> None:  # pragma: no cover - subprocess
    die_with_parent()
    try:
        t0 = time.time()  # wall clock: the parent compares it with its own
        res = run_blocks(job, units, blocks, w, on_progress=lambda n: q.put(("p", w, n)))
        q.put(("t", w, (t0, time.time())))
        q.put(("ok", w, res))
        # Done: everything is on disk and the result in the queue's pipe. Leave without the
        # interpreter's teardown (a collection over torch's and TensorStore's objects, module by
        # module: seconds the parent would wait for in join()).
        q.close()
        q.join_thread()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    except BridgeError as e:
        q.put(("err", w, f"writer {w}: {e}"))
    except BaseException as e:  # noqa: BLE001 - report any crash as one line
        q.put(("err", w, f"writer {w} crashed: {type(e).__name__}: {e}".splitlines()[0]))
        traceback.print_exc(file=sys.stderr)


def _waiting_main(q, jobs, run_blocks) -> None:  # pragma: no cover - subprocess
    """A prestarted writer: receiving `run_blocks` (pickled by reference) imports the writer's modules
    (the seconds a spawned process costs); then wait for its job (`_worker_main`'s arguments after the
    queue) or to be killed (`Prestarted.close`)."""
    die_with_parent()
    _worker_main(q, *jobs.get())


class Prestarted:
    """`n` writer processes started before their jobs are known: spawning them (interpreter start and
    imports, seconds each) overlaps whatever the parent does meanwhile, e.g. a torchrun rank joining
    its launch and claiming the destination (`converters.megatron.distributed`). `run_parallel` hands
    them their jobs; `close()` ends those that got none (a failed launch) and is idempotent."""

    def __init__(self, n: int, run_blocks: Callable[..., Any]) -> None:
        # spawn: TensorStore aborts in a forked child once the parent has used it
        self.ctx = mp.get_context("spawn")
        self.q = self.ctx.Queue()
        self.jobs = [self.ctx.SimpleQueue() for _ in range(n)]
        self.procs = [self.ctx.Process(target=_waiting_main, args=(self.q, j, run_blocks), daemon=True) for j in self.jobs]
        self.handed = False
        try:
            for p in self.procs:
                p.start()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self.handed:
            return   # run_parallel owns them now (and stops them on its errors)
        self.handed = True
        for p in self.procs:
            if p.pid is not None and p.is_alive():
                p.kill()
        for p in self.procs:
            if p.pid is not None:
                p.join()


def run_parallel(run_blocks: Callable[..., Any], job: WriterJob, units: Sequence[Unit], per: dict[int, list[Block]],
                 bar, timings: dict[str, float] | None = None, pool: Prestarted | None = None) -> list[tuple]:
    """One process per writer of `per` (writer id -> its blocks), each calling `run_blocks` (a module-level
    function: the spawned process imports it by name) on `job` and its blocks; their results in writer order.
    With `pool` (as many processes as writers, not yet handed jobs) its processes run them."""
    args = [(run_blocks, job, {b.unit: units[b.unit] for b in blocks}, blocks, w)
            for w, blocks in per.items()]
    if pool is not None and (pool.handed or len(pool.procs) != len(args)):
        raise BridgeError(f"internal: {len(pool.procs)} prestarted writers for {len(args)} jobs")
    if pool is not None:   # started earlier: what is left of their start shows from the hand-over on
        q, procs, t_spawn = pool.q, pool.procs, time.time()
        pool.handed = True
    else:
        ctx = mp.get_context("spawn")   # spawn: TensorStore aborts in a forked child once the parent has used it
        q = ctx.Queue()
        procs = [ctx.Process(target=_worker_main, args=(q, *a), daemon=True) for a in args]
        t_spawn = time.time()
    ids = list(per)
    done: dict[int, Any] = {}
    errors: list[str] = []
    spans: dict[int, tuple[float, float]] = {}   # worker -> wall clock at work, done
    try:
        if pool is not None:
            for jobs, a in zip(pool.jobs, args):
                jobs.put(a)
        else:
            for p in procs:
                p.start()
        while len(done) + len(errors) < len(procs):
            try:
                kind, w, payload = q.get(timeout=1.0)
            except Exception:  # queue.Empty
                dead = [i for i, p in enumerate(procs) if not p.is_alive() and i not in done and p.exitcode not in (0, None)]
                if dead and q.empty():
                    errors.append(f"writer {ids[dead[0]]} died with exit code {procs[dead[0]].exitcode}")
                    break
                continue
            if kind == "p":
                bar.update(payload)
            elif kind == "t":
                spans[w] = payload
            elif kind == "ok":
                done[w] = payload
            else:
                errors.append(payload)
                break
    finally:
        if len(done) < len(procs):   # an error, Ctrl-C or SIGTERM: stop every worker before tmp goes
            for p in procs:
                if p.pid is not None and p.is_alive():
                    p.kill()
        t_last = time.time()
        for p in procs:
            if p.pid is not None:
                p.join()
    if timings is not None and spans:
        timings["worker_start"] = max(a for a, _ in spans.values()) - t_spawn
        timings["worker_work"] = max(b - a for a, b in spans.values())
        timings["worker_exit"] = time.time() - t_last
    if errors:
        raise BridgeError(errors[0])
    return [done[w] for w in sorted(done)]
