"""Scale probe, offline steps (no torch.distributed). Each subcommand appends JSON to --json.

    offline.py compare A B --json F        bit-exact array-by-array comparison (megatron_roundtrip's
                                           compare_checkpoints(a, b, exact=True)), timed
    offline.py digests A B [C ...] --json F  the manifests' per-array digests agree (cheap cross-check)
    offline.py anchor SRC RAW --json F     torch.distributed.checkpoint load of every tensor of the
                                           torch_dist checkpoint SRC into CPU tensors (page cache dropped
                                           first), then a raw write of the same bytes (tofile + fsync)
    offline.py rawread DIR --json F        every file under DIR read with 8 threads, 16 MiB at a time, page
                                           cache dropped first (bench_scale.raw_read): the disk's rate,
                                           verify's anchor
    offline.py verify CKPT --json F        verify in-process, cold then warm (disk-bound or not);
               [--baseline OLD_VERIFY_PY]  warm A B B A against an older verify.py;
               [--reads-only]              a warm run with the digest skipped (the reads' own rate)
    offline.py convert SRC DST --json F    `gtp-bridge convert SRC DST`'s code path in this process at the CLI's
                                           defaults (converters.megatron.convert_entry.convert, workers and budget
                                           None): its phase timings (ConvertResult.timings)
    offline.py convert_ab SRC DST --json F convert vs its anchor in the order A B B A: `gtp-bridge convert`
                                           (CLI), anchor, anchor, `offline.py convert` (same code, with
                                           timings); before each the page cache dropped and the libraries
                                           re-read (measure.py --warm-imports); each a fresh process measured
                                           (wall, CPU, peak RSS, bytes); the second conversion's digests
                                           equal the first's (DST kept, DST_b removed)
    offline.py tomeg CONV DST --json F     `gtp-bridge to-megatron --tp 2 CONV DST`'s code path in this process
                                           (converters.megatron.write.to_megatron.to_megatron at the CLI's defaults), timed
                                           after the imports; DST removed after
    offline.py tomeg_anchor CONV OUT --json F  to-megatron's anchor in this process (bench_scale._anchor_tomeg:
                                           raw TensorStore read of every array + dcp.save); OUT removed after
    offline.py tomeg_ab CONV DST --json F  to-megatron vs its anchor in the order A B B A, as convert_ab: API,
                                           anchor, anchor, API (each a fresh process, page cache dropped and
                                           libraries re-read before it, timed in-process after the imports),
                                           then the CLI once (process start included: a second figure)
    offline.py layer_read CONV LIVE --json F  one layer of the largest stacked array of CONV in a fresh
                                           context: bytes TensorStore read vs the layer's bytes; exact vs LIVE
    offline.py jax CKPT --json F           JAX restore onto a 1-GPU mesh: bridge.jaxside.restore vs
                                           plain Orbax, cold (page cache dropped before each), in the
                                           order A B B A after one untimed warm-up restore (the first
                                           restore of a process pays for growing the GPU allocator and
                                           Orbax's/TensorStore's first use); per restore also the bytes
                                           read (/proc/self/io) and the time in the Orbax read itself;
                                           bit-exact agreement of the restored arrays
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))  # repository root
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts", "gpu"))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from scale_measure import drop_caches  # noqa: E402 (one implementation for every scale script)
PAGE = os.sysconf("SC_PAGE_SIZE")


def _io() -> dict:
    with open("/proc/self/io") as f:
        return {k: int(v) for k, v in (ln.split(":") for ln in f)}


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def append(path: str, rec: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(rec, default=str) + "\n")
    print("[offline]", json.dumps(rec, default=str)[:1500], flush=True)


def cmd_rawread(a) -> int:
    from bench_scale import raw_read

    dropped = drop_caches()
    r = raw_read(a.paths[0], min(8, os.cpu_count() or 1))
    append(a.json, dict(r, what="raw_read", path=a.paths[0], dropped_caches=dropped, GBps=r["bytes"] / r["seconds"] / 1e9))
    return 0


def cmd_compare(a) -> int:
    from megatron_roundtrip import compare_checkpoints

    t0 = time.perf_counter()
    res = compare_checkpoints(a.paths[0], a.paths[1], exact=True)
    res["seconds"] = time.perf_counter() - t0
    res["what"] = "compare_exact"
    res["mismatch"] = res["mismatch"][:20]
    append(a.json, res)
    return 0 if res["ok"] else 1


def cmd_digests(a) -> int:
    from bridge.store import open_checkpoint

    ms = [open_checkpoint(p).manifest for p in a.paths]
    base = {k: r.digest for k, r in ms[0].arrays.items()}
    out = {"what": "digests", "paths": a.paths, "arrays": len(base), "differ": {}, "ok": True}
    for p, m in zip(a.paths[1:], ms[1:]):
        other = {k: r.digest for k, r in m.arrays.items()}
        bad = sorted(k for k in set(base) | set(other) if base.get(k) != other.get(k) or base.get(k) is None)
        out["differ"][p] = bad[:20]
        out["ok"] = out["ok"] and not bad
    append(a.json, out)
    return 0 if out["ok"] else 1


def cmd_anchor(a) -> int:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    src, raw = a.paths
    rec: dict = {"what": "anchor", "src": src}
    md = FileSystemReader(src).read_metadata()
    target = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype)
              for k, v in md.state_dict_metadata.items() if hasattr(v, "size")}
    rec["tensors"] = len(target)
    rec["bytes"] = sum(t.numel() * t.element_size() for t in target.values())
    rec["dropped_caches"] = drop_caches()
    r0 = rss()
    t0 = time.perf_counter()
    dcp.load(target, checkpoint_id=src, no_dist=True)
    rec["dcp_load_seconds"] = time.perf_counter() - t0
    rec["rss_after_load"] = rss()
    rec["rss_before_load"] = r0
    os.makedirs(raw, exist_ok=True)
    t0 = time.perf_counter()
    total = 0
    for i, (k, t) in enumerate(target.items()):
        t = t.contiguous()
        arr = t.view(torch.uint8).numpy() if t.dtype in (torch.bfloat16, torch.float16) else t.numpy()
        with open(os.path.join(raw, f"a{i}.bin"), "wb") as f:
            arr.tofile(f)
            f.flush()
            os.fsync(f.fileno())
        total += arr.nbytes
    dfd = os.open(raw, os.O_RDONLY)
    os.fsync(dfd)
    os.close(dfd)
    rec["raw_write_seconds"] = time.perf_counter() - t0
    rec["raw_bytes"] = total
    rec["anchor_seconds"] = rec["dcp_load_seconds"] + rec["raw_write_seconds"]
    rec["dcp_load_GBps"] = rec["bytes"] / rec["dcp_load_seconds"] / 1e9
    rec["raw_write_GBps"] = total / rec["raw_write_seconds"] / 1e9
    del target
    shutil.rmtree(raw, ignore_errors=True)
    append(a.json, rec)
    return 0


def cmd_convert(a) -> int:
    from converters.megatron.convert import ConvertOptions
    from converters.megatron.convert_entry import convert

    t0 = time.perf_counter()
    r = convert(a.paths[0], a.paths[1], ConvertOptions(workers=None, budget=None, show_progress=False))
    append(a.json, {"what": "convert_api", "src": a.paths[0], "seconds_in_process": time.perf_counter() - t0,
                    "workers": r.workers, "budget": r.budget, "bytes": r.bytes, "timings": r.timings})
    return 0


def _last(path: str, what: str) -> dict:
    """The last record of kind `what` appended to the JSON-lines file `path`."""
    out: dict = {}
    if os.path.exists(path):
        for ln in open(path):
            r = json.loads(ln)
            if r.get("what") == what:
                out = r
    return out


def cmd_convert_ab(a) -> int:
    """A B B A: CLI convert, anchor, anchor, API convert (see the module docstring)."""
    import scale_measure as sm

    src, dst = a.paths
    py = sys.executable
    me = os.path.abspath(__file__)
    steps = [("convert_cli", dst, [py, "-m", "bridge.cli", "convert", src, dst]),
             ("anchor", None, [py, me, "anchor", src, dst + "_raw", "--json", a.json]),
             ("anchor", None, [py, me, "anchor", src, dst + "_raw", "--json", a.json]),
             ("convert_api", dst + "_b", [py, me, "convert", src, dst + "_b", "--json", a.json])]
    conv_s, anchor_s = [], []
    for i, (kind, out, argv) in enumerate(steps):
        rec: dict = {"what": "convert_ab", "position": i, "kind": kind, "dropped_caches": sm.drop_caches()}
        rec["warm_imports"] = sm.measure([py, "-c", sm.WARM_IMPORTS], timeout=120).rc == 0
        r = sm.measure(argv, timeout=a.step_timeout)
        rec.update(rc=r.rc, wall_seconds=r.seconds, cpu_seconds=r.cpu_seconds, peak_process_rss=r.peak_process_rss,
                   peak_tree_rss=r.peak_tree_rss, io=r.io, timed_out=r.timed_out)
        if r.rc != 0:
            rec["tail"] = r.output[-1500:]
        if kind == "anchor":
            an = _last(a.json, "anchor")
            rec.update(anchor_seconds=an.get("anchor_seconds"), dcp_load_seconds=an.get("dcp_load_seconds"),
                       raw_write_seconds=an.get("raw_write_seconds"))
            if r.rc == 0 and an:
                anchor_s.append(an["anchor_seconds"])
        else:
            if kind == "convert_api":
                rec["timings"] = _last(a.json, "convert_api").get("timings")
            if r.rc == 0:
                conv_s.append(r.seconds)
        append(a.json, rec)
        if out is not None and out != dst and os.path.isdir(out):
            from bridge.store import open_checkpoint

            d0 = {k: v.digest for k, v in open_checkpoint(dst).manifest.arrays.items()}
            d1 = {k: v.digest for k, v in open_checkpoint(out).manifest.arrays.items()}
            append(a.json, {"what": "convert_ab_digests", "a": dst, "b": out, "arrays": len(d0),
                            "equal": d0 == d1 and all(d0.values())})
            shutil.rmtree(out, ignore_errors=True)
    if conv_s and anchor_s:
        append(a.json, {"what": "convert_ab_ratio", "convert_s": conv_s, "anchor_s": anchor_s,
                        "ratio_of_means": (sum(conv_s) / len(conv_s)) / (sum(anchor_s) / len(anchor_s))})
    return 0 if len(conv_s) == 2 and len(anchor_s) == 2 else 1


def cmd_tomeg(a) -> int:
    # the libraries the anchor imports before its clock starts (torch, DCP, TensorStore), so both
    # sides are timed warm; the CLI figure (tomeg_ab's last run) includes them
    import tensorstore  # noqa: F401
    import torch.distributed.checkpoint  # noqa: F401

    from converters.megatron.write.torch_dist import MegatronTarget
    from converters.megatron.write.to_megatron import to_megatron

    src, dst = a.paths
    t0 = time.perf_counter()
    r = to_megatron(src, dst, MegatronTarget(tp=a.tp), show_progress=False)
    rec = {"what": "tomeg_api", "src": src, "tp": a.tp, "seconds_in_process": time.perf_counter() - t0,
           "workers": r["workers"], "budget": r["budget"], "bytes": r["bytes"], "bytes_read": r["bytes_read"],
           "elements_read": r["elements_read"], "elements_needed": r["elements_needed"]}
    shutil.rmtree(dst, ignore_errors=True)
    append(a.json, rec)
    return 0


def cmd_tomeg_anchor(a) -> int:
    from bench_scale import _anchor_tomeg

    conv, out = a.paths
    r = _anchor_tomeg(conv, out)
    shutil.rmtree(out, ignore_errors=True)
    append(a.json, dict(r, what="tomeg_anchor", anchor_seconds=r["ts_read_s"] + r["dcp_save_s"]))
    return 0


def cmd_tomeg_ab(a) -> int:
    """A B B A: API to-megatron, anchor, anchor, API; then the CLI once (see the module docstring)."""
    import scale_measure as sm

    conv, dst = a.paths
    py = sys.executable
    me = os.path.abspath(__file__)
    tp = ["--tp", str(a.tp)]
    steps = [("tomeg_api", [py, me, "tomeg", conv, dst, "--json", a.json] + tp),
             ("tomeg_anchor", [py, me, "tomeg_anchor", conv, dst + "_anchor", "--json", a.json]),
             ("tomeg_anchor", [py, me, "tomeg_anchor", conv, dst + "_anchor", "--json", a.json]),
             ("tomeg_api", [py, me, "tomeg", conv, dst, "--json", a.json] + tp),
             ("tomeg_cli", [py, "-m", "bridge.cli", "to-megatron", "--no-scheduler", conv, dst] + tp)]
    api_s, anchor_s, cli_s = [], [], []
    for i, (kind, argv) in enumerate(steps):
        rec: dict = {"what": "tomeg_ab", "position": i, "kind": kind, "dropped_caches": sm.drop_caches()}
        rec["warm_imports"] = sm.measure([py, "-c", sm.WARM_IMPORTS], timeout=120).rc == 0
        r = sm.measure(argv, timeout=a.step_timeout)
        rec.update(rc=r.rc, wall_seconds=r.seconds, cpu_seconds=r.cpu_seconds, peak_process_rss=r.peak_process_rss,
                   peak_tree_rss=r.peak_tree_rss, io=r.io, timed_out=r.timed_out)
        if r.rc != 0:
            rec["tail"] = r.output[-1500:]
        if r.rc == 0 and kind == "tomeg_api":
            got = _last(a.json, "tomeg_api")
            rec.update(seconds=got["seconds_in_process"], workers=got["workers"], budget=got["budget"])
            api_s.append(got["seconds_in_process"])
        elif r.rc == 0 and kind == "tomeg_anchor":
            got = _last(a.json, "tomeg_anchor")
            rec.update(seconds=got["anchor_seconds"], ts_read_s=got["ts_read_s"], dcp_save_s=got["dcp_save_s"])
            anchor_s.append(got["anchor_seconds"])
        elif r.rc == 0:
            rec["seconds"] = r.seconds
            cli_s.append(r.seconds)
        shutil.rmtree(dst, ignore_errors=True)
        append(a.json, rec)
    if api_s and anchor_s:
        mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
        append(a.json, {"what": "tomeg_ab_ratio", "api_s": api_s, "anchor_s": anchor_s, "cli_s": cli_s,
                        "ratio_of_means": mean(api_s) / mean(anchor_s),
                        "cli_over_anchor": mean(cli_s) / mean(anchor_s) if cli_s else None})
    return 0 if len(api_s) == 2 and len(anchor_s) == 2 else 1


def cmd_layer_read(a) -> int:
    """One layer of the largest stacked array, read from a fresh context, vs its bytes; exact vs LIVE."""
    import numpy as np

    from bench_scale import ts_bytes_read
    from bridge.layout.boxes import Box
    from bridge.store import open_checkpoint

    conv, live = a.paths
    ck = open_checkpoint(conv)
    infos = {p: ck.info(p) for p in ck.paths()}
    stacked = [p for p, i in infos.items() if "layers" in p and len(i.shape) == 3]
    big = max(stacked, key=lambda p: infos[p].nbytes)
    shape = infos[big].shape
    layer = shape[0] // 2
    box = Box((layer, 0, 0), (layer + 1,) + tuple(shape[1:]))
    rec = {"what": "layer_read", "array": ".".join(big), "layer": layer, "inner_chunk": list(infos[big].inner_chunk_shape),
           "dropped_caches": drop_caches()}
    ck = open_checkpoint(conv)   # fresh context: nothing cached
    b0, t0 = ts_bytes_read(), time.perf_counter()
    got = ck.read(big, box)
    rec.update(seconds=time.perf_counter() - t0, bytes_read=ts_bytes_read() - b0, bytes_needed=got.nbytes)
    rec["read_over_needed"] = rec["bytes_read"] / rec["bytes_needed"]
    want = open_checkpoint(live).read(big, box)
    rec["exact_vs_live"] = bool(got.shape == want.shape and np.array_equal(got.view(np.uint8), want.view(np.uint8)))
    append(a.json, rec)
    return 0 if rec["exact_vs_live"] else 1


def _load_module(path: str, name: str):
    """A module from a file (an older verify.py for an A/B in one process)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def cmd_verify(a) -> int:
    """`gtp-bridge verify`'s code path (bridge.store.verify.verify_checkpoint) in this process:
    page cache dropped (every byte from the disk), then warm (no byte from the disk). Equal times
    mean verify is bound by its own processing, not by the disk. Time, CPU seconds (all threads),
    bytes read through read(2)/pread(2) (rchar) and from the disk (read_bytes).
    With --baseline FILE (an older bridge/store/verify.py): warm runs of both in the order A B B A.
    With --reads-only: also a warm run with the digest skipped (TensorStore's reads alone)."""
    import resource

    import bridge.store as v   # its verify_checkpoint, beside a --baseline module's
    from bridge.store import open_checkpoint

    def cpu() -> float:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    path = a.paths[0]
    open_checkpoint(path)  # TensorStore initialised and the libraries loaded before either run
    base = _load_module(a.baseline, "baseline_verify") if a.baseline else None
    runs = [("cold", v), ("warm", v)]
    if base is not None:
        runs += [("warm_baseline", base), ("warm", v), ("warm", v), ("warm_baseline", base)]
    if a.reads_only:
        runs += [("warm_reads_only", v)]
    for mode, mod in runs:
        rec: dict = {"what": "verify_inprocess", "mode": mode, "path": path,
                     "code": a.baseline if mod is base else "this tree",
                     "dropped_caches": drop_caches() if mode == "cold" else False}
        io0, c0, t0 = _io(), cpu(), time.perf_counter()
        if mode == "warm_reads_only":
            res = mod.verify_checkpoint(path, show_progress=False, digests=False)
        else:
            res = mod.verify_checkpoint(path, show_progress=False)
        rec["seconds"] = time.perf_counter() - t0
        rec["cpu_seconds"] = cpu() - c0
        io1 = _io()
        rec.update(ok=res.ok, checked=res.checked, bytes=res.bytes_read, rchar=io1["rchar"] - io0["rchar"],
                   read_bytes=io1["read_bytes"] - io0["read_bytes"], GBps=res.bytes_read / rec["seconds"] / 1e9,
                   damaged=dict(list(res.damaged.items())[:5]) if mode != "warm_reads_only" else {})
        append(a.json, rec)
    return 0


