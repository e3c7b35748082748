"""Read patterns of the store on object storage: requests, time and CPU per pattern vs raw reads of
the same bytes, same local server, one run.

    python benchmarks/bench_remote_reads.py --mib 512 --reps 3 --server s3

One checkpoint of `--mib` MiB of fp32 in `--arrays` arrays (`save_checkpoint`, so the object-storage
chunking: 16 MiB shards of 1 MiB inner chunks) and the same bytes as raw 16 MiB objects, on a local
S3 server (moto) or GCS emulator (tests/support/servers.py). Patterns, each reading every byte once:
  whole    every array read whole through the bridge's reader (8 threads over arrays)
  verify   `verify_checkpoint` (blocks aligned to the stored chunks, digests)
  rows8    each array in 8 row blocks, as a restore onto 8 devices sharded on the first axis
  cols8    each array in 8 column blocks (8 devices on the second axis): every block cuts every shard
  raw      the raw objects read whole, all at once (the anchor)
Reps run the patterns in a rotated order (load that drifts on a shared host hits all alike).
Reported per pattern: median MB/s, the median over reps of raw time / pattern time of the same rep
(1.0: as fast as raw), client CPU seconds per GiB, and the GETs and bytes TensorStore's own counters
(`ts.experimental_collect_matching_metrics`) saw. The last line, "SUMMARY {json}", is for scripts.

The servers are single-process emulators on this host: absolute rates say little about a cloud
store; request counts (billed, and each a round trip) and ratios do.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests", "support"))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from bench_remote import make_arrays, paired_ratio, raw_read, raw_write  # noqa: E402

PATTERNS = ("whole", "verify", "rows8", "cols8", "raw")


def counters(driver: str) -> dict[str, int]:
    import tensorstore as ts

    names = {f"/tensorstore/kvstore/{driver}/read": "GET", f"/tensorstore/kvstore/{driver}/bytes_read": "bytes"}
    out = {"GET": 0, "bytes": 0}
    for m in ts.experimental_collect_matching_metrics("/tensorstore/kvstore/"):
        if m["name"] in names and m.get("values"):
            out[names[m["name"]]] = int(m["values"][0]["value"])
    return out


def blocks(shape, parts: int, axis: int):
    """`parts` boxes splitting `shape` along `axis` (as devices of a 1-D mesh hold it).

    >>> [(b.start, b.stop) for b in blocks((4, 6), 2, 1)]
    [((0, 0), (4, 3)), ((0, 3), (4, 6))]
    """
    from bridge.layout.boxes import Box

    step = -(-shape[axis] // parts)
    for lo in range(0, shape[axis], step):
        start, stop = [0] * len(shape), list(shape)
        start[axis], stop[axis] = lo, min(shape[axis], lo + step)
        yield Box(tuple(start), tuple(stop))


def read_pattern(pattern: str, url: str, raw_url: str, arrays) -> None:
    from bridge.store.reader import open_checkpoint
    from bridge.store.verify import verify_checkpoint

    if pattern == "raw":
        return raw_read(raw_url, arrays)
    if pattern == "verify":
        r = verify_checkpoint(url, show_progress=False)
        assert r.ok, r
        return
    ck = open_checkpoint(url)
    paths = [tuple(k.split("/")) for k in arrays]
    if pattern == "whole":
        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(ck.read, paths))
        assert all(g.shape == arrays["/".join(p)].shape for g, p in zip(got, paths))
        return
    axis = 0 if pattern == "rows8" else 1
    boxes = [(p, b) for p in paths for b in blocks(arrays["/".join(p)].shape, 8, axis)]
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda pb: ck.read(*pb), boxes))
    assert sum(g.nbytes for g in got) == sum(a.nbytes for a in arrays.values())


def run(server: str, mib: float, n_arrays: int, reps: int) -> dict:
    from servers import GcsServer, S3Server, environ

    from bridge.store.commit import save_checkpoint

    arrays = make_arrays(mib, n_arrays)
    nbytes = sum(a.nbytes for a in arrays.values())
    driver = "s3" if server == "s3" else "gcs"
    make_server = (lambda: S3Server(memory_objects=True)) if server == "s3" else GcsServer
    times = {p: [] for p in PATTERNS}
    cpu = {p: [] for p in PATTERNS}
    reqs: dict[str, dict] = {}
    with make_server() as srv, environ(**srv.env):
        url, raw_url = srv.url("reads/store"), srv.url("reads/raw")
        save_checkpoint(url, arrays)
        raw_write(raw_url, arrays)
        for p in PATTERNS:  # warm-up, untimed: imports, connections; counts requests once
            c0 = counters(driver)
            read_pattern(p, url, raw_url, arrays)
            c1 = counters(driver)
            reqs[p] = {k: c1[k] - c0[k] for k in c0}
        for rep in range(reps):
            k = rep % len(PATTERNS)
            order = PATTERNS[k:] + PATTERNS[:k]
            if rep % 2:
                order = order[::-1]
            for p in order:
                c0, t0 = time.process_time(), time.perf_counter()
                read_pattern(p, url, raw_url, arrays)
                times[p].append(time.perf_counter() - t0)
                cpu[p].append(time.process_time() - c0)
    gib = nbytes / (1 << 30)
    return {"server": server, "bytes": nbytes, "arrays": n_arrays, "reps": reps,
            "MBps": {p: round(nbytes / statistics.median(t) / 1e6, 1) for p, t in times.items()},
            "ratio_vs_raw": {p: paired_ratio(times["raw"], t) for p, t in times.items() if p != "raw"},
            "ratio_range": {p: [round(min(r / s for r, s in zip(times["raw"], t)), 3),
                                round(max(r / s for r, s in zip(times["raw"], t)), 3)]
                            for p, t in times.items() if p != "raw"},
            "cpu_s_per_GiB": {p: round(statistics.median(c) / gib, 2) for p, c in cpu.items()},
            "requests": reqs}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=float, default=256)
    ap.add_argument("--arrays", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--server", choices=("s3", "gs", "both"), default="s3")
    args = ap.parse_args(argv)
    results = []
    for server in (("s3", "gs") if args.server == "both" else (args.server,)):
        r = run(server, args.mib, args.arrays, args.reps)
        results.append(r)
        print(f"{server}: {r['bytes'] / 2**20:.0f} MiB in {r['arrays']} arrays, median of {r['reps']}")
        for p in PATTERNS:
            q = r["requests"][p]
            ratio = "" if p == "raw" else (f"  {r['ratio_vs_raw'][p]:.2f}x raw (range {r['ratio_range'][p][0]:.2f}-"
                                           f"{r['ratio_range'][p][1]:.2f})")
            print(f"  {p:7s} {r['MBps'][p]:8.1f} MB/s  CPU {r['cpu_s_per_GiB'][p]:.2f} s/GiB  "
                  f"GETs {q['GET']:5d}  read {q['bytes'] / 2**20:8.1f} MiB{ratio}")
    print("SUMMARY " + json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
