"""bridge/format owns the logical tree's schema and the manifest's keys: nobody else spells them.

The names are the on-disk format (Orbax keys, manifest JSON keys); a literal anywhere else is a
second copy of the format that can drift. The scan reads every string constant of bridge/ and
converters/ (docstrings and command-line help aside) except bridge/format/ (the owner) and bridge/testing/ (the test
harness). Where the same word is another library's name (torch's param-group `params` / `step`,
a mesh axis called `model`), the line says so with a `# foreign: <whose name>` comment, or the
module is listed in FOREIGN_MODULES with its reason.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from bridge.format import manifest, schema, seal

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("bridge", "converters")
OWNERS = ("bridge/format/", "bridge/testing/")

# Tree roots and Adam state names (bridge.format.schema) and the manifest's own keys (bridge.format.manifest,
# bridge.format.seal): spelled here independently, so a renamed constant does not silently shrink the scan.
TREE_WORDS = {"params", "model", "step", "opt_state", "mu", "nu", "count"}
MANIFEST_WORDS = {"gtp_bridge", "gtp_bridge_checksum", "previous_source", "optimizer_extra",
                  "pad_for_alignment_values", "wd_mult_zero_params", "extra_state_keys", "extra_state_payload"}

# Modules that speak torch's optimizer API, where `params` / `step` / `model` are torch's or Megatron's
# names (param_groups' keys, optimizer state keys, sharded-state-dict paths, module wrappers).
FOREIGN_MODULES = {
    "converters/megatron/live/adapter.py": ({"params", "step", "model"}, "torch param_groups / optimizer state keys, "
                                                       "Megatron sharded-state-dict paths and module wrappers"),
    "converters/megatron/plan/format.py": ({"params", "step", "model"}, "torch param_groups keys, Megatron module wrappers"),
}


HELP_KEYWORDS = {"help", "epilog", "description", "usage"}   # argparse text: documentation, like docstrings
HELP_NAMES = {"EPILOG", "DESCRIPTION", "USAGE", "HELP"}


def _documentation(tree: ast.AST) -> set[int]:
    """ids of the string constants that document rather than name: docstrings and command-line help."""
    out = set()

    def strings(node):
        return [n for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)]

    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
        elif isinstance(node, ast.keyword) and node.arg in HELP_KEYWORDS:
            out.update(id(n) for n in strings(node.value))
        elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id in HELP_NAMES for t in node.targets):
            out.update(id(n) for n in strings(node.value))
    return out


def schema_literals(rel: str, source: str) -> list[str]:
    """`file:line: 'word'` for every string constant that spells the schema outside its owner.

    >>> schema_literals("x.py", 'p = ("opt_state", "0", "mu")\\nq = "model"  # foreign: mesh axis\\n')
    ["x.py:1: 'opt_state'", "x.py:1: 'mu'"]
    >>> schema_literals("x.py", 'raise E(f"no opt_state/0/count in {d}")\\n')
    ["x.py:1: 'no opt_state/0/count in '"]
    >>> schema_literals("x.py", 'p.add_argument("--only", help="e.g. opt_state/0/nu/*")\\n')
    []
    """
    tree = ast.parse(source)
    lines = source.splitlines()
    skip = _documentation(tree)
    allowed, _why = FOREIGN_MODULES.get(rel, (set(), ""))
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Constant) and isinstance(node.value, str)) or id(node) in skip:
            continue
        s = node.value
        hit = (s in TREE_WORDS and s not in allowed) or s in MANIFEST_WORDS or "opt_state/" in s or "opt_state." in s
        if hit and "# foreign:" not in lines[node.lineno - 1]:
            found.append((node.lineno, node.col_offset, f"{rel}:{node.lineno}: {s!r}"))
    return [f for _, _, f in sorted(found)]


def _modules() -> list[Path]:
    files = [p for d in SCANNED for p in sorted((ROOT / d).rglob("*.py"))]
    return [p for p in files if not p.relative_to(ROOT).as_posix().startswith(OWNERS)]


def test_scan_covers_the_code():
    rels = {p.relative_to(ROOT).as_posix() for p in _modules()}
    # the modules that used to spell the tree (issue #19) are all scanned; the owner is not
    for rel in ("bridge/live/holdings.py", "bridge/live/export.py", "bridge/live/reload.py", "bridge/jaxside/abstract.py",
                "bridge/jaxside/save.py", "bridge/jaxside/restore.py", "bridge/jaxside/manifest_view.py",
                "bridge/commands/inspect.py", "converters/megatron/plan/convert_plan.py", "converters/megatron/convert.py",
                "converters/megatron/write/torch_dist.py", "converters/megatron/plan/write_plan.py"):
        assert rel in rels, rel
    assert not any(r.startswith("bridge/format/") for r in rels)
    assert set(FOREIGN_MODULES) <= rels, "a FOREIGN_MODULES entry names a module that no longer exists"


def test_the_words_are_the_formats():
    """The scanned words are exactly what bridge/format defines (so the scan follows the format)."""
    assert {schema.PARAMS, schema.MODEL, schema.STEP, schema.OPT_STATE, schema.MU, schema.NU, schema.COUNT} == TREE_WORDS
    assert {manifest.MANIFEST_KEY, seal.CHECKSUM_KEY, manifest.PREVIOUS_SOURCE_KEY, manifest.OPTIMIZER_EXTRA_KEY,
            manifest.PADS_KEY} <= MANIFEST_WORDS


@pytest.mark.parametrize("path", _modules(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_schema_literal_outside_bridge_format(path):
    rel = path.relative_to(ROOT).as_posix()
    found = schema_literals(rel, path.read_text())
    assert not found, ("tree roots / manifest keys spelled outside bridge/format (use bridge.format.schema / "
                       "bridge.format.manifest; mark another library's same-named key with '# foreign: <whose>'):\n  "
                       + "\n  ".join(found))


def test_scan_finds_literals_and_spares_documentation():
    """The scanner itself: paths, roles, messages and manifest keys are caught; docs and marked foreign names not."""
    src = '''"""Module docs may say opt_state/0/mu."""
P = ("params",)
ROLES = {"model": 1, "mu": 2}
K = m["gtp_bridge"]
raise E(f"{d} has no opt_state/0/count")
AXES = ("data", "model")  # foreign: mesh axis names
p.add_argument("--only", help="e.g. 'opt_state/0/nu/*'")
def f():
    """Returns step."""
    return g["step"]
'''
    assert schema_literals("m.py", src) == [
        "m.py:2: 'params'", "m.py:3: 'model'", "m.py:3: 'mu'", "m.py:4: 'gtp_bridge'", "m.py:5: ' has no opt_state/0/count'",
        "m.py:10: 'step'"]
    # a module declared foreign may use torch's same-named keys, and nothing else
    assert schema_literals("converters/megatron/live/adapter.py", 'g["step"]; g["params"]; s["mu"]\n') == \
        ["converters/megatron/live/adapter.py:1: 'mu'"]


def test_scheduler_record_is_the_dataclass_in_the_order_convert_wrote():
    """`scheduler_record` builds a SchedulerRecord (no hand copy of its fields); its JSON keys keep the
    order the converter has always written (an unsorted JSON file: byte-identical checkpoints)."""
    from dataclasses import fields

    from bridge.format.scheduler import SchedulerRecord
    from converters.megatron.convert import scheduler_record

    sd = {"start_lr": 1e-3, "min_lr": 1e-5, "warmup_iter": 80, "end_iter": 800, "decay_style": "cosine", "num_iters": 240,
          "start_wd": 0.0, "end_wd": 0.1, "wd_incr_steps": 800, "wd_incr_style": "linear"}
    rec = scheduler_record({"opt_param_scheduler": sd}, {"global_batch_size": 8, "train_iters": 100}, 30)
    assert list(rec) == ["version", "max_lr", "min_lr", "lr_warmup_steps", "lr_decay_steps", "lr_decay_style",
                         "num_steps", "start_wd", "end_wd", "wd_incr_steps", "wd_incr_style", "init_lr", "wsd_decay_steps",
                         "lr_wsd_decay_style", "increment", "rampup_samples", "at_count"]
    assert list(rec) == [f.name for f in fields(SchedulerRecord)]
    assert SchedulerRecord.from_json(rec).to_json() == rec
    assert (rec["max_lr"], rec["lr_warmup_steps"], rec["num_steps"], rec["end_wd"], rec["increment"], rec["at_count"]) \
        == (1e-3, 80, 240, 0.1, 8, 30)
