"""Megatron-LM's learning-rate scheduler state built from Megatron-LM's own argument names.

A checkpoint that records no scheduler (a library-style save, a JAX save, a MaxText run) still needs
`common_state["opt_param_scheduler"]` for Megatron-LM's `--load` to restore the optimizer: without it
megatron-core 0.19.2's `load_checkpoint` raises KeyError 'opt_param_scheduler'. And with Megatron-LM's
defaults (no `--use-checkpoint-opt_param-scheduler`, no `--override-opt_param-scheduler`) the loading
run's `OptimizerParamScheduler` asserts that every recorded value equals the one it built from its
own arguments. So the state is built here exactly as Megatron-LM builds its scheduler
(`megatron/training/training.py: get_optimizer_param_scheduler`, after `arguments.validate_args`),
from the same argument names the loading run is given, with `num_steps` in samples as Megatron counts
them (`iteration * global_batch_size` for an unbroken run without batch-size ramp-up).
"""

from __future__ import annotations

import math
import shlex
from typing import Any, Mapping

from bridge.errors import BridgeError
from bridge.format.scheduler import DECAY_STYLES, WD_STYLES, WSD_STYLES, SchedulerRecord

#: Megatron-LM's argument (dest) -> (type, Megatron-LM 0.19.2's default, choices or None)
SCHEDULER_ARGS: dict[str, tuple[type, Any, tuple | None]] = {
    "lr": (float, None, None),
    "min_lr": (float, 0.0, None),
    "lr_decay_style": (str, "linear", DECAY_STYLES),
    "lr_wsd_decay_style": (str, "exponential", WSD_STYLES),
    "lr_decay_iters": (int, None, None),
    "lr_decay_samples": (int, None, None),
    "lr_wsd_decay_iters": (int, None, None),
    "lr_wsd_decay_samples": (int, None, None),
    "lr_warmup_fraction": (float, None, None),
    "lr_warmup_iters": (int, 0, None),
    "lr_warmup_samples": (int, 0, None),
    "lr_warmup_init": (float, 0.0, None),
    "train_iters": (int, None, None),
    "train_samples": (int, None, None),
    "global_batch_size": (int, None, None),
    "weight_decay": (float, 0.01, None),
    "start_weight_decay": (float, None, None),
    "end_weight_decay": (float, None, None),
    "weight_decay_incr_style": (str, "constant", WD_STYLES),
}

#: what the refusal asks for: the arguments a Megatron-LM run cannot start without
NEEDED = "--lr X --train-iters N (or --train-samples N) --global-batch-size B"


def flag(dest: str) -> str:
    """Megatron-LM's flag of an argument.

    >>> flag("lr_warmup_iters")
    '--lr-warmup-iters'
    """
    return "--" + dest.replace("_", "-")


TO_MEGATRON_GROUP = ("Megatron-LM scheduler (when SRC records none)",
                     "the arguments the run that loads DST is given: its LR scheduler state is built from them exactly "
                     "as Megatron-LM builds it (num_steps = step x global batch size samples)")


def add_scheduler_flags(parser: Any, group: tuple[str, str] = TO_MEGATRON_GROUP, opt_out: bool = True) -> None:
    """Megatron-LM's scheduler arguments (their own names) and `--megatron-args FILE` on `parser`
    (with `--no-scheduler` when `opt_out`), in an argument group (title, description) `group`.
    Every default is None here, so what the user gave is known; Megatron's defaults apply later."""
    g = parser.add_argument_group(*group)
    for dest, (typ, _, choices) in SCHEDULER_ARGS.items():
        g.add_argument(flag(dest), dest=f"sched_{dest}", type=typ, choices=choices, default=None, metavar=None
                       if choices else dest.split("_")[-1].upper())
    g.add_argument("--megatron-args", metavar="FILE",
                   help="a file holding the loading run's Megatron-LM arguments (e.g. its command line; "
                        "arguments other than the scheduler's are ignored; flags given here win)")
    if not opt_out:
        return
    g.add_argument("--no-scheduler", action="store_true",
                   help="write no scheduler state although SRC records none (Megatron-LM then loads it only with "
                        "--no-load-optim or --finetune, which drop the optimizer state)")


