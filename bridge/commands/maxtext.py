"""`gtp-bridge to-maxtext SRC ROOT` and `gtp-bridge from-maxtext SRC DST`: the maxtext preset (issue #22)."""

from __future__ import annotations

import argparse
import json
import os
import sys

from bridge.format.scheduler_args import add_scheduler_flags

TO_EPILOG = """examples:
  gtp-bridge to-maxtext logical_ckpt/ mt/myrun/checkpoints              # MaxText resumes with run_name=myrun
  gtp-bridge to-maxtext logical_ckpt/ mt/l2/checkpoints --decoder-block llama2   # query scale folded
  gtp-bridge to-maxtext moe_logical/ mt/moe/checkpoints        # MoE run: qwen3_moe block (mixtral: folded)
  gtp-bridge to-maxtext logical_ckpt/ mt/run/checkpoints --lr 3e-4 --lr-decay-style cosine --lr-warmup-iters 100 --train-iters 1000 --global-batch-size 256

MaxText's lr schedule follows the Megatron run's (recorded in SRC, or given by Megatron-LM's scheduler
flags): MaxText applies Megatron's lr at every following step. Where MaxText cannot express it
(inverse-square-root, WSD exponential / minus_sqrt, a non-zero warmup start still running, ends not on
whole iterations, min_lr held after the decay, a running weight-decay increment) it says so in one line;
--constant-lr continues at the constant recorded lr instead.

The step directory is <ROOT>/<step - 1> (MaxText's naming: the last step index taken) holding
items/ (MaxText's train state: params, adamw state, step) and gtp_bridge_maxtext.json. It prints
MaxText's command that resumes from it, as one line that runs as printed (base_output_directory and
run_name make MaxText's checkpoint_dir ROOT, so ROOT is <dir>/<run>/checkpoints; the key=value
settings build this model and optimizer, shell-quoted), and the settings to append for a one-step
try on a CPU. --decoder-block qwen2 (default)
is MaxText's llama layer with the attention's 1/sqrt(head_dim) applied in the op: the state is
carried over exactly. llama2 folds it into the query kernel and its moments (forward exact, the
Adam trajectory is not). docs/maxtext.md has the mapping table.
"""

FROM_EPILOG = """examples:
  gtp-bridge from-maxtext maxtext_run/checkpoints logical_ckpt/       # latest step; a run we started
  gtp-bridge from-maxtext ckpts/1200 logical/ --lr 3e-4 --betas 0.9,0.95   # MaxText's own run
  gtp-bridge to-megatron logical_ckpt/ megatron_run/ --tp 2            # then on to Megatron-Core

SRC is a MaxText checkpoint root (its latest step), a step directory or its items/ directory. A
step written by to-maxtext, or saved by a MaxText run resumed from one, carries the hyper-parameters
and Megatron's records; for any other MaxText checkpoint give its AdamW settings (--lr, --betas,
--eps, --weight-decay; norms are Megatron's no-decay set).
"""


