"""Write throughput of the store vs raw TensorStore, Orbax (JAX) and torch DCP, same bytes, one run.

    python benchmarks/bench_store_write.py --gib 1 --reps 3

Variants (all fsync'd, no compression, same N GiB of fp32 in `--arrays` arrays):
  store  2 writer processes, each owning half the rows of every array (CheckpointWriter + finalize:
         per-writer OCDBT, merge, _METADATA, digest, atomic rename)
  raw_ts 2 processes, each writing its halves as plain zarr3 arrays (file kvstore, one chunk per half)
  orbax  Orbax from JAX, 1 process, arrays sharded over 2 CPU devices (zarr3, OCDBT, no compression)
  dcp    torch.distributed.checkpoint.save from 2 gloo ranks, each holding its half as a DTensor shard
  diagnostics (--variants): store_nocrc (no crc32c per inner chunk), store_outer (inner chunk = outer
         chunk), store_nodigest (no digests), store_lean (none of the three), store_nostage (TensorStore
         copies inner chunks itself instead of the writer staging them in reused slabs), store_nodrop
         (no drop-behind), store_old (neither staging nor drop-behind, 256 MiB batches, one commit),
         store_if<N>[d<D>][tf<F>] and store_tf<F> (N MiB batches, D commits in flight (1 when not given),
         OCDBT data files of F MiB; the defaults are 64 MiB (128 with >= 16 CPUs), 1 and 16 MiB)
Reps are interleaved (variant order rotates); every worker starts from the same free-memory state
(--memory warm|cold, see _settle);
medians are reported as GB/s (1e9 B/s) and as ratios. Peak RSS is each writer's VmHWM;
"overhead" subtracts the RSS it had after creating its data. The last line, "SUMMARY {json}", has
the medians and the ratios store / anchor for scripts.

Needs only numpy, tensorstore, orbax-checkpoint + jax (orbax variant), torch (dcp variant); the
repository root is put on sys.path, so it runs from a checkout without installing the project.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import re
import resource
import shutil
import statistics
import sys
import time

import numpy as np

# Run from a checkout without installing: spawned workers inherit sys.path.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

COLS = 4096


def _shapes(gib: float, n_arrays: int) -> list[tuple[int, int]]:
    rows = int(gib * (1 << 30) / 4 / COLS / n_arrays)
    rows -= rows % 2
    return [(rows, COLS)] * n_arrays


def _half(shape, rank, seed):
    """This rank's half of an array (rows), generated and touched before timing."""
    rows = shape[0] // 2
    rng = np.random.default_rng(seed * 7 + rank)
    return rng.random((rows, shape[1]), dtype=np.float32)


