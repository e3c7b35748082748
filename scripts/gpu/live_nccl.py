"""Live export over NCCL with the reference GTP trainer, reload at another layout, next-step check.

Run from the repository root on the GPU machine (one process per GPU is spawned here):

    python scripts/gpu/live_nccl.py               # 2 GPUs: TP2xGTP1 and TP1xGTP2 as sources
    python scripts/gpu/live_nccl.py --world 4     # 4 GPUs (issue #9): TP2xGTP2 -> TP1xGTP4, TP4xGTP1 + JAX
    python scripts/gpu/live_nccl.py --backend gloo   # CPU dry run of the same logic

Per scenario: the reference trainer (native FP8 weights, GTP padding) trains 3 steps at the
source layout, `export_state` writes the checkpoint (exchange over NCCL on the GPUs, device->host
through pinned buffers), the source takes one more step; every target layout reloads with
`reload_state`, takes one step. Checks (`bridge.testing.scenario.check_scenario`): plain Orbax
restore == the state the ranks held (assembled from raw dumps without `bridge.layout`),
bit-exact; each reload == that state, bit-exact; next step == the source's next step to fp32
tolerance; the held state is within fp32 tolerance of a world-size-1 run. With `--world 4` JAX
also restores the checkpoint with a different NamedSharding on the GPUs (CPU devices when JAX has
no GPU backend; the line says which) and must equal the held state bit-exactly.
Prints `PASS <scenario>` / `FAIL <scenario>: <why>` per scenario and figures; exits 1 on failure.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np  # noqa: E402

STEPS = 3
SEED = 5
ADAM = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
SCENARIOS = {
    2: [{"name": "src_tp2_gtp1", "src": {"tp": 2}, "targets": {"tp1_gtp2": {"gtp": 2, "egtp": 2}}},
        {"name": "src_tp1_gtp2", "src": {"gtp": 2, "egtp": 2}, "targets": {"tp2_gtp1": {"tp": 2}}}],
    4: [{"name": "src_tp2_gtp2", "src": {"tp": 2, "gtp": 2, "egtp": 2},
         "targets": {"tp1_gtp4": {"gtp": 4, "egtp": 4}, "tp4_gtp1": {"tp": 4}}}],
}


def config():
    from bridge.live.api import AdamConfig
    from bridge.testing.trainer import TrainerConfig

    return TrainerConfig(adam=AdamConfig(**ADAM), weights="fp8", pad_for_alignment=8, seed=SEED)


def worker(rank: int, world: int, init: str, backend: str, root: str) -> None:
    import torch
    import torch.distributed as dist

    from bridge.testing.scenario import run_scenario

    torch.set_num_threads(2)
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    try:
        for sc in SCENARIOS[world]:
            out = os.path.join(root, sc["name"])
            if rank == 0:
                os.makedirs(out, exist_ok=True)
            dist.barrier()
            t0 = time.perf_counter()
            facts = run_scenario(rank, out, os.path.join(out, "ckpt"), sc["src"], sc["targets"], config(), STEPS,
                                 device=device, backend=backend)
            facts["wall_s"] = time.perf_counter() - t0
            with open(os.path.join(out, f"facts.rank{rank}.json"), "w") as f:
                json.dump(facts, f)
            dist.barrier()
    finally:
        dist.destroy_process_group()


def world1_problems(held: dict, device) -> list[str]:
    from bridge.layout import ParallelLayout
    from bridge.testing.check import assemble_global, dump_rank
    from bridge.testing.trainer import train
    from bridge.testing.scenario import logical_from_assembled

    ref = logical_from_assembled(assemble_global([dump_rank(train(ParallelLayout(), STEPS, SEED, config(),
                                                                  device=device).trainer)]))
    bad = []
    for k, tol in (("master", 1e-5), ("exp_avg", 1e-7), ("exp_avg_sq", 1e-9)):
        for name, w in held[k].items():
            if not np.allclose(w, ref[k][name], atol=tol, rtol=1e-5):
                bad.append(f"{k}/{name} differs from the world-size-1 run by {float(np.abs(w - ref[k][name]).max()):.3g}")
    return bad


def jax_problems(dst: str, held: dict, world: int) -> tuple[list[str], str]:
    """Restore with a NamedSharding over `world` JAX devices (GPUs when available)."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import orbax.checkpoint as ocp

    from bridge.testing.scenario import abstract_tree, check_restored

    try:
        devs = jax.devices("gpu")
    except RuntimeError:
        devs = []
    where = "gpu"
    if len(devs) < world:
        devs, where = jax.devices("cpu"), "cpu"
    devs = devs[:world] if len(devs) >= world else devs[:1]
    mesh = Mesh(np.array(devs).reshape(-1), ("x",))
    n = len(devs)

    def sharding(s):
        # a layout unlike the torch one: shard the LAST dim where it divides, else replicate
        if s.ndim and s.shape[-1] % n == 0:
            return NamedSharding(mesh, P(*([None] * (s.ndim - 1) + ["x"])))
        return NamedSharding(mesh, P())

    got = ocp.StandardCheckpointer().restore(dst, abstract_tree(held, sharding))
    return check_restored(got, held, STEPS), f"{len(devs)} {where} device(s)"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, choices=sorted(SCENARIOS), default=2)
    ap.add_argument("--backend", choices=("nccl", "gloo"), default="nccl")
    ap.add_argument("--out", default=None, help="keep dumps and checkpoints here (default: temp dir, removed)")
    a = ap.parse_args(argv)
    # CPU fallback for the JAX restore: as many host devices as ranks (no effect on a GPU backend)
    os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={a.world}")
    import torch
    import torch.multiprocessing as mp

    if a.backend == "nccl" and torch.cuda.device_count() < a.world:
        print(f"FAIL setup: {a.world} GPUs needed, {torch.cuda.device_count()} visible")
        return 1
    root = a.out or tempfile.mkdtemp(prefix="live_nccl_")
    os.makedirs(root, exist_ok=True)
    init = f"file://{os.path.join(root, 'pg_init')}"
    t0 = time.perf_counter()
    try:
        mp.spawn(worker, args=(a.world, init, a.backend, root), nprocs=a.world, join=True)
    except Exception:
        print(f"FAIL spawn: {traceback.format_exc().strip().splitlines()[-1]}")
        return 1
    print(f"workers done in {time.perf_counter() - t0:.1f} s ({a.backend}, world {a.world})")
    from bridge.live.export import phase_seconds
    from bridge.testing.scenario import check_scenario

    device = torch.device("cuda", 0) if a.backend == "nccl" else torch.device("cpu")
    failed = 0
    for sc in SCENARIOS[a.world]:
        out = os.path.join(root, sc["name"])
        dst = os.path.join(out, "ckpt")
        try:
            problems, held = check_scenario(out, dst, a.world, list(sc["targets"]), STEPS)
            problems += world1_problems(held, device)
            facts = json.load(open(os.path.join(out, "facts.rank0.json")))
            ex = facts["export"]
            ph = phase_seconds(ex["timings"])
            extra = ""
            if a.world == 4:
                jp, where = jax_problems(dst, held, a.world)
                problems += [f"JAX restore: {p}" for p in jp]
                extra = f"; JAX restore on {where} with a last-dim NamedSharding: {'exact' if not jp else 'DIFFERS'}"
            line = (f"export rank0 {ex['bytes_written'] / 2**10:.1f} KiB written, sent {ex['bytes_sent']} B "
                    f"(to GTP peers {ex['sent_by_group']['gtp']} B, DP peers {ex['sent_by_group']['distopt']} B, "
                    f"others {ex['sent_by_group']['other']} B), "
                    f"plan {ph['plan']:.3f}s exchange {ph['exchange']:.3f}s write {ph['write']:.3f}s "
                    f"commit {ph['commit']:.3f}s; reloads: "
                    + ", ".join(f"{t} read {facts[t]['bytes_read']} B" for t in sc["targets"]) + extra)
            if problems:
                failed += 1
                print(f"FAIL {sc['name']}: {problems[0]} ({len(problems)} problems)")
            else:
                print(f"PASS {sc['name']}: Orbax restore exact, reload at {', '.join(sc['targets'])} exact, next step "
                      f"matches, world-1 within fp32 tolerance")
            print(f"     {line}")
        except Exception:
            failed += 1
            print(f"FAIL {sc['name']}: {traceback.format_exc().strip().splitlines()[-1]}")
    if not a.out:
        shutil.rmtree(root, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