def _bits_equal(x, y) -> bool:
    import jax
    import jax.numpy as jnp

    if x.shape != y.shape or x.dtype != y.dtype:
        return False
    it = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}[x.dtype.itemsize]
    return bool(jnp.array_equal(jax.lax.bitcast_convert_type(x, it), jax.lax.bitcast_convert_type(y, it)))


def _by_path(tree) -> dict:
    import jax

    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {jax.tree_util.keystr(p): v for p, v in flat}


def cmd_jax(a) -> int:
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jax
    import numpy as np
    import orbax.checkpoint as ocp
    from jax.sharding import Mesh

    from bridge.jaxside import restore
    from bridge.jaxside.abstract import Target, abstract_tree, stored_arrays

    path = a.paths[0]
    import importlib.metadata as im

    vers = {}
    for pkg in ("jax", "jaxlib", "orbax-checkpoint", "tensorstore", "optax", "numpy"):
        try:
            vers[pkg] = im.version(pkg)
        except Exception:  # noqa: BLE001
            vers[pkg] = None
    devs = jax.devices()
    append(a.json, {"what": "jax_env", "versions": vers, "devices": [str(d) for d in devs]})
    mesh = Mesh(np.array(devs[:1]).reshape(1, 1), ("fsdp", "tp"))
    stored = stored_arrays(path)
    target = Target(mesh=mesh)
    ab_full = abstract_tree(stored, target)
    ab_part = abstract_tree(stored, target, items=("params", "opt_state"))
    nbytes = {"full": sum(int(np.prod(s.shape)) * np.dtype(s.dtype).itemsize for s in jax.tree.leaves(ab_full)),
              "params_opt": sum(int(np.prod(s.shape)) * np.dtype(s.dtype).itemsize
                                for s in jax.tree.leaves(ab_part))}
    jax.block_until_ready(jax.device_put(np.ones(4, np.float32), devs[0]))  # backend up before timing

    def bridge_part():
        r = restore(path, mesh=mesh, items=("params", "opt_state"))
        return {"params": r.params, "mu": r.opt_state[0].mu, "nu": r.opt_state[0].nu}

    def orbax_part():
        import orbax.checkpoint as ocp

        restore_args = jax.tree.map(
            lambda s: ocp.ArrayRestoreArgs(sharding=s.sharding, global_shape=s.shape, dtype=s.dtype), ab_part)
        ck = ocp.Checkpointer(ocp.PyTreeCheckpointHandler())
        o = ck.restore(path, args=ocp.args.PyTreeRestore(item=ab_part, restore_args=restore_args,
                                                         partial_restore=True))
        return {"params": o["params"], "mu": o["opt_state"][0]["mu"], "nu": o["opt_state"][0]["nu"]}

    def bridge_full():
        r = restore(path, mesh=mesh)
        return {"params": r.params, "mu": r.opt_state[0].mu, "nu": r.opt_state[0].nu, "model": r.model,
                "step": r.step}

    def standard_full():
        o = ocp.StandardCheckpointer().restore(path, ab_full)
        return {"params": o["params"], "mu": o["opt_state"][0]["mu"], "nu": o["opt_state"][0]["nu"],
                "model": o["model"], "step": o["step"]}

    variants = {"bridge_restore_params_mu_nu": (bridge_part, "params_opt"),
                "orbax_pytree_partial_params_mu_nu": (orbax_part, "params_opt"),
                "bridge_restore_all_items": (bridge_full, "full"),
                "orbax_standard_checkpointer_all": (standard_full, "full")}
    import collections

    import jax.monitoring as mon

    events: collections.Counter = collections.Counter()
    mon.register_event_duration_secs_listener(lambda name, d, **kw: events.__setitem__(name, events[name] + d))
    # Untimed warm-up: one full restore brings the GPU allocator to size and initialises Orbax and
    # TensorStore, so neither side of a pair pays for that alone. Then A B B A: each library once
    # first and once second in each pair.
    t0 = time.perf_counter()
    jax.block_until_ready(jax.tree.leaves(bridge_full()))
    append(a.json, {"what": "jax_warmup", "seconds": time.perf_counter() - t0})
    order = ["bridge_restore_params_mu_nu", "orbax_pytree_partial_params_mu_nu",
             "orbax_pytree_partial_params_mu_nu", "bridge_restore_params_mu_nu",
             "bridge_restore_all_items", "orbax_standard_checkpointer_all",
             "orbax_standard_checkpointer_all", "bridge_restore_all_items"]
    results = {}
    deadline = time.time() + a.budget_s
    for i, name in enumerate(order):
        fn, kind = variants[name]
        if time.time() > deadline:
            append(a.json, {"what": "jax_restore", "name": name, "round": "cold", "skipped": "time budget"})
            continue
        rec = {"what": "jax_restore", "name": name, "round": "cold", "position": i, "bytes": nbytes[kind],
               "dropped_caches": drop_caches()}
        r0, io0 = rss(), _io()
        events.clear()
        t0 = time.perf_counter()
        try:
            out = fn()
            jax.block_until_ready(jax.tree.leaves(out))
            rec["seconds"] = time.perf_counter() - t0
            rec["GBps"] = nbytes[kind] / rec["seconds"] / 1e9
            rec["ok"] = True
            rec["leaves"] = len(jax.tree.leaves(out))
            rec["device"] = str(next(iter(jax.tree.leaves(out)[0].devices())))
        except Exception as e:  # noqa: BLE001
            rec["seconds"] = time.perf_counter() - t0
            rec["ok"] = False
            rec["error"] = f"{type(e).__name__}: {e}"[:1500]
            rec["traceback_tail"] = traceback.format_exc()[-2500:]
            out = None
        io1 = _io()
        rec["rchar"], rec["read_bytes"] = io1["rchar"] - io0["rchar"], io1["read_bytes"] - io0["read_bytes"]
        rec["orbax_read_s"] = events.get("/jax/orbax/read/total_duration_secs")
        rec["compile_s"] = sum(v for k, v in events.items() if "compil" in k)
        rec["rss_growth"] = rss() - r0
        append(a.json, rec)
        if out is not None and name not in results:
            results[name] = out
        del out
    # bit-exact agreement of what the two libraries restored
    for x, y in (("bridge_restore_params_mu_nu", "orbax_pytree_partial_params_mu_nu"),
                 ("bridge_restore_all_items", "orbax_standard_checkpointer_all"),
                 ("bridge_restore_params_mu_nu", "bridge_restore_all_items")):
        if x in results and y in results:
            try:
                bx, by = _by_path({k: results[x][k] for k in ("params", "mu", "nu")}), \
                    _by_path({k: results[y][k] for k in ("params", "mu", "nu")})
                if "model" in results[x] and "model" in results[y]:
                    bx.update(_by_path({"model": results[x]["model"]}))
                    by.update(_by_path({"model": results[y]["model"]}))
                bad = sorted(k for k in set(bx) | set(by)
                             if k not in bx or k not in by or not _bits_equal(bx[k], by[k]))
                append(a.json, {"what": "jax_agree", "a": x, "b": y, "leaves": len(bx), "ok": not bad,
                                "differ": bad[:10]})
            except Exception as e:  # noqa: BLE001
                append(a.json, {"what": "jax_agree", "a": x, "b": y, "error": f"{type(e).__name__}: {e}"})
    results.clear()
    times: dict = {}
    for ln in open(a.json):
        r = json.loads(ln)
        if r.get("what") == "jax_restore" and r.get("ok") and r.get("position") is not None:
            times.setdefault(r["name"], []).append(r["seconds"])
    for x, y in (("bridge_restore_params_mu_nu", "orbax_pytree_partial_params_mu_nu"),
                 ("bridge_restore_all_items", "orbax_standard_checkpointer_all")):
        if times.get(x) and times.get(y):
            append(a.json, {"what": "jax_ratio", "a": x, "b": y, "a_s": times[x], "b_s": times[y],
                            "ratio_of_means": (sum(times[x]) / len(times[x])) / (sum(times[y]) / len(times[y]))})
    return 0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("cmd", choices=["compare", "digests", "anchor", "jax", "verify", "rawread", "convert", "convert_ab",
                                    "layer_read", "tomeg", "tomeg_anchor", "tomeg_ab"])
    ap.add_argument("paths", nargs="+")
    ap.add_argument("--json", required=True)
    ap.add_argument("--budget-s", type=float, default=150.0)
    ap.add_argument("--baseline", default=None, help="verify: an older verify.py to A/B against (warm)")
    ap.add_argument("--reads-only", action="store_true", help="verify: also a warm run without the digest")
    ap.add_argument("--step-timeout", type=float, default=150.0, help="convert_ab / tomeg_ab: limit of each measured run")
    ap.add_argument("--tp", type=int, default=2, help="tomeg / tomeg_ab: target tensor-parallel size")
    a = ap.parse_args()
    sys.exit({"compare": cmd_compare, "digests": cmd_digests, "anchor": cmd_anchor, "jax": cmd_jax,
              "verify": cmd_verify, "rawread": cmd_rawread, "convert": cmd_convert, "convert_ab": cmd_convert_ab,
              "layer_read": cmd_layer_read, "tomeg": cmd_tomeg, "tomeg_anchor": cmd_tomeg_anchor,
              "tomeg_ab": cmd_tomeg_ab}[a.cmd](a))


if __name__ == "__main__":
    main()
