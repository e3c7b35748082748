"""Run a command, time it, and record the peak RSS of its process tree and the bytes it read/wrote.

    python3 scripts/gpu/scale/measure.py --name NAME --json RESULTS.jsonl [--drop-caches] [--log LOG] \
        [--timeout S] -- CMD...

Appends one JSON line: name, argv, rc, seconds, peak_process_rss (largest single process, e.g. one of
convert's writer processes), peak_tree_rss (largest sum over the command and its descendants),
io (rchar/wchar: bytes passed to read()/write(), page cache included; read_bytes/write_bytes: what
reached the disk), and the tail of the command's output (which goes to LOG). The measuring is
benchmarks/scale_measure.py's (from /proc; no third-party package).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import scale_measure as sm  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--name", required=True)
    ap.add_argument("--json", required=True)
    ap.add_argument("--log", default=None)
    ap.add_argument("--drop-caches", action="store_true")
    ap.add_argument("--warm-imports", action="store_true",
                    help="after dropping the page cache, import the libraries once in a throwaway process: the "
                         "checkpoint's bytes stay cold, the libraries' files do not (bench_scale.py's policy)")
    ap.add_argument("--timeout", type=float, default=None)
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    sm.exit_on_sigterm()
    cmd = a.cmd[1:] if a.cmd and a.cmd[0] == "--" else a.cmd
    rec: dict = {"name": a.name, "argv": cmd}
    if a.drop_caches:
        rec["dropped_caches"] = sm.drop_caches()
    if a.warm_imports:
        rec["warm_imports"] = sm.measure([sys.executable, "-c", sm.WARM_IMPORTS], timeout=120).rc == 0
    r = sm.measure(cmd, timeout=a.timeout, log=a.log)
    rec.update(rc=r.rc, seconds=r.seconds, cpu_seconds=r.cpu_seconds, peak_process_rss=r.peak_process_rss,
               peak_tree_rss=r.peak_tree_rss, io=r.io, timed_out=r.timed_out, tail=r.output[-1500:])
    with open(a.json, "a") as f:
        f.write(json.dumps(rec) + "\n")
    print(f"[measure] {a.name}: rc={r.rc} {r.seconds:.2f} s (CPU {r.cpu_seconds:.1f} s), peak RSS {r.peak_process_rss / 2**30:.2f} GiB "
          f"(tree {r.peak_tree_rss / 2**30:.2f} GiB), read {r.io.get('rchar', 0) / 1e9:.2f} GB "
          f"(disk {r.io.get('read_bytes', 0) / 1e9:.2f}), wrote {r.io.get('wchar', 0) / 1e9:.2f} GB"
          + (" TIMED OUT" if r.timed_out else ""), flush=True)
    sys.exit(r.rc if r.rc >= 0 else 128 - r.rc)


if __name__ == "__main__":
    main()