def add_parser(sub) -> None:
    p = sub.add_parser("to-maxtext", help="logical checkpoint -> MaxText train-state checkpoint (maxtext preset)",
                       description="Write a logical checkpoint of a llama-style model (RMSNorm, SwiGLU, GQA, RoPE, "
                                   "no biases) as a MaxText 0.2.5 train-state checkpoint: params and Adam state, "
                                   "as a step of a MaxText checkpoint root.",
                       epilog=TO_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", metavar="SRC", help="logical checkpoint directory (with Adam state)")
    p.add_argument("root", metavar="ROOT", help="MaxText checkpoint root (its checkpoint_dir); created if missing")
    p.add_argument("--decoder-block", default=None, choices=["qwen2", "llama2", "qwen3_moe", "mixtral"],
                   help="MaxText decoder block (default qwen2, for MoE qwen3_moe: exact; llama2 / mixtral fold "
                        "the query scale)")
    p.add_argument("--num-experts-per-tok", type=int, default=0, metavar="K",
                   help="an MoE model's experts per token when the source records no moe_router_topk")
    p.add_argument("--unscanned", action="store_true", help="MaxText scan_layers=false (decoder/layers_<i>/...)")
    p.add_argument("--overrides-json", metavar="FILE", help="also write MaxText's config overrides to FILE (JSON)")
    p.add_argument("--constant-lr", action="store_true",
                   help="continue at the constant recorded lr instead of following the Megatron run's lr schedule "
                        "(needed where MaxText cannot express that schedule: to-maxtext says so)")
    add_scheduler_flags(p, ("Megatron-LM scheduler (default: the one SRC records)",
                            "the Megatron run's scheduler arguments; MaxText's lr schedule settings are set so that "
                            "MaxText applies Megatron's lr at every following step"), opt_out=False)
    add_stream_flags(p)
    p.set_defaults(func=run_to)

    q = sub.add_parser("from-maxtext", help="MaxText train-state checkpoint -> logical checkpoint (maxtext preset)",
                       description="Read a MaxText 0.2.5 train-state checkpoint of a llama-family model (params and "
                                   "adamw state) into a logical checkpoint that to-megatron takes.",
                       epilog=FROM_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    q.add_argument("src", metavar="SRC", help="MaxText checkpoint root, step directory or items/ directory")
    q.add_argument("dst", metavar="DST", help="new logical checkpoint directory")
    q.add_argument("--lr", type=float, help="learning rate (a MaxText run we did not start)")
    q.add_argument("--betas", default=None, metavar="B1,B2", help="Adam betas (default 0.9,0.95: MaxText's)")
    q.add_argument("--eps", type=float, default=None, help="Adam eps (default 1e-8)")
    q.add_argument("--weight-decay", type=float, default=None, help="AdamW weight decay (default 0.1, MaxText's)")
    q.add_argument("--clip-grad", type=float, default=None, help="global-norm clipping threshold (default none)")
    q.add_argument("--num-experts-per-tok", type=int, default=0, metavar="K",
                   help="an MoE checkpoint's experts per token (MaxText's num_experts_per_tok; a MaxText run "
                        "we did not start)")
    q.add_argument("--decoder-block", choices=["qwen2", "llama2", "qwen3_moe", "mixtral"], default=None,
                   help="the MaxText block the run used (llama2: the query scale is unfolded); default from the "
                        "checkpoint's sidecar, else qwen2")
    q.add_argument("--maxtext-settings", metavar="FILE",
                   help="the MaxText run's settings (a JSON object, e.g. to-maxtext's --overrides-json, or its "
                        "key=value command line): its lr schedule is recorded as the Megatron scheduler to-megatron "
                        "writes (needs --global-batch-size)")
    q.add_argument("--global-batch-size", type=int, metavar="SIZE",
                   help="samples per step of the MaxText run (Megatron's scheduler counts samples)")
    add_stream_flags(q)
    q.set_defaults(func=run_from)


def add_stream_flags(p: argparse.ArgumentParser) -> None:
    """--workers / --budget, with convert's meaning and defaults (the conversion is streamed)."""
    p.add_argument("--workers", type=int, default=None,
                   help="writer processes (each owns whole output chunks); default: one per core, at most 8")
    p.add_argument("--budget", default=None,
                   help="host memory for the data of all processes together, e.g. 512M, 2G; each process also "
                        "needs about 0.5 GiB for itself (default: half of the free memory left after that, "
                        "256M..16G; printed)")


def stream_options(args: argparse.Namespace):
    from bridge.jaxside.presets.maxtext_stream import StreamOptions
    from bridge.units import parse_size

    budget = parse_size(args.budget) if args.budget is not None else None
    first = os.environ.get("RANK", "0") == "0"   # under torchrun rank 0 speaks for every rank
    return StreamOptions(workers=args.workers, budget=budget, show_progress=None if first else False,
                         announce=(lambda line: print(line, flush=True)) if first else None)


def run_to(args: argparse.Namespace) -> int:
    from bridge.jaxside.presets.maxtext_stream import write_maxtext

    from bridge.format.scheduler_args import given_args
    from bridge.jaxside.presets.maxtext_schedule import ScheduleOptions

    schedule = ScheduleOptions(scheduler_args=given_args(args) or None, constant_lr=args.constant_lr)
    w = write_maxtext(args.src, args.root, decoder_block=args.decoder_block, scan_layers=not args.unscanned,
                      stream=stream_options(args), num_experts_per_tok=args.num_experts_per_tok,
                      schedule=schedule)
    if os.environ.get("RANK", "0") != "0":   # under torchrun rank 0 reports for every rank
        return 0
    d = w.dims
    print(f"wrote {w.step_dir} (MaxText step dir {w.step - 1 if w.step else 0}, resumes at step {w.step}): "
          f"{d.layers} layers, hidden {d.hidden}, {d.heads} heads / {d.kv_heads} kv, head dim {d.head_dim}, "
          f"ffn {d.ffn}, vocab {d.vocab}{' (tied)' if d.tied else ''}"
          f"{f', {d.experts} experts (top {d.topk})' if d.experts else ''}; block {w.options.decoder_block}"
          f"{', scanned' if w.options.scan_layers else ', unscanned'}")
    for note in w.notes:
        print(f"gtp-bridge: note: {note}", file=sys.stderr)
    if args.overrides_json:
        with open(args.overrides_json, "w") as f:
            json.dump(w.overrides, f, indent=1)
    print_command(os.path.dirname(w.step_dir), w.overrides, w.step)
    return 0


def print_command(root: str, overrides: dict, step: int) -> None:
    """MaxText's command resuming from `root`, one line that runs as printed, and the CPU try's settings."""
    from bridge.jaxside.presets.maxtext_command import maxtext_command, quoted

    cmd = maxtext_command(root, overrides, step)
    if cmd is None:
        print(f"gtp-bridge: note: MaxText resumes only from <base_output_directory>/<run_name>/checkpoints, and "
              f"{root} is not named so; write to such a root (e.g. {os.path.join(root, 'myrun', 'checkpoints')}) "
              f"to get the command that resumes it", file=sys.stderr)
        print("MaxText settings: " + quoted(overrides))
        return
    print(f"MaxText resumes at step {step} with this command (in MaxText's Python environment, as printed):")
    print(cmd.command)
    print("For a local try on a CPU (one step, MaxText's synthetic data), append to it:")
    print(cmd.cpu_settings)


def run_schedule(args: argparse.Namespace):
    """The MaxText run's schedule from --maxtext-settings / --global-batch-size, or None."""
    from bridge.errors import BridgeError
    from bridge.jaxside.presets.maxtext_schedule import MaxTextRunSchedule, settings_from_text

    if args.maxtext_settings is None:
        if args.global_batch_size is not None:
            raise BridgeError("--global-batch-size goes with --maxtext-settings FILE (the MaxText run's schedule)")
        return None
    if args.global_batch_size is None or args.global_batch_size <= 0:
        raise BridgeError("--maxtext-settings needs --global-batch-size N (N > 0: samples per MaxText step; "
                          "Megatron's scheduler counts samples)")
    try:
        with open(args.maxtext_settings, encoding="utf-8") as f:
            text = f.read(1 << 20)
    except (OSError, UnicodeDecodeError) as e:
        raise BridgeError(f"--maxtext-settings {args.maxtext_settings}: cannot read it ({e})") from None
    return MaxTextRunSchedule(settings_from_text(text, args.maxtext_settings), args.global_batch_size)


def run_from(args: argparse.Namespace) -> int:
    from bridge.errors import BridgeError
    from bridge.format.manifest import check_hyperparameters
    from bridge.jaxside.presets.maxtext import Hyper, Options
    from bridge.jaxside.presets.maxtext_stream import read_maxtext

    given = {k: getattr(args, k) for k in ("eps", "weight_decay", "clip_grad") if getattr(args, k) is not None}
    if args.betas is not None:
        try:
            given["b1"], given["b2"] = (float(x) for x in args.betas.split(","))
        except ValueError:
            raise BridgeError(f"--betas {args.betas!r}: give two numbers, e.g. --betas 0.9,0.95") from None
    check_hyperparameters("from-maxtext flags", lr=args.lr, betas=(given["b1"], given["b2"]) if "b1" in given else None,
                          eps=args.eps, weight_decay=args.weight_decay, clip_grad=args.clip_grad)
    hyper = None
    if args.lr is not None:
        hyper = Hyper(lr=args.lr, b1=given.get("b1", 0.9), b2=given.get("b2", 0.95), eps=given.get("eps", 1e-8),
                      weight_decay=given.get("weight_decay", 0.1), clip_grad=given.get("clip_grad"))
    elif given:
        raise BridgeError("--betas/--eps/--weight-decay/--clip-grad need --lr (they replace the recorded settings)")
    opts = Options(decoder_block=args.decoder_block) if args.decoder_block else None
    res = read_maxtext(args.src, args.dst, hyper=hyper, options=opts, stream=stream_options(args),
                       topk=args.num_experts_per_tok,
                       schedule=run_schedule(args))
    if os.environ.get("RANK", "0") != "0":   # under torchrun rank 0 reports for every rank
        return 0
    d = res["dims"]
    how = "sidecar of the run gtp-bridge wrote" if res["sidecar"] else "the given AdamW settings"
    print(f"wrote {res['dst']} from {res['items']} (step {res['trained_steps']}, Adam count {res['adam_count']}): "
          f"{d['layers']} "
          f"layers, hidden {d['hidden']}, vocab {d['vocab']}; hyper-parameters from {how}")
    return 0
