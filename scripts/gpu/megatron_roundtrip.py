"""Live export from / load into real Megatron-Core runs (GPU machine, issue #7).

Driven by `scripts/gpu/megatron_roundtrip.sh`; every mode but `compare` runs under
`torch.distributed.run` on 2 GPUs with the tiny GPT of `tests/fixtures/megatron/tinygpt.py`.

    --mode train --layout tp2|dp2 --out DIR
        train 3 steps; check that every rank's own optimizer state (fp32 masters, moments) and bf16
        shards are exactly what the live export wrote (read back box by box); save with
        dist_checkpointing in both formats (kept: DIR/<layout>/dp_reshardable for the converter);
        time one cold and REPEATS warm saves of each format and of the live export; then step 3,
        export DIR/<layout>/live_after, step 4; write DIR/<layout>/result.json.
    --mode load --layout L --src DIR/<other> --out DIR
        fresh model at layout L, `load_megatron` from DIR/<other>/live; re-export and compare with
        the source bit-exactly; step 3 and step 4 losses against the source run's; export after
        step 3 and compare with the source's live_after to fp32 tolerance; DIR/load_<L>/result.json.
    --mode compare A B [--exact]
        compare two logical checkpoints array by array (single process).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests", "fixtures", "megatron"))

# sync_replicas: TP replicas start identical (0.19.2 initialises position embeddings per TP rank,
# and a run whose replicas differ has no single logical state to reload elsewhere).
# gtp2 (TP1 x GTP2, local specs) needs TransformerEngine staged first (docs: gpu-recipes.md).
LAYOUTS = {"tp2": dict(nproc=2, tp=2, sync_replicas=True), "dp2": dict(nproc=2, sync_replicas=True),
           "gtp2": dict(nproc=2, gtp=2, sync_replicas=True)}
STEPS = 3
REPEATS = 2


def compare_checkpoints(a: str, b: str, exact: bool, rtol: float = 1e-4, atol: float = 1e-8) -> dict:
    """Array-by-array comparison of two logical checkpoints; returns a summary (mismatches listed).

    Not exact: fp32 arrays within `rtol`/`atol`, bf16 arrays within one bf16 ulp (a weight may round
    the other way when the masters differ in the last fp32 bits); `max_rel` is over fp32 arrays.
    """
    import numpy as np

    from bridge.store import open_checkpoint

    ca, cb = open_checkpoint(a), open_checkpoint(b)
    pa, pb = set(map(tuple, ca.paths())), set(map(tuple, cb.paths()))
    out = {"a": a, "b": b, "exact": exact, "only_a": sorted(".".join(p) for p in pa - pb),
           "only_b": sorted(".".join(p) for p in pb - pa), "mismatch": [], "arrays": 0, "max_abs": 0.0,
           "max_rel": 0.0}
    for p in sorted(pa & pb):
        x, y = ca.read(p), cb.read(p)
        out["arrays"] += 1
        if x.shape != y.shape or x.dtype != y.dtype:
            out["mismatch"].append(f"{'.'.join(p)}: {x.dtype}{x.shape} vs {y.dtype}{y.shape}")
            continue
        if exact:
            same = x.tobytes() == y.tobytes()
        else:
            xf, yf = x.astype(np.float64), y.astype(np.float64)
            bf16 = x.dtype.itemsize == 2
            same = bool(np.allclose(xf, yf, rtol=2.0 ** -7 if bf16 else rtol, atol=1e-6 if bf16 else atol))
            if x.size:
                out["max_abs"] = max(out["max_abs"], float(np.abs(xf - yf).max()))
                if not bf16:
                    rel = np.abs(xf - yf) / np.maximum(np.abs(yf), 1e-30)
                    out["max_rel"] = max(out["max_rel"], float(rel.max()))
        if not same:
            out["mismatch"].append(".".join(p))
    out["ok"] = not (out["mismatch"] or out["only_a"] or out["only_b"])
    return out


def check_export_against_live(path: str, params, run) -> list[str]:
    """Read back, box by box, what this rank holds; return mismatches (weights: main copies only)."""
    import numpy as np
    import torch

    from bridge.live.holdings import tree_name
    from bridge.store import open_checkpoint

    ck = open_checkpoint(path)
    bad = []

    def check(root, array, box, want):
        got = ck.read(tree_name(root, array), box)
        w = want.detach().float().cpu().numpy() if want.dtype == torch.bfloat16 else want.detach().cpu().numpy()
        g = got.astype(np.float32) if got.dtype != w.dtype else got
        if g.tobytes() != w.astype(g.dtype).tobytes():
            bad.append(f"rank {run.rank} {root}/{array} {box}")

    for lp in params:
        g = lp.geometry
        tp, gtp, t, gg = g.placement(run.layout, run.rank)
        flat = lp.weight.reshape(-1)
        for pc in g.shard_pieces(tp, gtp, t, gg, lp.index or None):
            check("model", pc.array, pc.logical, flat[pc.local_start:pc.local_start + pc.logical.size]
                  .reshape(pc.logical.shape))
        o = lp.optim
        if o is None:
            continue
        for pc in g.fragment_pieces(tp, gtp, t, gg, o.f0, o.f1, lp.index or None):
            for root, ten in o.tensors().items():
                check(root, pc.array, pc.logical, ten[pc.local_start:pc.local_start + pc.logical.size]
                      .reshape(pc.logical.shape))
    return bad


def export_grads(model, optimizer, path: str) -> None:
    """Export the live state with the fp32 masters replaced by the main grads the last Adam step
    consumed (Megatron keeps them on the shard main params after the step, already clipped)."""
    from dataclasses import replace

    from bridge.live.export import export_state
    from converters.megatron.live.adapter import local_params

    params, run = local_params(model, optimizer, for_export=True)
    out = []
    for lp in params:
        if lp.optim is not None:
            g = lp.optim.master.grad
            if g is None:
                raise RuntimeError(f"rank {run.rank}: {lp.key}: no main grad after the step")
            lp = replace(lp, optim=replace(lp.optim, master=g.detach().reshape(-1)))
        out.append(lp)
    export_state(path, run, out)


def megatron_own_load(run_cfg: dict, ckpt: str):
    """A fresh model + optimizer at this layout filled by Megatron's own `dist_checkpointing.load`."""
    import tinygpt

    model, gpt, optimizer, _ = tinygpt.build(run_cfg)
    tinygpt.megatron_load(gpt, optimizer, ckpt, "fully_reshardable")
    return model, optimizer


