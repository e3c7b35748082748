"""Offline paths at scale, each timed against its anchor in the same run.

    python benchmarks/bench_scale.py --gib 0.25              # quick CPU mode (~1-2 min on 2 cores)
    python benchmarks/bench_scale.py --gib 12 --dir /tmp/bs --deadline 540 --json out.jsonl

1. `scale_synth.write`: a Megatron-shaped `dp_reshardable` torch_dist checkpoint of `--gib` of state
   (GQA + SwiGLU GPT, TP=1, several DDP buckets), written by streaming worker processes.
2. `gtp-bridge convert SRC CONV` at default settings   vs   anchor: `dcp.load` of every tensor of SRC
   into preallocated CPU tensors + a raw write (tofile + fsync) of the same bytes.
3. `gtp-bridge verify CONV`   vs   anchor: a raw parallel read of CONV's files (the disk's read
   rate; verify's rate counts the state's bytes); bytes the verify read / bytes stored (and / state).
4. `to-megatron --tp 2 CONV TM` (the API, timed in-process after its imports)   vs   anchor: a raw
   TensorStore read of every logical array + `dcp.save` of the same tensors (timed the same way);
   the CLI's whole command too, as a second figure (`to_megatron_cli`).
5. Reads in a fresh process: one layer of the largest stacked array (bytes read / its bytes); a
   `load`-style reload of another layout's boxes (TP=2 rank 1's half of every array; bytes read /
   needed). Then an exact check of every array of CONV against values regenerated independently
   (scale_synth.logical), in parallel processes.
6. `fully_reshardable`: the same state saved in the other optimizer format, converted, and its
   per-array digests compared with the `dp_reshardable` conversion's (both formats agree).
Every command runs in its own process tree: wall time, peak RSS (largest process and whole tree),
and its tree's read()/write() bytes (/proc/<pid>/io). The page cache is dropped before each step
when running as root (else the report says it was not), then the libraries are imported once so
that only the checkpoint's bytes come from the disk. Anchors time their operations in-process;
the bridge's commands are timed as a user runs them (process start included), except to-megatron
(above). Steps that would not fit before `--deadline` (seconds from start) or named by `--skip` are
skipped and reported as skipped. Prints a table of ratios and
one JSON line (also appended to `--json`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for p in (HERE, ROOT):
    if p not in sys.path:
        sys.path.insert(0, p)

import scale_measure as sm  # noqa: E402
import scale_synth as ss  # noqa: E402

GiB = 2**30


def ts_bytes_read() -> int:
    """TensorStore's own count of bytes its file kvstore read in this process."""
    import tensorstore as ts

    return sum(int(v.get("value", 0)) for m in ts.experimental_collect_matching_metrics(
        "/tensorstore/kvstore/file/bytes_read") for v in m["values"])


# ---------------------------------------------------------------------------------------------
# Anchors and readers (each runs as `bench_scale.py _<name> ...` in its own process; prints JSON last)


