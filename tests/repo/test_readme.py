"""The README's Python blocks run as written, in order, in a fresh process and an empty directory.

The blocks check their own results against independent reads (plain Orbax restore, TensorStore
bytes), so running them is the test; this file also checks they got to the end. One block is
marked as needing Megatron-Core on GPUs and is not run; nothing else may be skipped.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
README = os.path.join(REPO, "README.md")
NOT_RUN = "# Not run by tests/repo/test_readme.py"


def python_blocks(text: str) -> list[str]:
    """Every ```python fenced block of a markdown text, in order.

    >>> python_blocks("a\\n```python\\nx = 1\\n```\\n```bash\\nls\\n```\\n```python\\ny = x\\n```\\n")
    ['x = 1\\n', 'y = x\\n']
    """
    return re.findall(r"^```python[ \t]*\n(.*?)^```[ \t]*$", text, flags=re.S | re.M)


def test_repository_stands_alone():
    """No source, script, doc or notebook points outside the repository (to a sibling `shared` folder)."""
    outside = ("../" + "shared", "/work/" + "shared")  # split so this file does not match itself
    hits = []
    for root, dirs, files in os.walk(REPO):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in ("fixtures", "__pycache__", "results")]
        for f in files:
            if f.endswith((".py", ".md", ".sh", ".ipynb", ".toml", ".txt", ".cfg")) or f == "Makefile":
                path = os.path.join(root, f)
                text = open(path, encoding="utf-8", errors="replace").read()
                hits += [f"{os.path.relpath(path, REPO)}: {o}" for o in outside if o in text]
    assert not hits, hits


@pytest.mark.slow
def test_readme_python_blocks_run_as_written(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("orbax.checkpoint")
    blocks = python_blocks(open(README, encoding="utf-8").read())
    run = [b for b in blocks if not b.lstrip().startswith(NOT_RUN)]
    assert len(blocks) - len(run) == 1, "exactly one block (live Megatron export) may be left out"
    assert len(run) >= 5 and sum(b.count("assert ") for b in run) >= 4
    script = tmp_path / "readme_blocks.py"
    done = "README-BLOCKS-DONE"
    script.write_text("\n\n".join(run) + f"\nprint({done!r})\n", encoding="utf-8")
    work = tmp_path / "work"
    work.mkdir()
    env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=8")
    r = subprocess.run([sys.executable, str(script)], cwd=work, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    assert r.stdout.rstrip().endswith(done)
    # a clean walk-through: none of Orbax's warnings about restores it could not do or had to guess
    assert not re.search(r"could not be restored|unsafe when restoring|Sharding info not provided", r.stderr), r.stderr
    assert "bit-exact" in r.stdout
    # the blocks wrote where they say, relative to the working directory
    for d in ("logical", "megatron_tp2_dp2", "after_jax_step", "jax_run", "megatron_gtp2", "after_jax_step_again"):
        assert (work / d).is_dir(), d


def test_readme_python_imports_only_the_facade():
    """The README's Python blocks import gtp-bridge only as `bridge` (the facade): no sub-module, no
    `converters`; every name they take from it exists."""
    import ast

    import bridge

    blocks = python_blocks(open(README, encoding="utf-8").read())
    used = set()
    for block in blocks:
        for node in ast.walk(ast.parse(block)):
            if isinstance(node, ast.ImportFrom):
                mods = [node.module or ""]
                used.update(a.name for a in node.names if node.module == "bridge")
            elif isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            else:
                continue
            for m in mods:
                top = m.split(".")[0]
                assert top != "converters" and (top != "bridge" or m == "bridge"), f"README imports {m}"
    assert used and all(hasattr(bridge, n) for n in used), sorted(n for n in used if not hasattr(bridge, n))


def test_readme_block_not_run_calls_the_facade_as_documented():
    """The one block that needs Megatron-Core on GPUs still names real functions with arguments
    their signatures accept (it cannot run here, so its calls are bound, not executed)."""
    import ast
    import inspect

    import bridge

    block = next(b for b in python_blocks(open(README, encoding="utf-8").read()) if b.lstrip().startswith(NOT_RUN))
    calls = [n for n in ast.walk(ast.parse(block)) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
             and hasattr(bridge, n.func.id)]  # the facade's functions (not the training loop's own)
    assert {c.func.id for c in calls} == {"export_megatron", "load_megatron", "AsyncSave"}
    for c in calls:
        args = [ast.literal_eval(a) if isinstance(a, ast.Constant) else object() for a in c.args]
        inspect.signature(getattr(bridge, c.func.id)).bind(*args, **{k.arg: None for k in c.keywords})
        assert isinstance(args[0], str), f"{c.func.id}: the checkpoint path comes first"


def test_readme_paths_exist():
    """Every repository path the README names (in backticks) exists; globs match something."""
    import glob

    text = open(README, encoding="utf-8").read()
    paths = set(re.findall(r"`((?:bridge|converters|docs|scripts|tests|benchmarks|notebooks)/[^`\s]*)`", text))
    assert len(paths) > 20
    missing = [p for p in sorted(paths) if not glob.glob(os.path.join(REPO, p.replace("|", "*")))]
    assert not missing, missing


def command_blocks(ref: str) -> dict[str, str]:
    """Each subcommand's text in a command reference: its `gtp-bridge SUB` line and the indented
    lines that follow it, up to the next `gtp-bridge` line.

    >>> command_blocks("gtp-bridge a X [--b]\\n    text --c\\ngtp-bridge --version\\ngtp-bridge d\\n")
    {'a': ' X [--b]\\n    text --c', 'd': ''}
    """
    blocks: dict[str, str] = {}
    for m in re.finditer(r"^gtp-bridge (\S+)(.*?)(?=^gtp-bridge |\Z)", ref, flags=re.M | re.S):
        if not m.group(1).startswith("-"):
            blocks[m.group(1)] = m.group(2).rstrip("\n")
    return blocks


def test_readme_command_reference_matches_the_parser():
    """The README's command reference shows every subcommand and every flag of `gtp-bridge`'s parser
    (an alias is enough), and nothing the parser lacks."""
    import argparse

    from bridge.cli import build_parser

    text = open(README, encoding="utf-8").read()
    ref = text[text.index("## Command reference"):]
    ref = ref[ref.index("```") + 3:]
    ref = ref[:ref.index("```")]
    parser = build_parser()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    top = {o for a in parser._actions for o in a.option_strings} - {"-h", "--help"}
    assert set(re.findall(r"^gtp-bridge (--[a-z-]+)", ref, flags=re.M)) == top  # --debug, --version
    shown = command_blocks(ref)
    assert set(shown) == set(subs)  # every command documented, none invented
    for sub, block in shown.items():
        flags = set(re.findall(r"(--[a-z][a-z-]*)", block))
        actions = [a.option_strings for a in subs[sub]._actions
                   if a.option_strings and not set(a.option_strings) & {"-h", "--debug"}]
        known = {o for names in actions for o in names}
        assert flags <= known, (sub, sorted(flags - known))
        missing = [names[-1] for names in actions if not set(names) & flags]
        assert not missing, (sub, missing)
