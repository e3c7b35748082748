"""Live export vs torch DCP save vs a raw TensorStore write, same ranks, same state, one run.

    python benchmarks/bench_live_export.py [--world 4] [--tp 1 --gtp 2] [--mib 64] [--reps 3]
                                           [--backend gloo|nccl] [--json OUT]

Every rank builds the state of a GTP run with the layout engine (padded physical bf16 shards of
per-layer SwiGLU fc1 / row-parallel fc2 / qkv weights and norms, fp32 DistOpt fragments of its
buffer) and, interleaved over `--reps` repetitions:
  export  `bridge.live.export_state` (plan, one all_to_all to chunk owners, owned-chunk writes,
          OCDBT merge, _METADATA, fsync, atomic rename);
  dcp     `torch.distributed.checkpoint.save` of the same tensors (each rank's weight shards and
          optimizer fragments under rank-unique keys, as local tensors), fsync'd by DCP;
  raw_ts  each rank writes exactly the bytes its export wrote as one zarr3 uint8 array (file
          kvstore, 4 MiB chunks), then fsyncs: the anchor for pure write speed.
After one untimed warm-up round. Reported: median wall seconds (slowest rank, between barriers), throughput of logical bytes,
ratios export/dcp time and raw/export time (>= 0.8 is the target), peak host RSS growth per phase
(VmHWM after resetting it; max over ranks), a reload at the swapped TP/GTP split (time; bytes
TensorStore read from storage / bytes needed, target <= 1.25), and with `--busbw` the exchange's bus bandwidth vs a
plain `all_gather_into_tensor` producing the same per-rank bytes (nccl-tests formula:
busbw = S/t * (n-1)/n, S = per-rank buffer bytes).
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

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402


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


def build_state(layout, rank: int, hidden: int, layers: int, pad: int, device):
    """This rank's LocalParams: random bf16 shards, fp32 fragments of a Megatron-style buffer."""
    from bridge.layout.distopt import BufferParam, buffer_layout, owned_ranges
    from bridge.live.api import LocalParam, OptimFragment

    geoms = model_geometries(hidden, layers, pad)
    names = [f"{g.name}#{g.index}" for g in geoms]
    shapes = [g.physical_shape(*g.sizes(layout)) for g in geoms]
    blay = buffer_layout([BufferParam(n, int(np.prod(s))) for n, s in zip(names, shapes)], None, layout.distopt_size)
    ranges = {o.name: o.param for o in owned_ranges(blay, layout.distopt_rank(rank))}
    gen = torch.Generator().manual_seed(1234 + rank)
    params = []
    for g, n, s in zip(geoms, names, shapes):
        w = torch.randn(s, generator=gen).to(torch.bfloat16).to(device)
        frag = None
        if n in ranges:
            f0, f1 = ranges[n]
            frag = OptimFragment(f0, f1, *(torch.randn(f1 - f0, generator=gen).to(device) for _ in range(3)))
        params.append(LocalParam(g.name, g, w, frag, index=g.index))
    return params


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


def _fsync_tree(root: str) -> None:
    for d, _, files in os.walk(root):
        for fn in files:
            fd = os.open(os.path.join(d, fn), os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)


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
    import tensorstore as ts

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
    from bridge.live.exchange import all_gather_flat, all_gather_json, all_to_all_bytes
    from bridge.live.export import _send_buffer, _summary
    from bridge.live.holdings import tree_name
    from bridge.live.plan import build_plan

    rank, world = dist.get_rank(), dist.get_world_size()
    holdings, summary = _summary(params, run, rank)
    plan = build_plan(all_gather_json({"error": None, **summary}), tree_name)
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
    return {"layout": f"TP{target.tp}xGTP{target.gtp}xDP{target.dp}", "s": t, "needed": res.bytes_read,
            "read": read_bytes() - b0}