def _anchor_convert(src: str, raw: str) -> dict:
    """dcp.load of every tensor of `src` + a raw write of the same bytes."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(src).read_metadata()
    target = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype)
              for k, v in md.state_dict_metadata.items() if hasattr(v, "size")}
    t0 = time.perf_counter()
    dcp.load(target, checkpoint_id=src, no_dist=True)
    t_load = time.perf_counter() - t0
    os.makedirs(raw)
    t0 = time.perf_counter()
    total = 0
    for i, t in enumerate(target.values()):
        a = t.contiguous().view(torch.uint8).numpy()
        with open(os.path.join(raw, f"a{i}.bin"), "wb") as f:
            a.tofile(f)
            f.flush()
            os.fsync(f.fileno())
        total += a.nbytes
    return {"dcp_load_s": t_load, "raw_write_s": time.perf_counter() - t0, "bytes": total}


def _anchor_tomeg(conv: str, out: str) -> dict:
    """Raw TensorStore read of every logical array + dcp.save of the same tensors."""
    import tensorstore as ts
    import torch.distributed.checkpoint as dcp

    from bridge.store import specs
    from bridge.store.reader import open_checkpoint

    ck = open_checkpoint(conv)
    paths = [p for p in ck.paths() if ck.info(p).shape]
    t0 = time.perf_counter()
    ctx = ts.Context(specs.context_spec())
    futs = [ts.open(specs.array_read_spec(ck.root, ".".join(p), use_ocdbt=ck.use_ocdbt, use_zarr3=ck.use_zarr3,
                                          fill_missing=ck.fill_missing), read=True, context=ctx) for p in paths]
    stores = [f.result() for f in futs]
    reads = [s.read() for s in stores]  # all in flight at once: TensorStore parallelises
    arrays = [r.result() for r in reads]
    t_read = time.perf_counter() - t0
    from bridge.dtypes import from_numpy

    sd = {".".join(p): from_numpy(a) for p, a in zip(paths, arrays)}
    t0 = time.perf_counter()
    dcp.save(sd, checkpoint_id=out, no_dist=True)
    t_save = time.perf_counter() - t0
    return {"ts_read_s": t_read, "dcp_save_s": t_save, "bytes": sum(a.nbytes for a in arrays), "arrays": len(paths)}


def _tomeg(conv: str, out: str) -> dict:
    """`gtp-bridge to-megatron --tp 2`'s code path (the API at the CLI's defaults) timed in-process,
    with torch, DCP and TensorStore imported before the clock as the anchor has them."""
    import tensorstore  # noqa: F401
    import torch.distributed.checkpoint  # noqa: F401

    from converters.megatron.write.torch_dist import MegatronTarget
    from converters.megatron.write.to_megatron import to_megatron

    t0 = time.perf_counter()
    r = to_megatron(conv, out, MegatronTarget(tp=2), show_progress=False)
    return {"seconds": time.perf_counter() - t0, "bytes": r["bytes"], "workers": r["workers"], "budget": r["budget"]}


def _tp2_box(path: tuple, shape: tuple, npre: int, rank: int):
    """TP=2 rank `rank`'s box of a logical array: half the rows of column-parallel (and vocab)
    arrays, half the columns of row-parallel ones, all of 1-D (replicated) ones."""
    from bridge.layout.boxes import Box

    name = ".".join(path)
    start, stop = [0] * len(shape), list(shape)
    ax = None
    if len(shape) - npre == 2:
        ax = npre + (1 if ("linear_proj" in name or "linear_fc2" in name) else 0)
    if ax is not None:
        n = shape[ax] // 2
        start[ax], stop[ax] = rank * n, (rank + 1) * n
    return Box(tuple(start), tuple(stop))


def _reads(conv: str, gib: float) -> dict:
    """The layer read and the load-style reads."""
    import numpy as np

    from bridge.layout.boxes import Box
    from bridge.store.reader import open_checkpoint

    sizes = ss.Sizes.for_gib(gib)
    out: dict = {}
    ck = open_checkpoint(conv)
    infos = {p: ck.info(p) for p in ck.paths()}
    stacked = [p for p, i in infos.items() if "layers" in p and len(i.shape) == 3]
    big = max(stacked, key=lambda p: infos[p].nbytes)
    layer = sizes.layers // 2
    shape = infos[big].shape
    box = Box((layer, 0, 0), (layer + 1,) + tuple(shape[1:]))
    ck = open_checkpoint(conv)  # fresh context: nothing cached
    b0, t0 = ts_bytes_read(), time.perf_counter()
    got = ck.read(big, box)
    need = got.nbytes
    out["layer_read"] = {"array": ".".join(big), "layer": layer, "seconds": time.perf_counter() - t0,
                         "bytes_read": ts_bytes_read() - b0, "bytes_needed": need,
                         "inner_chunk": list(infos[big].inner_chunk_shape)}
    want = _expected(sizes, big, layer)
    out["layer_read"]["exact"] = bool(np.array_equal(got[0].view(np.uint8), want.view(np.uint8)))
    # load-style: TP=2 rank 1's boxes of every array (what a reload at another layout reads)
    ck = open_checkpoint(conv)
    b0, t0 = ts_bytes_read(), time.perf_counter()
    need = 0
    futs = []
    for p, i in infos.items():
        if not i.shape:
            continue
        npre = 1 if "layers" in p else 0
        b = _tp2_box(p, i.shape, npre, 1)
        futs.append(ck.open(p)[b.slices].read())
        need += b.size * np.dtype(i.dtype).itemsize
    for f in futs:
        f.result()
    out["load_read"] = {"what": "TP=2 rank 1 boxes of every array", "seconds": time.perf_counter() - t0,
                        "bytes_read": ts_bytes_read() - b0, "bytes_needed": need}
    return out


def _exact(conv: str, gib: float, workers: int) -> dict:
    """Every array of `conv`, layer by layer, against the values regenerated independently."""
    from multiprocessing import get_context

    sizes = ss.Sizes.for_gib(gib)
    t0 = time.perf_counter()
    jobs = [(conv, gib, key, layer) for key, layer in ss.instances(sizes)]
    with get_context("spawn").Pool(workers) as pool:
        bad = [r for r in pool.imap_unordered(_exact_one, jobs) if r]
    return {"instances": len(jobs), "mismatch": bad[:10], "ok": not bad, "seconds": time.perf_counter() - t0}


ROLE_PATHS = {"param": ("params",), "exp_avg": ("opt_state", "0", "mu"), "exp_avg_sq": ("opt_state", "0", "nu"),
              "model": ("model",)}


def _logical_path(role: str, key: str, section: str) -> tuple:
    return ROLE_PATHS[role] + tuple(key.split(".")) + ((section,) if section else ())


def _expected(sizes: ss.Sizes, path: tuple, layer: int):
    """The regenerated logical instance behind a stored path (its role, key and section)."""
    for role, pre in ROLE_PATHS.items():
        if path[:len(pre)] == pre:
            rest = path[len(pre):]
            for key, _, _ in sizes.params():
                kp = tuple(key.split("."))
                if rest[:len(kp)] == kp:
                    sec = rest[len(kp)] if len(rest) > len(kp) else ""
                    return ss.logical(sizes, key, layer, role)[sec]
    raise KeyError(path)


def _exact_one(job: tuple) -> str:
    """'' when every role and section of one instance equals its regenerated value, else what differs."""
    import numpy as np

    from bridge.layout.boxes import Box
    from bridge.store.reader import open_checkpoint

    conv, gib, key, layer = job
    sizes = ss.Sizes.for_gib(gib)
    ck = open_checkpoint(conv)
    for role in ROLE_PATHS:
        for sec, want in ss.logical(sizes, key, layer, role).items():
            path = _logical_path(role, key, sec)
            shape = ck.info(path).shape
            box = Box((layer,) + (0,) * want.ndim, (layer + 1,) + tuple(shape[1:])) if layer is not None \
                else Box.full(shape)
            got = ck.read(path, box)
            got = got[0] if layer is not None else got
            if got.shape != want.shape or not np.array_equal(got.view(np.uint8), want.view(np.uint8)):
                return f"{'.'.join(path)}[{layer}]"
    return ""


def _digests(a: str, b: str) -> dict:
    from bridge.store.reader import open_checkpoint

    ma, mb = open_checkpoint(a).manifest, open_checkpoint(b).manifest
    da = {k: r.digest for k, r in ma.arrays.items()}
    db = {k: r.digest for k, r in mb.arrays.items()}
    differ = sorted(k for k in set(da) | set(db) if da.get(k) != db.get(k) or da.get(k) is None)
    return {"arrays": len(da), "differ": differ[:10], "ok": not differ}


def raw_read(path: str, threads: int) -> dict:
    """Read every file under `path` with `threads` threads, 16 MiB at a time: the disk's read rate."""
    files = [os.path.join(r, n) for r, _, fs in os.walk(path) for n in fs]

    def one(fn: str) -> int:
        n = 0
        buf = bytearray(16 << 20)
        with open(fn, "rb", buffering=0) as f:
            while True:
                k = f.readinto(buf)
                if not k:
                    return n
                n += k

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as ex:
        total = sum(ex.map(one, sorted(files, key=os.path.getsize, reverse=True)))
    return {"seconds": time.perf_counter() - t0, "bytes": total, "files": len(files), "threads": threads}


