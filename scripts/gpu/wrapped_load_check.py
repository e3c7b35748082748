"""`to-megatron --key-convention wrapped` output loads into a DDP-wrapped model as library users load
(megatron-core 0.19.2's `dist_checkpointing.load` of `DDP(Float16Module(GPTModel)).sharded_state_dict()`,
keys `module.decoder...`): every weight, master and moment equal to the logical checkpoint bit for bit.
Under torch.distributed.run, one process (scripts/gpu/run_handoffs.sh runs it; `--cpu` for dry runs):

    python3 -m torch.distributed.run --standalone --nproc-per-node 1 scripts/gpu/wrapped_load_check.py \\
        --ckpt RUN/iter_0000003 --logical LOGICAL --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from megatron_resume import RESULTS, check, compare_state, expected_tensors  # noqa: E402  (sets sys.path too)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True, help="the iteration directory to-megatron wrote")
    ap.add_argument("--logical", required=True)
    ap.add_argument("--json", required=True)
    ap.add_argument("--cpu", action="store_true")
    a = ap.parse_args()
    if a.cpu:
        sys.path.insert(0, os.path.join(HERE, "scale", "cpu"))
        import cpu_patch  # noqa: F401
    import tinygpt

    res: dict = {"ckpt": a.ckpt}
    try:
        tinygpt.setup_parallel(1)
        model, gpt, optimizer, _ = tinygpt.build({"tp": 1})
        keys = {sh.key for sh in model.sharded_state_dict().values() if hasattr(sh, "key")}
        check("wrapped model", bool(keys) and all(k.startswith("module.") for k in keys),
              f"the DDP-wrapped model's {len(keys)} keys all start with module.")
        expected = expected_tensors(gpt, a.logical, tinygpt.SIZES["num_query_groups"])
        import torch
        from megatron.core import dist_checkpointing
        from megatron.core.optimizer import distrib_optimizer

        if not distrib_optimizer.HAVE_APEX_OR_TE:  # as tinygpt.megatron_load explains
            for opt in tinygpt.optimizer_list(optimizer):
                opt.init_state_fn(opt.optimizer, opt.config)
                for st in opt.optimizer.state.values():
                    st.setdefault("step", torch.tensor(0.0))
        md = tinygpt.sharded_metadata("dp_reshardable")
        sd = {"model": model.sharded_state_dict(metadata=md)}  # the wrapped model's: keys module.decoder...
        sd["optimizer"] = optimizer.sharded_state_dict(sd, is_loading=True, metadata=md)
        loaded = dist_checkpointing.load(sd, a.ckpt)
        # the loaded dict is keyed like the module tree (module.<name>); the bare GPTModel takes <name>
        gpt.load_state_dict({k.removeprefix("module."): v for k, v in loaded["model"].items()})
        optimizer.load_state_dict(loaded["optimizer"])
        n, bad, msgs = compare_state(model, gpt, optimizer, expected, tinygpt)
        check("state", n > 0 and bad == 0, f"{n - bad}/{n} weight/master/exp_avg/exp_avg_sq tensors equal the logical "
                                           f"checkpoint bit for bit" + (f"; {msgs}" if msgs else ""))
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        check("ran", False, f"{type(e).__name__}: {e}"[:800])
    res["checks"] = RESULTS
    res["ok"] = bool(RESULTS) and all(r["ok"] for r in RESULTS)
    with open(a.json, "w") as f:
        json.dump(res, f, indent=1, default=str)
    print(("ALL PASS" if res["ok"] else "SOME FAILED") + f" ({len(RESULTS)} checks)", flush=True)
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
