"""Real Megatron-Core 0.19.2 loads `gtp-bridge to-megatron` output at a new layout and continues identically.

GPU machine, under torch.distributed.run (world = the *target* layout's GPUs), from the repo root:

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/megatron_core-0.19.2-*.whl
    export PYTHONPATH=$PWD:/tmp/site CUDA_DEVICE_MAX_CONNECTIONS=1 NCCL_NVLS_ENABLE=0
    python3 -m torch.distributed.run --standalone --nproc-per-node 2 scripts/gpu/megatron_load_check.py \\
        --fixture dp2 --tp 2 --format fully_reshardable --work /tmp/loadcheck

What it does:
 1. rank 0 (unless --megatron-ckpt is given): `convert` the committed fixture
    tests/fixtures/megatron/<run>/dp_reshardable to a logical checkpoint, then `to-megatron` it at the
    target layout (TP x GTP x DP x EP of this world) and format. (Both steps need only numpy,
    tensorstore, ml_dtypes and torch; pass --megatron-ckpt DIR to use one made on a CPU machine.)
 2. every rank: build the fixture's tiny GPT (tests/fixtures/megatron/tinygpt.py) at the target layout
    with a fresh distributed optimizer, `dist_checkpointing.load` the written checkpoint exactly as
    Megatron-LM's training loop does (model + optimizer sharded state dicts, is_loading=True), load it
    into the model and the optimizer;
 3. checks, each printed as one PASS/FAIL line on rank 0:
    - load:       dist_checkpointing.load and the model / optimizer load_state_dict raised nothing;
    - iteration:  common_state carries the source step (3);
    - masters:    every rank's fp32 masters equal its bf16 weights rounded (bf16(master) == weight);
    - next loss:  training steps 3 and 4 reproduce the source run's recorded `next_losses`
                  (run.json) to --rtol (step 3 depends on the weights, step 4 also on the
                  optimizer state: masters, moments and step count).
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


def prepare(a: argparse.Namespace, world: int) -> str:
    """convert + to-megatron on rank 0; returns the torch_dist directory to load."""
    from converters.megatron_convert import ConvertOptions, convert
    from converters.megatron_write import Target, to_megatron

    os.makedirs(a.work, exist_ok=True)
    name = os.path.basename(os.path.normpath(a.source))
    logical = os.path.join(a.work, f"{name}_logical")
    out = os.path.join(a.work, f"{name}_to_tp{a.tp}_gtp{a.gtp}_ep{a.ep}_{a.format}")
    if not os.path.isdir(logical):
        convert(os.path.join(a.source, a.source_format), logical, ConvertOptions(workers=1))
    if not os.path.isdir(out):
        dp = world // (a.tp * a.gtp)
        to_megatron(logical, out, Target(tp=a.tp, gtp=a.gtp, dp=dp, ep=a.ep, fmt=a.format,
                                         bucket_size=a.bucket_size))
    return out


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
    ap.add_argument("--source-format", default="dp_reshardable", choices=["dp_reshardable", "fully_reshardable"])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--gtp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--format", default="fully_reshardable", choices=["fully_reshardable", "dp_reshardable"])
    ap.add_argument("--bucket-size", type=int, default=None, help="target DDP bucket size (dp_reshardable)")
    ap.add_argument("--work", default="/tmp/gtp_load_check")
    ap.add_argument("--megatron-ckpt", default=None, help="use this to-megatron output instead of making one")
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
    err = [None, None]
    if ckpt is None:
        if rank == 0:
            try:
                err[1] = prepare(a, world)
            except Exception as e:  # noqa: BLE001 - reported as a FAIL line
                err[0] = f"{type(e).__name__}: {e}"
        dist.broadcast_object_list(err, src=0)
        if err[0] is not None:
            if rank == 0:
                print(f"FAIL prepare: {err[0]}", flush=True)
            return 1
        ckpt = err[1]

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
