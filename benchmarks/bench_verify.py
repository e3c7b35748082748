"""`verify` vs a raw TensorStore read of the same arrays and a raw read of the files, and the bytes each reads.

    python benchmarks/bench_verify.py [--mib 256] [--layers 16] [--threads N] [--reps 3] [--dir /tmp/x] [--cold]
                                      [--baseline OLD_VERIFY_PY]

Writes a synthetic checkpoint of `--mib` MiB of float32 stacked-layer arrays (shape
(layers, rows, cols)) in two chunk layouts, half the bytes each: inner chunks spanning every layer
(what the converter wrote at e9efc35, e.g. (16, 128, 128)) and one layer per inner chunk (what the
live export writes, (1, 512, 512)). Then, interleaved over `--reps`:
- **verify**: `bridge.store.verify.verify_checkpoint` (every byte read, digested, compared);
- **raw**: plain TensorStore opens of the same arrays and one whole-array `read()` each, all
  issued at once (no digest): the anchor;
- **files**: every file of the checkpoint read with 8 threads, 16 MiB at a time (the disk's rate);
- **baseline** (with `--baseline FILE`, e.g. `git show <commit>:bridge/store/verify.py > old.py`):
  that file's `verify_checkpoint`, interleaved with this tree's (an A/B of two versions in one process).
Reported: median wall times, their ratios, CPU seconds (user + system, all threads) and bytes read
by the process (/proc/self/io rchar) over the arrays' bytes. CPU seconds show the per-byte overhead
that limits a machine with many cores. Page cache state is the same for all: warm (the checkpoint
was just written and is read once before timing), or with `--cold` dropped before each run (root
only). Targets: bytes <= 1.1x.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bridge.layout.boxes import Box  # noqa: E402
from bridge.layout.chunks import ArrayOwnership  # noqa: E402
from bridge.store import ArraySpec, CheckpointWriter, begin_checkpoint, commit_checkpoint, make_write_plan  # noqa: E402
from bridge.store.plan import ArrayPlan, WritePlan  # noqa: E402
from bridge.store.reader import open_checkpoint  # noqa: E402
from bridge.store.verify import verify_checkpoint  # noqa: E402


def rchar() -> int:
    """Bytes this process read through read(2)/pread(2) so far (page cache hits included)."""
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar")).split()[1])


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def drop_caches() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def layer_shapes(mib: int, layers: int, cols: int = 1024) -> list[tuple[int, int, int]]:
    """Shapes of (layers, 512, cols) float32 arrays, about `mib` MiB in total (at least one).

    >>> layer_shapes(64, 16)
    [(16, 512, 1024), (16, 512, 1024)]
    """
    n = max(1, (mib << 20) // (layers * 512 * cols * 4))
    return [(layers, 512, cols)] * n


def build(root: str, mib: int, layers: int) -> tuple[str, int]:
    shapes = layer_shapes(mib // 2, layers)
    arrays, inner = {}, {}
    for i, s in enumerate(shapes):
        arrays[("params", f"span{i}")], inner[("params", f"span{i}")] = s, (s[0], 128, 128)
        arrays[("params", f"layer{i}")], inner[("params", f"layer{i}")] = s, (1, 512, 512)
    base = make_write_plan([ArraySpec(p, s, "float32") for p, s in arrays.items()], 1)
    plans = {}
    for name, ap in base.arrays.items():
        s = ap.spec.shape
        plans[name] = ArrayPlan(ap.spec, ArrayOwnership(s, s, np.zeros((1, 1, 1), np.int32)), inner[ap.spec.path])
    plan = WritePlan(plans, 1)
    dst = os.path.join(root, "ck")
    claim = begin_checkpoint(dst)
    w = CheckpointWriter(claim.tmp, plan, 0)
    rng = np.random.default_rng(0)
    for ap in plan.arrays.values():
        s = ap.spec.shape
        w.write(ap.spec.path, Box.full(s), rng.standard_normal(s, dtype=np.float32))  # one piece: no rewrites
    w.finish()
    commit_checkpoint(claim, plan, timeout=120)
    return dst, plan.total_bytes


def raw_read(dst: str) -> int:
    """The anchor: every array opened with plain TensorStore and read whole, all reads in flight at once."""
    ck = open_checkpoint(dst)
    stores = ck.open_many(ck.paths())
    futures = [t.read() for t in stores]
    return sum(f.result().nbytes for f in futures)


def files_read(dst: str, threads: int = 8) -> int:
    """The disk's anchor: every file under `dst` read with `threads` threads, 16 MiB at a time."""
    from concurrent.futures import ThreadPoolExecutor

    def one(fn: str) -> int:
        n, buf = 0, bytearray(16 << 20)
        with open(fn, "rb", buffering=0) as f:
            while k := f.readinto(buf):
                n += k
        return n

    names = [os.path.join(r, n) for r, _, fs in os.walk(dst) for n in fs]
    with ThreadPoolExecutor(threads) as ex:
        return sum(ex.map(one, sorted(names, key=os.path.getsize, reverse=True)))


def load_module(path: str, name: str):
    """A module from a file (an older verify.py, for an A/B in one process)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--cold", action="store_true", help="drop the page cache before each run (root only)")
    ap.add_argument("--baseline", default=None, help="an older verify.py to time against this tree's")
    args = ap.parse_args()
    if args.cold and os.geteuid() != 0:
        ap.error("--cold needs root (it writes /proc/sys/vm/drop_caches)")
    root = tempfile.mkdtemp(dir=args.dir, prefix="bench_verify_")
    try:
        dst, nbytes = build(root, args.mib, args.layers)
        raw_read(dst)  # warm the page cache equally for both
        modes = ("verify", "raw", "files") + (("baseline",) if args.baseline else ())
        base = load_module(args.baseline, "baseline_verify") if args.baseline else None
        times: dict = {m: [] for m in modes}
        cpus: dict = {m: [] for m in modes}
        reads: dict = {m: [] for m in modes}
        for _ in range(args.reps):
            for mode in modes:
                if args.cold:
                    drop_caches()
                r0, c0, t0 = rchar(), cpu_seconds(), time.perf_counter()
                if mode in ("verify", "baseline"):
                    fn = verify_checkpoint if mode == "verify" else base.verify_checkpoint
                    res = fn(dst, threads=args.threads, show_progress=False)
                    assert res.ok, res
                elif mode == "raw":
                    raw_read(dst)
                else:
                    files_read(dst)
                times[mode].append(time.perf_counter() - t0)
                cpus[mode].append(cpu_seconds() - c0)
                reads[mode].append(rchar() - r0)
        t = {m: statistics.median(times[m]) for m in modes}
        print(f"arrays: {nbytes / 2**20:.0f} MiB (half inner chunks over all {args.layers} layers, half one layer each); "
              f"{os.cpu_count()} CPUs, verify threads {args.threads or 'default'}, page cache "
              f"{'dropped before each run' if args.cold else 'warm'}")
        for m in modes:
            print(f"{m:7s} {t[m]:7.3f} s  {nbytes / t[m] / 2**30:6.2f} GiB/s  CPU {statistics.median(cpus[m]):6.2f} s  "
                  f"bytes read {statistics.median(reads[m]) / nbytes:.3f}x")
        print(f"verify / raw time: {t['verify'] / t['raw']:.2f}x; verify / files time: {t['verify'] / t['files']:.2f}x")
        if base is not None:
            print(f"verify / baseline time: {t['verify'] / t['baseline']:.2f}x")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
