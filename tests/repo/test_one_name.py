"""One name per concept across the layers, the memory arithmetic in one place, options objects for
convert's writers (issue 32, item 4).

- Writer commits in flight are `commit_depth` everywhere (they were `device_commits` in
  ExportOptions, `commits_in_flight` in StagedWriter); a memory budget is `budget` (it was
  `inflight_bytes`, `budget_bytes` depending on the entry point); bytes per writer transaction are
  `batch_bytes` (CheckpointWriter's `inflight_bytes`). The retired names appear in `bridge/` and
  `converters/` only where a public keyword still accepts its former name with a
  DeprecationWarning (a function or class that calls `bridge.renamed.renamed`). Kept on purpose:
  `save` / `restore`'s `concurrent_gb` (Orbax's own name and unit, handed to Orbax as is) and
  `verify_checkpoint`'s `block_bytes` (a read block's size, not a budget).
- The split of a budget (per writer process, block / cache / batch, a live export's batch and
  staging buffers) is defined in `bridge/budget.py` only.
"""

from __future__ import annotations

import ast
import dataclasses
import doctest
import inspect
import warnings
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("bridge", "converters")
RETIRED = {"device_commits", "commits_in_flight", "inflight_bytes", "budget_bytes", "writer_batch_bytes"}
# the budget's arithmetic: defined in bridge/budget.py and nowhere else
SPLITTERS = {"split_share", "ShareSplit", "Share", "writer_batch_bytes", "export_split", "staged_split",
             "staging_buffers", "per_worker", "MIN_BATCH_BYTES"}


def _sources():
    for pkg in PACKAGES:
        for path in sorted((REPO / pkg).rglob("*.py")):
            yield path, ast.parse(path.read_text(), str(path))


def _names(node: ast.AST):
    """(identifier, line) of every name bound or used under `node` (strings and comments excluded)."""
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            yield n.id, n.lineno
        elif isinstance(n, ast.arg):
            yield n.arg, n.lineno
        elif isinstance(n, ast.keyword) and n.arg:
            yield n.arg, n.value.lineno
        elif isinstance(n, ast.Attribute):
            yield n.attr, n.lineno
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield n.name, n.lineno


def _calls_renamed(node: ast.AST) -> bool:
    return any(isinstance(c, ast.Call) and isinstance(c.func, ast.Name) and c.func.id == "renamed"
               for c in ast.walk(node))


