"""What --help offers is what the command line accepts (issue #30, item 6).

- Every example line of every --help (the top level's and each command's) is read as a shell reads
  it (`shlex`, `#` starts a comment, a pipe ends the command) and parsed by the real parser: trailing
  prose pasted along with an example would be taken as arguments and refused.
- `to-megatron --megatron-core` offers exactly the releases that load a format to-megatron writes
  (`converters.megatron.write.torch_dist.RELEASES`), so nothing --help lists is refused afterwards.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import shlex

import pytest

from bridge.cli import build_parser


def _help_texts() -> dict[str, str]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    texts = {"gtp-bridge": parser.format_help()}
    texts.update({name: p.format_help() for name, p in sub.choices.items()})
    return texts


def example_lines(text: str) -> list[str]:
    """The example commands of one --help text: lines that start with `gtp-bridge ` after indentation."""
    return [ln.strip() for ln in text.splitlines() if ln.strip().startswith("gtp-bridge ")]


def as_shell_words(line: str) -> list[str]:
    """A pasted example as the shell splits it: comments dropped, up to the first pipe.

    >>> as_shell_words("gtp-bridge inspect ckpt/ --json | jq .arrays  # note")
    ['gtp-bridge', 'inspect', 'ckpt/', '--json']
    """
    words = shlex.split(line, comments=True)
    return words[:words.index("|")] if "|" in words else words


EXAMPLES = sorted({(cmd, ln) for cmd, text in _help_texts().items() for ln in example_lines(text)})


def test_every_command_shows_examples():
    shown = {cmd for cmd, _ in EXAMPLES}
    assert set(_help_texts()) <= shown, set(_help_texts()) - shown


@pytest.mark.parametrize("cmd,line", EXAMPLES, ids=[f"{c}:{i}" for i, (c, _) in enumerate(EXAMPLES)])
def test_help_example_parses(cmd, line):
    words = as_shell_words(line)
    assert words[0] == "gtp-bridge", line
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            build_parser().parse_args(words[1:])
        except SystemExit as e:
            pytest.fail(f"--help of {cmd} shows {line!r}, which the parser refuses: {err.getvalue().strip()} "
                        f"(exit {e.code})")


def test_megatron_core_offers_only_loadable_releases():
    from converters.megatron.write.torch_dist import RELEASES

    loadable = sorted(r for r, formats in RELEASES.items() if formats)
    p = build_parser()
    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    action = next(a for a in sub.choices["to-megatron"]._actions if "--megatron-core" in a.option_strings)
    assert sorted(action.choices) == loadable
    for release in action.choices:  # each offered release is accepted with the default format
        args = p.parse_args(["to-megatron", "a", "b", "--tp", "1", "--megatron-core", release])
        assert args.fmt in RELEASES[args.release]