WARM_IMPORTS = sm.WARM_IMPORTS

INTERNAL = {"_anchor_convert": lambda a: _anchor_convert(a[0], a[1]), "_anchor_tomeg": lambda a: _anchor_tomeg(a[0], a[1]),
            "_tomeg": lambda a: _tomeg(a[0], a[1]),
            "_reads": lambda a: _reads(a[0], float(a[1])),
            "_exact": lambda a: _exact(a[0], float(a[1]), int(a[2])), "_digests": lambda a: _digests(a[0], a[1])}


# ---------------------------------------------------------------------------------------------
# The driver


class Bench:
    def __init__(self, a) -> None:
        self.a = a
        self.t0 = time.perf_counter()
        self.res: dict = {"bench": "scale", "gib": a.gib, "cores": os.cpu_count(), "steps": {}, "skipped": [],
                          "root": os.geteuid() == 0}
        self.logs = os.path.join(a.dir, "logs")
        os.makedirs(self.logs, exist_ok=True)

    def left(self) -> float:
        return self.a.deadline - (time.perf_counter() - self.t0)

    def fits(self, name: str, need: float) -> bool:
        if name in self.a.skip:
            self.res["skipped"].append(f"{name}: skipped (--skip)")
            return False
        if self.left() < need:
            msg = f"{name}: skipped, {self.left():.0f} s left before the deadline, needs ~{need:.0f} s"
            print("SKIPPED", msg, flush=True)
            self.res["skipped"].append(msg)
            return False
        return True

    def cmd(self, name: str, argv: list[str], need: float, cold: bool = True) -> dict | None:
        """Run a measured command if it fits; record it (with its JSON result for internal steps)."""
        if not self.fits(name, need):
            return None
        rec: dict = {"dropped_caches": sm.drop_caches()} if cold else {}
        if cold and rec["dropped_caches"]:
            # The checkpoint's bytes stay cold, the libraries' files do not: a user's machine has
            # torch and TensorStore cached, and an anchor measured in-process never pays for them.
            sm.measure([sys.executable, "-c", WARM_IMPORTS], timeout=120)
        r = sm.measure(argv, timeout=max(5.0, self.left() - 3), log=os.path.join(self.logs, f"{name}.log"))
        rec.update(rc=r.rc, seconds=r.seconds, peak_process_rss=r.peak_process_rss, peak_tree_rss=r.peak_tree_rss,
                   rchar=r.io.get("rchar", 0), read_bytes=r.io.get("read_bytes", 0), wchar=r.io.get("wchar", 0),
                   write_bytes=r.io.get("write_bytes", 0), timed_out=r.timed_out)
        if r.rc != 0:
            rec["output_tail"] = r.output[-1500:]
        last = [ln for ln in r.output.strip().splitlines() if ln.startswith("{")]
        if argv[2:3] and argv[2].startswith("_") and last and r.rc == 0:
            rec["result"] = json.loads(last[-1])
        self.res["steps"][name] = rec
        print(f"[step] {name}: rc={r.rc} {r.seconds:.2f} s, peak RSS {r.peak_process_rss / GiB:.2f} GiB "
              f"(tree {r.peak_tree_rss / GiB:.2f}), read {rec['rchar'] / 1e9:.2f} GB, wrote {rec['wchar'] / 1e9:.2f} GB"
              + ("" if r.rc == 0 else f"\n{r.output[-1500:]}"), flush=True)
        return rec

    def internal(self, name: str, fn: str, args: list[str], need: float) -> dict | None:
        return self.cmd(name, [sys.executable, os.path.abspath(__file__), fn] + args, need)

    def cli(self, name: str, args: list[str], need: float) -> dict | None:
        return self.cmd(name, [sys.executable, "-m", "bridge.cli"] + args, need)


