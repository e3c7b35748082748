"""`to-megatron` time against an anchor measured in the same run.

Builds a Megatron-shaped `fully_reshardable` checkpoint (benchmarks/bench_convert.build_source:
GQA + SwiGLU GPT written by real `dcp.save`), converts it to a logical checkpoint, then times:
  to-megatron  gtp-bridge to-megatron LOGICAL RUN --tp T (budget / workers as given)
  anchor       raw TensorStore read of every array to-megatron reads (whole arrays, concurrently)
               + `torch.distributed.checkpoint.save` of the same tensors (one per array, no resharding)
(page cache not dropped: every timing reads warm files) and reports to-megatron / anchor (below 1.0: faster than reading and saving with the standard
tools), the bytes read vs the bytes needed, and optionally the same for another checkout
(`--old /path/to/checkout`, run in a subprocess) for a before/after figure.

    python benchmarks/bench_to_megatron.py --hidden 1024 --layers 2 --vocab 4096 --tp 2 --repeat 3 --old ../main
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch.distributed.checkpoint as dcp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests", "support"))


def time_to_megatron(logical: str, run: str, tp: int, budget: int | None, workers: int | None) -> tuple[float, dict]:
    from converters.megatron.write.torch_dist import MegatronTarget
    from converters.megatron.write.to_megatron import to_megatron

    shutil.rmtree(run, ignore_errors=True)
    t0 = time.perf_counter()
    res = to_megatron(logical, run, MegatronTarget(tp=tp), budget=budget, workers=workers, show_progress=False)
    return time.perf_counter() - t0, res


def time_old(checkout: str, logical: str, run: str, tp: int, budget: int | None) -> float:
    """Wall time of another checkout's to-megatron (its own process; import time excluded)."""
    shutil.rmtree(run, ignore_errors=True)
    code = ("import sys, time, torch, tensorstore\n"   # imports outside the timed region, as in this process
            "from converters.megatron.write.torch_dist import MegatronTarget\n"
            "from converters.megatron.write.to_megatron import to_megatron\n"
            "t0 = time.perf_counter()\n"
            f"to_megatron({logical!r}, {run!r}, MegatronTarget(tp={tp}), show_progress=False"
            + (f", budget={budget})\n" if budget else ")\n") +
            "print(time.perf_counter() - t0)\n")
    env = dict(os.environ, PYTHONPATH=checkout)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def time_anchor(logical: str, out: str) -> tuple[float, float, int]:
    """Raw TensorStore read of every model/params/mu/nu array, then dcp.save of them as torch tensors."""
    from bridge.store.reader import open_checkpoint
    from bridge.dtypes import from_numpy

    ck = open_checkpoint(logical)
    paths = [p for p, a in ck.arrays().items() if p[0] in ("model", "params", "opt_state") and len(a.shape) > 0]
    stores = ck.open_many(paths)
    t0 = time.perf_counter()
    futs = [s.read() for s in stores]
    arrays = [np.asarray(f.result()) for f in futs]
    t_read = time.perf_counter() - t0
    sd = {"/".join(p): from_numpy(a) for p, a in zip(paths, arrays)}
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    dcp.save(sd, checkpoint_id=out, no_dist=True)
    t_save = time.perf_counter() - t0
    return t_read, t_save, sum(a.nbytes for a in arrays)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--budget", help="to-megatron --budget (default: its own)")
    ap.add_argument("--workers", type=int, help="to-megatron --workers (default: its own)")
    ap.add_argument("--old", help="another checkout to time the same way (before/after)")
    ap.add_argument("--repeat", type=int, default=1, help="time each step N times, keep the fastest")
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
    args = ap.parse_args()
    from bench_convert import build_source

    from bridge.units import parse_size
    from converters.megatron.convert import ConvertOptions
    from converters.megatron.convert_entry import convert

    root = args.dir or tempfile.mkdtemp(prefix="bench-to-megatron-")
    os.makedirs(root, exist_ok=True)
    src, logical = os.path.join(root, "src"), os.path.join(root, "logical")
    try:
        shutil.rmtree(src, ignore_errors=True)
        shutil.rmtree(logical, ignore_errors=True)
        nbytes = build_source(src, args.hidden, args.layers, args.vocab)
        convert(src, logical, ConvertOptions(workers=1, show_progress=False))
        shutil.rmtree(src)
        budget = parse_size(args.budget) if args.budget else None
        runs = [time_to_megatron(logical, os.path.join(root, "run"), args.tp, budget, args.workers)
                for _ in range(args.repeat)]
        shutil.rmtree(os.path.join(root, "run"))
        t_tm, res = min(runs, key=lambda r: r[0])
        anchors = [time_anchor(logical, os.path.join(root, "anchor")) for _ in range(args.repeat)]
        shutil.rmtree(os.path.join(root, "anchor"))
        t_read, t_save, abytes = min(anchors, key=lambda a: a[0] + a[1])
        anchor = t_read + t_save
        row = {"state_MiB": round(nbytes / 2**20, 1), "tp": args.tp, "budget_MiB": res["budget"] >> 20,
               "workers": res["workers"], "to_megatron_s": round(t_tm, 3), "anchor_read_s": round(t_read, 3),
               "anchor_dcp_save_s": round(t_save, 3), "ratio_vs_anchor": round(t_tm / anchor, 3),
               "bytes_read_vs_needed": round(res["elements_read"] / max(1, res["elements_needed"]), 4),
               "GB_per_s": round(abytes / t_tm / 1e9, 3)}
        if args.old:
            t_old = min(time_old(args.old, logical, os.path.join(root, "run_old"), args.tp, budget) for _ in range(args.repeat))
            shutil.rmtree(os.path.join(root, "run_old"), ignore_errors=True)
            row.update(old_s=round(t_old, 3), old_ratio_vs_anchor=round(t_old / anchor, 3),
                       speedup_vs_old=round(t_old / t_tm, 2))
        print(json.dumps(row))
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
