"""`verify` vs a raw TensorStore read of the same arrays, and the bytes each reads.

    python benchmarks/bench_verify.py [--mib 256] [--layers 16] [--threads N] [--reps 3] [--dir /tmp/x]

Writes a synthetic checkpoint of `--mib` MiB of float32 stacked-layer arrays (shape
(layers, rows, cols)) in two chunk layouts, half the bytes each: inner chunks spanning every layer
(what the converter wrote at e9efc35, e.g. (16, 128, 128)) and one layer per inner chunk (what the
live export writes, (1, 512, 512)). Then, interleaved over `--reps`:
- **verify**: `bridge.store.verify.verify_checkpoint` (every byte read, digested, compared);
- **raw**: plain TensorStore opens of the same arrays and one whole-array `read()` each, all
  issued at once (no digest): the anchor.
Reported: median wall times and their ratio (verify / raw), and bytes read by the process
(/proc/self/io rchar) over the arrays' bytes. Page cache state is the same for both (warm: the
checkpoint was just written and is read once before timing). Targets: bytes <= 1.1x.
"""

from __future__ import annotations

import argparse
import os
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
    w = CheckpointWriter(begin_checkpoint(dst), plan, 0)
    rng = np.random.default_rng(0)
    for ap in plan.arrays.values():
        s = ap.spec.shape
        w.write(ap.spec.path, Box.full(s), rng.standard_normal(s, dtype=np.float32))  # one piece: no rewrites
    w.finish()
    commit_checkpoint(dst, plan, timeout=120)
    return dst, plan.total_bytes


def raw_read(dst: str) -> int:
    """The anchor: every array opened with plain TensorStore and read whole, all reads in flight at once."""
    ck = open_checkpoint(dst)
    stores = ck.open_many(ck.paths())
    futures = [t.read() for t in stores]
    return sum(f.result().nbytes for f in futures)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    root = tempfile.mkdtemp(dir=args.dir, prefix="bench_verify_")
    try:
        dst, nbytes = build(root, args.mib, args.layers)
        raw_read(dst)  # warm the page cache equally for both
        times = {"verify": [], "raw": []}
        reads = {"verify": [], "raw": []}
        for _ in range(args.reps):
            for mode in ("verify", "raw"):
                r0, t0 = rchar(), time.perf_counter()
                if mode == "verify":
                    res = verify_checkpoint(dst, threads=args.threads, show_progress=False)
                    assert res.ok, res
                else:
                    raw_read(dst)
                times[mode].append(time.perf_counter() - t0)
                reads[mode].append(rchar() - r0)
        tv, tr = statistics.median(times["verify"]), statistics.median(times["raw"])
        print(f"arrays: {nbytes / 2**20:.0f} MiB (half inner chunks over all {args.layers} layers, half one layer each); "
              f"{os.cpu_count()} CPUs, verify threads {args.threads or 'default'}")
        print(f"verify  {tv:7.3f} s  {nbytes / tv / 2**30:6.2f} GiB/s  bytes read {statistics.median(reads['verify']) / nbytes:.3f}x")
        print(f"raw     {tr:7.3f} s  {nbytes / tr / 2**30:6.2f} GiB/s  bytes read {statistics.median(reads['raw']) / nbytes:.3f}x")
        print(f"verify / raw time: {tv / tr:.2f}x")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
