"""Megatron-LM's own `--load` resumes from `gtp-bridge to-megatron` output (issue 18), real megatron-core 0.19.2.

One GPU, under torch.distributed.run, repository root, after (scripts/gpu/run_resume.sh does it all):

    gtp-bridge convert tests/fixtures/megatron/tp2/dp_reshardable LOGICAL        # a TP=2 run's save
    gtp-bridge to-megatron --tp 1 --format dp_reshardable LOGICAL RUN \\
        --megatron-args scripts/gpu/handoff_megatron_args.txt                    # RUN/iter_<step, 7 digits> + tracker
    python3 -m torch.distributed.run --standalone --nproc-per-node 1 scripts/gpu/megatron_resume.py \\
        --run-dir RUN --logical LOGICAL --json OUT.json

Builds the tiny GPT of tests/fixtures/megatron/tinygpt.py at TP=1 (a new layout for the TP=2 source),
sets Megatron-LM's global args from its own argument parser (`megatron.training.arguments.parse_args`
with `--load RUN --ckpt-format torch_dist`, the model's sizes and the scheduler arguments of
scripts/gpu/handoff_megatron_args.txt), builds the scheduler as `pretrain()` does
(`get_optimizer_param_scheduler`), and calls Megatron-LM's
`megatron.training.checkpointing.load_checkpoint([model], optimizer, scheduler)` exactly as
`pretrain()` does on resume. Checks, each printed as PASS/FAIL as it is made:
 - control:    the same call on an empty directory returns iteration 0 (what a missing tracker gives:
               training from scratch), so the next check can fail;
 - control state: before the load, the fresh model's state differs from the checkpoint's;
 - iteration:  the returned iteration equals the logical checkpoint's `step`;
 - state:      every parameter's bf16 weight, fp32 master, exp_avg and exp_avg_sq in the loaded model /
               distributed optimizer equal the logical checkpoint's arrays bit for bit (fused qkv and
               fc1 rebuilt from their logical sections here, independently of the bridge);
 - flags:      Megatron-LM's defaults (no --no-load-optim, --finetune, --use-checkpoint-opt_param-scheduler,
               --override-opt_param-scheduler): the optimizer and the scheduler are loaded, and the scheduler
               asserts every recorded value equals the one it built from the arguments;
 - scheduler:  num_steps = step x global batch size (samples) and every param group at --lr after the load;
 - next loss (--source-run run.json): the first loss after the load equals the source run's next_losses[0];
 - next step:  one more training step runs: a finite loss, the weights updated. Recorded, not checked:
               the Adam step counts. Without TransformerEngine / Apex (torch Adam), 0.19.2's dp_reshardable
               load sets the param groups' `step` but leaves torch Adam's per-parameter `step` at the value
               `init_state_fn` gave it (one tensor shared by all parameters), whatever the checkpoint.
`--cpu` runs it on the CPU with CUDA patched out (scripts/gpu/scale/cpu/cpu_patch.py), for dry runs.
Exit code 0 when every check passes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests", "fixtures", "megatron"))

RESULTS: list[dict] = []


def check(name: str, ok: bool, msg: str) -> bool:
    RESULTS.append({"check": name, "ok": bool(ok), "message": msg})
    print(f"{'PASS' if ok else 'FAIL'} {name}: {msg}", flush=True)
    return ok


def megatron_args(run_dir: str, tinygpt) -> argparse.Namespace:
    """Megatron-LM's args for the tiny GPT, from Megatron-LM's own parser (its defaults for everything
    else), plus what `validate_args` / the tokenizer would have set."""
    import torch
    from megatron.training.arguments import parse_args

    s = tinygpt.SIZES
    argv = ["megatron_resume", "--load", run_dir, "--ckpt-format", "torch_dist",
            "--num-layers", str(s["num_layers"]), "--hidden-size", str(s["hidden_size"]),
            "--ffn-hidden-size", str(s["ffn_hidden_size"]), "--num-attention-heads", str(s["num_attention_heads"]),
            "--group-query-attention", "--num-query-groups", str(s["num_query_groups"]),
            "--kv-channels", str(s["kv_channels"]), "--swiglu", "--seq-length", str(s["seq_length"]),
            "--max-position-embeddings", str(s["seq_length"]), "--micro-batch-size", str(s["global_batch"]),
            "--global-batch-size", str(s["global_batch"]), "--lr", str(tinygpt.LR), "--bf16",
            # the scheduler: Megatron-LM builds it from these (get_optimizer_param_scheduler) and, with its
            # defaults, asserts the checkpoint's scheduler state equals what it built
            "--train-iters", "100", "--min-lr", str(tinygpt.LR), "--lr-decay-style", "constant",
            "--weight-decay", str(tinygpt.WEIGHT_DECAY),
            "--use-distributed-optimizer", "--tensor-model-parallel-size", "1"]
    saved = sys.argv
    sys.argv = argv
    try:
        args = parse_args()
    finally:
        sys.argv = saved
    args.world_size = 1
    args.data_parallel_size = 1
    args.rank = 0
    args.padded_vocab_size = s["vocab_size"]
    args.params_dtype = torch.bfloat16
    args.use_dist_ckpt = True
    if args.weight_decay_incr_style == "constant":  # as validate_args does
        args.start_weight_decay = args.end_weight_decay = args.weight_decay
    return args


def fused(logical: dict, key: str, groups: int):
    """Megatron's stored tensor of a fused parameter from its logical sections (numpy).

    qkv: per query group g, [query rows of g; key rows of g; value rows of g]; fc1: [gate; up]."""
    import numpy as np

    if "linear_qkv" in key:
        q, k, v = logical["query"], logical["key"], logical["value"]
        rest = q.shape[1:]
        parts = [x.reshape((groups, x.shape[0] // groups) + rest) for x in (q, k, v)]
        return np.concatenate(parts, axis=1).reshape((-1,) + rest)
    return np.concatenate([logical["gate"], logical["up"]], axis=0)


def expected_tensors(gpt, logical_dir: str, groups: int) -> dict:
    """param tensor id -> {role: expected numpy array} from the logical checkpoint, located through the
    model's own sharded_state_dict (checkpoint key, layer offset), read with the bridge's TensorStore reader."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from bridge.store import open_checkpoint

    ck = open_checkpoint(logical_dir)
    stored = {".".join(p) for p in ck.paths()}

    def read(name: str):
        return ck.read(name)

    def stored_name(role: str, key: str) -> str:
        return ".".join({"model": ["model"], "param": ["params"], "exp_avg": ["opt_state", "0", "mu"],
                         "exp_avg_sq": ["opt_state", "0", "nu"]}[role] + key.split("."))

    cache: dict = {}

    def array(role: str, key: str, layer):
        base = stored_name(role, key)
        if (base, layer) not in cache:
            secs = {}
            for sec in ("query", "key", "value", "gate", "up"):
                if f"{base}.{sec}" in stored:
                    secs[sec] = read(f"{base}.{sec}")
            full = fused({k: (v[layer] if layer is not None else v) for k, v in secs.items()}, key, groups) \
                if secs else (read(base)[layer] if layer is not None else read(base))
            cache[(base, layer)] = full
        return cache[(base, layer)]

    out: dict = {}
    sd = gpt.sharded_state_dict()
    for sh in sd.values():
        if not isinstance(sh, ShardedTensor) or sh.key.endswith("_extra_state"):
            continue
        layer = sh.global_offset[0] if sh.prepend_axis_num else None
        out[id(sh.data)] = {"key": sh.key, "layer": layer,
                            **{r: array(r, sh.key, layer) for r in ("model", "param", "exp_avg", "exp_avg_sq")}}
    return out