def given_args(ns: Any) -> dict[str, Any]:
    """The scheduler arguments a parsed command line gives: `--megatron-args FILE`, then the flags."""
    out: dict[str, Any] = {}
    path = getattr(ns, "megatron_args", None)
    if path:
        out.update(args_from_file(path))
    out.update({d: getattr(ns, f"sched_{d}") for d in SCHEDULER_ARGS if getattr(ns, f"sched_{d}", None) is not None})
    return out


def args_from_file(path: str) -> dict[str, Any]:
    """Scheduler arguments from a file of Megatron-LM arguments (shell words; `#` comments; other
    arguments skipped). `--rampup-batch-size` is refused: the samples per iteration then vary.

    Reads `--flag value` and `--flag=value`."""
    import argparse

    try:
        with open(path, encoding="utf-8") as f:
            words = shlex.split(f.read(), comments=True)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise BridgeError(f"--megatron-args {path}: cannot read it ({e}); give a text file of Megatron-LM "
                          f"arguments") from None
    if any(w.split("=", 1)[0] == "--rampup-batch-size" for w in words):
        raise BridgeError(f"--megatron-args {path}: --rampup-batch-size is not supported (the samples per iteration "
                          f"vary); build the scheduler state with Megatron-LM itself")
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for dest, (typ, _, _) in SCHEDULER_ARGS.items():
        p.add_argument(flag(dest), dest=dest, type=str, default=None)
    got, _ = p.parse_known_args(words)
    out = {}
    for dest, raw in vars(got).items():
        if raw is None:
            continue
        typ, _, choices = SCHEDULER_ARGS[dest]
        try:
            val = typ(raw)
        except ValueError:
            raise BridgeError(f"--megatron-args {path}: {flag(dest)} {raw!r} is not a {typ.__name__}") from None
        if choices and val not in choices:
            raise BridgeError(f"--megatron-args {path}: {flag(dest)} {raw!r} is not one of {list(choices)}")
        out[dest] = val
    return out


def check_scheduler_args(a: Mapping[str, Any]) -> None:
    """The scheduler-only checks, in one place: values finite and >= 0, counts positive, and what
    Megatron-LM's `validate_args` asserts about combining them; BridgeError naming the flag."""
    for dest, v in a.items():
        typ = SCHEDULER_ARGS[dest][0]
        if v is None or typ is str:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise BridgeError(f"{flag(dest)} {v!r}: must be a finite number >= 0")
    for dest in ("train_iters", "train_samples", "global_batch_size"):
        if a.get(dest) is not None and (int(a[dest]) != a[dest] or a[dest] <= 0):
            raise BridgeError(f"{flag(dest)} {a[dest]!r}: must be a positive integer")
    if a.get("lr") is None or a.get("global_batch_size") is None or \
            (a.get("train_iters") is None) == (a.get("train_samples") is None):
        raise BridgeError(f"the scheduler needs {NEEDED} (exactly one of --train-iters / --train-samples), as "
                          f"Megatron-LM's run does")
    if a["min_lr"] > a["lr"]:
        raise BridgeError(f"--min-lr {a['min_lr']} exceeds --lr {a['lr']} (Megatron-LM asserts min_lr <= lr)")
    if a["lr_warmup_fraction"] is not None and not a["lr_warmup_fraction"] < 1:
        raise BridgeError(f"--lr-warmup-fraction {a['lr_warmup_fraction']}: must be below 1")
    if a["train_iters"] is not None:
        clash = [d for d in ("lr_decay_samples", "lr_wsd_decay_samples") if a[d] is not None] + \
            (["lr_warmup_samples"] if a["lr_warmup_samples"] else [])
        if clash:
            raise BridgeError(f"--train-iters (iteration-based) with {flag(clash[0])}: use the -iters arguments, "
                              f"as Megatron-LM requires")
    else:
        clash = [d for d in ("lr_decay_iters", "lr_wsd_decay_iters") if a[d] is not None] + \
            (["lr_warmup_iters"] if a["lr_warmup_iters"] else [])
        if clash:
            raise BridgeError(f"--train-samples (sample-based) with {flag(clash[0])}: use the -samples arguments, "
                              f"as Megatron-LM requires")
    if a["lr_warmup_fraction"] is not None and (a["lr_warmup_iters"] or a["lr_warmup_samples"]):
        raise BridgeError("--lr-warmup-fraction with --lr-warmup-iters / --lr-warmup-samples: give one of them")
    constant = a["weight_decay_incr_style"] == "constant"
    given = [d for d in ("start_weight_decay", "end_weight_decay") if a[d] is not None]
    if constant and given:
        raise BridgeError(f"{flag(given[0])} with --weight-decay-incr-style constant: Megatron-LM refuses it; use "
                          f"--weight-decay, or a linear / cosine increment style")
    if not constant and len(given) < 2:
        raise BridgeError(f"--weight-decay-incr-style {a['weight_decay_incr_style']} needs --start-weight-decay and "
                          f"--end-weight-decay")
    if a["lr_warmup_init"] > a["lr"] or (not constant and a["end_weight_decay"] < a["start_weight_decay"]):
        raise BridgeError("need --lr-warmup-init <= --lr and --start-weight-decay <= --end-weight-decay "
                          "(OptimizerParamScheduler asserts both)")


