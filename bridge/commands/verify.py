"""`gtp-bridge verify DIR`: re-read every array; exit 0 intact, 1 damaged (naming each array), 2 bad usage."""

from __future__ import annotations

import argparse
import sys

from bridge.errors import BridgeError
from bridge.store import verify_checkpoint


def add_parser(sub) -> None:
    p = sub.add_parser("verify", help="full integrity check of a checkpoint",
                       description="Re-read every array of a checkpoint (each stored byte once, in parallel) and "
                                   "compare it with the recorded shapes, dtypes and digests; check the metadata "
                                   "checksum. Exit 0 intact, 1 damaged (data or metadata), 2 bad usage (DIR is "
                                   "not a checkpoint directory).",
                       epilog="examples:\n  gtp-bridge verify logical_ckpt/\n"
                              "  gtp-bridge verify logical_ckpt/ --json | jq .damaged     # one JSON object",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir", help="checkpoint directory")
    p.add_argument("--threads", type=int, default=None, help="parallel reads (default: 2 per CPU, 4..32)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object on stdout (ok, arrays checked, damaged arrays); other lines go to stderr")
    p.set_defaults(func=run)


def run(args) -> int:
    from bridge.commands.summary import run_reporting, verify_json

    return run_reporting(args, lambda: _verify(args), lambda res: verify_json(args.dir, res),
                         lambda res: 0 if res.ok else 1)


def _verify(args):
    if args.threads is not None and args.threads < 1:
        raise BridgeError(f"--threads must be >= 1, got {args.threads}")
    from bridge.torchrun import command_ranks

    with command_ranks(f"verify {args.dir}") as ranks:  # under torchrun: each rank reads a share
        res = verify_checkpoint(args.dir, threads=args.threads, coordinator=ranks.coord if ranks else None)
        if ranks is not None and ranks.rank != 0:  # rank 0 reports for every rank, all exit alike
            return res
    for problem in res.metadata_problems:
        print(f"DAMAGED metadata: {problem}")
    for name, why in sorted(res.damaged.items()):
        print(f"DAMAGED {name}: {why}")
    if res.ok:
        note = "" if res.has_manifest else " (no gtp-bridge manifest: read check only, no digests)"
        print(f"OK: {res.checked} arrays intact{note}")
        return res
    print(f"{len(res.damaged)} of {res.checked} arrays damaged" +
          (", metadata damaged" if res.metadata_problems else ""), file=sys.stderr)
    return res
