"""`gtp-bridge to-megatron SRC DST --tp T [--gtp G] [--dp D] [--ep E] [--format F]`."""

from __future__ import annotations

import argparse

from bridge.commands.convert import add_split_flags
from bridge.format.scheduler_args import add_scheduler_flags, given_args

#: the megatron-core releases --megatron-core offers: those that load a format to-megatron writes
#: (converters.megatron.write.torch_dist.RELEASES; tests/commands/test_cli_help.py keeps the two in step)
RELEASES = ["0.15", "0.16", "0.19"]

EPILOG = """examples:
  gtp-bridge to-megatron ckpt/logical runs/gpt_tp2 --tp 2 --dp 4          # -> runs/gpt_tp2/iter_<step>
  gtp-bridge to-megatron ckpt/logical runs/gpt_tp2/iter_0001000 --tp 2    # the same, naming the iteration
  gtp-bridge to-megatron ckpt/logical out --tp 1 --gtp 2 --format dp_reshardable
  gtp-bridge to-megatron ckpt/logical out --tp 2 --json | jq .run_dir     # the summary as one JSON object

The run directory gets iter_<step, 7 digits>/ and latest_checkpointed_iteration.txt (set last, atomically),
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
                                              "its iteration directory (iter_ + the step in 7 digits, e.g. iter_0001000)")
    p.add_argument("--tp", type=int, required=True, help="target tensor-parallel size")
    p.add_argument("--gtp", type=int, default=1, help="target GTP (weight-remat) size (default 1)")
    p.add_argument("--dp", type=int, default=1, help="target data-parallel (replicate) size (default 1)")
    p.add_argument("--ep", type=int, default=1, help="target expert-parallel size (default 1)")
    p.add_argument("--pp", type=int, default=1,
                   help="target pipeline-parallel size (default 1; an even split of the layers unless the flags "
                        "below say otherwise; no virtual chunks)")
    add_split_flags(p)
    p.add_argument("--vpp", type=int, default=1, metavar="V",
                   help="virtual pipeline chunks per stage (Megatron's --num-virtual-stages-per-pipeline-rank; "
                        "dp_reshardable writes one buffer per chunk)")
    p.add_argument("--format", dest="fmt", default="fully_reshardable",
                   choices=["fully_reshardable", "dp_reshardable"], help="optimizer format (default fully_reshardable)")
    p.add_argument("--megatron-core", dest="release", default="0.19", choices=RELEASES, type=_release,
                   help="release that will load DST (default 0.19): 0.15 / 0.16 read the common state from common.pt "
                        "(0.14 loads none of the formats to-megatron writes)")
    p.add_argument("--pad-for-alignment", type=int, help="GTP pad_for_alignment of the target run (default: source's, else 16)")
    p.add_argument("--bucket-size", type=int, help="DDP bucket size in elements (dp_reshardable; default one bucket)")
    p.add_argument("--budget", help="host memory for data in flight, e.g. 512M, 2G (default: a quarter of the "
                                    "available memory, 256M..4G; the value used is printed)")
    p.add_argument("--workers", type=int, help="writer threads, one .distcp file each (default min(8, cores))")
    p.add_argument("--key-convention", default="unwrapped", choices=["unwrapped", "wrapped"],
                   help="keys of every entry: unwrapped (default: what Megatron-LM's load_checkpoint builds, "
                        "decoder...) or wrapped (a DDP-wrapped model's sharded_state_dict(), module.decoder...)")
    add_scheduler_flags(p)
    p.add_argument("--weights-from-masters", action="store_true",
                   help="write the bf16 weights as bf16(fp32 masters) instead of the stored model arrays "
                        "(the default when the checkpoint has none)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object on stdout (what was written); other lines go to stderr")
    p.set_defaults(func=run)


def _release(text: str) -> str:
    """--megatron-core's value; 0.14, which --help does not offer, is refused with the reason."""
    if text == "0.14":
        raise argparse.ArgumentTypeError("megatron-core 0.14 does not load the formats to-megatron writes "
                                         "(fully_reshardable, dp_reshardable); load with 0.15 or later")
    return text


def run(args: argparse.Namespace) -> int:
    from bridge.commands.summary import run_reporting, to_megatron_json

    return run_reporting(args, lambda: _write(args), to_megatron_json)


def _write(args: argparse.Namespace) -> dict:
    from bridge.errors import BridgeError
    from bridge.units import human_bytes, parse_size
    from converters.megatron.write.torch_dist import MegatronTarget
    from converters.megatron.write.to_megatron import to_megatron

    sched_args = given_args(args)
    if sched_args and args.no_scheduler:
        raise BridgeError("--no-scheduler with scheduler arguments: give one or the other")
    res = to_megatron(args.src, args.dst, MegatronTarget(tp=args.tp, gtp=args.gtp, dp=args.dp, ep=args.ep, fmt=args.fmt,
                                                  pad_for_alignment=args.pad_for_alignment,
                                                  bucket_size=args.bucket_size, release=args.release, pp=args.pp,
                                                  pp_first=args.pp_first, pp_last=args.pp_last,
                                                  embedding_in_split=bool(args.embedding_in_split),
                                                  loss_in_split=bool(args.loss_in_split), vpp=args.vpp,
                                                  key_convention=args.key_convention,
                                                  scheduler_args=sched_args or None,
                                                  require_scheduler=not args.no_scheduler),
                      budget=parse_size(args.budget) if args.budget else None, workers=args.workers,
                      weights_from_masters=args.weights_from_masters)
    if res.get("rank", 0) != 0:  # under torchrun rank 0 reports for every rank
        return res
    lay = res["layout"]
    prev = res["tracker_previous"]
    print(f"wrote {res['dst']} ({res['format']}, TP={lay['tp']} GTP={lay['gtp']} DP={lay['dp']} EP={lay['ep']} "
          f"PP={lay['pp']}, "
          f"world {lay['world']}, step {res['step']}): {res['params']} params, {res['bytes'] / 2**20:.1f} MiB; "  # foreign: report keys
          f"{res['tracker']} = {res['step']}" + (f" (was {prev})" if prev is not None else "")  # foreign: report keys
          + f"; load with --load {res['run_dir']}")
    how = "derived from the fp32 masters (bf16, round-to-nearest-even)" if res["weights_derived"] else \
        "stored weights, each checked equal to bf16(its fp32 master)"
    print(f"weights: {how}; budget {human_bytes(res['budget'])}, {res['workers']} workers; read "
          f"{res['elements_read']:,} elements for {res['elements_needed']:,} needed")
    if res.get("ranks"):
        from converters.megatron.distributed import rank_summary

        print(rank_summary(res["ranks"], res["seconds"]))
    sched = {"built": "built from the scheduler arguments given", "carried": "carried from SRC",
             None: "none (--no-scheduler: Megatron-LM loads it only with --no-load-optim or --finetune)"}
    print(f"keys: {args.key_convention}; LR-scheduler state: {sched[res['scheduler']]}")
    return res
