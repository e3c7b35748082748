"""`gtp-bridge convert SRC DST`: Megatron-Core torch_dist checkpoint -> logical checkpoint."""

from __future__ import annotations

import argparse

from bridge.errors import BridgeError


EPILOG = """examples:
  gtp-bridge convert runs/gpt/iter_0001000 ckpt/logical
  gtp-bridge convert runs/gpt ckpt/logical --workers 4 --budget 2G     # latest iteration
  gtp-bridge convert lib_ckpt out --kv-channels 128                      # no args saved: head dim
  gtp-bridge convert lib_gtp out --num-attention-heads 32 --num-query-groups 8 --vocab-size 50304
  gtp-bridge convert lib_ckpt out --model-config model.yaml              # facts from a file (Megatron names)
  gtp-bridge convert runs/gpt jax_ckpts --orbax-step-dir                # as step <iter> of an Orbax CheckpointManager
  gtp-bridge convert runs/gpt ckpt/logical --dry-run                     # the plan, facts and bytes; writes nothing
  gtp-bridge convert runs/gpt ckpt/logical --json | jq .arrays           # the summary as one JSON object
"""


def add_hint_flags(p: argparse.ArgumentParser) -> None:
    """Flags that supply what a source checkpoint does not show."""
    g = p.add_argument_group(
        "facts the checkpoint may lack (read from its args, a Megatron-Bridge run_config.yaml or NeMo context/ "
        "when saved; inferred from shapes and chunk offsets when possible; an error names the flag still needed)")
    g.add_argument("--model-config", metavar="FILE",
                   help="YAML or JSON file of model facts under Megatron argument names (flat, or under model:)")
    g.add_argument("--tp", type=int, help="tensor-parallel size of the run that saved SRC")
    g.add_argument("--gtp", type=int, help="GTP (weight-remat) size of the run")
    g.add_argument("--dp", type=int, help="data-parallel (replicate) size of the run")
    g.add_argument("--ep", type=int, help="expert-parallel size of the run")
    g.add_argument("--pp", type=int, help="pipeline-parallel size of the run (no virtual chunks)")
    add_split_flags(g)
    g.add_argument("--pad-for-alignment", type=int, help="GTP pad_for_alignment (default: inferred, else 16)")
    g.add_argument("--bucket-size", type=int, help="DDP bucket size in elements (dp_reshardable, dp_zero_gather_scatter)")
    g.add_argument("--num-layers", type=int)
    g.add_argument("--hidden-size", type=int)
    g.add_argument("--ffn-hidden-size", type=int)
    g.add_argument("--moe-ffn-hidden-size", type=int)
    g.add_argument("--num-experts", type=int)
    g.add_argument("--vocab-size", type=int,
                   help="rows of the word embedding: the vocab the model was built with (Megatron-LM's padded vocab)")
    g.add_argument("--num-attention-heads", type=int)
    g.add_argument("--num-query-groups", type=int)
    g.add_argument("--kv-channels", type=int, help="attention head dim")
    sw = g.add_mutually_exclusive_group()
    sw.add_argument("--swiglu", dest="swiglu", action="store_true", default=None, help="linear_fc1 is gated")
    sw.add_argument("--no-swiglu", dest="swiglu", action="store_false", help="linear_fc1 is not gated")


def add_split_flags(g) -> None:
    """Megatron-LM's flags for uneven pipeline stages (convert: of the run; to-megatron: of the target)."""
    g.add_argument("--decoder-first-pipeline-num-layers", "--pp-first-layers", dest="pp_first", type=int,
                   metavar="N", help="layers on the first pipeline stage (the other stages share the rest evenly)")
    g.add_argument("--decoder-last-pipeline-num-layers", "--pp-last-layers", dest="pp_last", type=int, metavar="N",
                   help="layers on the last pipeline stage")
    g.add_argument("--account-for-embedding-in-pipeline-split", dest="embedding_in_split", action="store_true",
                   default=None, help="the embedding counts as a layer of the first stage")
    g.add_argument("--account-for-loss-in-pipeline-split", dest="loss_in_split", action="store_true", default=None,
                   help="the loss counts as a layer of the last stage")


