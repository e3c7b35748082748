"""No test or benchmark changes product code's module state (issue 19: switches are options and seams).

A patched module global leaks into every later test in the process and hides the option the
product lacks; what a test needs to vary goes through an argument (`to_megatron(open_file=...)`,
`ExportOptions(...)`, `CheckpointWriter(target_data_file_size=...)`, or a test seam set for a block
with `bridge._testing.seams(...)`). The scan reads every .py file
under tests/, benchmarks/ and scripts/ (and the Python programs they hold in string literals, run in
subprocesses) with `ast` and refuses:

- `monkeypatch.setattr/delattr/setitem/delitem` and `mock.patch(.object/.dict)` on a product module or
  anything imported from one (or a "bridge.…" / "converters.…" target string);
- `setattr` / `delattr` on those, and assignments to their attributes (`specs.X = …`);
Environment variables (`monkeypatch.setenv`), the working directory and third-party modules stay allowed.
"""

from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PRODUCT = ("bridge", "converters")
SCANNED = ("tests", "benchmarks", "scripts")
PATCHERS = {"setattr", "delattr", "setitem", "delitem"}            # monkeypatch.<these>
MOCKS = {"patch", "object", "dict"}                                # mock.patch, mock.patch.object, mock.patch.dict


def _is_product(module: str | None) -> bool:
    return bool(module) and module.split(".")[0] in PRODUCT


def _root(node: ast.AST) -> str | None:
    """The name an attribute / subscript chain starts from (`a` of `a.b[c].d`)."""
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _aliases(target: ast.AST, value: ast.AST, names: set[str]) -> list[str]:
    """Names `target = value` makes aliases of product objects: `cls = mw.DcpFile`,
    `cls, meth = (mw.DcpFile, "tensor") if ... else (...)`; not a call's result (an instance)."""
    if isinstance(value, ast.IfExp):
        return _aliases(target, value.body, names) + _aliases(target, value.orelse, names)
    if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple) and len(target.elts) == len(value.elts):
        return [n for t, v in zip(target.elts, value.elts) for n in _aliases(t, v, names)]
    chain = value
    while isinstance(chain, ast.Attribute):
        chain = chain.value
    if isinstance(target, ast.Name) and isinstance(chain, ast.Name) and chain.id in names:
        return [target.id]
    return []


def _product_names(tree: ast.AST) -> set[str]:
    """Names bound anywhere in the file to a product module or to something imported from one, and
    plain aliases of those."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if _is_product(a.name):
                    names.add(a.asname or a.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and _is_product(node.module):
            names.update(a.asname or a.name for a in node.names)
    changed = True
    while changed:   # aliases of aliases
        changed = False
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign):
                for t in node.targets:
                    for n in _aliases(t, node.value, names):
                        if n not in names:
                            names.add(n)
                            changed = True
    return names


def _targets_product(arg: ast.AST, names: set[str]) -> bool:
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return _is_product(arg.value) and "." in arg.value   # monkeypatch.setattr("bridge.x.Y", value)
    return _root(arg) in names


def _call_name(func: ast.AST) -> tuple[str | None, str | None]:
    """(receiver, method) of `a.b.method(...)` -> ("b", "method"); `f(...)` -> (None, "f")."""
    if isinstance(func, ast.Attribute):
        recv = func.value
        return (recv.attr if isinstance(recv, ast.Attribute) else getattr(recv, "id", None)), func.attr
    return None, getattr(func, "id", None)


def _embedded_programs(tree: ast.AST) -> list[ast.AST]:
    """Python programs held in string literals (f-string fields read as a name) that import product code."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = node.value
        elif isinstance(node, ast.JoinedStr):
            text = "".join(v.value if isinstance(v, ast.Constant) else "_" for v in node.values)
        else:
            continue
        if not any(f"{kw} {p}" in text for kw in ("import", "from") for p in PRODUCT):
            continue
        try:
            out.append(ast.parse(text))
        except SyntaxError:
            continue
    return out


