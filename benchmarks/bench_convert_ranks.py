"""`convert` under torchrun (R ranks x W/R workers) vs one process of W workers, on one host.

    python benchmarks/bench_convert_ranks.py --gib 0.25 --dir /tmp/bcr            # quick CPU mode
    python benchmarks/bench_convert_ranks.py --gib 12 --workers 16 --ranks 2 --dir /tmp/bcr --deadline 200

A synthetic Megatron-shaped `dp_reshardable` save (`scale_synth.write`) is converted in A B B A
order: A = `gtp-bridge convert SRC OUT --workers W --budget B`, B = `torchrun --nproc-per-node R
gtp-bridge convert SRC OUT --workers W/R --budget B/R` (so every writer has the same share and the
plan has the same blocks). The page cache is dropped before each run when running as root, then
the libraries are imported once (warm, as on a user's host). Each
run's wall time is measured as a user runs it (process start included); both outputs must hold the
same per-array digests (the manifests'), which the commit computed from the bytes each writer wrote.
Prints one JSON line: the runs (each with the command's phases from its `--json` summary: A's
process, every rank of B), the B / A ratio of each adjacent pair and their median.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import scale_measure as sm  # noqa: E402
import scale_synth  # noqa: E402


def digests(path: str) -> dict[str, str]:
    """Array name -> the digest its manifest records (bridge's reader; checked by the commit)."""
    from bridge.store.reader import open_checkpoint

    man = open_checkpoint(path).manifest
    return {name: rec.digest for name, rec in man.arrays.items()}


def _report(log: str) -> list[str]:
    """The command's own report lines (the budget line, the per-rank summary, any error)."""
    try:
        with open(log, errors="replace") as f:
            return [ln.strip() for ln in f if ln.startswith(("convert:", "ranks:", "phases", "gtp-bridge:"))][-5:]
    except OSError:
        return []


def _phases(log: str) -> dict:
    """The command's `--json` summary's phases: this process's (A), every rank's (B), from the log."""
    try:
        with open(log, errors="replace") as f:
            text = f.read()
        rep, _ = json.JSONDecoder().raw_decode(text, text.rindex('{\n "schema"'))   # `emit`'s indented object
    except (OSError, ValueError):
        return {}
    return {"phases": rep.get("phases", {}), "rank_phases": [r.get("phases", {}) for r in rep.get("ranks", [])]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=0.25)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--workers", type=int, default=4, help="workers of the one process (ranks x workers each)")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--budget-per-worker", default="1G")
    ap.add_argument("--reps", type=int, default=2, help="A B pairs (A B B A ...)")
    ap.add_argument("--deadline", type=float, default=1e9, help="seconds from the start: no run starts after")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    t_start = time.monotonic()
    from bridge.units import parse_size

    per = parse_size(a.budget_per_worker)
    src, out = os.path.join(a.dir, "src"), os.path.join(a.dir, "out")
    shutil.rmtree(a.dir, ignore_errors=True)
    os.makedirs(a.dir)
    sizes = scale_synth.Sizes.for_gib(a.gib)
    t0 = time.perf_counter()
    scale_synth.write(src, sizes, "dp_reshardable", scale_synth.default_bucket_size(sizes))
    gen_s = time.perf_counter() - t0
    gtpb = [sys.executable, "-m", "bridge.cli", "convert", src, out, "--json"]
    one = gtpb + ["--workers", str(a.workers), "--budget", str(per * a.workers)]
    w = a.workers // a.ranks
    ranks = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={a.ranks}",
             "-m", "bridge.cli", "convert", src, out, "--json", "--workers", str(w), "--budget", str(per * w)]
    order = ["A", "B", "B", "A"] * ((a.reps + 1) // 2)
    order = order[:2 * a.reps]
    runs, first = [], {}
    for name in order:
        if time.monotonic() - t_start > a.deadline:
            break
        shutil.rmtree(out, ignore_errors=True)
        dropped = sm.drop_caches()
        if dropped:
            # the checkpoint's bytes stay cold, the libraries' files do not (as in bench_scale): a user's host
            # has torch cached, and only B imports it (torchrun, gloo), A's processes never do
            sm.measure([sys.executable, "-c", sm.WARM_IMPORTS + "; import torch.distributed.run"], timeout=120)
        log = os.path.join(a.dir, f"{name}{len(runs)}.log")
        r = sm.measure(one if name == "A" else ranks, log=log)
        rec = {"run": name, "rc": r.rc, "seconds": round(r.seconds, 2), "dropped_caches": dropped,
               "peak_process_rss": r.peak_process_rss, "report": _report(log), **_phases(log)}
        if r.rc == 0:
            d = digests(out)
            first.setdefault("digests", d)
            rec["same_digests_as_first"] = d == first["digests"]
        runs.append(rec)
        print(json.dumps(rec), flush=True)
    pairs = [(x, y) for x, y in zip(runs[::2], runs[1::2])]
    ratios = [round((y if y["run"] == "B" else x)["seconds"] / (x if x["run"] == "A" else y)["seconds"], 3)
              for x, y in pairs if x["rc"] == 0 and y["rc"] == 0]
    res = {"bench": "convert_ranks", "gib": a.gib, "state_bytes": sizes.state_bytes(), "gen_s": round(gen_s, 1), "workers": a.workers, "ranks": a.ranks, "runs": runs,
           "ranks_over_one": ratios, "median": statistics.median(ratios) if ratios else None,
           "cores": os.cpu_count()}
    print(json.dumps(res), flush=True)
    if a.json:
        with open(a.json, "a") as f:
            f.write(json.dumps(res) + "\n")
    shutil.rmtree(a.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
