"""The `gtp-bridge` command line.

Each subcommand lives in `bridge/commands/<name>.py` and exposes
`add_parser(subparsers)` (registering itself, with examples in its epilog, lines starting with
`  gtp-bridge`) and `run(args) -> int`.

Error contract (docs/format.md): bad usage or bad input prints ONE line `gtp-bridge: error: ...` on stderr
and exits 2 (`IntegrityError`: exit 1); `--debug` (before or after the subcommand) shows the
traceback instead. Progress bars appear only on a terminal (`bridge.progress`), so piped output is
just the result.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import re
import sys
from typing import Callable, NoReturn

from bridge import __version__
from bridge.errors import NO_SPACE, BridgeError, write_failure

# Order is the order shown in --help.
COMMANDS = ["convert", "to_megatron", "maxtext", "inspect", "verify", "diff", "demo"]

class _Parser(argparse.ArgumentParser):
    """ArgumentParser whose usage errors are one line (plus where to look), exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    """The full parser: every built subcommand, `--debug` accepted before or after it, examples in --help."""
    parser = _Parser(
        prog="gtp-bridge",
        description="Move Megatron-Core (GTP) training state to and from JAX as global logical arrays.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    parser.add_argument("--version", action="version", version=f"gtp-bridge {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name in COMMANDS:
        importlib.import_module(f"bridge.commands.{name}").add_parser(sub)
    for p in sub.choices.values():
        if "--debug" in p._option_string_actions:
            continue
        # SUPPRESS keeps a top-level --debug from being reset by the subparser's default.
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks on errors")
    parser.epilog = examples_text(sub.choices)
    return parser


def examples_text(choices: dict[str, argparse.ArgumentParser]) -> str:
    """'examples:' block with the first example of each subcommand's epilog, aligned.

    An epilog example line is `  gtp-bridge ...` optionally followed by two or more spaces and a comment.
    """
    pairs = []
    for p in choices.values():
        ex = next((ln.strip() for ln in (p.epilog or "").splitlines() if ln.strip().startswith("gtp-bridge ")), None)
        if ex:
            cmd, note = (re.split(r"\s{2,}", ex, maxsplit=1) + [""])[:2]
            pairs.append((cmd.strip(), note.strip()))
    width = max((len(c) for c, _ in pairs), default=0)
    lines = ["examples:"] + [f"  {c.ljust(width)}  {n}".rstrip() for c, n in pairs]
    lines.append("Run `gtp-bridge COMMAND --help` for each command's options and more examples.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point: parse, run the subcommand, turn errors into one line and an exit code."""
    rc = run(build_parser, argv)
    if argv is None:   # the program itself (not a caller's argv): a torchrun rank leaves at once
        from bridge.torchrun import leave_launch

        leave_launch(rc)
    return rc


def run(make_parser: Callable[[], argparse.ArgumentParser], argv: list[str] | None = None) -> int:
    """`main` with the parser `make_parser()` builds: its subcommand's errors become one line and an exit code."""
    debug = "--debug" in (sys.argv[1:] if argv is None else argv)
    _show_notes()
    try:
        parser = make_parser()
        args = parser.parse_args(argv)
        if not getattr(args, "command", None):
            parser.print_help(sys.stderr)
            return 2
        return int(args.func(args) or 0)
    except BridgeError as e:
        if debug:
            raise
        _error_line(_one_line(str(e)))
        return e.exit_code
    except KeyboardInterrupt:
        print("gtp-bridge: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0  # `gtp-bridge inspect ... | head`: the reader left; not an error
    except OSError as e:
        if debug:
            raise
        if e.errno in NO_SPACE:
            _error_line(write_failure(e.filename or 'the destination', e))
            return 2
        _error_line(f"{_one_line(str(e))} (check the path and permissions)")
        return 2
    except Exception as e:  # a bug or an input we failed to classify: still one line, traceback on --debug
        if debug:
            raise
        _error_line(f"unexpected {type(e).__name__}: {_one_line(str(e))} (rerun with --debug for the traceback)")
        return 2


def _error_line(message: str) -> None:
    """The one error line, written in one call: the ranks of a torchrun launch share stderr, and
    print's two writes (text, then newline) on an unbuffered stream interleave their lines."""
    sys.stderr.write(f"gtp-bridge: error: {message}\n")
    sys.stderr.flush()


def _show_notes() -> None:
    """Library notes (logger "bridge", INFO: e.g. which step of an Orbax manager root is read) go to stderr."""
    log = logging.getLogger("bridge")
    if not any(isinstance(h, _StderrNotes) for h in log.handlers):
        log.addHandler(_StderrNotes())
    log.setLevel(logging.INFO)


class _StderrNotes(logging.Handler):
    """Writes to the current sys.stderr (not the one at set-up: tests and callers swap it)."""

    def emit(self, record: logging.LogRecord) -> None:
        print(f"gtp-bridge: {record.getMessage()}", file=sys.stderr)


def _one_line(text: str) -> str:
    """First non-empty line of an error message (tensorstore and friends return multi-line text)."""
    return next((ln.strip() for ln in text.splitlines() if ln.strip()), "")


if __name__ == "__main__":
    sys.exit(main())
