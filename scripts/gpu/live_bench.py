"""Live export benchmark over NCCL: export vs DCP save vs raw TensorStore, and exchange bus bandwidth.

Run from the repository root on the GPU machine:

    python scripts/gpu/live_bench.py                 # 2 GPUs: TP2xGTP1 and TP1xGTP2
    python scripts/gpu/live_bench.py --world 4       # 4 GPUs: TP2xGTP2
    python scripts/gpu/live_bench.py --mib 4096 --reps 3
    python scripts/gpu/live_bench.py --layout gtp2 --writer-timeline   # one layout; other flags go to
                                                                     # bench_live_export (diagnostics)

For each layout it runs `benchmarks/bench_live_export.py --backend nccl --busbw` (same ranks, same
state: export_state (plan reused, and replanned) vs the store alone on the same boxes vs
torch.distributed.checkpoint.save vs a raw TensorStore write of as many bytes as the export wrote;
then the export's all_to_all alone vs a plain all_gather_into_tensor with the same per-rank bytes)
and prints one figure line per layout plus PASS/FAIL against the targets (export <= DCP time,
raw/export >= 0.8, exchange busbw >= 0.7 x all-gather busbw; every rank's pieces read back from an
exported checkpoint bit-exactly, `--verify`), then a table, the export's per-step
split, and one parseable line `LIVE_BENCH [json per layout]`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks")))

LAYOUTS = {2: [(2, 1), (1, 2)], 4: [(2, 2)]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, choices=sorted(LAYOUTS), default=2)
    ap.add_argument("--mib", type=float, default=2048, help="total model state (weights + optimizer), MiB")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--backend", choices=("nccl", "gloo"), default="nccl")
    ap.add_argument("--dir", default=None, help="scratch directory on a real disk (default: a temp dir)")
    ap.add_argument("--layout", choices=("tp2", "gtp2"), default=None, help="only this layout (world 2)")
    a, extra = ap.parse_known_args(argv)  # the rest goes to bench_live_export (its diagnostics)
    import bench_live_export as bench

    failed = 0
    rows = []
    for tp, gtp in LAYOUTS[a.world]:
        if a.layout and a.layout != ("tp2" if tp == 2 else "gtp2"):
            continue
        out = tempfile.mktemp(suffix=".json")
        argv_b = ["--world", str(a.world), "--tp", str(tp), "--gtp", str(gtp), "--mib", str(a.mib), "--reps",
                  str(a.reps), "--backend", a.backend, "--busbw", "--verify", "--json", out, *extra]
        if a.dir:
            argv_b += ["--dir", os.path.join(a.dir, f"tp{tp}_gtp{gtp}")]
        bench.main(argv_b)
        s = json.load(open(out))
        b = s["busbw"]
        ph = s["phases"]
        verified = not s["verify"]["mismatches"]  # every rank's pieces read back bit-exactly
        ok = (verified and s["export_over_dcp_time"] <= 1.0 and s["raw_over_export_time"] >= 0.8
              and b["busbw_ratio"] >= 0.7)
        failed += not ok
        print(f"{'PASS' if ok else 'FAIL'} TP{tp}xGTP{gtp}: "
              f"{'read-back exact' if verified else 'READ-BACK MISMATCH ' + str(s['verify']['mismatches'])}, export/dcp time {s['export_over_dcp_time']:.2f}, "
              f"raw/export time {s['raw_over_export_time']:.2f}, store-only/export {s['store_over_export_time']:.2f}, "
              f"exchange ({b['source']} splits) busbw {b['a2a_busbw_GBps']:.1f} GB/s vs "
              f"all-gather {b['allgather_busbw_GBps']:.1f} GB/s (ratio {b['busbw_ratio']:.2f}), "
              f"peak host RSS growth export {ph['export']['peak_rss_growth_MiB']:.0f} MiB / "
              f"dcp {ph['dcp']['peak_rss_growth_MiB']:.0f} MiB; reload at {s['reload']['layout']} "
              f"{s['reload']['max_s']:.2f} s, read/needed "
              f"{s['reload']['bytes_read_from_storage'] / max(1, s['reload']['bytes_needed']):.2f}", flush=True)
        rows.append({"layout": f"TP{tp}xGTP{gtp}", "ok": ok, "verified": verified,
                     **{k: round(ph[k]["median_s"], 4) for k in ("export", "export_replan", "store", "dcp", "raw_ts")},
                     "export_over_dcp": round(s["export_over_dcp_time"], 3),
                     "raw_over_export": round(s["raw_over_export_time"], 3),
                     "store_over_export": round(s["store_over_export_time"], 3),
                     "busbw_ratio": round(b["busbw_ratio"], 3),
                     "peak_rss_MiB": round(ph["export"]["peak_rss_growth_MiB"], 1),
                     "inner_KiB": (s["per_rank"][0].get("inner") or 0) >> 10,
                     "reload_read_over_needed": round(s["reload"]["bytes_read_from_storage"]
                                                      / max(1, s["reload"]["bytes_needed"]), 3),
                     "staged_MiB": round(sum(r.get("staged_bytes", 0) for r in s["per_rank"]) / 2 ** 20, 1),
                     "donated_staging": any(r.get("donated_staging") for r in s["per_rank"]),
                     "steps_s": {k: round(v, 4) for k, v in ph["export"]["steps_s"].items()}})
    print("\nlayout     export  replan   store     dcp     raw  exp/dcp raw/exp store/exp busbw  RSS+MiB inner read/need")
    for r in rows:
        print(f"{r['layout']:9} {r['export']:7.3f} {r['export_replan']:7.3f} {r['store']:7.3f} {r['dcp']:7.3f} "
              f"{r['raw_ts']:7.3f} {r['export_over_dcp']:7.2f} {r['raw_over_export']:7.2f} {r['store_over_export']:9.2f} "
              f"{r['busbw_ratio']:5.2f} {r['peak_rss_MiB']:8.0f} {r['inner_KiB']:4d}K {r['reload_read_over_needed']:9.2f}")
    for r in rows:
        print(f"{r['layout']} export steps (s): " + ", ".join(f"{k} {v:.3f}" for k, v in r["steps_s"].items()))
    print("LIVE_BENCH " + json.dumps(rows, separators=(",", ":")), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