def step_and_record(model, optimizer, d: str, res: dict, prefix: str = "") -> None:
    """Steps 3 and 4; after step 3 export `<prefix>live_after` and `<prefix>live_grads`."""
    import tinygpt
    from converters.megatron.live.adapter import export_megatron

    res[prefix + "next_losses"] = [tinygpt.train_step(model, optimizer, STEPS)]
    res[prefix + "step3"] = dict(tinygpt.LAST_STEP)
    export_megatron(os.path.join(d, prefix + "live_after"), model, optimizer)
    export_grads(model, optimizer, os.path.join(d, prefix + "live_grads"))
    res[prefix + "next_losses"].append(tinygpt.train_step(model, optimizer, STEPS + 1))


def _sync():
    import torch

    torch.cuda.synchronize()
    torch.distributed.barrier()


def _timed(fn) -> float:
    _sync()
    t0 = time.perf_counter()
    fn()
    _sync()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", required=True, choices=["train", "load", "compare"])
    ap.add_argument("--layout", choices=sorted(LAYOUTS))
    ap.add_argument("--src")
    ap.add_argument("--out")
    ap.add_argument("paths", nargs="*")
    ap.add_argument("--exact", action="store_true")
    a = ap.parse_args()
    if a.mode == "compare":
        res = compare_checkpoints(a.paths[0], a.paths[1], a.exact)
        print(json.dumps({k: v for k, v in res.items()}, indent=None)[:4000])
        sys.exit(0 if res["ok"] else 1)

    import torch

    import tinygpt
    from bridge.live.export import Exporter
    from converters.megatron.live.adapter import export_megatron, load_megatron, local_params

    run_cfg = LAYOUTS[a.layout]
    tinygpt.setup_parallel(run_cfg.get("tp", 1), run_cfg.get("ep", 1), run_cfg.get("gtp", 1))
    rank = torch.distributed.get_rank()
    model, gpt, optimizer, _ = tinygpt.build(run_cfg)
    res: dict = {"layout": a.layout, "mode": a.mode}

    if a.mode == "train":
        d = os.path.join(a.out, a.layout)
        os.makedirs(d, exist_ok=True)
        res["losses"] = [tinygpt.train_step(model, optimizer, s) for s in range(STEPS)]
        live = os.path.join(d, "live")
        times = {"live_export": [], "dp_reshardable": [], "fully_reshardable": []}
        exporter = Exporter()  # the repeated exports reuse the plan, as a run exporting every N steps
        times["live_export"].append(_timed(lambda: export_megatron(live, model, optimizer, exporter=exporter)))
        params, lrun = local_params(model, optimizer, for_export=True)
        res["readback_mismatches"] = check_export_against_live(live, params, lrun)
        res["step"] = lrun.step
        for fmt in ("dp_reshardable", "fully_reshardable"):
            for i in range(REPEATS + 1):
                p = os.path.join(d, fmt if i == 0 else f"{fmt}_{i}")
                sd = tinygpt.build_state_dict(run_cfg, model, gpt, optimizer, fmt, STEPS)
                times[fmt].append(_timed(lambda: tinygpt.save(sd, p, fmt)))
        for i in range(1, REPEATS + 1):
            times["live_export"].append(_timed(lambda: export_megatron(os.path.join(d, f"live_{i}"), model, optimizer,
                                                                       exporter=exporter)))
        res["seconds"] = times
        warm = {k: statistics.median(v[1:]) for k, v in times.items()}
        res["warm_median_seconds"] = warm
        res["ratio_live_over_dcp"] = {f: warm["live_export"] / warm[f] for f in ("dp_reshardable", "fully_reshardable")}
        step_and_record(model, optimizer, d, res)
    else:
        src = a.src
        d = os.path.join(a.out, f"load_{a.layout}")
        os.makedirs(d, exist_ok=True)
        r = load_megatron(os.path.join(src, "live"), model, optimizer)
        res["loaded_step"] = r.step
        export_megatron(os.path.join(d, "reexport"), model, optimizer)
        if rank == 0:
            res["reexport_vs_source"] = compare_checkpoints(os.path.join(src, "live"), os.path.join(d, "reexport"),
                                                            exact=True)
        step_and_record(model, optimizer, d, res)
        # Baseline: Megatron's own load of the source's fully_reshardable save at this layout.
        # Our load must leave exactly the state Megatron's does, and the next step must agree.
        try:
            model_b, optimizer_b = megatron_own_load(run_cfg, os.path.join(src, "fully_reshardable"))
            export_megatron(os.path.join(d, "own_reexport"), model_b, optimizer_b)
            step_and_record(model_b, optimizer_b, d, res, prefix="own_")
        except (Exception, BaseException) as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            import traceback

            traceback.print_exc()
            res["own_error"] = f"{type(e).__name__}: {e}"[:500]
        if rank == 0 and "own_error" not in res:
            res["own_load_vs_ours"] = compare_checkpoints(os.path.join(d, "own_reexport"),
                                                          os.path.join(d, "reexport"), exact=True)
            res["own_after_vs_ours"] = compare_checkpoints(os.path.join(d, "own_live_after"),
                                                           os.path.join(d, "live_after"), exact=True)
            res["own_loss_diff"] = [x - y for x, y in zip(res["next_losses"], res["own_next_losses"])]
        if rank == 0:
            res["after_vs_source_after"] = compare_checkpoints(os.path.join(src, "live_after"),
                                                               os.path.join(d, "live_after"), exact=False)
            src_res = json.load(open(os.path.join(src, "result.json")))
            res["source_next_losses"] = src_res["next_losses"]
            res["loss_diff"] = [x - y for x, y in zip(res["next_losses"], src_res["next_losses"])]

    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, {k: v for k, v in res.items() if k in
                                                   ("readback_mismatches", "seconds")})
    if rank == 0:
        res["per_rank"] = gathered
        with open(os.path.join(d, "result.json"), "w") as f:
            json.dump(res, f, indent=1, default=str)
        print(json.dumps({k: v for k, v in res.items() if k != "per_rank"}, default=str)[:3000], flush=True)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
