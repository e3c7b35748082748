"""Every registered subcommand keeps the docs/format.md error contract on bad input.

Bad input -> exit 2, exactly one stderr line `gtp-bridge: error: ...` (no traceback), nothing left at
the destination.
"""

from __future__ import annotations

import os

import pytest

from bridge import cli
from inspect_fixtures import run_cli

REGISTERED = set(cli.build_parser()._subparsers._group_actions[0].choices)

# command -> argv builder(tmp) for input that does not exist / is not a checkpoint, and the destination
BAD_INPUT = {
    "convert": lambda t: (["convert", str(t / "missing_src"), str(t / "dst")], t / "dst"),
    "to-megatron": lambda t: (["to-megatron", str(t / "missing_src"), str(t / "dst"), "--tp", "1"], t / "dst"),
    "inspect": lambda t: (["inspect", str(t / "missing")], None),
    "verify": lambda t: (["verify", str(t / "missing")], None),
    "diff": lambda t: (["diff", str(t / "missing_a"), str(t / "missing_b")], None),
}


@pytest.mark.parametrize("command", sorted(BAD_INPUT))
def test_bad_input_contract(command, tmp_path):
    argv, dst = BAD_INPUT[command](tmp_path)
    r = run_cli(*argv)
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("gtp-bridge: error: "), r.stderr
    assert "missing" in lines[0]  # names the bad path
    if dst is not None:
        assert not os.path.lexists(dst) and not any(p.name.startswith("dst") for p in tmp_path.iterdir())


def test_every_command_has_help_and_debug():
    parser = cli.build_parser()
    for name, sub in parser._subparsers._group_actions[0].choices.items():
        assert sub.format_help().strip(), name
        assert "--debug" in sub._option_string_actions, name  # `gtp-bridge CMD ... --debug` works everywhere
    top = parser.format_help().split("examples:", 1)[1]
    assert all(f"gtp-bridge {name}" in top for name in REGISTERED)
