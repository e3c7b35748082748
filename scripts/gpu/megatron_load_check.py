"""Real Megatron-Core 0.19.2 loads `gtp-bridge to-megatron` output at a new layout and continues identically.

GPU machine, under torch.distributed.run (world = the *target* layout's GPUs), from the repo root,
after `gtp-bridge convert` of a run's save and `gtp-bridge to-megatron` at the target layout (the
driver `scripts/gpu/run_gtp.sh` does all of it, TransformerEngine installed):

    python3 -m torch.distributed.run --standalone --nproc-per-node 2 scripts/gpu/megatron_load_check.py \\
        --source /tmp/mrt/tp2 --tp 1 --format fully_reshardable --megatron-ckpt /tmp/lc/dp2_fully_reshardable

Every rank builds the tiny GPT (tests/fixtures/megatron/tinygpt.py) at the target layout with a fresh
distributed optimizer and loads the checkpoint as Megatron-LM's training loop does
(`tinygpt.megatron_load`). Checks, each printed as one PASS/FAIL line on rank 0 as it is made:
 - load:       dist_checkpointing.load and the model / optimizer load_state_dict raised nothing;
 - iteration:  common_state carries the source step;
 - masters:    every rank's fp32 masters equal its bf16 weights rounded (bf16(master) == weight);
 - same as Megatron's own load (GTP=1 targets): weights, masters and moments equal those of a second
   fresh run filled by Megatron's own load of the source's `fully_reshardable` save;
 - next loss:  training steps 3 and 4 reproduce the source run's recorded `next_losses` to --rtol,
   and (GTP=1) equal the losses of the run Megatron loaded itself.
Exit code 0 when every check passes, 1 otherwise.

Pick a source run whose replicas agree (dp2, gtp2_local, moe_ep2 — TP runs of 0.19.2 initialise
position embeddings per TP rank, so a TP source has no single logical state to continue elsewhere).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
FIXTURES = os.path.join(ROOT, "tests", "fixtures", "megatron")
sys.path.insert(0, ROOT)
sys.path.insert(0, FIXTURES)


def record(results: list, rank: int, item: tuple) -> None:
    """Keep a (name, ok, message) check and print it at once on rank 0 (a later crash loses nothing)."""
    results.append(item)
    if rank == 0:
        name, ok, msg = item
        print(f"{'PASS' if ok else 'FAIL'} {name}: {msg}", flush=True)


def log(rank: int, msg: str) -> None:
    print(f"[rank {rank}] {msg}", flush=True)


def state_differences(opt_a, opt_b) -> int:
    """Elements of fp32 masters / exp_avg / exp_avg_sq that differ between two same-layout optimizers."""
    import tinygpt

    bad = 0
    for oa, ob in zip(tinygpt.optimizer_list(opt_a), tinygpt.optimizer_list(opt_b)):
        for pa, pb in zip(oa.model_param_gbuf_map, ob.model_param_gbuf_map):
            sa, sb = oa._get_main_param_and_optimizer_states(pa), ob._get_main_param_and_optimizer_states(pb)
            for k in ("param", "exp_avg", "exp_avg_sq"):
                bad += int((sa[k].view(-1).float() != sb[k].view(-1).float()).sum().item())
    return all_sum(bad)


def weight_differences(gpt_a, gpt_b) -> int:
    bad = sum(int((x.detach() != y.detach()).sum().item()) for x, y in zip(gpt_a.parameters(), gpt_b.parameters()))
    return all_sum(bad)


def all_sum(n: int) -> int:
    import torch
    import torch.distributed as dist

    t = torch.tensor([n], device="cuda")
    dist.all_reduce(t)
    return int(t.item())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fixture", default="dp2", help="source fixture run (tests/fixtures/megatron/<run>)")
    ap.add_argument("--source", default=None,
                    help="a Megatron run directory with dp_reshardable/, fully_reshardable/ and run.json or "
                         "result.json (default: the fixture's)")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--gtp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--format", default="fully_reshardable", choices=["fully_reshardable", "dp_reshardable"])
    ap.add_argument("--bucket-size", type=int, default=None, help="target DDP bucket size (dp_reshardable)")
    ap.add_argument("--megatron-ckpt", required=True, help="the `gtp-bridge to-megatron` output to load")
    ap.add_argument("--rtol", type=float, default=2e-3, help="relative tolerance on the next-step losses")
    ap.add_argument("--hang-report", type=float, default=75.0,
                    help="print every thread's stack after this many seconds (diagnoses a hang)")
    a = ap.parse_args()
    import faulthandler

    faulthandler.dump_traceback_later(a.hang_report, exit=False)

    import torch
    import torch.distributed as dist

    import tinygpt

    a.source = a.source or os.path.join(FIXTURES, a.fixture)
    rec = next(os.path.join(a.source, f) for f in ("run.json", "result.json") if os.path.exists(os.path.join(a.source, f)))
    src_run = json.load(open(rec))
    src_layout = src_run.get("layout") if isinstance(src_run.get("layout"), dict) else {}
    src_steps = src_run.get("steps", src_run.get("step", 3))
    run = dict(tp=a.tp, gtp=a.gtp, ep=a.ep, moe=bool(src_layout.get("moe")), te=bool(src_layout.get("te")),
               overlap=a.format == "dp_reshardable" and a.bucket_size is not None, bucket_size=a.bucket_size)
    tinygpt.setup_parallel(a.tp, a.ep, a.gtp)
    rank, world = dist.get_rank(), dist.get_world_size()
    results: list[tuple[str, bool, str]] = []

    ckpt = a.megatron_ckpt
    log(rank, f"checkpoint {ckpt}; building the model")
    model, gpt, optimizer, _config = tinygpt.build(run)
    try:
        log(rank, "dist_checkpointing.load")
        loaded = tinygpt.megatron_load(gpt, optimizer, ckpt, a.format)
        record(results, rank, ("load", True, f"{ckpt} at TP={a.tp} GTP={a.gtp} EP={a.ep} world {world}"))
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        record(results, rank, ("load", False, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"))
        loaded = None
    log(rank, "loaded")

    if loaded is not None:
        it = loaded.get("iteration")
        record(results, rank, ("iteration", it == src_steps, f"iteration {it}"))
        bad = 0
        for opt in tinygpt.optimizer_list(optimizer):
            for p in opt.model_param_gbuf_map:
                f0, f1 = opt._get_model_param_range_map(p)["param"].start, opt._get_model_param_range_map(p)["param"].end
                master = opt._get_main_param_and_optimizer_states(p)["param"]
                live = p.detach().view(-1)[f0:f1]
                bad += int((master.to(live.dtype) != live).sum().item())
        t = torch.tensor([bad], device="cuda")
        dist.all_reduce(t)
        record(results, rank, ("masters", int(t.item()) == 0, f"{int(t.item())} elements where bf16(master) != weight"))
        # Baseline: Megatron's own load of the source run's fully_reshardable save at this layout.
        own_dir = os.path.join(a.source, "fully_reshardable")
        own = None
        if a.gtp == 1 and os.path.isdir(own_dir):
            log(rank, "Megatron's own load of the source's fully_reshardable save")
            model_b, gpt_b, optimizer_b, _ = tinygpt.build(run)
            tinygpt.megatron_load(gpt_b, optimizer_b, own_dir, "fully_reshardable")
            diff = state_differences(optimizer, optimizer_b) + weight_differences(gpt, gpt_b)
            record(results, rank, ("same as Megatron's own load", diff == 0,
                            f"{diff} elements of weights / masters / moments differ from loading {own_dir}"))
            own = [tinygpt.train_step(model_b, optimizer_b, s) for s in (3, 4)]
        want = src_run.get("next_losses", [])
        got = [tinygpt.train_step(model, optimizer, s) for s in (3, 4)]
        ok = len(want) == 2 and all(abs(g - w) <= a.rtol * abs(w) for g, w in zip(got, want))
        record(results, rank, ("next loss", ok, f"steps 3, 4: got {got}, source run {want} (rtol {a.rtol})"))
        if own is not None:
            record(results, rank, ("next loss == own load", got == own, f"steps 3, 4: ours {got}, Megatron's own load {own}"))

    if rank == 0:
        print("PASS all" if all(ok for _, ok, _ in results) else "FAIL some checks", flush=True)
    dist.barrier()
    return 0 if all(ok for _, ok, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