def retired_uses(tree: ast.AST) -> list[tuple[str, int]]:
    """Retired names used outside a deprecation site (a top-level function or class that calls
    `renamed`, where the former keyword is taken and passed on).

    >>> retired_uses(ast.parse("def f(budget=None, inflight_bytes=None):\\n    return renamed('f', 'inflight_bytes', 'budget', inflight_bytes, budget)"))
    []
    >>> retired_uses(ast.parse("w = Writer(inflight_bytes=4)\\nx = w.commits_in_flight"))
    [('inflight_bytes', 1), ('commits_in_flight', 2)]
    """
    found = []
    for top in tree.body:
        if isinstance(top, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and _calls_renamed(top):
            continue
        found += [(name, line) for name, line in _names(top) if name in RETIRED]
    return sorted(found, key=lambda x: x[1])


def test_retired_names_only_at_deprecation_sites():
    offenders = [f"{path.relative_to(REPO)}:{line}: {name}"
                 for path, tree in _sources() for name, line in retired_uses(tree)]
    assert offenders == []


def test_the_budget_split_is_defined_once():
    where = {}
    for path, tree in _sources():
        for n in ast.walk(tree):
            defined = ([n.name] if isinstance(n, (ast.FunctionDef, ast.ClassDef)) else
                       [t.id for t in n.targets if isinstance(t, ast.Name)] if isinstance(n, ast.Assign) else [])
            for name in set(defined) & SPLITTERS:
                where.setdefault(name, []).append(str(path.relative_to(REPO)))
    assert {name: files for name, files in where.items() if files != ["bridge/budget.py"]} == {}
    assert set(where) == SPLITTERS - {"Share", "writer_batch_bytes"}


def test_budget_splits_as_the_fractions_say():
    """A second computation of the rules the three layers used (convert's and the streamed MaxText
    conversion's sixteenth / twentieth, the live export's quarter)."""
    from bridge.budget import MIN_BATCH_BYTES, export_split, per_worker, split_share, staging_buffers

    for share in (1, 4095, 64 << 10, 1 << 20, 21 << 20, 192 << 20, (3 << 30) + 7):
        s = split_share(share)
        assert (s.block, s.cache, s.batch) == (max(1, share // 16), max(1, share // 16),
                                               max(share // 20, MIN_BATCH_BYTES))
        assert split_share(share, min_block=4096).block == max(4096, share // 16)
    for budget, depth in ((256 << 20, 2), (1 << 30, 1), (4096, 3), (3, 2)):
        e = export_split(budget, depth)
        assert e.batch == max(1, budget // 4) and e.staging == (depth + 2) * e.batch
        assert staging_buffers(depth) == depth + 2
    assert per_worker(1 << 30, 3) == (1 << 30) // 3 and per_worker(5, 8) == 1


def test_export_options_former_names_warn_and_mean_the_same():
    pytest.importorskip("torch")
    from bridge.errors import BridgeError
    from bridge.live.export import ExportOptions, _options

    fields = {f.name for f in dataclasses.fields(ExportOptions)}
    assert {"budget", "commit_depth"} <= fields and not fields & RETIRED
    with pytest.warns(DeprecationWarning, match=r"device_commits= is deprecated, pass commit_depth="):
        old = ExportOptions(device_commits=1, inflight_bytes=None)
    assert old == ExportOptions(commit_depth=1)
    with pytest.warns(DeprecationWarning, match=r"inflight_bytes= is deprecated, pass budget="):
        assert _options(None, {"inflight_bytes": 4096}) == ExportOptions(budget=4096)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new names, and copies of options, warn nothing
        opts = dataclasses.replace(ExportOptions(budget=1 << 20, commit_depth=3), timeout=5.0)
    assert (opts.budget, opts.commit_depth) == (1 << 20, 3)
    with pytest.raises(BridgeError, match="pass commit_depth= only"):
        ExportOptions(commit_depth=3, device_commits=1)


def test_reload_former_keyword_warns_and_both_are_refused(tmp_path):
    pytest.importorskip("torch")
    from bridge.errors import BridgeError
    from bridge.live.reload import reload_state
    from converters.megatron.live.adapter import load_megatron

    for fn in (reload_state, load_megatron):
        assert "budget" in inspect.signature(fn).parameters
    missing = str(tmp_path / "nothing")
    with pytest.warns(DeprecationWarning, match="reload_state: inflight_bytes= is deprecated"), \
            pytest.raises(BridgeError):  # the warning comes first, then the missing checkpoint
        reload_state(missing, None, [], inflight_bytes=1 << 20)
    with pytest.raises(BridgeError, match="pass budget= only"):
        reload_state(missing, None, [], budget=1, inflight_bytes=1)


def test_convert_writers_get_one_options_object():
    """convert's writer chain takes a WriterJob, not 10-11 positional arguments."""
    pytest.importorskip("torch")
    from converters.megatron import convert, writer_procs
    from converters.megatron.writer_job import WriterJob

    chain = [convert.write_share, convert.run_blocks, convert._write_blocks, writer_procs.run_parallel,
             writer_procs._worker_main]
    too_long = {f.__name__: len(inspect.signature(f).parameters) for f in chain
                if len(inspect.signature(f).parameters) > 7}
    assert too_long == {}
    for f in chain[1:]:
        assert "job" in inspect.signature(f).parameters, f.__name__
    assert dataclasses.is_dataclass(WriterJob)


@pytest.mark.parametrize("module", ["bridge.budget", "bridge.renamed", __name__])
def test_docstring_examples(module):
    import importlib

    res = doctest.testmod(importlib.import_module(module))
    assert res.attempted > 0 and res.failed == 0