def bits(t):
    """A torch tensor's raw bits as a numpy array (bf16 / fp32)."""
    import numpy as np
    import torch

    t = t.detach().float().cpu() if t.dtype not in (torch.bfloat16, torch.float32) else t.detach().cpu()
    return t.contiguous().view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32).numpy().astype(np.int64)


def np_bits(a):
    import ml_dtypes
    import numpy as np

    return (a.view(np.int16) if a.dtype == ml_dtypes.bfloat16 else a.astype(np.float32).view(np.int32)).astype(np.int64)


def compare_state(model, gpt, optimizer, expected: dict, tinygpt) -> tuple[int, int, list[str]]:
    """(tensors compared, tensors differing, first differences) over weights, masters and moments."""
    by_param = {id(p): p for p in gpt.parameters()}
    n, bad, msgs = 0, 0, []
    opt_states = {}
    for opt in tinygpt.optimizer_list(optimizer):
        for p in opt.model_param_gbuf_map:
            opt_states[id(p)] = opt._get_main_param_and_optimizer_states(p)
    for pid, exp in expected.items():
        p = by_param.get(pid)
        if p is None:
            msgs.append(f"{exp['key']}: no parameter behind the sharded tensor")
            bad += 1
            continue
        got = {"model": p}
        st = opt_states.get(pid)
        if st is None:
            msgs.append(f"{exp['key']}[{exp['layer']}]: no optimizer state")
            bad += 1
            continue
        got.update(param=st["param"], exp_avg=st["exp_avg"], exp_avg_sq=st["exp_avg_sq"])
        for role, t in got.items():
            n += 1
            want = np_bits(exp[role]).reshape(-1)
            have = bits(t).reshape(-1)
            if want.shape != have.shape or (want != have).any():
                bad += 1
                if len(msgs) < 10:
                    diff = int((want != have).sum()) if want.shape == have.shape else f"shape {have.shape} vs {want.shape}"
                    msgs.append(f"{exp['key']}[{exp['layer']}].{role}: {diff} elements differ")
    return n, bad, msgs


