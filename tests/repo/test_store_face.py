"""The store is used through its public face (issue 32), read from the source with `ast`:

- product code outside `bridge/store/` (`bridge/`, `converters/`, `scripts/`) imports only
  `from bridge.store import ...`, never a submodule (`bridge.store.reader`, `from bridge.store import
  kvstore`) and never a private name;
- nothing outside `bridge/store/` asks a `Storage` whether it is a file system (`.file_system`): what
  differs between local and object storage is a method of the storage object.

Tests may import the store's insides (they test them).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

from test_layering import _write

REPO = Path(__file__).resolve().parents[2]
PRODUCT = ("bridge", "converters", "scripts")



def _product_files(root: Path):
    for pkg in PRODUCT:
        for path in sorted((root / pkg).rglob("*.py")) if (root / pkg).is_dir() else []:
            rel = path.relative_to(root).as_posix()
            if not rel.startswith("bridge/store/"):
                yield rel, ast.parse(path.read_text(encoding="utf-8"), rel)


def store_internals(root: Path) -> dict[str, list[tuple[int, str, list[str]]]]:
    """File -> [(line, store submodule or 'bridge.store', names)] of every import that reaches past the
    store's face: `import bridge.store.x`, `from bridge.store.x import ...`, `from bridge.store import x`
    where x is a submodule, and a private name imported from the face."""
    subs = {p.stem for p in (root / "bridge" / "store").glob("*.py") if p.stem != "__init__"}
    out: dict[str, list] = {}
    for rel, tree in _product_files(root):
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith("bridge.store."):
                        out.setdefault(rel, []).append((node.lineno, a.name, []))
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [a.name for a in node.names]
                if node.module.startswith("bridge.store."):
                    out.setdefault(rel, []).append((node.lineno, node.module, names))
                elif node.module == "bridge.store":
                    bad = [n for n in names if n in subs or n.startswith("_")]
                    if bad:
                        out.setdefault(rel, []).append((node.lineno, node.module, bad))
    return out


def file_system_questions(root: Path) -> dict[str, list[int]]:
    """File -> lines where product code outside bridge/store reads an attribute named `file_system`."""
    out: dict[str, list[int]] = {}
    for rel, tree in _product_files(root):
        lines = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == "file_system"]
        if lines:
            out[rel] = lines
    return out


def test_product_code_imports_only_the_store_face():
    bad = [f"{rel}:{line} {mod} {', '.join(names)}".rstrip() for rel, hits in store_internals(REPO).items()
           for line, mod, names in hits]
    assert bad == [], "imports past bridge.store's public face (export the name from bridge/store/__init__.py, " \
                      "or give Storage a method):\n" + "\n".join(bad)


def test_the_face_exports_only_what_it_has():
    import bridge.store

    assert [n for n in bridge.store.__all__ if not hasattr(bridge.store, n)] == []


def test_nothing_outside_the_store_asks_for_a_file_system():
    bad = [f"{rel}:{line}" for rel, lines in file_system_questions(REPO).items() for line in lines]
    assert bad == [], "`.file_system` asked outside bridge/store (give Storage a method saying what differs): " + \
                      ", ".join(bad)


def test_checks_catch_the_old_shapes(tmp_path):
    """What the face replaced is counted: a submodule import (top level or in a function), a submodule
    or a private name through the package, `import bridge.store.x`, and `storage.file_system`;
    inside bridge/store and through the face nothing is."""
    _write(tmp_path, {
        "bridge/store/__init__.py": "from bridge.store.reader import open_checkpoint\n",
        "bridge/store/reader.py": "def open_checkpoint(): pass\ndef _one_line(): pass\n",
        "bridge/store/kvstore.py": "from bridge.store.reader import _one_line\nfs = object().file_system\n",
        "bridge/inspect/open.py": "from bridge.store import open_checkpoint, open_storage\n",
        "bridge/live/reload.py": "def f():\n    from bridge.store.reader import open_checkpoint\n",
        "converters/megatron/dcp.py": "from bridge.store import kvstore\nfrom bridge.store import _one_line\n"
                                      "import bridge.store.remote as r\nif not storage.file_system: pass\n",
        "scripts/same_bytes.py": "import bridge.store\n",
    })
    assert store_internals(tmp_path) == {
        "bridge/live/reload.py": [(2, "bridge.store.reader", ["open_checkpoint"])],
        "converters/megatron/dcp.py": [(1, "bridge.store", ["kvstore"]), (2, "bridge.store", ["_one_line"]),
                                       (3, "bridge.store.remote", [])],
    }
    assert file_system_questions(tmp_path) == {"converters/megatron/dcp.py": [4]}


def test_import_bridge_store_is_light():
    """The face loads every store module, but neither TensorStore, torch nor JAX (they load on first use)."""
    code = ("import sys, bridge.store; heavy = [m for m in ('torch', 'jax', 'tensorstore', 'orbax', 'converters') "
            "if m in sys.modules]; assert heavy == [], heavy")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