def worker(rank: int, world: int, init: str, args: dict, out_json: str) -> None:
    import torch.distributed.checkpoint as dcp

    import tensorstore as ts

    from bridge.layout import ParallelLayout
    from bridge.live.api import AdamConfig, LiveRun
    from bridge.live.export import export_state

    torch.set_num_threads(1)
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
    dcp_sd = {}
    for i, p in enumerate(params):
        dcp_sd[f"r{rank}.{i}.weight"] = p.weight
        if p.optim is not None:
            for k, t in p.optim.tensors().items():
                dcp_sd[f"r{rank}.{i}.{k}"] = t
    root = args["dir"]
    res = {"export": [], "dcp": [], "raw_ts": []}
    mem = {"export": [], "dcp": [], "raw_ts": []}
    written = 0
    phases: list[list[float]] = []  # export's own plan / exchange / write / commit seconds per rep
    for rep in range(-1, args["reps"]):  # rep -1: untimed warm-up (imports, first allocations, DCP set-up)
        order = ["export", "dcp", "raw_ts"]
        order = order[rep % 3:] + order[:rep % 3]
        for name in order:
            path = os.path.join(root, f"{name}_{rep + 1}")
            if name == "export":
                t, m, rep_ = _timed(lambda: export_state(path, run, params, inflight_bytes=args["inflight"],
                                                          target_chunk_bytes=args["chunk"],
                                                          inner_chunk_bytes=args["inner"]), device)
                written = rep_.bytes_written
                if rep >= 0:
                    phases.append([rep_.plan_s, rep_.exchange_s, rep_.write_s, rep_.commit_s])
            elif name == "dcp":
                t, m, _ = _timed(lambda: dcp.save(dcp_sd, checkpoint_id=path), device)
            else:
                n = written if written else state_bytes
                data, spec = _raw_write(path, n, rank)

                def raw():
                    st = ts.open(spec, create=True).result()
                    st.write(data).result()
                    _fsync_tree(os.path.join(path, f"rank{rank}"))

                if rank == 0:
                    os.makedirs(path, exist_ok=True)
                dist.barrier()
                t, m, _ = _timed(raw, device)
            if rep >= 0:
                res[name].append(t)
                mem[name].append(m)
            dist.barrier()
            if rank == 0:
                shutil.rmtree(path, ignore_errors=True)
                shutil.rmtree(path + ".orbax-checkpoint-tmp", ignore_errors=True)
            dist.barrier()
    busbw = _exchange_busbw(params, run, args["reps"], device) if args["busbw"] else None
    reload_fig = _reload_figures(os.path.join(root, "reload_src"), run, params, args, device)
    # slowest rank per repetition, peak memory over ranks
    mine = {"t": res, "mem": mem, "written": written, "state_bytes": state_bytes, "reload": reload_fig,
            "phases": phases}
    from bridge.live.exchange import all_gather_json

    allr = all_gather_json(mine)
    if rank == 0:
        out = {}
        for name in res:
            per_rep = [max(r["t"][name][i] for r in allr) for i in range(args["reps"])]
            out[name] = {"median_s": statistics.median(per_rep), "reps_s": per_rep,
                         "peak_rss_growth_MiB": max(max(r["mem"][name]) for r in allr) / 2 ** 20}
        # per phase: the slowest rank in each rep, then the median over reps
        split = {k: statistics.median(max(r["phases"][i][j] for r in allr) for i in range(args["reps"]))
                 for j, k in enumerate(("plan", "exchange", "write", "commit"))}
        out["export"]["split_s"] = split
        total_written = sum(r["written"] for r in allr)
        summary = {"args": args, "world": world, "logical_bytes_written": total_written,
                   "rank_state_bytes": sum(r["state_bytes"] for r in allr), "phases": out,
                   "export_over_dcp_time": out["export"]["median_s"] / out["dcp"]["median_s"],
                   "raw_over_export_time": out["raw_ts"]["median_s"] / out["export"]["median_s"],
                   "export_GBps": total_written / out["export"]["median_s"] / 1e9, "busbw": busbw,
                   "reload": {"layout": allr[0]["reload"]["layout"],
                              "max_s": max(r["reload"]["s"] for r in allr),
                              "bytes_needed": sum(r["reload"]["needed"] for r in allr),
                              "bytes_read_from_storage": sum(r["reload"]["read"] for r in allr)}}
        with open(out_json, "w") as f:
            json.dump(summary, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


def hidden_for(mib: float, layers: int) -> int:
    """Hidden size whose per-layer state (~ (8+4+3+1) h^2 bf16 + fp32 masters/moments) totals `mib`."""
    per_h2 = 12 * (2 + 12)  # h^2 elements per layer (fc1 8, fc2 4... see model_geometries) x bytes per element
    h = int((mib * 2 ** 20 / layers / per_h2) ** 0.5)
    return max(64, h - h % 64)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--gtp", type=int, default=2)
    ap.add_argument("--mib", type=float, default=64, help="total model state (weights + optimizer), MiB")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--pad", type=int, default=16, help="pad_for_alignment")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--inflight", type=int, default=256 << 20, help="export in-flight budget, bytes")
    ap.add_argument("--chunk-mib", type=float, default=4, help="export target outer chunk size, MiB")
    ap.add_argument("--inner-kib", type=float, default=256, help="export inner (read) chunk size, KiB")
    ap.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    ap.add_argument("--busbw", action="store_true", help="also time the exchange vs all_gather_into_tensor")
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
    ap.add_argument("--json", default=None, help="write the summary JSON here")
    a = ap.parse_args(argv)
    if a.world % (a.tp * a.gtp):
        ap.error(f"--world {a.world} is not divisible by tp*gtp = {a.tp * a.gtp}")
    scratch = a.dir or tempfile.mkdtemp(prefix="bench_live_")
    os.makedirs(scratch, exist_ok=True)
    args = {"tp": a.tp, "gtp": a.gtp, "hidden": hidden_for(a.mib, a.layers), "layers": a.layers, "pad": a.pad,
            "reps": a.reps, "inflight": a.inflight, "chunk": int(a.chunk_mib * 2 ** 20), "inner": int(a.inner_kib * 2 ** 10), "backend": a.backend, "busbw": a.busbw, "dir": scratch}
    out_json = a.json or os.path.join(scratch, "summary.json")
    init = f"file://{os.path.join(scratch, 'pg_init')}"
    mp.spawn(worker, args=(a.world, init, args, out_json), nprocs=a.world, join=True)
    with open(out_json) as f:
        s = json.load(f)
    ph = s["phases"]
    print(f"world {a.world} TP{a.tp}xGTP{a.gtp}xDP{a.world // (a.tp * a.gtp)} {a.backend}, hidden {args['hidden']}, "
          f"{a.layers} layers: {s['logical_bytes_written'] / 2**20:.1f} MiB logical written "
          f"(ranks hold {s['rank_state_bytes'] / 2**20:.1f} MiB incl. replicas and padding)")
    print(f"{'phase':8} {'median s':>9} {'peak RSS +MiB':>14}")
    for name in ("export", "dcp", "raw_ts"):
        print(f"{name:8} {ph[name]['median_s']:9.3f} {ph[name]['peak_rss_growth_MiB']:14.1f}")
    sp = ph["export"]["split_s"]
    print("export phases (slowest rank, median s): " + ", ".join(f"{k} {v:.3f}" for k, v in sp.items()))
    print(f"export / dcp time: {s['export_over_dcp_time']:.2f} (target <= 1.0);  "
          f"raw_ts / export time: {s['raw_over_export_time']:.2f} (target >= 0.8);  export {s['export_GBps']:.3f} GB/s")
    r = s["reload"]
    print(f"reload at {r['layout']}: {r['max_s']:.3f} s, storage bytes read / bytes needed "
          f"{r['bytes_read_from_storage'] / max(1, r['bytes_needed']):.2f} (target <= 1.25)")
    if s["busbw"]:
        b = s["busbw"]
        print(f"exchange ({b['source']} splits) busbw {b['a2a_busbw_GBps']:.2f} GB/s vs all_gather_into_tensor "
              f"{b['allgather_busbw_GBps']:.2f} GB/s at {b['bytes_per_rank'] / 2**20:.1f} MiB/rank: ratio "
              f"{b['busbw_ratio']:.2f} (target >= 0.7)")
    if not a.dir:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