def adam_steps(optimizer, tinygpt) -> list[float]:
    out = set()
    for opt in tinygpt.optimizer_list(optimizer):
        for g in opt.optimizer.param_groups:
            for p in g["params"]:
                s = opt.optimizer.state.get(p, {}).get("step")
                if s is not None:
                    out.add(float(s))
    return sorted(out)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", required=True, help="to-megatron's run directory (holds the tracker)")
    ap.add_argument("--logical", required=True, help="the logical checkpoint to-megatron read")
    ap.add_argument("--json", required=True)
    ap.add_argument("--cpu", action="store_true", help="dry run on the CPU (CUDA patched out)")
    ap.add_argument("--source-run", help="the source fixture's run.json: the next loss must equal its next_losses[0]")
    a = ap.parse_args()
    if a.cpu:
        sys.path.insert(0, os.path.join(HERE, "scale", "cpu"))
        import cpu_patch  # noqa: F401
    import torch

    import tinygpt
    from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator
    from megatron.core.optimizer import distrib_optimizer
    from megatron.training import checkpointing, global_vars, training

    res: dict = {"run": a.run_dir, "logical": a.logical}
    try:
        tinygpt.setup_parallel(1)
        model, gpt, optimizer, _ = tinygpt.build({"tp": 1})
        if not distrib_optimizer.HAVE_APEX_OR_TE:
            # As tinygpt.megatron_load explains: 0.19.2's DistributedOptimizer.state_dict() needs an Adam
            # `step` that a fresh torch Adam does not have yet; Megatron's own init_state_fn gives it one.
            for opt in tinygpt.optimizer_list(optimizer):
                opt.init_state_fn(opt.optimizer, opt.config)
                for st in opt.optimizer.state.values():
                    st.setdefault("step", torch.tensor(0.0))
        args = megatron_args(a.run_dir, tinygpt)
        global_vars.set_args(args)
        check("flags", not args.no_load_optim and not args.finetune and not args.use_checkpoint_opt_param_scheduler
              and not args.override_opt_param_scheduler,
              f"Megatron-LM's defaults: no_load_optim={args.no_load_optim} finetune={args.finetune} "
              f"use_checkpoint_opt_param_scheduler={args.use_checkpoint_opt_param_scheduler} "
              f"override_opt_param_scheduler={args.override_opt_param_scheduler}")
        # The scheduler pretrain() builds from the args (lr, min_lr, decay style, train_iters x global batch)
        scheduler = training.get_optimizer_param_scheduler(optimizer)
        optimizer.param_scheduler = scheduler  # tinygpt.train_step steps it
        init_num_microbatches_calculator(0, None, args.global_batch_size, args.micro_batch_size, 1)
        with open(os.path.join(a.run_dir, "latest_checkpointed_iteration.txt")) as f:
            res["tracker"] = f.read()
        import numpy as np

        from bridge.store import open_checkpoint

        step = int(open_checkpoint(a.logical).read("step"))
        res["logical_step"] = step
        # control: Megatron-LM on a directory without a tracker starts from scratch (iteration 0)
        with tempfile.TemporaryDirectory() as empty:
            args.load = empty
            args.exit_on_missing_checkpoint = False
            it0, _ = checkpointing.load_checkpoint([model], optimizer, scheduler)
            check("control", it0 == 0, f"load_checkpoint on an empty directory returns iteration {it0} (from scratch)")
        args.load = a.run_dir
        expected = expected_tensors(gpt, a.logical, tinygpt.SIZES["num_query_groups"])
        n0, bad0, _ = compare_state(model, gpt, optimizer, expected, tinygpt)
        check("control state", bad0 > 0, f"before the load {bad0}/{n0} tensors differ from the checkpoint "
                                         f"(the state comparison can fail)")
        man = open_checkpoint(a.logical).manifest
        res["scheduler_recorded"] = bool(man.megatron and man.megatron.scheduler)
        # as pretrain() does: its scheduler passed, the optimizer loaded (0.19.2 then needs
        # `opt_param_scheduler` in the checkpoint: KeyError without)
        it, _ = checkpointing.load_checkpoint([model], optimizer, scheduler)
        res["iteration"] = it
        check("iteration", it == step, f"load_checkpoint(--load {a.run_dir}) returned iteration {it}; the checkpoint's step is {step}")
        n, bad, msgs = compare_state(model, gpt, optimizer, expected, tinygpt)
        check("state", n > 0 and bad == 0, f"{n - bad}/{n} weight/master/exp_avg/exp_avg_sq tensors equal the logical "
                                           f"checkpoint bit for bit" + (f"; {msgs}" if msgs else ""))
        res["scheduler_num_steps"] = scheduler.num_steps
        want = step * args.global_batch_size  # samples, as Megatron counts them (unbroken runs here)
        lrs = sorted({float(g["lr"]) for o in tinygpt.optimizer_list(optimizer) for g in o.optimizer.param_groups})
        res["lrs_after_load"] = lrs
        check("scheduler", scheduler.num_steps == want and lrs == [float(args.lr)],
              f"scheduler num_steps {scheduler.num_steps} (want {step} x {args.global_batch_size} = {want} samples); "
              f"param-group lrs {lrs} (want [{args.lr}])")
        res["adam_steps_after_load"] = adam_steps(optimizer, tinygpt)
        res["param_group_steps_after_load"] = sorted({g.get("step") for o in tinygpt.optimizer_list(optimizer)
                                                      for g in o.optimizer.param_groups})
        before = [p.detach().clone() for p in gpt.parameters()]
        loss = tinygpt.train_step(model, optimizer, it)
        res["next_loss"] = loss
        moved = sum(int((b != p.detach()).any()) for b, p in zip(before, gpt.parameters()))
        res["adam_steps_after_step"] = adam_steps(optimizer, tinygpt)
        if a.source_run:
            with open(a.source_run) as f:
                src_next = json.load(f)["next_losses"]
            res["source_next_losses"] = src_next
            res["second_loss"] = tinygpt.train_step(model, optimizer, it + 1)  # recorded: torch Adam's step (above)
            check("next loss", loss == src_next[0], f"next loss {loss!r} vs the source run's {src_next[0]!r} "
                                                     f"(second: {res['second_loss']!r} vs {src_next[1]!r}, recorded)")
        check("next step", bool(np.isfinite(loss)) and moved > 0,
              f"one more step at iteration {it}: loss {loss:.6f}, {moved}/{len(before)} weights updated; param-group "
              f"step {res['param_group_steps_after_load']}, torch Adam per-parameter step {res['adam_steps_after_load']} "
              f"-> {res['adam_steps_after_step']}")
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
