"""Live export vs torch DCP save vs a raw TensorStore write, same ranks, same state, one run.

    python benchmarks/bench_live_export.py [--world 4] [--tp 1 --gtp 2] [--mib 64] [--reps 3]
                                           [--backend gloo|nccl] [--json OUT]

Every rank builds the state of a GTP run with the layout engine (padded physical bf16 shards of
per-layer SwiGLU fc1 / row-parallel fc2 / qkv weights and norms, identical on DP replicas; fp32
DistOpt fragments of its buffer) and, interleaved over `--reps` repetitions (order rotated):
  export         `bridge.live.export_state` (holdings, plan, one all_to_all to chunk owners,
                 owned-chunk writes, OCDBT merge, _METADATA, fsync, atomic rename); the plan is
                 reused from the earlier export (a run exports every N steps with one layout);
  export_replan  the same after `Exporter.clear_cache()` (what a first export costs);
  store          the store alone: `CheckpointWriter` writes of the same boxes from host memory with
                 the same write plan + `finalize` (export minus everything live: shows our overhead);
  dcp            `torch.distributed.checkpoint.save` of the same tensors (weight shards keyed by
                 shard coordinates, so DP replicas are saved once as the export writes them once;
                 optimizer fragments keyed by rank), fsync'd by DCP, with DCP's own plan cache
                 (`DefaultSavePlanner(enable_plan_caching=True)`) as the export reuses its plan;
  raw_ts         each rank writes exactly as many bytes as its export wrote, as one zarr3 uint8
                 array (file kvstore, 4 MiB chunks, from host memory), then fsyncs: pure write speed.
After one untimed warm-up round. Reported: median wall seconds (slowest rank, between barriers),
throughput of logical bytes, ratios export/dcp time (target <= 1) and raw/export time (target
>= 0.8), the export's per-step split (`ExportReport.timings`: slowest rank per rep, median), peak
host RSS growth per variant (VmHWM after resetting it; max over ranks), a reload at the swapped
TP/GTP split (time; bytes TensorStore read from storage / bytes needed, target <= 1.25), and with
`--busbw` the exchange's bus bandwidth vs a plain `all_gather_into_tensor` producing the same
per-rank bytes (nccl-tests formula: busbw = S/t * (n-1)/n, S = per-rank buffer bytes). The last
line, `SUMMARY {json}`, is the machine-readable result.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import zlib

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from bridge.store.durable import fsync_tree  # noqa: E402


def model_geometries(hidden: int, layers: int, pad: int):
    """Per-layer geometries of a GPT-like block stack (fused SwiGLU fc1, row fc2, GQA qkv, row proj, norm)."""
    from bridge.layout import FusedSpec, ParamGeometry

    ffn = 4 * hidden
    out = []
    for i in range(layers):
        idx = (i,)
        out += [
            ParamGeometry("decoder.layers.mlp.linear_fc1.weight", (2 * ffn, hidden), "column", gtp=True,
                          pad_for_alignment=pad, prepend=(layers,), fused=FusedSpec.swiglu(ffn), index=idx),
            ParamGeometry("decoder.layers.mlp.linear_fc2.weight", (hidden, ffn), "row", gtp=True,
                          pad_for_alignment=pad, prepend=(layers,), index=idx),
            ParamGeometry("decoder.layers.self_attention.linear_qkv.weight", (2 * hidden, hidden), "column", gtp=True,
                          pad_for_alignment=pad, prepend=(layers,), fused=FusedSpec.qkv(8, 4, hidden // 8),
                          index=idx),  # GQA: 8 heads, 4 query groups -> (8 + 2*4) * hidden/8 rows
            ParamGeometry("decoder.layers.self_attention.linear_proj.weight", (hidden, hidden), "row", gtp=True,
                          pad_for_alignment=pad, prepend=(layers,), index=idx),
            ParamGeometry("decoder.layers.mlp.linear_fc1.layer_norm_weight", (hidden,), "replicated", prepend=(layers,),
                          index=idx),
        ]
    return out


def _region_seed(i: int, pieces) -> int:
    """Seed from the logical region a tensor holds: replicas (DP, or a replicated param's TP / GTP
    copies) hold the same region and get the same values, as in a real run."""
    return zlib.crc32(repr((i, [(p.array, p.logical) for p in pieces])).encode())


def build_state(layout, rank: int, hidden: int, layers: int, pad: int, device):
    """This rank's LocalParams: random bf16 shards, fp32 fragments of a Megatron-style buffer.

    Values are seeded by the logical region each tensor holds, so every replica of a region (DP
    copies, TP / GTP copies of replicated params, optimizer fragments of those) is identical.
    """
    from bridge.layout.distopt import BufferParam, buffer_layout, owned_ranges
    from bridge.live.api import LocalParam, OptimFragment

    geoms = model_geometries(hidden, layers, pad)
    names = [f"{g.name}#{g.index}" for g in geoms]
    shapes = [g.physical_shape(*g.sizes(layout)) for g in geoms]
    blay = buffer_layout([BufferParam(n, int(np.prod(s))) for n, s in zip(names, shapes)], None, layout.distopt_size)
    ranges = {o.name: o.param for o in owned_ranges(blay, layout.distopt_rank(rank))}
    params = []
    for i, (g, n, s) in enumerate(zip(geoms, names, shapes)):
        tp, gtp, t, gg = g.placement(layout, rank)
        wgen = torch.Generator().manual_seed(_region_seed(i, g.shard_pieces(tp, gtp, t, gg)))
        w = torch.randn(s, generator=wgen).to(torch.bfloat16).to(device)
        frag = None
        if n in ranges:
            f0, f1 = ranges[n]
            gen = torch.Generator().manual_seed(_region_seed(i, g.fragment_pieces(tp, gtp, t, gg, f0, f1)))
            frag = OptimFragment(f0, f1, *(torch.randn(f1 - f0, generator=gen).to(device) for _ in range(3)))
        params.append(LocalParam(g.name, g, w, frag, index=g.index))
    return params


def dcp_state_dict(params, layout, rank: int) -> dict:
    """The same tensors for torch DCP: weight shards keyed by the logical region they hold (replicas
    share a key, so DCP's planner saves one copy, as the export writes one), fragments by rank."""
    sd = {}
    for i, p in enumerate(params):
        tp, gtp, t, g = p.geometry.placement(layout, rank)
        sd[f"w{i}.{_region_seed(i, p.geometry.shard_pieces(tp, gtp, t, g)):08x}"] = p.weight
        if p.optim is not None:
            for k, v in p.optim.tensors().items():
                sd[f"r{rank}.{i}.{k}"] = v
    return sd


def _hwm_reset() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _mem() -> tuple[int, int]:
    """(VmRSS, VmHWM) in bytes."""
    vals = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS", "VmHWM")):
                k, v = line.split(":")
                vals[k] = int(v.split()[0]) * 1024
    return vals["VmRSS"], vals["VmHWM"]


# --writer-timeline: wall seconds inside these CheckpointWriter methods (inclusive; flush includes
# _await_commits, finish includes flush), summed per rep, for the export and the store alone.
TIMELINE_METHODS = ("write", "_store", "_issue", "flush", "_await_commits", "_drop_written_pages", "finish")
_TIMELINE: dict[str, float] = {}


def timed_writer_class() -> type:
    """A `CheckpointWriter` subclass adding the seconds spent in each TIMELINE_METHODS to _TIMELINE;
    handed to the export as the `writer_class` testing seam (`bridge._testing`) and used by the store variant."""
    from bridge.store.writer import CheckpointWriter

    def timed(name):
        def method(self, *a, **k):
            t0 = time.perf_counter()
            try:
                return getattr(super(cls, self), name)(*a, **k)
            finally:
                _TIMELINE[name] = _TIMELINE.get(name, 0.0) + time.perf_counter() - t0
        return method

    cls = type("TimedCheckpointWriter", (CheckpointWriter,), {name: timed(name) for name in TIMELINE_METHODS})
    return cls


def _timed(fn, device):
    dist.barrier()
    if device.type == "cuda":
        torch.cuda.synchronize()
    _hwm_reset()
    rss0, _ = _mem()
    t0 = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    t1 = time.perf_counter()
    _, hwm = _mem()
    dist.barrier()
    return t1 - t0, max(0, hwm - rss0), out


def _raw_write(path: str, nbytes: int, rank: int) -> tuple[np.ndarray, dict]:
    data = np.frombuffer(np.random.default_rng(rank).bytes(nbytes), dtype=np.uint8) if nbytes else np.zeros(0, np.uint8)
    spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": f"{path}/rank{rank}/"},
            "metadata": {"shape": [nbytes], "data_type": "uint8", "chunk_grid": {"name": "regular",
                         "configuration": {"chunk_shape": [max(1, min(nbytes, 4 << 20))]}}}}
    return data, spec


