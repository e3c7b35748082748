"""Training steps while an asynchronous export writes: writer process vs writer thread, one run.

    python benchmarks/bench_async_gil.py [--mib 256] [--reps 2] [--json OUT]

One gloo rank holds the state of a GPT-like run (`bench_live_export.build_state`, bf16 weights and
fp32 masters / moments) and runs a stand-in training loop whose steps are what Megatron's are
for the Python interpreter: many small torch ops (a deep narrow MLP, forward + backward + SGD),
so a step needs the GIL hundreds of times. Interleaved P T T P per rep:
  P  `export_async`, then steps until it committed: the writes in the exporter's writer process
     (the default);
  T  the same with the writes on a thread of this process (the writer-class seam selects it:
     the asynchronous export before the writer process).
Reported: mean step time without an export (taken between the exports: steps per second), the
mean step while each kind writes and its ratio to that anchor (target <= 1.05 on an idle machine with cores to
spare for the writer), the call's blocked time and the background time. On a 2-core machine the
writer process also competes with the loop for cores: the ratio then includes that, not only the GIL.
The last line, `SUMMARY {json}`, is the machine-readable result.
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

sys.path.insert(0, os.path.abspath(os.path.dirname(__file__)))
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from bench_live_export import build_state, hidden_for  # noqa: E402


def make_loop(wait_s: float, depth: int = 24, width: int = 64):
    """A stand-in training step: many small ops, each taking the GIL, then `wait_s` with the GIL
    released, as a GPU step waits for the device at its end (`loss.item()`); returns a step function.
    Each release is where a thread holding the GIL makes the loop wait (up to the 5 ms switch interval)."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(width, width) for _ in range(depth)]
    params = [p for m in layers for p in m.parameters()]
    x = torch.randn(8, width)

    def step() -> None:
        h = x
        for m in layers:
            h = torch.relu(m(h))
        loss = h.square().mean()
        for p in params:
            p.grad = None
        loss.backward()
        with torch.no_grad():
            for p in params:
                p.add_(p.grad, alpha=-1e-3)
        loss.item()
        time.sleep(wait_s)   # the device's part of the step: the GIL is free meanwhile

    return step


def steps_for(step, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        step()
        out.append(time.perf_counter() - t)
    return out


def run(args: argparse.Namespace) -> dict:
    from bridge import _testing
    from bridge.layout import ParallelLayout
    from bridge.live.api import AdamConfig, LiveRun
    from bridge.live.export import Exporter, ExportOptions
    from bridge.store.writer import CheckpointWriter

    torch.set_num_threads(1)
    work = tempfile.mkdtemp(prefix="bench_async_gil_", dir=args.dir)
    dist.init_process_group("gloo", init_method=f"file://{work}/pg", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=600))
    layout = ParallelLayout(tp=1, gtp=1, dp=1)
    params = build_state(layout, 0, hidden_for(args.mib, args.layers), args.layers, 0, "cpu")
    live = LiveRun(layout, 0, 7, AdamConfig(lr=1e-3))
    exporter = Exporter()
    opts = ExportOptions()
    step = make_loop(args.wait_ms / 1e3)
    steps_for(step, 20)  # warm-up

    def export(kind: str, i: int) -> dict:
        path = os.path.join(work, f"{kind}{i}")
        t = time.perf_counter()
        if kind == "T":
            with _testing.seams(writer_class=CheckpointWriter):
                h = exporter.export_async(path, live, params, opts)
        else:
            h = exporter.export_async(path, live, params, opts)
        t_ret = time.perf_counter()
        during = []
        while not h.done():
            during += steps_for(step, 1)
        h.wait()
        shutil.rmtree(path)
        return {"kind": kind, "blocked_s": t_ret - t, "background_s": h.finished_at - t_ret, "steps": during}

    export("P", -1)  # warm: slots allocated, the writer process started
    export("T", -1)
    runs, plain = [], []
    for rep in range(args.reps):
        for kind in ("P", "T", "T", "P"):
            plain += steps_for(step, args.plain)
            runs.append(export(kind, rep))
    dist.destroy_process_group()
    shutil.rmtree(work, ignore_errors=True)
    anchor = statistics.fmean(plain)   # the mean: steps per second, what the training pays
    out = {"mib": args.mib, "plain_step_s": anchor, "writer_pid_differs": exporter.writer.pid != os.getpid()}
    for kind, name in (("P", "process"), ("T", "thread")):
        rs = [r for r in runs if r["kind"] == kind]
        during = [s for r in rs for s in r["steps"]]
        out[name] = {"step_s": statistics.fmean(during) if during else None,
                     "step_ratio": statistics.fmean(during) / anchor if during else None,
                     "steps_during": len(during),
                     "blocked_s": statistics.median(r["blocked_s"] for r in rs),
                     "background_s": statistics.median(r["background_s"] for r in rs)}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=float, default=256, help="state size (MiB, about)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--plain", type=int, default=30, help="steps without an export before each export")
    ap.add_argument("--wait-ms", type=float, default=2.0, help="the device's part of a step (GIL released)")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    res = run(args)
    for name in ("process", "thread"):
        r = res[name]
        print(f"{name:8s} step while writing {r['step_s'] * 1e3:7.2f} ms = {r['step_ratio']:.2f}x the "
              f"{res['plain_step_s'] * 1e3:.2f} ms without ({r['steps_during']} steps); blocked {r['blocked_s']:.3f} s, "
              f"background {r['background_s']:.2f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    print("SUMMARY " + json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