def violations(source: str, filename: str = "<source>") -> list[str]:
    """Every place in `source` that patches product module state, as "file:line: what"."""
    found = []
    trees = [ast.parse(source, filename)]
    trees += _embedded_programs(trees[0])
    for i, tree in enumerate(trees):
        where = filename if i == 0 else f"{filename} (program in a string)"
        names = _product_names(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                recv, meth = _call_name(node.func)
                args = node.args[:1]
                if recv is None and meth in ("setattr", "delattr") and args and _targets_product(args[0], names):
                    found.append(f"{where}:{node.lineno}: {meth}({ast.unparse(args[0])}, ...)")
                elif recv == "monkeypatch" and meth in PATCHERS and args and _targets_product(args[0], names):
                    found.append(f"{where}:{node.lineno}: monkeypatch.{meth}({ast.unparse(args[0])}, ...)")
                elif recv in ("mock", "patch") and meth in MOCKS and args and _targets_product(args[0], names):
                    found.append(f"{where}:{node.lineno}: {ast.unparse(node.func)}({ast.unparse(args[0])}, ...)")
            elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
                targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
                for t in targets:
                    for el in (t.elts if isinstance(t, ast.Tuple) else [t]):
                        if isinstance(el, (ast.Attribute, ast.Subscript)) and _root(el) in names:
                            found.append(f"{where}:{node.lineno}: {ast.unparse(el)} = ...")
    return found


def _files() -> list[str]:
    """Every .py file scanned, this one excepted (its strings are the scanner's examples)."""
    out = []
    for top in SCANNED:
        for dp, ds, fs in os.walk(os.path.join(ROOT, top)):
            ds[:] = [d for d in ds if d not in ("__pycache__", "fixtures", "results")]
            out += [os.path.join(dp, f) for f in fs if f.endswith(".py")]
    return sorted(f for f in out if f != os.path.abspath(__file__))


def test_no_test_benchmark_or_script_patches_product_module_state():
    files = _files()
    assert any(f.endswith("test_to_megatron_rundir.py") for f in files)  # the scan reaches the tests
    bad = []
    for path in files:
        with open(path, encoding="utf-8") as f:
            bad += violations(f.read(), os.path.relpath(path, ROOT))
    assert not bad, "patching product module state (give the product an option or a seam instead):\n" + "\n".join(bad)


# --- the scanner itself: what it must catch and what it must let through ----------------------

@pytest.mark.parametrize("src", [
    "from converters.megatron.write import torch_dist as mw\ndef t(monkeypatch):\n    monkeypatch.setattr(mw, '_objects', f)\n",
    "def t(monkeypatch):\n    monkeypatch.setattr('bridge.store.specs.TARGET_DATA_FILE_SIZE', 1)\n",
    "def f():\n    from bridge.store import specs\n    specs.TARGET_DATA_FILE_SIZE = 1\n",
    "import bridge.store.specs\nbridge.store.specs.TARGET_DATA_FILE_SIZE += 1\n",
    "from bridge.store.writer import CheckpointWriter\nsetattr(CheckpointWriter, 'write', g)\n",
    "from bridge.live import export as ex\nex.CheckpointWriter = Fake\n",
    "from bridge.store import specs\ndef t(monkeypatch):\n    monkeypatch.setitem(specs.OCDBT_CONFIG, 'k', 1)\n",
    "from unittest import mock\nfrom bridge.store import writer\nwith mock.patch.object(writer, 'x', 1):\n    pass\n",
    # a program run in a subprocess, as the old signal tests did (alias, then setattr)
    "code = (\n    'import converters.megatron.write.torch_dist as mw\\n'\n    f'cls = mw.DcpFile\\n'\n"
    "    'setattr(cls, \"tensor\", chunk)\\n')\n",
    "import converters.megatron.write.torch_dist as mw\ncls, meth = (mw.DcpFile, 'tensor') if x else (mw.W, 'chunk')\n"
    "setattr(cls, meth, f)\n",
])
def test_scanner_catches_a_patch(src):
    assert violations(src)


@pytest.mark.parametrize("src", [
    "def t(monkeypatch):\n    monkeypatch.setenv('GTPB_X', '1')\n    monkeypatch.chdir('/tmp')\n",
    "import sys\ndef t(monkeypatch):\n    monkeypatch.setattr(sys, 'argv', ['x'])\n",
    "from bridge.store.writer import CheckpointWriter\nw = CheckpointWriter(a, b, 0)\nw.threads = 2\n",
    "from bridge.store.writer import CheckpointWriter\nclass Timed(CheckpointWriter):\n    pass\nTimed.x = 1\n",
    "from converters.megatron.write.torch_dist import DcpFile\nclass Full(DcpFile):\n    def obj(self, *a):\n        raise OSError\n",
    "import os\nos.environ['X'] = '1'\n",
    "from bridge.format.tree import path_str\ngot = {path_str(p): 1 for p in ps}\ngot['step'] = 2\n",
    "from bridge.store import specs\nsize = specs.TARGET_DATA_FILE_SIZE * 2\nrec = {}\nrec['x'] = size\n",
])
def test_scanner_lets_options_and_local_objects_through(src):
    assert not violations(src)