def rate_need(nbytes: int, gbps: float, fixed: float = 10.0) -> float:
    """A conservative time estimate for moving `nbytes` at `gbps` GB/s."""
    return fixed + nbytes / (gbps * 1e9)


def run(a) -> dict:
    b = Bench(a)
    res = b.res
    D = a.dir
    src, conv, raw, tm, tma = (os.path.join(D, n) for n in ("src_dp", "conv_dp", "raw", "tm2", "tm2_anchor"))
    for p in (src, conv, raw, tm, tma, os.path.join(D, "src_fr"), os.path.join(D, "conv_fr")):
        shutil.rmtree(p, ignore_errors=True)
    sizes = ss.Sizes.for_gib(a.gib)
    bucket = ss.default_bucket_size(sizes)
    state = sizes.state_bytes()
    res.update(sizes=vars(sizes), state_bytes=state, bucket_size=bucket, params=sizes.n_params(),
               convert_args=a.convert_args)
    print(f"state {state / GiB:.2f} GiB: {sizes}, bucket size {bucket}, {os.cpu_count()} cores, "
          f"deadline {a.deadline:.0f} s, page cache {'dropped' if res['root'] else 'NOT dropped (not root)'}",
          flush=True)
    # generation (in-process pool; not a measured step of the bridge)
    t0 = time.perf_counter()
    gen = ss.write(src, sizes, "dp_reshardable", bucket, workers=a.gen_workers)
    res["generate_dp"] = dict(gen, seconds=time.perf_counter() - t0, disk=sm.du(src))
    print(f"[gen] dp_reshardable: {gen['tensor_bytes'] / GiB:.2f} GiB in {res['generate_dp']['seconds']:.1f} s, "
          f"{gen['buckets']} buckets, {gen['files']} files", flush=True)
    conv_rec = b.cli("convert", ["convert", src, conv] + a.convert_args.split(), rate_need(state, 0.15))
    if conv_rec and conv_rec["rc"] == 0:
        res["disk_conv"] = sm.du(conv)
    b.internal("anchor_convert", "_anchor_convert", [src, raw], rate_need(2 * state, 0.5))
    shutil.rmtree(raw, ignore_errors=True)
    if os.path.isdir(conv):
        b.cli("verify", ["verify", conv], rate_need(state, 0.2))
        if b.fits("raw_read", rate_need(res.get("disk_conv", state), 0.3)):
            dropped = sm.drop_caches()
            res["steps"]["raw_read"] = dict(raw_read(conv, min(8, os.cpu_count() or 1)), dropped_caches=dropped)
        b.internal("reads", "_reads", [conv, str(a.gib)], rate_need(state // 2, 0.3))
        b.internal("to_megatron", "_tomeg", [conv, tm], rate_need(state, 0.1))
        if os.path.isdir(tm):
            res["disk_tm2"] = sm.du(tm)
        shutil.rmtree(tm, ignore_errors=True)
        b.internal("anchor_tomeg", "_anchor_tomeg", [conv, tma], rate_need(2 * state, 0.4))
        shutil.rmtree(tma, ignore_errors=True)
        b.cli("to_megatron_cli", ["to-megatron", "--no-scheduler", "--tp", "2", conv, tm], rate_need(state, 0.1))
        shutil.rmtree(tm, ignore_errors=True)
        if a.exact:
            b.internal("exact", "_exact", [conv, str(a.gib), str(a.exact_workers)],
                       rate_need(2 * state, 0.1 * a.exact_workers))
    if a.fully and os.path.isdir(conv):
        sfr, cfr = os.path.join(D, "src_fr"), os.path.join(D, "conv_fr")
        if b.fits("generate_fully", rate_need(2 * state, 0.2)):
            shutil.rmtree(src, ignore_errors=True)  # disk: the dp source is no longer needed
            t0 = time.perf_counter()
            g2 = ss.write(sfr, sizes, "fully_reshardable", bucket, workers=a.gen_workers)
            res["generate_fully"] = dict(g2, seconds=time.perf_counter() - t0, disk=sm.du(sfr))
            b.cli("convert_fully", ["convert", sfr, cfr] + a.convert_args.split(), rate_need(state, 0.15))
            if os.path.isdir(cfr):
                b.internal("digests_fully_vs_dp", "_digests", [cfr, conv], 15)
            shutil.rmtree(sfr, ignore_errors=True)
            shutil.rmtree(cfr, ignore_errors=True)
    res["seconds"] = time.perf_counter() - b.t0
    res["ratios"] = ratios(res)
    return res


def ratios(res: dict) -> dict:
    """The figures the issue compares (None where a step did not run)."""
    S, state = res["steps"], res["state_bytes"]
    out: dict = {}

    def ok(n):
        return n in S and S[n].get("rc", 0) == 0

    if ok("convert") and ok("anchor_convert"):
        r = S["anchor_convert"]["result"]
        out["convert_vs_dcp_load_plus_raw_write"] = S["convert"]["seconds"] / (r["dcp_load_s"] + r["raw_write_s"])
    if ok("verify") and "raw_read" in S:
        disk = res.get("disk_conv", state)
        v_rate = state / S["verify"]["seconds"]  # the bytes it checks; the raw read reads every file
        r_rate = S["raw_read"]["bytes"] / S["raw_read"]["seconds"]
        out["verify_rate_vs_raw_read_rate"] = v_rate / r_rate
        out["verify_read_over_stored"] = S["verify"]["rchar"] / disk
        out["verify_read_over_state"] = S["verify"]["rchar"] / state
        out["verify_GBps"], out["raw_read_GBps"] = v_rate / 1e9, r_rate / 1e9
    if ok("to_megatron") and ok("anchor_tomeg"):  # both in-process, after their imports
        r = S["anchor_tomeg"]["result"]
        anchor = r["ts_read_s"] + r["dcp_save_s"]
        out["to_megatron_vs_ts_read_plus_dcp_save"] = S["to_megatron"]["result"]["seconds"] / anchor
        if ok("to_megatron_cli"):  # a user's whole command (process start, imports) vs the in-process anchor
            out["to_megatron_cli_vs_ts_read_plus_dcp_save"] = S["to_megatron_cli"]["seconds"] / anchor
    if ok("reads"):
        r = S["reads"]["result"]
        out["layer_read_over_needed"] = r["layer_read"]["bytes_read"] / r["layer_read"]["bytes_needed"]
        out["load_read_over_needed"] = r["load_read"]["bytes_read"] / r["load_read"]["bytes_needed"]
        out["layer_read_exact"] = r["layer_read"]["exact"]
    if ok("exact"):
        out["converted_exact_vs_regenerated"] = S["exact"]["result"]["ok"]
    if "disk_conv" in res:
        out["conv_disk_over_state"] = res["disk_conv"] / state
    if "disk_tm2" in res:
        out["tm2_disk_over_state"] = res["disk_tm2"] / state
    if ok("digests_fully_vs_dp"):
        out["fully_vs_dp_digests_equal"] = S["digests_fully_vs_dp"]["result"]["ok"]
    out["failed_steps"] = [n for n, s in S.items() if s.get("rc", 0) != 0]
    out["peak_process_rss_GiB"] = {n: round(s["peak_process_rss"] / GiB, 3) for n, s in S.items()
                                   if "peak_process_rss" in s}
    return out


def report(res: dict) -> None:
    S, r = res["steps"], res["ratios"]
    print(f"\nscale benchmark: {res['state_bytes'] / GiB:.2f} GiB of state ({res['params'] / 1e9:.3f} B params), "
          f"{res['cores']} cores, page cache {'dropped' if res['root'] else 'NOT dropped (not root)'}")
    print("| step | seconds | peak RSS GiB (process / tree) | read GB | written GB |")
    print("|---|---|---|---|---|")
    for n, s in S.items():
        if "peak_process_rss" in s:
            print(f"| {n}{'' if s['rc'] == 0 else ' (rc=%d)' % s['rc']} | {s['seconds']:.2f} | "
                  f"{s['peak_process_rss'] / GiB:.2f} / {s['peak_tree_rss'] / GiB:.2f} | {s['rchar'] / 1e9:.2f} | "
                  f"{s['wchar'] / 1e9:.2f} |")
        else:
            print(f"| {n} | {s['seconds']:.2f} | | {s['bytes'] / 1e9:.2f} | |")
    for k, v in r.items():
        if k != "peak_process_rss_GiB":
            print(f"{k}: {v:.3f}" if isinstance(v, float) else f"{k}: {v}")
    for m in res["skipped"]:
        print("SKIPPED", m)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in INTERNAL:
        print(json.dumps(INTERNAL[sys.argv[1]](sys.argv[2:]), default=str), flush=True)
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=0.25, help="state size to generate (GiB)")
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temp dir, removed after)")
    ap.add_argument("--deadline", type=float, default=3600.0, help="seconds from start; later steps are skipped")
    ap.add_argument("--json", default=None, help="append the result line to this file")
    ap.add_argument("--gen-workers", type=int, default=None)
    ap.add_argument("--no-exact", dest="exact", action="store_false",
                    help="skip the exact check of every converted array against regenerated values")
    ap.add_argument("--exact-workers", type=int, default=max(1, min(8, os.cpu_count() or 1)))
    ap.add_argument("--convert-args", default="", help="extra convert options, e.g. '--workers 8 --budget 32M' "
                                                         "(default: none, the CLI's defaults)")
    ap.add_argument("--no-fully", dest="fully", action="store_false", help="skip the fully_reshardable part")
    ap.add_argument("--skip", default="", help="steps not to run, comma-separated (e.g. anchor_convert,to_megatron_cli)")
    a = ap.parse_args()
    a.skip = {x.strip() for x in a.skip.split(",") if x.strip()}
    sm.exit_on_sigterm()
    own = a.dir is None
    a.dir = a.dir or tempfile.mkdtemp(prefix="bench-scale-")
    os.makedirs(a.dir, exist_ok=True)
    try:
        res = run(a)
        report(res)
        line = json.dumps(res, default=str)
        print(line)
        if a.json:
            with open(a.json, "a") as f:
                f.write(line + "\n")
    finally:
        if own:
            shutil.rmtree(a.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
