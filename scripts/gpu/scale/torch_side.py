"""Scale probe, torch side (GPU, `torchrun --nproc-per-node 1`, real megatron-core 0.19.2).

    python3 -m torch.distributed.run --standalone --nproc-per-node 1 scripts/gpu/scale/torch_side.py --dir D --json OUT

1. Build the GPT of `bigpt.py` (DDP overlap-grad-reduce, default buckets, distributed optimizer),
   train STEPS steps on random tokens.
2. Writes, each timed with host-RSS sampling: export_megatron (cold) -> D/live, dist_checkpointing.save
   dp_reshardable (cold) -> D/dp, fully_reshardable (cold, deleted), then `--warm` warm repeats of each
   (deleted after timing).
3. Loads: fresh model 1 <- load_megatron(D/live); fresh model 2 <- Megatron's own
   dist_checkpointing.load of D/dp (dp_reshardable); page cache dropped before each cold load, then a
   warm repeat of each into the same model.
4. Bit-exact comparison on the GPU of weights, masters and moments (source vs each loaded model),
   the next step on all three models (losses), and the states again after that step.
Results go to the JSON file as they are measured.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import threading
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(HERE))))  # repository root

import torch  # noqa: E402

import bigpt  # noqa: E402
import tinygpt  # noqa: E402

STEPS = 2
NEXT = 2  # steps after the loads (the 2nd also depends on the restored Adam step count)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(HERE))), "benchmarks"))
from scale_measure import drop_caches, du  # noqa: E402 (one implementation for every scale script)
PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class RssSampler:
    """Peak RSS of this process while a block runs (sampled every `dt` s)."""

    def __init__(self, dt: float = 0.02) -> None:
        self.dt, self.peak, self.stop = dt, 0, threading.Event()

    def __enter__(self):
        self.base = rss()
        self.peak = self.base
        self.t = threading.Thread(target=self._run, daemon=True)
        self.t.start()
        return self

    def _run(self) -> None:
        while not self.stop.is_set():
            self.peak = max(self.peak, rss())
            time.sleep(self.dt)

    def __exit__(self, *exc):
        self.stop.set()
        self.t.join()
        self.peak = max(self.peak, rss())
        self.after = rss()


def sync() -> None:
    torch.cuda.synchronize()
    torch.distributed.barrier()


class Recorder:
    def __init__(self, path: str) -> None:
        self.path, self.res = path, {"ops": [], "errors": []}

    def save(self) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.res, f, indent=1, default=str)
        os.replace(tmp, self.path)

    def op(self, name: str, fn, *, out_dir: str | None = None, cold_cache: bool = False, note: str = "",
           state_bytes: int = 0):
        """Run fn timed (CUDA synced) with RSS sampling; record; return fn's result (None on error)."""
        rec = {"name": name, "note": note}
        if cold_cache:
            rec["dropped_caches"] = drop_caches()
        sync()
        ret = None
        with RssSampler() as s:
            t0 = time.perf_counter()
            try:
                ret = fn()
                sync()
                rec["ok"] = True
            except BaseException as e:  # noqa: BLE001 - DCP raises BaseException subclasses
                if isinstance(e, KeyboardInterrupt):
                    raise
                rec["ok"] = False
                rec["error"] = f"{type(e).__name__}: {e}"[:2000]
                rec["traceback_tail"] = traceback.format_exc()[-3000:]
                traceback.print_exc()
            rec["seconds"] = time.perf_counter() - t0
        rec.update(rss_before=s.base, rss_peak=s.peak, rss_after=s.after, rss_growth=s.peak - s.base)
        if state_bytes:
            rec["state_bytes"] = state_bytes
            rec["GBps"] = state_bytes / rec["seconds"] / 1e9
        if out_dir and os.path.exists(out_dir):
            rec["disk_bytes"] = du(out_dir)
        print(f"[op] {name}: {rec['seconds']:.2f} s ok={rec['ok']} rss_peak {s.peak / 2**30:.2f} GiB "
              f"(+{(s.peak - s.base) / 2**30:.2f}) {note}", flush=True)
        self.res["ops"].append(rec)
        self.save()
        return ret


