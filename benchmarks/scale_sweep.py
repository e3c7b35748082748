"""`convert` at a grid of budgets and worker counts: each output verified, checked bit-exact and
measured (issue 16's Done-when sweep).

    python benchmarks/scale_sweep.py --gib 0.58 --dir /tmp/sweep              # synthetic source (CPU)
    python benchmarks/scale_sweep.py --src DP_DIR --ref LIVE_DIR --dir D      # an existing source
        [--grid 32M:1,64M:2,256M:4,default:8] [--json out.jsonl] [--deadline S] [--min-worker-bytes N]

For each `budget:workers` setting (`default` = the CLI's default budget): `gtp-bridge convert` in
its own process tree (wall time, peak RSS of the largest process and of the tree, bytes read),
then `verify` (every byte against its recorded digest), the bytes on disk over the state's bytes,
and bit-exactness against an independent reference:
- `--gib`: a synthetic `dp_reshardable` checkpoint (benchmarks/scale_synth.py); every array of the
  output compared with values regenerated independently (bench_scale's exact check);
- `--ref`: another checkpoint of the same state (e.g. the live export); every array's recorded
  digest must equal the reference's (and `verify` proved the output's bytes match its digests).
`--min-worker-bytes N` runs convert through its Python API with that `ConvertOptions` field (the
CLI gives each worker at least 1 GiB of work, so a small checkpoint converts in one process
whatever --workers says; a small N makes it use the workers asked for).
The budget share is what convert prints (`budget X (Y each)`); the issue's bound on memory is
peak RSS of the largest process <= 0.5 GiB + that share. The output is removed after each setting.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for p in (HERE, ROOT):
    if p not in sys.path:
        sys.path.insert(0, p)

import scale_measure as sm  # noqa: E402

GiB = 2**30
OVERHEAD = 512 << 20   # the fixed per-process allowance (interpreter, torch, TensorStore)
UNITS = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def parse_grid(text: str) -> list[tuple[str, int]]:
    """`32M:1,default:8` -> [('32M', 1), ('default', 8)].

    >>> parse_grid("32M:1, default:8")
    [('32M', 1), ('default', 8)]
    """
    out = []
    for item in text.split(","):
        budget, workers = item.strip().rsplit(":", 1)
        out.append((budget, int(workers)))
    return out


def size_of(text: str) -> int:
    """'1.5G' -> bytes.

    >>> size_of("2.0 GiB"), size_of("512.0 MiB"), size_of("64K")
    (2147483648, 536870912, 65536)
    """
    m = re.fullmatch(r"\s*([\d.]+)\s*([kKmMgG])?(i?B)?\s*", text)
    if not m:
        raise ValueError(text)
    return int(float(m.group(1)) * UNITS.get((m.group(2) or "").lower(), 1))


def budget_share(output: str) -> tuple[int, int, int] | None:
    """(workers, budget, share per worker) from convert's announce line, None if absent.

    >>> budget_share("convert: 8 workers, budget 16.0 GiB (2.0 GiB each)\\n")
    (8, 17179869184, 2147483648)
    >>> budget_share("convert: 1 worker (of 8 asked: the checkpoint is too small for more), budget 32.0 MiB")
    (1, 33554432, 33554432)
    """
    m = re.search(r"convert: (\d+) workers?[^,]*, budget ([\d.]+ \w+)(?: \(([\d.]+ \w+) each\))?", output)
    if not m:
        return None
    budget = size_of(m.group(2))
    return int(m.group(1)), budget, size_of(m.group(3)) if m.group(3) else budget


def digests_equal(a: str, ref: str) -> dict:
    """Every array's recorded digest in `a` equals `ref`'s (same arrays, same algorithm)."""
    from bridge.store.reader import open_checkpoint

    ma, mr = open_checkpoint(a).manifest, open_checkpoint(ref).manifest
    da = {k: r.digest for k, r in ma.arrays.items()}
    dr = {k: r.digest for k, r in mr.arrays.items()}
    differ = sorted(k for k in set(da) | set(dr) if da.get(k) != dr.get(k) or da.get(k) is None)
    return {"arrays": len(da), "differ": differ[:10], "ok": not differ and ma.digest_algorithm == mr.digest_algorithm}


API_CONVERT = """import sys
from converters.megatron.convert import ConvertOptions
from converters.megatron.convert_entry import convert
src, out, budget, workers, mwb = sys.argv[1:6]
budget = None if budget == 'default' else int(budget)
convert(src, out, ConvertOptions(workers=int(workers), budget=budget, min_worker_bytes=int(mwb), announce=print))
"""


def convert_argv(src: str, out: str, budget: str, workers: int, min_worker_bytes: int | None) -> list[str]:
    """The command that converts `src` at one setting (the CLI, or the API with min_worker_bytes)."""
    if min_worker_bytes is None:
        argv = [sys.executable, "-m", "bridge.cli", "convert", src, out, "--workers", str(workers)]
        return argv + (["--budget", budget] if budget != "default" else [])
    b = budget if budget == "default" else str(size_of(budget))
    return [sys.executable, "-c", API_CONVERT, src, out, b, str(workers), str(min_worker_bytes)]


def run_setting(src: str, out: str, budget: str, workers: int, state: int, logs: str, timeout: float,
                exact, min_worker_bytes: int | None = None, early=None) -> dict:
    from bridge.store.verify import verify_checkpoint

    shutil.rmtree(out, ignore_errors=True)
    argv = convert_argv(src, out, budget, workers, min_worker_bytes)
    rec: dict = {"what": "sweep", "budget": budget, "workers_asked": workers, "min_worker_bytes": min_worker_bytes,
                 "dropped_caches": sm.drop_caches()}
    r = sm.measure(argv, timeout=timeout, log=os.path.join(logs, f"convert_{budget}_{workers}.log"))
    rec.update(rc=r.rc, seconds=r.seconds, peak_process_rss=r.peak_process_rss, peak_tree_rss=r.peak_tree_rss,
               rchar=r.io.get("rchar", 0), read_bytes=r.io.get("read_bytes", 0), timed_out=r.timed_out)
    share = budget_share(r.output)
    if share:
        rec["workers"], rec["budget_bytes"], rec["share"] = share
        rec["rss_bound"] = OVERHEAD + rec["share"]
        rec["rss_within_bound"] = r.peak_process_rss <= rec["rss_bound"]
    if r.rc != 0:
        rec["output_tail"] = r.output[-1500:]
        return rec
    rec["disk_over_state"] = sm.du(out) / state
    if early is not None:  # the conversion's own figures, kept even if the checks below run out of time
        early(dict(rec, what="sweep_convert"))
    t0 = time.perf_counter()
    v = verify_checkpoint(out, show_progress=False)
    rec["verify"] = {"ok": v.ok, "damaged": dict(list(v.damaged.items())[:5]), "seconds": time.perf_counter() - t0}
    rec["exact"] = exact(out)
    rec["ok"] = bool(v.ok and rec["exact"]["ok"] and rec["disk_over_state"] <= 1.10)
    shutil.rmtree(out, ignore_errors=True)
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=None, help="generate a synthetic source of this many GiB")
    ap.add_argument("--src", default=None, help="an existing torch_dist checkpoint to convert")
    ap.add_argument("--ref", default=None, help="with --src: a checkpoint of the same state (digests compared)")
    ap.add_argument("--dir", required=True, help="scratch directory")
    ap.add_argument("--grid", default="32M:1,64M:2,256M:4,default:8")
    ap.add_argument("--json", default=None, help="append per setting a line once converted (what=sweep_convert) "
                                                  "and one once checked (what=sweep)")
    ap.add_argument("--deadline", type=float, default=3600.0, help="seconds from start; later settings are skipped")
    ap.add_argument("--min-worker-bytes", type=int, default=None,
                    help="convert through the API with this ConvertOptions.min_worker_bytes (default: the CLI)")
    a = ap.parse_args()
    if (a.gib is None) == (a.src is None) or (a.src and not a.ref):
        ap.error("pass --gib, or --src with --ref")
    sm.exit_on_sigterm()
    t_start = time.perf_counter()
    os.makedirs(a.dir, exist_ok=True)
    logs = os.path.join(a.dir, "logs")
    os.makedirs(logs, exist_ok=True)
    if a.gib is not None:
        import bench_scale as bs
        import scale_synth as ss

        sizes = ss.Sizes.for_gib(a.gib)
        src = os.path.join(a.dir, "src_dp")
        if not os.path.isdir(src):
            ss.write(src, sizes, "dp_reshardable", ss.default_bucket_size(sizes))
        state = sizes.state_bytes()
        workers = max(1, min(8, os.cpu_count() or 1))

        def exact(out: str) -> dict:
            return bs._exact(out, a.gib, workers)
    else:
        from bridge.store.reader import open_checkpoint

        src = a.src
        state = sum(r.nbytes for r in open_checkpoint(a.ref).arrays().values())

        def exact(out: str) -> dict:
            return digests_equal(out, a.ref)
    print(f"sweep: source {src}, state {state / GiB:.3f} GiB, {os.cpu_count()} cores, grid {a.grid}", flush=True)
    results = []
    for budget, workers in parse_grid(a.grid):
        left = a.deadline - (time.perf_counter() - t_start)
        if left < 20:
            print(f"SKIPPED {budget}:{workers} ({left:.0f} s left)", flush=True)
            results.append({"what": "sweep", "budget": budget, "workers_asked": workers, "skipped": True})
            continue
        def write(rec: dict) -> None:
            if a.json:
                with open(a.json, "a") as f:
                    f.write(json.dumps(rec, default=str) + "\n")

        def early(rec: dict) -> None:
            write(rec)
            print(f"[sweep] {budget}:{workers} converted: {rec['seconds']:.1f} s, peak RSS "
                  f"{rec['peak_process_rss'] / GiB:.3f} GiB (bound {rec.get('rss_bound', 0) / GiB:.3f}), "
                  f"disk {rec['disk_over_state']:.3f}x; verifying", flush=True)

        rec = run_setting(src, os.path.join(a.dir, "conv"), budget, workers, state, logs, left - 10, exact,
                          a.min_worker_bytes, early)
        results.append(rec)
        write(rec)
        print(f"[sweep] {budget}:{workers} rc={rec['rc']} {rec['seconds']:.1f} s, workers {rec.get('workers')}, "
              f"share {rec.get('share', 0) / GiB:.3f} GiB, peak RSS {rec['peak_process_rss'] / GiB:.3f} GiB "
              f"(bound {rec.get('rss_bound', 0) / GiB:.3f}; tree {rec['peak_tree_rss'] / GiB:.2f}), "
              f"disk {rec.get('disk_over_state', 0):.3f}x, verify {rec.get('verify', {}).get('ok')}, "
              f"exact {rec.get('exact', {}).get('ok')}", flush=True)
    print("| budget:workers | workers | share GiB | seconds | peak RSS GiB (largest / tree) | bound GiB | disk / state "
          "| verify | exact |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        if r.get("skipped"):
            print(f"| {r['budget']}:{r['workers_asked']} | skipped | | | | | | | |")
            continue
        print(f"| {r['budget']}:{r['workers_asked']} | {r.get('workers')} | {r.get('share', 0) / GiB:.3f} | "
              f"{r['seconds']:.1f} | {r['peak_process_rss'] / GiB:.3f} / {r['peak_tree_rss'] / GiB:.2f} | "
              f"{r.get('rss_bound', 0) / GiB:.3f} | {r.get('disk_over_state', 0):.3f} | {r.get('verify', {}).get('ok')} | "
              f"{r.get('exact', {}).get('ok')} |")


if __name__ == "__main__":
    main()
