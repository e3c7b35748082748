"""Writer processes of `convert`: one spawned process per writer, each running its blocks
(`converters.megatron.convert.run_blocks`), reporting progress and its result through a queue; any
error, Ctrl-C or SIGTERM in the parent kills them all before the temp directory goes."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys
import time
import traceback
from typing import Any, Sequence

from bridge.errors import BridgeError
from converters.megatron.plan import Block, Unit
from converters.megatron.writer_job import WriterJob


def die_with_parent() -> None:
    """In a worker: be killed (SIGKILL) when the parent process dies, however it dies (Linux), and
    leave SIGINT to the parent, which stops the workers and cleans up."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        try:
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass
    if os.getppid() == 1:  # the parent died before the death signal was armed
        os._exit(1)


def _worker_main(q, job: WriterJob, units, blocks, w) -> None:  # pragma: no cover - subprocess
    die_with_parent()
    try:
        t0 = time.time()  # wall clock: the parent compares it with its own
        from converters.megatron.convert import run_blocks

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


def run_parallel(job: WriterJob, units: Sequence[Unit], per: dict[int, list[Block]], bar,
                 timings: dict[str, float] | None = None) -> list[tuple]:
    """One process per writer of `per` (writer id -> its blocks), each doing `job`; their results in writer order."""
    # spawn: TensorStore aborts in a forked child once the parent has used it
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = []
    ids = list(per)
    for w, blocks in per.items():
        mine = {b.unit: units[b.unit] for b in blocks}
        procs.append(ctx.Process(target=_worker_main, args=(q, job, mine, blocks, w), daemon=True))
    done: dict[int, Any] = {}
    errors: list[str] = []
    spans: dict[int, tuple[float, float]] = {}   # worker -> wall clock at work, done
    t_spawn = time.time()
    try:
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
