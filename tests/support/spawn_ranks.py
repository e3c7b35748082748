"""Run a function on spawned ranks of a gloo process group (the live, dist and adapter tests' ranks)."""

from __future__ import annotations


def _spawn_entry(rank, world, init_file, out_dir, fn, args, timeout_s):
    import datetime
    import json
    import os
    import traceback

    import torch.distributed as dist

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))
        result = fn(rank, world, *args)
        with open(os.path.join(out_dir, f"result_{rank}.json"), "w") as f:
            json.dump(result, f)
        dist.destroy_process_group()
    except BaseException:
        with open(os.path.join(out_dir, f"error_{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        os._exit(1)


def spawn(world: int, fn, args: tuple, tmp_path, timeout_s: float = 240.0, pg_timeout_s: float = 60.0,
          allow_fail: bool = False) -> tuple[list, dict]:
    """Run `fn(rank, world, *args)` on `world` spawned gloo ranks; return (results, errors by rank).

    Results are JSON. A rank still running after `timeout_s` is killed and reported as a hang.
    """
    import json
    import multiprocessing as mp
    import os
    import time

    ctx = mp.get_context("spawn")
    out_dir = str(tmp_path / f"spawn_{time.monotonic_ns()}")
    os.makedirs(out_dir)
    init_file = os.path.join(out_dir, "pg_init")
    procs = [ctx.Process(target=_spawn_entry, args=(r, world, init_file, out_dir, fn, args, pg_timeout_s))
             for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(max(0.1, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for r in hung:
        procs[r].kill()
        procs[r].join()
    errors = {}
    for r in range(world):
        ef = os.path.join(out_dir, f"error_{r}.txt")
        if os.path.exists(ef):
            errors[r] = open(ef).read()
        elif r in hung:
            errors[r] = "HUNG"
        elif procs[r].exitcode != 0:
            errors[r] = f"exit code {procs[r].exitcode}"
    if errors and not allow_fail:
        r = min(errors)
        raise AssertionError(f"rank {r} failed:\n{errors[r]}")
    results = []
    for r in range(world):
        rf = os.path.join(out_dir, f"result_{r}.json")
        results.append(json.load(open(rf)) if os.path.exists(rf) else None)
    return results, errors
