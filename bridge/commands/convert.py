"""`gtp-bridge convert SRC DST`: Megatron-Core torch_dist checkpoint -> logical checkpoint."""

from __future__ import annotations

import argparse


EPILOG = """examples:
  gtp-bridge convert runs/gpt/iter_0001000 ckpt/logical
  gtp-bridge convert runs/gpt ckpt/logical --workers 4 --budget 2G     # latest iteration
  gtp-bridge convert lib_ckpt out --kv-channels 128                      # no args saved: head dim
  gtp-bridge convert runs/gpt jax_ckpts --orbax-step-dir                # as step <iter> of an Orbax CheckpointManager
"""


def add_hint_flags(p: argparse.ArgumentParser) -> None:
    """Flags that supply what a source checkpoint does not show."""
    g = p.add_argument_group("facts the checkpoint may lack (only needed when it cannot be inferred)")
    g.add_argument("--tp", type=int, help="tensor-parallel size of the run that saved SRC")
    g.add_argument("--gtp", type=int, help="GTP (weight-remat) size of the run")
    g.add_argument("--dp", type=int, help="data-parallel (replicate) size of the run")
    g.add_argument("--ep", type=int, help="expert-parallel size of the run")
    g.add_argument("--pad-for-alignment", type=int, help="GTP pad_for_alignment (default: inferred, else 16)")
    g.add_argument("--bucket-size", type=int, help="DDP bucket size in elements (dp_reshardable)")
    g.add_argument("--num-attention-heads", type=int)
    g.add_argument("--num-query-groups", type=int)
    g.add_argument("--kv-channels", type=int, help="attention head dim")
    sw = g.add_mutually_exclusive_group()
    sw.add_argument("--swiglu", dest="swiglu", action="store_true", default=None, help="linear_fc1 is gated")
    sw.add_argument("--no-swiglu", dest="swiglu", action="store_false", help="linear_fc1 is not gated")


def hints_from(args: argparse.Namespace):
    from converters.megatron.format import Hints

    return Hints(tp=args.tp, gtp=args.gtp, dp=args.dp, ep=args.ep, pad_for_alignment=args.pad_for_alignment,
                 num_attention_heads=args.num_attention_heads, num_query_groups=args.num_query_groups,
                 kv_channels=args.kv_channels, swiglu=args.swiglu, bucket_size=args.bucket_size)


def add_parser(sub) -> None:
    p = sub.add_parser("convert", help="Megatron torch_dist checkpoint -> logical checkpoint",
                       description="Convert a Megatron-Core torch_dist checkpoint (fully_reshardable, "
                                   "dp_reshardable, legacy padded GTP, chained dense+expert; auto-detected) "
                                   "into a logical Orbax/TensorStore checkpoint.",
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", metavar="SRC", help="torch_dist checkpoint directory (iter_<N> or its parent)")
    p.add_argument("dst", metavar="DST", help="new logical checkpoint directory (must not exist); with --orbax-step-dir "
                                              "an Orbax CheckpointManager root")
    p.add_argument("--workers", type=int, default=None,
                   help="writer processes (each owns whole outer chunks); default: one per core, at most 8")
    p.add_argument("--budget", default=None,
                   help="host memory for the data of all processes together, e.g. 512M, 2G; each process also "
                        "needs about 0.5 GiB for itself (default: half of the free memory left after that, "
                        "256M..16G; printed)")
    p.add_argument("--force", action="store_true",
                   help="convert even when fp32 masters disagree with the bf16 weights (corrupt source; loud)")
    p.add_argument("--orbax-step-dir", "--orbax-manager", dest="orbax_manager", action="store_true",
                   help="DST is an Orbax CheckpointManager root (created if missing): write the checkpoint as its "
                        "step <iteration> (DST/<step>/default/), where CheckpointManager.latest_step() finds it")
    add_hint_flags(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from bridge.inspect.format import parse_size
    from bridge.location import location
    from converters.megatron.convert import ConvertOptions, convert
    from converters.megatron.rundir import locate_megatron_dir

    # before anything looks at them: an unknown scheme is refused in one line, never taken for a local path
    args.src, args.dst = location(args.src, "source"), location(args.dst, "destination")
    found = locate_megatron_dir(args.src)  # a run directory: the iteration its tracker names
    if found.note:
        print(found.note)
    args.src = found.path
    budget = parse_size(args.budget) if args.budget is not None else None
    opts = ConvertOptions(workers=args.workers, budget=budget, force=args.force, hints=hints_from(args),
                          announce=lambda line: print(line, flush=True))
    if args.orbax_manager:
        from bridge.store.manager import write_step

        res, step_dir = write_step(args.dst, lambda item: convert(args.src, item, opts), lambda r: r.step)
        res.dst = step_dir
    else:
        res = convert(args.src, args.dst, opts)
    lay = res.layout
    print(f"converted {args.src} ({res.source_format}, TP={lay['tp']} GTP={lay['gtp']} DP={lay['dp']} "
          f"EP={lay['ep']}, step {res.step}) -> {res.dst}: {res.params} params, {res.arrays} arrays, "
          f"{res.bytes / 2**20:.1f} MiB")
    if res.inferred:
        print("inferred: " + ", ".join(res.inferred))
    return 0
