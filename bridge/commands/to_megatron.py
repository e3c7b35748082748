"""`gtp-bridge to-megatron SRC DST --tp T [--gtp G] [--dp D] [--ep E] [--format F]`."""

from __future__ import annotations

import argparse

EPILOG = """examples:
  gtp-bridge to-megatron ckpt/logical runs/gpt_tp2 --tp 2 --dp 4          # -> runs/gpt_tp2/iter_<step>
  gtp-bridge to-megatron ckpt/logical runs/gpt_tp2/iter_0001000 --tp 2    # the same, naming the iteration
  gtp-bridge to-megatron ckpt/logical out --tp 1 --gtp 2 --format dp_reshardable

The run directory gets iter_XXXXXXX/ and latest_checkpointed_iteration.txt (set last, atomically),
so Megatron-LM's --load <run directory> resumes at that step; other iterations there are kept.
"""


def add_parser(sub) -> None:
    p = sub.add_parser("to-megatron", help="logical checkpoint -> Megatron torch_dist for a target layout",
                       description="Write a Megatron-Core torch_dist checkpoint (DCP .distcp + .metadata, "
                                   "common_state, metadata.json) that megatron-core 0.19.2 loads at the target "
                                   "TP x GTP x DP x EP layout.",
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", metavar="SRC", help="logical checkpoint directory")
    p.add_argument("dst", metavar="DST", help="Megatron run directory (new, empty or existing: --load DST), or "
                                              "its iter_XXXXXXX directory (XXXXXXX = the step, 7 digits)")
    p.add_argument("--tp", type=int, required=True, help="target tensor-parallel size")
    p.add_argument("--gtp", type=int, default=1, help="target GTP (weight-remat) size (default 1)")
    p.add_argument("--dp", type=int, default=1, help="target data-parallel (replicate) size (default 1)")
    p.add_argument("--ep", type=int, default=1, help="target expert-parallel size (default 1)")
    p.add_argument("--format", dest="fmt", default="fully_reshardable",
                   choices=["fully_reshardable", "dp_reshardable"], help="optimizer format (default fully_reshardable)")
    p.add_argument("--pad-for-alignment", type=int, help="GTP pad_for_alignment of the target run (default: source's, else 16)")
    p.add_argument("--bucket-size", type=int, help="DDP bucket size in elements (dp_reshardable; default one bucket)")
    p.add_argument("--budget", default="1G", help="in-flight host memory budget, e.g. 512M, 2G (default 1G)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from bridge.inspect_format import parse_size
    from converters.megatron_write import Target, to_megatron

    res = to_megatron(args.src, args.dst, Target(tp=args.tp, gtp=args.gtp, dp=args.dp, ep=args.ep, fmt=args.fmt,
                                                  pad_for_alignment=args.pad_for_alignment,
                                                  bucket_size=args.bucket_size),
                      budget=parse_size(args.budget))
    lay = res["layout"]
    prev = res["tracker_previous"]
    print(f"wrote {res['dst']} ({res['format']}, TP={lay['tp']} GTP={lay['gtp']} DP={lay['dp']} EP={lay['ep']}, "
          f"world {lay['world']}, step {res['step']}): {res['params']} params, {res['bytes'] / 2**20:.1f} MiB; "
          f"{res['tracker']} = {res['step']}" + (f" (was {prev})" if prev is not None else "")
          + f"; load with --load {res['run_dir']}")
    return 0