def record_from_args(args: Mapping[str, Any], iteration: int) -> SchedulerRecord:
    """The scheduler of a Megatron-LM run given `args` (Megatron-LM's argument names; absent ones take
    Megatron-LM's defaults), as it stands after `iteration` iterations of `global_batch_size` samples.

    >>> r = record_from_args({"lr": 3e-4, "min_lr": 3e-5, "lr_decay_style": "cosine", "train_iters": 100,
    ...                       "lr_warmup_iters": 10, "global_batch_size": 8}, 7)
    >>> (r.max_lr, r.lr_warmup_steps, r.lr_decay_steps, r.num_steps, r.start_wd, r.wd_incr_steps)
    (0.0003, 80, 800, 56, 0.01, 800)
    """
    unknown = sorted(set(args) - set(SCHEDULER_ARGS))
    if unknown:
        raise BridgeError(f"unknown scheduler argument {unknown[0]!r}; use Megatron-LM's names: {sorted(SCHEDULER_ARGS)}")
    a = {d: default for d, (_, default, _) in SCHEDULER_ARGS.items()}
    a.update({k: v for k, v in args.items() if v is not None})
    check_scheduler_args(a)
    if int(iteration) < 0:
        raise BridgeError(f"iteration {iteration} is negative")
    gbs = int(a["global_batch_size"])
    if a["weight_decay_incr_style"] == "constant":  # validate_args
        a["start_weight_decay"] = a["end_weight_decay"] = a["weight_decay"]
    if a["train_iters"]:  # get_optimizer_param_scheduler, iteration-based
        decay_iters = a["lr_decay_iters"] if a["lr_decay_iters"] is not None else a["train_iters"]
        decay = decay_iters * gbs
        wd_steps = a["train_iters"] * gbs
        wsd = a["lr_wsd_decay_iters"] * gbs if a["lr_wsd_decay_iters"] is not None else None
        warmup = a["lr_warmup_fraction"] * decay if a["lr_warmup_fraction"] is not None else a["lr_warmup_iters"] * gbs
    else:  # sample-based
        decay = a["lr_decay_samples"] if a["lr_decay_samples"] is not None else a["train_samples"]
        wd_steps = a["train_samples"]
        wsd = a["lr_wsd_decay_samples"]
        warmup = a["lr_warmup_fraction"] * decay if a["lr_warmup_fraction"] is not None else a["lr_warmup_samples"]
    rec = SchedulerRecord(float(a["lr"]), a["min_lr"], warmup, decay, a["lr_decay_style"], int(iteration) * gbs,
                          start_wd=a["start_weight_decay"], end_wd=a["end_weight_decay"], wd_incr_steps=wd_steps,
                          wd_incr_style=a["weight_decay_incr_style"], init_lr=a["lr_warmup_init"],
                          wsd_decay_steps=wsd, lr_wsd_decay_style=a["lr_wsd_decay_style"], increment=gbs,
                          at_count=int(iteration))
    try:
        rec.validate()
    except BridgeError as e:
        raise BridgeError(str(e).replace("manifest scheduler record: ", "scheduler arguments: ")
                          .replace("; fix the record or pass learning_rate= yourself", "")) from None
    return rec