def _cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _rss_mib() -> float:
    """Peak RSS since _settle reset it (VmHWM), else since start (ru_maxrss)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _cur_rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / (1 << 20)


def _settle(extra) -> None:
    """Bring free memory to the same state for every variant, after set-up, before timing.

    On VMs that hand freed guest memory back to the host (virtio-balloon free page reporting;
    measured here: freed pages stay cheap for >10 s, are expensive again by ~20 s), writing into
    recently freed pages costs several times less than into fresh ones, and which variant gets
    which depends on what ran or was freed just before (the orbax variant frees its numpy sources
    after device_put; a previous variant's exit frees GiBs). Two neutral states:
    --memory warm: each worker touches and frees `warm_bytes` (about its share of the output) so
    every variant writes into recycled pages (steady state of a long-running host);
    --memory cold: each worker idles `settle` seconds so freed memory has been handed back.
    """
    if extra.get("warm_bytes"):
        buf = np.ones(int(extra["warm_bytes"]), dtype=np.uint8)
        del buf
        try:  # the touch above is not the variant's memory: reset the peak-RSS mark (Linux >= 4.0)
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass
    time.sleep(extra.get("settle", 0.0))


# -- variants: each runs in a spawned process and returns (t_start, t_end, peak_rss, base_rss) ------
def store_worker(rank, world, shapes, out_dir, barrier, q, extra):
    import tensorstore  # noqa: F401 (imported at start-up in any real program, as in raw_ts)
    from bridge.layout.boxes import Box
    from bridge.layout.chunks import regular_ownership
    from bridge.store import ArraySpec, CheckpointWriter, Manifest, finalize, make_write_plan, tmp_dir_for

    catalog = [ArraySpec(("params", f"a{i}"), s, "float32") for i, s in enumerate(shapes)]
    # Writer r owns rows [r*R/2, (r+1)*R/2) of every array: the block it holds.
    diag = extra.get("diag", {})  # diagnostic variants: plan / writer options changed
    plan = make_write_plan(catalog, world, {a.path: regular_ownership(a.shape, world, 4) for a in catalog},
                           **diag.get("plan", {}))
    data = [_half(s, rank, i) for i, s in enumerate(shapes)]
    base = _cur_rss_mib()
    _settle(extra)
    barrier.wait()
    t0 = time.time()
    c0 = _cpu_s()
    opts = {k: v for k, v in extra.items() if k not in ("donate", "diag", "settle", "warm_bytes")}
    opts.update(diag.get("writer", {}))
    if "target_file" in diag:  # OCDBT data file size: how many files a commit writes in parallel
        opts["target_data_file_size"] = diag["target_file"]
    w = CheckpointWriter(tmp_dir_for(out_dir), plan, rank, **opts)
    for i, s in enumerate(shapes):
        r0 = rank * (s[0] // 2)
        w.write(("params", f"a{i}"), Box.of((r0, 0), data[i].shape), data[i], donate=extra.get("donate", True))
    w.finish()
    finalize(out_dir, plan, rank, Manifest(), timeout=600)
    if rank == 0:
        t1 = time.time()
    else:  # writer 1 is done when the committed checkpoint appears
        while not os.path.exists(out_dir):
            time.sleep(0.005)
        t1 = time.time()
    q.put((rank, t0, t1, _rss_mib(), base, _cpu_s() - c0))


def raw_ts_worker(rank, world, shapes, out_dir, barrier, q, extra):
    import tensorstore as ts

    data = [_half(s, rank, i) for i, s in enumerate(shapes)]
    base = _cur_rss_mib()
    ctx = ts.Context({"file_io_concurrency": {"limit": 64}})
    _settle(extra)
    barrier.wait()
    t0 = time.time()
    c0 = _cpu_s()
    futs = []
    for i, d in enumerate(data):
        spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": f"{out_dir}/a{i}.r{rank}/"},
                "metadata": {"shape": list(d.shape), "data_type": "float32",
                             "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(d.shape)}}}}
        t = ts.open(spec, create=True, context=ctx).result()
        futs.append(t.write(d))
    for f in futs:
        f.result()
    q.put((rank, t0, time.time(), _rss_mib(), base, _cpu_s() - c0))


def dcp_worker(rank, world, shapes, out_dir, barrier, q, extra):
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(extra["port"]))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    data = [_half(s, rank, i) for i, s in enumerate(shapes)]
    sd = {f"params.a{i}": DTensor.from_local(torch.from_numpy(d), mesh, [Shard(0)], run_check=False)
          for i, d in enumerate(data)}
    base = _cur_rss_mib()
    _settle(extra)
    barrier.wait()
    t0 = time.time()
    c0 = _cpu_s()
    dcp.save(sd, checkpoint_id=out_dir)
    dist.barrier()
    t1 = time.time()
    q.put((rank, t0, t1, _rss_mib(), base, _cpu_s() - c0))
    dist.destroy_process_group()


def orbax_worker(rank, world, shapes, out_dir, barrier, q, extra):
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={world}"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    import orbax.checkpoint as ocp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:world]), ("w",))
    sh = NamedSharding(mesh, P("w"))
    tree = {}
    for i, s in enumerate(shapes):
        halves = [jax.device_put(_half(s, r, i), d) for r, d in enumerate(mesh.devices)]
        tree[f"a{i}"] = jax.make_array_from_single_device_arrays(s, sh, halves)
        del halves
    base = _cur_rss_mib()
    ck = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_zarr3=True, use_compression=False))
    _settle(extra)
    barrier.wait()
    t0 = time.time()
    c0 = _cpu_s()
    ck.save(out_dir, {"params": tree})
    q.put((rank, t0, time.time(), _rss_mib(), base, _cpu_s() - c0))


VARIANTS = {"store": (store_worker, 2), "raw_ts": (raw_ts_worker, 2), "orbax": (orbax_worker, 1),
            "dcp": (dcp_worker, 2)}
# Named diagnostic store variants: which of the store's extras cost what.
STORE_DIAGNOSTICS = {
    "store_nocrc": {"plan": {"checksum": False}},
    "store_outer": {"plan": {"inner_chunk_bytes": None}},
    "store_nodigest": {"writer": {"compute_digest": False}},
    "store_lean": {"plan": {"checksum": False, "inner_chunk_bytes": None}, "writer": {"compute_digest": False}},
    "store_nostage": {"writer": {"staging": False}},
    "store_nodrop": {"writer": {"drop_behind": False}},
    "store_old": {"writer": {"staging": False, "drop_behind": False, "batch_bytes": 256 << 20, "commit_depth": 1}},
}


def store_diagnostic(name: str) -> dict | None:
    """Options of diagnostic store variant `name` (a named one, or store_if<N>[d<D>][tf<F>] / store_tf<F>).

    >>> store_diagnostic("store_if128d2tf16")
    {'writer': {'batch_bytes': 134217728, 'commit_depth': 2}, 'target_file': 16777216}
    >>> store_diagnostic("store_tf32"), store_diagnostic("store")
    ({'target_file': 33554432}, None)
    """
    if name in STORE_DIAGNOSTICS:
        return STORE_DIAGNOSTICS[name]
    m = re.fullmatch(r"store_(?:if(\d+)(?:d(\d+))?)?(?:tf(\d+))?", name)
    if m is None or not (m.group(1) or m.group(3)):
        return None
    diag: dict = {}
    if m.group(1):
        diag["writer"] = {"batch_bytes": int(m.group(1)) << 20, "commit_depth": int(m.group(2) or 1)}
    if m.group(3):
        diag["target_file"] = int(m.group(3)) << 20
    return diag


def variant(name: str):
    """(worker function, process count) of a variant name."""
    if name in VARIANTS:
        return VARIANTS[name]
    if store_diagnostic(name) is not None:
        return store_worker, 2
    raise SystemExit(f"unknown variant {name!r}: use {', '.join(VARIANTS)} or a store diagnostic (see --help)")


def run_variant(name, shapes, workdir, rep, store_extra, memory="warm", settle=25.0):
    fn, nproc = variant(name)
    out = os.path.join(workdir, f"{name}_{rep}")
    for p in (out, out + ".orbax-checkpoint-tmp"):
        shutil.rmtree(p, ignore_errors=True)
    os.sync()  # the previous variant's files are gone and written back
    if name == "raw_ts":
        os.makedirs(out)
    if name.startswith("store"):
        from bridge.store import begin_checkpoint

        begin_checkpoint(out)
    extra = dict(store_extra) if name.startswith("store") else {}
    nbytes = sum(int(np.prod(s)) * 4 for s in shapes)
    if memory == "warm":
        extra["warm_bytes"] = nbytes // nproc + (256 << 20)
    else:
        extra["settle"] = settle
    diag = store_diagnostic(name)
    if diag is not None:
        extra["diag"] = diag
    if name == "dcp":
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            extra["port"] = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    barrier, q = ctx.Barrier(nproc), ctx.Queue()
    procs = [ctx.Process(target=fn, args=(r, 2, shapes, out, barrier, q, extra)) for r in range(nproc)]
    for p in procs:
        p.start()
    results = []
    while len(results) < len(procs):
        try:
            results.append(q.get(timeout=1.0))
        except Exception:  # queue.Empty: make sure nobody died silently
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead:
                for p in procs:
                    if p.is_alive():
                        p.kill()
                raise RuntimeError(f"{name}: a worker exited with {dead}")
    for p in procs:
        p.join(60)
        if p.exitcode != 0:
            raise RuntimeError(f"{name} worker exited with {p.exitcode}")
    t0 = min(r[1] for r in results)
    t1 = max(r[2] for r in results)
    shutil.rmtree(out, ignore_errors=True)
    return {"gbps": nbytes / (t1 - t0) / 1e9, "seconds": t1 - t0,
            "peak_rss_mib": max(r[3] for r in results),
            "rss_overhead_mib": max(r[3] - r[4] for r in results),
            "cpu_s": sum(r[5] for r in results)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=1.0, help="GiB of fp32 state (default 1)")
    ap.add_argument("--arrays", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--workdir", default="/tmp/bench_store_write")
    ap.add_argument("--variants", default="store,raw_ts,orbax,dcp")
    ap.add_argument("--inflight-mib", type=int, default=None, help="store writer in-flight budget")
    ap.add_argument("--copy", action="store_true", help="store copies data (write(donate=False))")
    ap.add_argument("--memory", choices=("warm", "cold"), default="warm",
                    help="free-memory state every variant starts from (see _settle; default warm)")
    ap.add_argument("--settle", type=float, default=25.0,
                    help="--memory cold: seconds every worker idles after set-up (default 25)")
    ap.add_argument("--json", help="also write results here")
    args = ap.parse_args(argv)
    shapes = _shapes(args.gib, args.arrays)
    variants = args.variants.split(",")
    for v in variants:
        variant(v)  # refuse an unknown name before anything runs
    store_extra = {}
    if args.inflight_mib:
        store_extra["batch_bytes"] = args.inflight_mib << 20
    if args.copy:
        store_extra["donate"] = False
    os.makedirs(args.workdir, exist_ok=True)
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    for rep in range(args.reps):
        order = variants[rep % len(variants):] + variants[:rep % len(variants)]
        for v in order:
            r = run_variant(v, shapes, args.workdir, rep, store_extra, args.memory, args.settle)
            runs[v].append(r)
            print(f"rep {rep} {v:7s} {r['gbps']:.2f} GB/s  {r['seconds']:.2f} s  CPU {r['cpu_s']:.2f} s  "
                  f"peak RSS {r['peak_rss_mib']:.0f} MiB",
                  file=sys.stderr)
    med = {v: statistics.median(r["gbps"] for r in rs) for v, rs in runs.items()}
    gib = sum(int(np.prod(s)) * 4 for s in shapes) / (1 << 30)
    print(f"\n{gib:.2f} GiB fp32 in {len(shapes)} arrays, {args.reps} interleaved reps, median GB/s; "
          f"{os.cpu_count()} CPUs; memory {args.memory}")
    print("| variant | GB/s (median) | runs | store / variant | writer CPU s (median) | peak RSS per writer (MiB) "
          "| RSS over data (MiB) |")
    print("|---|---|---|---|---|---|---|")
    for v, rs in runs.items():
        ratio = med.get("store", float("nan")) / med[v]
        print(f"| {v} | {med[v]:.2f} | {', '.join(format(r['gbps'], '.2f') for r in rs)} | {ratio:.2f} | "
              f"{statistics.median(r['cpu_s'] for r in rs):.2f} | "
              f"{max(r['peak_rss_mib'] for r in rs):.0f} | {max(r['rss_overhead_mib'] for r in rs):.0f} |")
    summary = {"gib": round(gib, 3), "reps": args.reps, "cpus": os.cpu_count(), "memory": args.memory,
               "median_gbps": {v: round(g, 3) for v, g in med.items()}}
    if "store" in med:
        summary["store_over"] = {v: round(med["store"] / g, 3) for v, g in med.items() if v != "store"}
    print("SUMMARY " + json.dumps(summary, sort_keys=True))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"median_gbps": med, "runs": runs, "summary": summary}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
