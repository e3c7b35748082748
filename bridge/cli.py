"""The `gtp-bridge` command line.

Each subcommand lives in `bridge/commands/<name>.py` and exposes
`add_parser(subparsers)` (registering itself, with an example in its epilog) and `run(args) -> int`.
Errors: a `BridgeError` prints one line `gtp-bridge: error: ...` and exits with its code (2 for bad
input, 1 for damaged data); `--debug` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from bridge.errors import BridgeError

# Order is the order shown in --help.
COMMANDS = ["convert", "to_megatron", "inspect", "verify", "diff", "demo"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gtp-bridge",
        description="Move Megatron-Core (GTP) training state to and from JAX as global logical arrays.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"bridge.commands.{name}")
        except ModuleNotFoundError as e:
            if e.name == f"bridge.commands.{name}":
                continue  # command not built yet
            raise
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except BridgeError as e:
        if args.debug:
            raise
        print(f"gtp-bridge: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("gtp-bridge: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