def hints_from(args: argparse.Namespace):
    from converters.megatron.plan.format import Hints

    return Hints(tp=args.tp, gtp=args.gtp, dp=args.dp, ep=args.ep, pp=args.pp, pad_for_alignment=args.pad_for_alignment,
                 num_attention_heads=args.num_attention_heads, num_query_groups=args.num_query_groups,
                 kv_channels=args.kv_channels, swiglu=args.swiglu, bucket_size=args.bucket_size,
                 model_only=getattr(args, "model_only", False), hidden_size=args.hidden_size,
                 ffn_hidden_size=args.ffn_hidden_size, moe_ffn_hidden_size=args.moe_ffn_hidden_size,
                 vocab_size=args.vocab_size, num_layers=args.num_layers, num_experts=args.num_experts,
                 model_config=args.model_config, pp_first=args.pp_first, pp_last=args.pp_last,
                 embedding_in_split=args.embedding_in_split, loss_in_split=args.loss_in_split)


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
    p.add_argument("--strict-replicas", action="store_true",
                   help="refuse (writing nothing) when the save's copies of a replicated parameter (norms, biases, "
                        "position embeddings: each TP / GTP rank's optimizer holds one) differ; by default the "
                        "differences are reported and recorded, and TP rank 0's copy (Megatron's main replica) is kept")
    p.add_argument("--model-only", action="store_true",
                   help="convert the weights alone, leaving the checkpoint's optimizer state out (without it, a "
                        "checkpoint whose optimizer state cannot be read is refused)")
    p.add_argument("--dry-run", action="store_true",
                   help="read SRC's metadata and print the plan: the facts with their sources (flag / save / "
                        "default), the arrays and the bytes it would write; writes nothing")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object on stdout (the summary, or --dry-run's plan); other lines go to stderr")
    add_hint_flags(p)
    p.set_defaults(func=run)


def _source_step(src: str, hints) -> int | None:
    """The step `convert` will record for the torch_dist checkpoint `src` (its metadata only)."""
    from converters.megatron.read.dcp import DcpCheckpoint
    from converters.megatron.plan.format import describe, optimizer_groups, step_of

    source = describe(DcpCheckpoint(src), hints)
    return step_of(source, optimizer_groups(source))


def run(args: argparse.Namespace) -> int:
    from bridge.commands.summary import convert_json, run_reporting
    from converters.megatron.plan.fact_sources import split_notes

    if args.dry_run:
        return dry_run(args)
    return run_reporting(args, lambda: _convert(args), lambda res: convert_json(res, args.src, *split_notes(res.inferred)))


def _options(args: argparse.Namespace):
    """ConvertOptions from the command line (the announce line goes to stdout, i.e. with the human text)."""
    from bridge.units import parse_size
    from converters.megatron.convert import ConvertOptions

    budget = parse_size(args.budget) if args.budget is not None else None
    return ConvertOptions(workers=args.workers, budget=budget, force=args.force, hints=hints_from(args),
                          announce=lambda line: print(line, flush=True), strict_replicas=args.strict_replicas)


def _locate(args: argparse.Namespace) -> None:
    """SRC / DST as locations (an unknown scheme refused in one line), SRC's iteration from a run directory."""
    from bridge.location import location
    from converters.megatron.read.rundir import locate_megatron_dir

    # before anything looks at them: an unknown scheme is refused in one line, never taken for a local path
    args.src, args.dst = location(args.src, "source"), location(args.dst, "destination")
    found = locate_megatron_dir(args.src)  # a run directory: the iteration its tracker names
    if found.note:
        print(found.note)
    args.src = found.path


def _convert(args: argparse.Namespace):
    from converters.megatron.convert_entry import convert
    from converters.megatron.plan.fact_sources import split_notes

    _locate(args)
    opts = _options(args)
    if args.orbax_manager:
        from bridge.torchrun import launched_world

        if launched_world() > 1:
            raise BridgeError("--orbax-step-dir is not supported under torchrun yet; convert to a plain DST, or "
                              "run one process")
        from bridge.store import write_step

        # Where the step is written in place (object storage) its number is needed before writing.
        res, step_dir = write_step(args.dst, lambda item: convert(args.src, item, opts), lambda r: r.step,
                                   step=lambda: _source_step(args.src, opts.hints))
        res.dst = step_dir
    else:
        res = convert(args.src, args.dst, opts)
    if res.rank != 0:  # under torchrun rank 0 reports for every rank
        return res
    lay = res.layout
    print(f"converted {args.src} ({res.source_format}, TP={lay['tp']} GTP={lay['gtp']} DP={lay['dp']} "
          f"EP={lay['ep']}, step {res.step}) -> {res.dst}: {res.params} params, {res.arrays} arrays, "
          f"{res.bytes / 2**20:.1f} MiB")
    given, inferred = split_notes(res.inferred)
    if given:
        print("given: " + ", ".join(given))
    if inferred:
        print("inferred: " + ", ".join(inferred))
    if res.ranks:
        from converters.megatron.distributed import phases_line, rank_summary

        print(rank_summary(res.ranks, sum(res.timings.values())))
        print(phases_line(res.ranks))
    return res


def dry_run(args: argparse.Namespace) -> int:
    """`convert --dry-run`: plan from SRC's metadata, print it; nothing is written or claimed."""
    import contextlib
    import sys

    from bridge.commands.summary import dry_run_json, emit, print_dry_run
    from bridge.location import absolute, join
    from bridge.store import check_destination_free, check_sources
    from converters.megatron.convert import plan_conversion
    from converters.megatron.plan.fact_sources import fact_sources

    with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
        _locate(args)
        cp = plan_conversion(args.src, _options(args))
    dst = absolute(args.dst)
    if args.orbax_manager:  # the step directory the real run would commit (Orbax's default item name)
        from bridge.errors import BridgeError
        from bridge.store import ITEM

        if cp.step is None:
            raise BridgeError("the checkpoint records no step, so it cannot become a step of an Orbax "
                              "CheckpointManager root; write it to a plain directory instead")
        dst = join(dst, str(cp.step), ITEM)
    check_destination_free(dst)
    check_sources(dst, [args.src])
    rep = dry_run_json(cp, args.src, dst, fact_sources(cp.src, cp.hints))
    if args.json:
        emit(rep)
    else:
        print_dry_run(rep, sys.stdout)
    return 0