def adam_steps(optimizer) -> dict:
    """Distinct Adam step values: per-parameter state (torch AdamW) and per group."""
    per_param, per_group = set(), set()
    for opt in tinygpt.optimizer_list(optimizer):
        for g in opt.optimizer.param_groups:
            if "step" in g:
                per_group.add(float(g["step"]))
            for p in g["params"]:
                st = opt.optimizer.state.get(p, {})
                if "step" in st:
                    per_param.add(float(st["step"]))
    return {"per_param_state": sorted(per_param), "param_groups": sorted(per_group)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--json", required=True)
    ap.add_argument("--warm", type=int, default=1, help="warm repeats of each write")
    ap.add_argument("--skip-fully", action="store_true")
    ap.add_argument("--no-loads", action="store_true", help="stop after the writes (no load / next-step part)")
    a = ap.parse_args()

    from bridge.live.export import Exporter
    from converters.megatron.live.adapter import export_megatron, load_megatron

    R = Recorder(a.json)
    res = R.res
    os.makedirs(a.dir, exist_ok=True)
    t0 = time.perf_counter()
    tinygpt.setup_parallel(1)
    res["sizes"] = bigpt.SIZES
    res["versions"] = {"torch": torch.__version__, "cuda": torch.version.cuda,
                       "gpu": torch.cuda.get_device_name(0)}
    try:
        import importlib.metadata as im
        res["versions"]["megatron-core"] = im.version("megatron-core")
    except Exception as e:  # noqa: BLE001
        res["versions"]["megatron-core"] = repr(e)
    model0, gpt0, opt0, _ = bigpt.build()
    torch.cuda.synchronize()
    res["build_seconds"] = time.perf_counter() - t0
    n = sum(p.numel() for p in model0.parameters())
    res["params"] = n
    res["params_formula"] = bigpt.n_params()
    state_bytes = n * 14  # fp32 master + exp_avg + exp_avg_sq + bf16 weight
    res["state_bytes"] = state_bytes
    res["buckets"] = bigpt.buckets(model0)
    res["optimizer_classes"] = [f"{type(o).__name__}/{type(o.optimizer).__name__}"
                                for o in tinygpt.optimizer_list(opt0)]
    print(f"params {n} ({n / 1e9:.3f} B), state {state_bytes / 2**30:.2f} GiB, buckets "
          f"{[b['buckets'] for b in res['buckets']]}", flush=True)
    t1 = time.perf_counter()
    res["losses"] = [tinygpt.train_step(model0, opt0, s) for s in range(STEPS)]
    torch.cuda.synchronize()
    res["train_seconds"] = time.perf_counter() - t1
    res["cuda_max_allocated"] = torch.cuda.max_memory_allocated()
    R.save()
    print("losses", res["losses"], flush=True)

    D = a.dir
    live, dp, fr = (os.path.join(D, x) for x in ("live", "dp", "fr"))

    def save_fmt(path: str, fmt: str):
        t = time.perf_counter()
        sd = bigpt.build_state_dict(model0, gpt0, opt0, fmt, STEPS)
        t_sd = time.perf_counter() - t
        t_save = tinygpt.save(sd, path, fmt)
        return {"sd_build_seconds": t_sd, "save_seconds": t_save}

    exporter = Exporter()  # keeps the plan between exports (the warm ones reuse it)

    def export(path: str):
        r = export_megatron(path, model0, opt0, exporter=exporter)
        return {**{k: getattr(r, k) for k in ("bytes_written", "plan_cached", "timings", "inner_chunk_bytes")},
                "staging_peak_bytes": r.staging.peak_bytes, "staged_bytes": r.staging.staged_bytes}

    # cold: first of each kind in this process
    res["export_report_cold"] = R.op("export_cold", lambda: export(live), out_dir=live, state_bytes=state_bytes)
    res["save_dp_cold"] = R.op("save_dp_reshardable_cold", lambda: save_fmt(dp, "dp_reshardable"), out_dir=dp,
                               state_bytes=state_bytes)
    if not a.skip_fully:
        res["save_fr_cold"] = R.op("save_fully_reshardable_cold", lambda: save_fmt(fr, "fully_reshardable"),
                                   out_dir=fr, state_bytes=state_bytes)
        shutil.rmtree(fr, ignore_errors=True)
    for i in range(1, a.warm + 1):
        p = os.path.join(D, f"live_w{i}")
        res[f"export_report_warm{i}"] = R.op(f"export_warm{i}", lambda: export(p), out_dir=p,
                                             state_bytes=state_bytes)
        shutil.rmtree(p, ignore_errors=True)
        p = os.path.join(D, f"dp_w{i}")
        res[f"save_dp_warm{i}"] = R.op(f"save_dp_reshardable_warm{i}", lambda: save_fmt(p, "dp_reshardable"),
                                       out_dir=p, state_bytes=state_bytes)
        shutil.rmtree(p, ignore_errors=True)
        if not a.skip_fully:
            p = os.path.join(D, f"fr_w{i}")
            res[f"save_fr_warm{i}"] = R.op(f"save_fully_reshardable_warm{i}",
                                           lambda: save_fmt(p, "fully_reshardable"), out_dir=p,
                                           state_bytes=state_bytes)
            shutil.rmtree(p, ignore_errors=True)
    R.save()
    if a.no_loads:
        res["total_seconds"] = time.perf_counter() - t0
        res["ru_maxrss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        R.save()
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
        return

    # ---- loads into fresh models
    t = time.perf_counter()
    model1, gpt1, opt1, _ = bigpt.build()
    model2, gpt2, opt2, _ = bigpt.build()
    torch.cuda.synchronize()
    res["fresh_build_seconds"] = time.perf_counter() - t

    def ours():
        r = load_megatron(live, model1, opt1)
        return {"step": r.step}

    def megatrons():
        tinygpt.megatron_load(gpt2, opt2, dp, "dp_reshardable")
        return {"ok": True}

    res["load_ours_cold"] = R.op("load_megatron_cold", ours, cold_cache=True, state_bytes=state_bytes,
                                 note="bridge load_megatron of D/live (page cache dropped)")
    res["load_megatron_own_cold"] = R.op("megatron_own_load_dp_cold", megatrons, cold_cache=True,
                                         state_bytes=state_bytes,
                                         note="dist_checkpointing.load of D/dp + load_state_dict (page cache dropped)")
    R.op("load_megatron_warm", ours, state_bytes=state_bytes, note="same, page cache warm")
    R.op("megatron_own_load_dp_warm", megatrons, state_bytes=state_bytes, note="same, page cache warm")

    s0, s1, s2 = (bigpt.state_tensors(m, o) for m, o in ((model0, opt0), (model1, opt1), (model2, opt2)))
    res["after_load"] = {"ours_vs_source": bigpt.compare_states(s0, s1),
                         "megatron_vs_source": bigpt.compare_states(s0, s2),
                         "ours_vs_megatron": bigpt.compare_states(s1, s2)}
    R.save()
    print("after load:", {k: (v["ok"], v["tensors"], v["mismatch"][:3]) for k, v in res["after_load"].items()},
          flush=True)
    res["adam_step_after_load"] = {name: adam_steps(o) for name, o in (("source", opt0), ("ours", opt1),
                                                                        ("megatron", opt2))}
    R.save()
    print("adam per-param step after load:", res["adam_step_after_load"], flush=True)
    nl: dict = {"source": [], "ours": [], "megatron": []}
    for k in range(NEXT):
        for name, m, o in (("source", model0, opt0), ("ours", model1, opt1), ("megatron", model2, opt2)):
            try:
                nl[name].append(tinygpt.train_step(m, o, STEPS + k))
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                nl[name].append(f"error: {type(e).__name__}: {e}"[:500])
        s0, s1, s2 = (bigpt.state_tensors(m, o) for m, o in ((model0, opt0), (model1, opt1), (model2, opt2)))
        res[f"after_next_step{k + 1}"] = {"ours_vs_source": bigpt.compare_states(s0, s1),
                                          "megatron_vs_source": bigpt.compare_states(s0, s2),
                                          "ours_vs_megatron": bigpt.compare_states(s1, s2)}
        del s0, s1, s2
        print(f"after next step {k + 1}:", {kk: (v["ok"], v["tensors"], v["mismatch"][:2])
                                            for kk, v in res[f"after_next_step{k + 1}"].items()}, flush=True)
    res["next_losses"] = nl
    print("next losses:", nl, flush=True)
    res["ru_maxrss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    res["cuda_max_allocated_end"] = torch.cuda.max_memory_allocated()
    res["total_seconds"] = time.perf_counter() - t0
    R.save()
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
