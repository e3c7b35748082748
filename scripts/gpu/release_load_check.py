"""GPU, one rank, any megatron-core release: load a `to-megatron` output into the tiny GPT and check it.

    PYTHONPATH=/tmp/site-<v> python3 -m torch.distributed.run --standalone --nproc-per-node 1 \\
        scripts/gpu/release_load_check.py --ckpt DIR --fmt dp_reshardable --ref REF.pt --run-json RUN.json --out OUT.json

Builds `tests/fixtures/megatron/tinygpt.py`'s model and optimizer with the installed release, loads
DIR as Megatron-LM does (`tinygpt.megatron_load`), dumps the live state (`tinygpt.reference`) and
compares it, tensor by tensor, with REF (the live dump of the run the logical checkpoint came from):
every bf16 weight, every owned flat range with its fp32 master and both Adam moments. Then two more
steps, whose losses are compared with that run's `next_losses`. Writes the result to OUT.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests", "fixtures", "megatron"))

import numpy as np  # noqa: E402

if not hasattr(np, "product"):  # as make_fixtures.py: releases <= 0.16 call it
    np.product = np.prod


def compare(ref: dict, got: dict) -> list[str]:
    """Names of the tensors that differ (or are missing) between two `tinygpt.reference` dumps."""
    import torch

    bad = []
    for name, p in ref["params"].items():
        q = got["params"].get(name)
        if q is None or not torch.equal(p["live"], q["live"]):
            bad.append(f"weight {name}")
    ro = {n: r for o in ref["optimizers"] for n, r in o["params"].items()}
    go = {n: r for o in got["optimizers"] for n, r in o["params"].items()}
    for name, r in ro.items():
        g = go.get(name)
        if g is None or r["range"]["param"] != g["range"]["param"]:
            bad.append(f"range {name}")
            continue
        for k in ("param", "exp_avg", "exp_avg_sq"):
            if not torch.equal(r[k], g[k]):
                bad.append(f"{k} {name}")
    return bad


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--fmt", required=True)
    ap.add_argument("--ref", required=True)
    ap.add_argument("--run-json", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    import torch

    import make_fixtures
    import megatron.core
    import tinygpt

    tinygpt.setup_parallel()
    model, gpt, optimizer, _ = tinygpt.build({})
    res: dict = {"release": megatron.core.__version__, "ckpt": a.ckpt, "fmt": a.fmt}
    try:
        try:
            tinygpt.megatron_load(gpt, optimizer, a.ckpt, a.fmt)
        except AssertionError:
            # 0.15's dp_reshardable asserts on torch AdamW's 0-d `step` (as its save does): load what
            # FusedAdam holds, the step coming from the param groups
            if not make_fixtures.without_step_state(optimizer):
                raise
            try:
                tinygpt.megatron_load(gpt, optimizer, a.ckpt, a.fmt)
                res["without_step_state"] = True
            finally:
                make_fixtures.without_step_state(optimizer, undo=True)
        ref = torch.load(a.ref, weights_only=True)
        got = tinygpt.reference(model, optimizer)
        res["differs"] = compare(ref, got)
        res["compared"] = len(ref["params"]) + 3 * sum(len(o["params"]) for o in ref["optimizers"])
        want = json.load(open(a.run_json))["next_losses"]
        losses = [tinygpt.train_step(model, optimizer, s) for s in (3, 4)]
        res["next_losses"], res["want_next_losses"] = losses, want
        res["ok"] = not res["differs"] and losses == want
    except Exception as e:  # noqa: BLE001 - the result records why a load failed
        import traceback

        res["error"] = f"{type(e).__name__}: {e}"[:2000]
        res["traceback"] = traceback.format_exc()[-3000:]
        res["ok"] = False
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps({k: v for k, v in res.items() if k != "traceback"})[:1500], flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
