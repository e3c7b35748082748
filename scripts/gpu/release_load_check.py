"""GPU, one rank, any megatron-core release: load a checkpoint into the tiny GPT and check it.

    PYTHONPATH=/tmp/site-<v> python3 -m torch.distributed.run --standalone --nproc-per-node 1 \\
        scripts/gpu/release_load_check.py --ckpt DIR --fmt dp_reshardable --ref REF.pt --run-json RUN.json --out OUT.json

DIR is a `to-megatron` output or the release's own save (the control: whatever fails there is the
release's, not the converter's). Builds `tests/fixtures/megatron/tinygpt.py`'s model and optimizer
with the installed release and loads DIR twice, each time into a fresh model and optimizer:

- `as_is`: as Megatron-LM does (`tinygpt.megatron_load`), nothing changed;
- `fused_step`: the same load with Adam's step counter handled as FusedAdam (apex / TE, what real
  runs use; neither is on the GPU machine) holds it: one `step` in the param groups, none per
  parameter. Without apex / TE megatron-core falls back to torch AdamW, whose per-parameter 0-d
  `step` the releases mishandle: 0.15's dp_reshardable asserts it is a flat range, the
  fully_reshardable load drops it from the source tensors and then copies every destination key
  (KeyError 'step'), and every release's `load_state_dict` gives all parameters ONE shared step
  tensor, which torch AdamW then increments once per parameter at the next step (the bias
  correction of every later step is wrong: the second loss after a load differs).

Each mode dumps the live state (`tinygpt.reference`), compares it tensor by tensor with REF (the live
dump of the run the checkpoint came from: every bf16 weight, every owned flat range with its fp32
master and both Adam moments), records the Adam step counters, and runs two more steps whose losses
are compared with that run's `next_losses`. Writes both results to OUT.
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


def step_counters(optimizer) -> dict:
    """The Adam step counters: per-parameter values, how many distinct tensors hold them, groups'."""
    import tinygpt

    vals, ids, groups = [], set(), []
    for opt in tinygpt.optimizer_list(optimizer):
        for st in opt.optimizer.state.values():
            if "step" in st:
                vals.append(float(st["step"]))
                ids.add(id(st["step"]))
        groups += [g.get("step") for g in opt.optimizer.param_groups]
    return {"per_param": sorted(set(vals)), "params": len(vals), "distinct_tensors": len(ids),
            "groups": sorted({float(g) for g in groups if g is not None})}


def fused_step(optimizer) -> None:
    """Make the distributed optimizers handle `step` as under FusedAdam (see the module docstring):
    the state getter leaves it out, the setter keeps the param-group step `load_state_dict` wrote."""
    import tinygpt

    for opt in tinygpt.optimizer_list(optimizer):
        get, put = opt._get_main_param_and_optimizer_states, opt._set_main_param_and_optimizer_states

        def getter(p, _get=get):
            return {k: v for k, v in _get(p).items() if k != "step"}

        def setter(p, tensors, _put=put, _opt=opt):
            gi, go = _opt.model_param_group_index_map[p]
            st = _opt.optimizer.state[_opt.optimizer.param_groups[gi]["params"][go]]
            if "step" in st and "step" not in tensors:
                tensors = {**tensors, "step": st["step"]}
            return _put(p, tensors)

        opt._get_main_param_and_optimizer_states = getter
        opt._set_main_param_and_optimizer_states = setter


def unshare_steps(optimizer) -> None:
    """One step tensor per parameter, as torch's own Optimizer.load_state_dict leaves them."""
    import tinygpt

    for opt in tinygpt.optimizer_list(optimizer):
        for st in opt.optimizer.state.values():
            if "step" in st:
                st["step"] = st["step"].clone()


def check(a, mode: str) -> dict:
    """Load a.ckpt into a fresh model + optimizer in `mode`, compare, step twice."""
    import torch

    import tinygpt

    model, gpt, optimizer, _ = tinygpt.build({})
    res: dict = {"mode": mode}
    try:
        if mode == "fused_step":
            fused_step(optimizer)
        tinygpt.megatron_load(gpt, optimizer, a.ckpt, a.fmt)
        res["steps_after_load"] = step_counters(optimizer)
        if mode == "fused_step":
            unshare_steps(optimizer)
        ref = torch.load(a.ref, weights_only=True)
        got = tinygpt.reference(model, optimizer)
        res["differs"] = compare(ref, got)
        res["compared"] = len(ref["params"]) + 3 * sum(len(o["params"]) for o in ref["optimizers"])
        want = json.load(open(a.run_json))["next_losses"]
        losses = [tinygpt.train_step(model, optimizer, 3)]
        res["steps_after_next"] = step_counters(optimizer)
        losses.append(tinygpt.train_step(model, optimizer, 4))
        res["next_losses"], res["want_next_losses"] = losses, want
        res["ok"] = not res["differs"] and losses == want
    except Exception as e:  # noqa: BLE001 - the result records why a load failed
        import traceback

        res["error"] = f"{type(e).__name__}: {e}"[:2000]
        res["traceback"] = traceback.format_exc()[-3000:]
        res["ok"] = False
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--fmt", required=True)
    ap.add_argument("--ref", required=True)
    ap.add_argument("--run-json", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--modes", default="as_is,fused_step")
    a = ap.parse_args()
    import torch

    import megatron.core
    import tinygpt
    from megatron.core.optimizer import distrib_optimizer

    tinygpt.setup_parallel()
    res: dict = {"release": megatron.core.__version__, "ckpt": a.ckpt, "fmt": a.fmt,
                 "apex_or_te": bool(distrib_optimizer.HAVE_APEX_OR_TE)}
    res["modes"] = {m: check(a, m) for m in a.modes.split(",")}
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps({k: v for k, v in res.items() if k != "modes"}), flush=True)
    for m, r in res["modes"].items():
        print(m, json.dumps({k: v for k, v in r.items() if k != "traceback"})[:1500], flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