def _exchange_busbw(params, run, reps: int, device, min_bytes: int = 64 << 20) -> dict:
    """Bus bandwidth of the exchange vs an all_gather_into_tensor with the same per-rank bytes.

    Uses the export plan's own all_to_all when it moves at least `min_bytes` per rank; otherwise
    (owners already hold almost everything) the same `all_to_all_bytes` path with uniform splits
    of `min_bytes`, so the figure measures the exchange mechanism. `source` says which.
    """
    from bridge.dist import all_gather_flat, all_gather_json
    from bridge.live.exchange import all_to_all_bytes
    from bridge.live.export import _send_buffer, _summary
    from bridge.live.holdings import RankSummary, tree_name
    from bridge.live.plan import build_plan

    rank, world = dist.get_rank(), dist.get_world_size()
    holdings, summary = _summary(params, run, rank)
    plan = build_plan([RankSummary.from_json(s) for s in all_gather_json(summary.to_json())], tree_name)
    size = max(sum(plan.send_splits(r)) for r in range(world))
    if size >= min_bytes:
        source = "plan"
        send = _send_buffer(plan, holdings, rank, device)
        splits_out, splits_in = plan.send_splits(rank), plan.recv_splits(rank)
    else:
        source = "uniform"
        per = min_bytes // world
        size = per * world
        send = torch.full((size,), rank % 251, dtype=torch.uint8, device=device)
        splits_out = splits_in = [per] * world
    size -= size % world
    ag_in = torch.zeros(max(1, size // world), dtype=torch.uint8, device=device)
    t_a2a, t_ag = [], []
    for _ in range(reps + 1):  # first round warms up
        t, _, _ = _timed(lambda: all_to_all_bytes(send, splits_out, splits_in), device)
        t_a2a.append(t)
        t, _, _ = _timed(lambda: all_gather_flat(ag_in), device)
        t_ag.append(t)
    ta = statistics.median(t_a2a[1:])
    tg = statistics.median(t_ag[1:])
    f = (world - 1) / world
    return {"source": source, "bytes_per_rank": size, "a2a_s": ta, "allgather_s": tg,
            "a2a_busbw_GBps": size / ta * f / 1e9 if ta else 0.0, "allgather_busbw_GBps": ag_in.numel() * world / tg * f / 1e9,
            "busbw_ratio": (size / ta) / (ag_in.numel() * world / tg) if ta and tg else 0.0}


def _reload_figures(path: str, run, params, args: dict, device) -> dict:
    """Export once more, then reload at the swapped TP/GTP split: time and storage bytes read vs needed."""
    import tensorstore as ts

    from bridge.layout import ParallelLayout
    from bridge.live.api import LiveRun
    from bridge.live.export import export_state
    from bridge.live.reload import reload_state

    export_state(path, run, params, target_chunk_bytes=args["chunk"], inner_chunk_bytes=args["inner"])
    lay = run.layout
    target = ParallelLayout(tp=lay.gtp, gtp=lay.tp, dp=lay.dp)
    rank = dist.get_rank()
    tgt = build_state(target, rank, args["hidden"], args["layers"], args["pad"], device)

    def read_bytes() -> int:
        return sum(m["values"][0].get("value", 0) for m in ts.experimental_collect_matching_metrics("/tensorstore/kvstore/")
                   if m["name"].endswith("bytes_read"))

    b0 = read_bytes()
    t, _, res = _timed(lambda: reload_state(path, LiveRun(target, rank, 0), tgt), device)
    out = {"layout": f"TP{target.tp}xGTP{target.gtp}xDP{target.dp}", "s": t, "needed": res.bytes_read,
           "read": read_bytes() - b0}
    if args.get("verify"):
        out["mismatches"], out["checked_bytes"] = _verify(path, run, params)
    return out


def _verify(path: str, run, params) -> tuple[list[str], int]:
    """Read back every piece this rank holds from the exported checkpoint and compare the bytes.

    The reference is the rank's own tensors (copied to the host), the read path the store reader
    (plain TensorStore): a wrong exchange, staging or write shows as a mismatch naming the array.
    """
    from bridge.live.export import _summary
    from bridge.live.holdings import tree_name
    from bridge.store.reader import open_checkpoint
    from bridge.format.tree import name_to_path
    from bridge.dtypes import to_numpy

    holdings, _ = _summary(params, run, dist.get_rank())
    ck = open_checkpoint(path)
    bad, n = [], 0
    for h in holdings:
        host = to_numpy(h.data.cpu())
        for p in h.pieces:
            want = host[p.local_start:p.local_start + p.logical.size].reshape(p.logical.shape)
            got = ck.read(name_to_path(tree_name(h.root, p.array)), p.logical)
            n += want.nbytes
            if got.shape != want.shape or got.tobytes() != want.tobytes():
                bad.append(f"{h.root}/{p.array} {p.logical}")
    return bad[:5], n


def _store_only(run, params, args: dict, rank: int, writer_class: type):
    """The store alone on the same boxes: this rank's export write plan and owned boxes, data from host memory.

    Returns a function that writes them with `CheckpointWriter` (donated, digests on, same chunking and
    in-flight budget as the export) and commits with `finalize`: what the export costs without the
    live part (holdings, plan, exchange, staging).
    """
    from bridge.dist import TorchCoordinator, all_gather_json
    from bridge.budget import export_split
    from bridge.live.export import COUNT_PATH, STEP_PATH, _plan, _summary
    from bridge.live.holdings import RankSummary
    from bridge.store.commit import begin_checkpoint, finalize
    from bridge.format.manifest import Manifest
    from bridge.dtypes import numpy_dtype
    from bridge.layout.boxes import Box

    world = dist.get_world_size()
    _, summary = _summary(params, run, rank)
    planned = _plan([RankSummary.from_json(s) for s in all_gather_json(summary.to_json())], run, world, args["chunk"],
                    None, args["inner"])
    rng = np.random.default_rng(rank)
    dtypes = {a.name: numpy_dtype(a.dtype) for a in planned.plan.catalog}
    data = []
    for t in planned.plan.transfers:
        if t.dst == rank:
            dt = dtypes[t.array]
            raw = rng.integers(0, 255, size=t.box.size * dt.itemsize, dtype=np.uint8)
            data.append((t.array, t.box, raw.view(dt).reshape(t.box.shape)))

    def write(path: str) -> None:
        coord = TorchCoordinator(dist.group.WORLD)
        claim = begin_checkpoint(path, coordinator=coord)
        tmp = claim.tmp
        batch = export_split(args["inflight"], 2).batch if args["inflight"] else None  # None: the export's default
        w = writer_class(tmp, planned.wplan, rank, batch_bytes=batch, compute_digest=args["digest"],
                         staging=not args.get("writer_nostage"), target_data_file_size=args.get("target_file"))
        for name, box, arr in data:
            w.write(name, box, arr, donate=True)
        if rank == 0:
            for p in (STEP_PATH, COUNT_PATH):
                w.write(p, Box((), ()), np.asarray(10, dtype=np.int32))
        w.finish()
        finalize(claim, planned.wplan, rank, Manifest(), coordinator=coord)

    return write


VARIANTS = ("export", "export_replan", "store", "dcp", "raw_ts")


def worker(rank: int, world: int, init: str, args: dict, out_json: str) -> None:
    """One rank of the benchmark, under the diagnostics' testing seams (`bridge._testing`)."""
    from bridge import _testing
    from bridge.store.writer import CheckpointWriter

    writer_class = timed_writer_class() if args.get("writer_timeline") else CheckpointWriter
    # diagnostics: TensorStore copies inner chunks itself (export and store alone); the OCDBT data
    # file size (how many files a commit writes at once); the writer timed per method
    with _testing.seams(writer_staging=not args.get("writer_nostage"), writer_class=writer_class,
                        target_data_file_size=args.get("target_file")):
        _worker(rank, world, init, args, out_json, writer_class)


def _worker(rank: int, world: int, init: str, args: dict, out_json: str, writer_class: type) -> None:
    import torch.distributed.checkpoint as dcp

    import tensorstore as ts

    from bridge.layout import ParallelLayout
    from bridge.live.api import AdamConfig, LiveRun
    from bridge.live.export import Exporter, ExportOptions

    torch.set_num_threads(1)
    timeline: dict[str, list] = {"export": [], "store": []}
    # diagnostic: writer commits in flight while device data is staged
    opts = ExportOptions(budget=args["inflight"], target_chunk_bytes=args["chunk"],
                         inner_chunk_bytes=args["inner"], digest=args["digest"],
                         **({"commit_depth": args["device_commits"]} if args.get("device_commits") else {}))
    exporter = Exporter()
    device = torch.device("cpu")
    if args["backend"] == "nccl":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    dist.init_process_group(args["backend"], init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    layout = ParallelLayout(tp=args["tp"], gtp=args["gtp"], dp=world // (args["tp"] * args["gtp"]))
    params = build_state(layout, rank, args["hidden"], args["layers"], args["pad"], device)
    run = LiveRun(layout, rank, 10, AdamConfig(lr=1e-4))
    state_bytes = sum(p.weight.numel() * 2 + (3 * 4 * p.optim.numel if p.optim else 0) for p in params)
    dcp_sd = dcp_state_dict(params, layout, rank)
    store_write = _store_only(run, params, args, rank, writer_class)
    root = args["dir"]
    res: dict[str, list] = {k: [] for k in VARIANTS}
    mem: dict[str, list] = {k: [] for k in VARIANTS}
    written = 0
    steps: list[dict] = []  # export's per-step seconds per rep (plan reused)
    steps_replan: list[dict] = []  # the same with the plan cache cleared first
    cached: list[bool] = []
    extra = {}
    for rep in range(-1, args["reps"]):  # rep -1: untimed warm-up (imports, first allocations, DCP set-up)
        order = list(VARIANTS)
        order = order[rep % len(order):] + order[:rep % len(order)]
        for name in order:
            path = os.path.join(root, f"{name}_{rep + 1}")
            _TIMELINE.clear()
            if name in ("export", "export_replan"):
                if name == "export_replan":
                    exporter.clear_cache()

                def go():
                    return exporter.export(path, run, params, opts)

                t, m, rep_ = _timed(go, device)
                written = rep_.bytes_written
                if rep >= 0:
                    (steps if name == "export" else steps_replan).append(rep_.timings)
                    if name == "export":
                        cached.append(rep_.plan_cached)
                        extra = {"write_calls": rep_.staging.write_calls,
                                 "staging_peak_bytes": rep_.staging.peak_bytes, "bytes_sent": rep_.bytes_sent,
                                 "staged_bytes": rep_.staging.staged_bytes, "donated_staging": rep_.staging.donated,
                                 "inner": rep_.inner_chunk_bytes}
            elif name == "store":
                t, m, _ = _timed(lambda: store_write(path), device)
            elif name == "dcp":
                t, m, _ = _timed(lambda: dcp.save(dcp_sd, checkpoint_id=path, planner=_dcp_planner()), device)
            else:
                n = written if written else state_bytes
                data, spec = _raw_write(path, n, rank)

                def raw():
                    st = ts.open(spec, create=True).result()
                    st.write(data).result()
                    fsync_tree(os.path.join(path, f"rank{rank}"))

                if rank == 0:
                    os.makedirs(path, exist_ok=True)
                dist.barrier()
                t, m, _ = _timed(raw, device)
            if rep >= 0:
                res[name].append(t)
                mem[name].append(m)
                if name in timeline and _TIMELINE:
                    timeline[name].append({**_TIMELINE, "total": t})
            dist.barrier()
            if rank == 0:
                shutil.rmtree(path, ignore_errors=True)
                shutil.rmtree(path + ".orbax-checkpoint-tmp", ignore_errors=True)
            dist.barrier()
    dcp_bytes = _dcp_bytes(dcp_sd, root, rank)
    busbw = _exchange_busbw(params, run, args["reps"], device) if args["busbw"] else None
    reload_fig = _reload_figures(os.path.join(root, "reload_src"), run, params, args, device)
    # slowest rank per repetition, peak memory over ranks
    mine = {"t": res, "mem": mem, "written": written, "state_bytes": state_bytes, "reload": reload_fig,
            "steps": steps, "steps_replan": steps_replan, "cached": cached, "extra": extra, "dcp_bytes": dcp_bytes,
            "timeline": timeline}
    from bridge.dist import all_gather_json
    from bridge.live.export import TIMING_STEPS

    allr = all_gather_json(mine)
    if rank == 0:
        out = {}
        for name in res:
            per_rep = [max(r["t"][name][i] for r in allr) for i in range(args["reps"])]
            out[name] = {"median_s": statistics.median(per_rep), "reps_s": per_rep,
                         "peak_rss_growth_MiB": max(max(r["mem"][name]) for r in allr) / 2 ** 20}

        def split(key):  # per step: the slowest rank in each rep, then the median over reps
            return {k: statistics.median(max(r[key][i].get(k, 0.0) for r in allr) for i in range(args["reps"]))
                    for k in TIMING_STEPS + ("d2h_wait", "commit_wait")}

        out["export"]["steps_s"] = split("steps")
        out["export_replan"]["steps_s"] = split("steps_replan")
        total_written = sum(r["written"] for r in allr)
        summary = {"args": args, "world": world, "logical_bytes_written": total_written,
                   "rank_state_bytes": sum(r["state_bytes"] for r in allr),
                   "dcp_bytes_written": sum(r["dcp_bytes"] for r in allr), "phases": out,
                   "plan_cached": all(all(r["cached"]) for r in allr),
                   "per_rank": [r["extra"] for r in allr],
                   "writer_timeline": {ph: [{k: round(statistics.median(t[k] for t in r["timeline"][ph]), 4)
                                             for k in r["timeline"][ph][0]} for r in allr]
                                       for ph in ("export", "store") if allr[0]["timeline"][ph]},
                   "export_over_dcp_time": out["export"]["median_s"] / out["dcp"]["median_s"],
                   "export_replan_over_dcp_time": out["export_replan"]["median_s"] / out["dcp"]["median_s"],
                   "raw_over_export_time": out["raw_ts"]["median_s"] / out["export"]["median_s"],
                   "store_over_export_time": out["store"]["median_s"] / out["export"]["median_s"],
                   "export_GBps": total_written / out["export"]["median_s"] / 1e9, "busbw": busbw,
                   "verify": None if not args.get("verify") else {
                       "checked_bytes": sum(r["reload"]["checked_bytes"] for r in allr),
                       "mismatches": [m for r in allr for m in r["reload"]["mismatches"]]},
                   "reload": {"layout": allr[0]["reload"]["layout"],
                              "max_s": max(r["reload"]["s"] for r in allr),
                              "bytes_needed": sum(r["reload"]["needed"] for r in allr),
                              "bytes_read_from_storage": sum(r["reload"]["read"] for r in allr)}}
        with open(out_json, "w") as f:
            json.dump(summary, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


def _dcp_planner():
    """DCP's default planner with its own plan cache where torch has one (the export reuses its plan too)."""
    from torch.distributed.checkpoint import DefaultSavePlanner

    try:
        return DefaultSavePlanner(enable_plan_caching=True)
    except TypeError:  # older torch: no plan caching
        return DefaultSavePlanner()


def _dcp_bytes(sd: dict, root: str, rank: int) -> int:
    """Bytes DCP writes for this rank's state dict (one more untimed save, then the file sizes)."""
    import torch.distributed.checkpoint as dcp

    path = os.path.join(root, "dcp_size")
    dcp.save(sd, checkpoint_id=path)
    dist.barrier()
    n = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.startswith(f"__{rank}_"))
    dist.barrier()
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)
    return n


def hidden_for(mib: float, layers: int) -> int:
    """Hidden size whose per-layer state (~ (8+4+3+1) h^2 bf16 + fp32 masters/moments) totals `mib`."""
    per_h2 = 12 * (2 + 12)  # h^2 elements per layer (fc1 8, fc2 4... see model_geometries) x bytes per element
    h = int((mib * 2 ** 20 / layers / per_h2) ** 0.5)
    return max(64, h - h % 64)


STEP_NOTES = {"holdings": "cut/refresh pieces (FP8 dequant)", "gather": "all-gather keys (+ summaries)",
              "plan": "global + write plan", "begin": "begin_checkpoint (collective)", "pack": "send buffer",
              "write_local": "local writes (overlap exchange)", "exchange_wait": "all_to_all wait",
              "write_recv": "writes (received / staged D2H)", "finish": "writer.finish (last commit)",
              "barrier": "wait for slowest rank", "commit": "rank 0 merge + _METADATA + fsync + rename",
              "d2h_wait": "(inside writes) blocked on device->host copies",
              "commit_wait": "(inside writes and finish) blocked on store commits"}


def format_summary(s: dict, world: int, tp: int, gtp: int, backend: str) -> str:
    """Human-readable summary: anchors, ratios, the export's per-step split, memory, reload, exchange."""
    ph = s["phases"]
    lines = [f"world {world} TP{tp}xGTP{gtp}xDP{world // (tp * gtp)} {backend}, hidden {s['args']['hidden']}, "
             f"{s['args']['layers']} layers: {s['logical_bytes_written'] / 2**20:.1f} MiB logical written "
             f"(ranks hold {s['rank_state_bytes'] / 2**20:.1f} MiB incl. replicas and padding; DCP writes "
             f"{s['dcp_bytes_written'] / 2**20:.1f} MiB)",
             f"{'variant':14} {'median s':>9} {'peak RSS +MiB':>14}"]
    notes = {"export": "plan reused (exports every N steps)" if s["plan_cached"] else "plan NOT reused",
             "export_replan": "plan cache cleared first", "store": "CheckpointWriter alone, same boxes, host data",
             "dcp": "torch DCP save, same tensors (replicas deduped)", "raw_ts": "zarr3 uint8, same byte count"}
    for name in ("export", "export_replan", "store", "dcp", "raw_ts"):
        lines.append(f"{name:14} {ph[name]['median_s']:9.3f} {ph[name]['peak_rss_growth_MiB']:14.1f}   {notes[name]}")
    lines.append("export steps (slowest rank per rep, median s; plan reused | replanned):")
    st, st2 = ph["export"]["steps_s"], ph["export_replan"]["steps_s"]
    for k in st:
        lines.append(f"  {k:14} {st[k]:7.3f} | {st2[k]:7.3f}   {STEP_NOTES.get(k, '')}")
    pr = s["per_rank"]
    inner = pr[0].get("inner")
    lines.append(f"inner (read) chunks {s['args']['inner']} -> {'whole outer chunk' if inner is None else f'{inner >> 10} KiB'}")
    lines.append(f"write calls per rank {[r.get('write_calls') for r in pr]}, staging buffers "
                 f"{max(r.get('staging_peak_bytes', 0) for r in pr) / 2**20:.0f} MiB "
                 f"({'donated' if any(r.get('donated_staging') for r in pr) else 'copied'}; staged "
                 f"{sum(r.get('staged_bytes', 0) for r in pr) / 2**20:.0f} MiB), bytes sent per rank "
                 f"{[r.get('bytes_sent') for r in pr]}")
    lines.append(f"export / dcp time: {s['export_over_dcp_time']:.2f} (target <= 1.0; replanned "
                 f"{s['export_replan_over_dcp_time']:.2f});  raw_ts / export time: {s['raw_over_export_time']:.2f} "
                 f"(target >= 0.8);  store-only / export time: {s['store_over_export_time']:.2f};  "
                 f"export {s['export_GBps']:.3f} GB/s")
    r = s["reload"]
    lines.append(f"reload at {r['layout']}: {r['max_s']:.3f} s, storage bytes read / bytes needed "
                 f"{r['bytes_read_from_storage'] / max(1, r['bytes_needed']):.2f} (target <= 1.25)")
    if s.get("verify"):
        v = s["verify"]
        lines.append(f"verify: {v['checked_bytes'] / 2**20:.1f} MiB of the ranks' pieces read back, "
                     + ("all bytes equal" if not v["mismatches"] else f"MISMATCH {v['mismatches']}"))
    for ph_name, ranks in (s.get("writer_timeline") or {}).items():
        lines.append(f"writer timeline, {ph_name} (median s per rank, inclusive): "
                     + "; ".join(f"rank {i} " + " ".join(f"{k}={v:.3f}" for k, v in t.items())
                                 for i, t in enumerate(ranks)))
    if s["busbw"]:
        b = s["busbw"]
        lines.append(f"exchange ({b['source']} splits) busbw {b['a2a_busbw_GBps']:.2f} GB/s vs all_gather_into_tensor "
                     f"{b['allgather_busbw_GBps']:.2f} GB/s at {b['bytes_per_rank'] / 2**20:.1f} MiB/rank: ratio "
                     f"{b['busbw_ratio']:.2f} (target >= 0.7)")
    lines.append("SUMMARY " + json.dumps({
        "layout": f"TP{tp}xGTP{gtp}xDP{world // (tp * gtp)}", "backend": backend,
        "export_s": round(ph["export"]["median_s"], 4), "dcp_s": round(ph["dcp"]["median_s"], 4),
        "raw_s": round(ph["raw_ts"]["median_s"], 4), "store_s": round(ph["store"]["median_s"], 4),
        "export_over_dcp": round(s["export_over_dcp_time"], 3), "raw_over_export": round(s["raw_over_export_time"], 3),
        "store_over_export": round(s["store_over_export_time"], 3),
        "export_replan_over_dcp": round(s["export_replan_over_dcp_time"], 3),
        "busbw_ratio": round(s["busbw"]["busbw_ratio"], 3) if s["busbw"] else None,
        "peak_rss_MiB": round(ph["export"]["peak_rss_growth_MiB"], 1), "inner_KiB": (inner or 0) >> 10,
        "verified": None if not s.get("verify") else not s["verify"]["mismatches"],
        "reload_read_over_needed": round(r["bytes_read_from_storage"] / max(1, r["bytes_needed"]), 3),
        "steps_s": {k: round(v, 4) for k, v in st.items()}}, separators=(",", ":")))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--gtp", type=int, default=2)
    ap.add_argument("--mib", type=float, default=64, help="total model state (weights + optimizer), MiB")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--pad", type=int, default=16, help="pad_for_alignment")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--inflight", type=int, default=None,
                    help="export in-flight budget, bytes (default: export_state's, which depends on the CPU count)")
    ap.add_argument("--chunk-mib", type=float, default=4, help="export target outer chunk size, MiB")
    ap.add_argument("--inner-kib", type=float, default=None,
                    help="export inner (read) chunk size, KiB (default: the export's 'auto' choice)")
    ap.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    ap.add_argument("--busbw", action="store_true", help="also time the exchange vs all_gather_into_tensor")
    ap.add_argument("--verify", action="store_true",
                    help="read every piece each rank holds back from an exported checkpoint and compare bytes")
    ap.add_argument("--no-digest", action="store_true", help="diagnostic: export and store without digests")
    ap.add_argument("--target-file-mib", type=float, default=None, help="diagnostic: OCDBT target data file size")
    ap.add_argument("--writer-nostage", action="store_true",
                    help="diagnostic: the store writer lets TensorStore copy inner chunks (no staging slabs)")
    ap.add_argument("--writer-timeline", action="store_true",
                    help="diagnostic: wall seconds inside the store writer's methods (export and store alone)")
    ap.add_argument("--device-commits", type=int, default=None,
                    help="diagnostic: writer commits in flight while device data is staged")
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
    ap.add_argument("--json", default=None, help="write the summary JSON here")
    a = ap.parse_args(argv)
    if a.world % (a.tp * a.gtp):
        ap.error(f"--world {a.world} is not divisible by tp*gtp = {a.tp * a.gtp}")
    scratch = a.dir or tempfile.mkdtemp(prefix="bench_live_")
    os.makedirs(scratch, exist_ok=True)
    args = {"tp": a.tp, "gtp": a.gtp, "hidden": hidden_for(a.mib, a.layers), "layers": a.layers, "pad": a.pad,
            "reps": a.reps, "inflight": a.inflight, "chunk": int(a.chunk_mib * 2 ** 20), "inner": "auto" if a.inner_kib is None else int(a.inner_kib * 2 ** 10), "backend": a.backend, "busbw": a.busbw, "dir": scratch,
            "verify": a.verify, "digest": not a.no_digest,
            "target_file": int(a.target_file_mib * 2 ** 20) if a.target_file_mib else None,
            "device_commits": a.device_commits, "writer_nostage": a.writer_nostage,
            "writer_timeline": a.writer_timeline}
    out_json = a.json or os.path.join(scratch, "summary.json")
    init = f"file://{os.path.join(scratch, 'pg_init')}"
    mp.spawn(worker, args=(a.world, init, args, out_json), nprocs=a.world, join=True)
    with open(out_json) as f:
        s = json.load(f)
    print(format_summary(s, a.world, a.tp, a.gtp, a.backend))
    if not a.dir:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
