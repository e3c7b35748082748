"""The layers run one way (read from the source with `ast`, nothing imported):

- the core (`bridge/` without its command line `cli.py`, `commands/` and the facade `__init__.py`)
  never imports `converters`; `converters` builds on the core; the command line and the facade sit
  on top of both;
- no module of `bridge/` or `converters/` imports `bridge.testing` (the test harness), except the
  harness itself;
- no import cycle among the modules (issue 32), imports made inside functions included;
- `import bridge` stays light: neither torch, nor JAX, nor TensorStore.

Imports inside functions count for both rules: a deferred import is still a dependency, and
deferring one only hides a circle from the interpreter (the two modules still need each other;
issue 32 found four such circles). Imports under `if TYPE_CHECKING:` count for the layer rules but
not for cycles: they never run, so they order no initialisation and bind no name at run time (a
run-time use of such a name fails with NameError in the tests); they only let annotations name a
type, which is how two modules that mention each other's types stay importable (PEP 563). A
circle that a module needs at run time therefore cannot hide there.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("bridge", "converters")


def module_name(root: Path, path: Path) -> str:
    """Dotted module name of a source file under `root`.

    >>> module_name(Path("/r"), Path("/r/bridge/store/__init__.py")), module_name(Path("/r"), Path("/r/bridge/cli.py"))
    ('bridge.store', 'bridge.cli')
    """
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _resolve(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


TOP, DEFERRED, TYPING = "top", "deferred", "typing"   # when an import runs: at import time, in a call, never


def imports(root: Path) -> dict[str, list[tuple[str, str, int]]]:
    """Module -> [(imported project module, TOP / DEFERRED / TYPING, line)] for every module of PACKAGES
    under `root`.

    `from a.b import c` counts as importing `a.b.c` when that is a module, else `a.b`. Imports inside
    functions are DEFERRED; those under a module-level `if TYPE_CHECKING:` are TYPING.
    """
    files = {module_name(root, p): p for pkg in PACKAGES if (root / pkg).is_dir() for p in (root / pkg).rglob("*.py")}
    out: dict[str, list[tuple[str, bool]]] = {}
    for mod, path in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        top = {id(n) for n in tree.body}
        for n in tree.body:  # `if TYPE_CHECKING:` / try-import blocks at module level are still top level
            if isinstance(n, (ast.If, ast.Try)):
                top |= {id(c) for c in ast.walk(n)}
        deps: list[tuple[str, str, int]] = []
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(node, mod, path.name == "__init__.py")
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            else:
                continue
            when = TYPING if _type_checking_only(tree, node) else TOP if id(node) in top else DEFERRED
            for name in names:
                if name.split(".")[0] in PACKAGES:
                    deps.append((name, when, node.lineno))
        out[mod] = deps
    return out


def _type_checking_only(tree: ast.Module, node: ast.AST) -> bool:
    for n in tree.body:
        if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test):
            if any(c is node for c in ast.walk(n)):
                return True
    return False


def is_core(module: str) -> bool:
    """`bridge` without its command line and its facade.

    >>> [is_core(m) for m in ("bridge.store.reader", "bridge", "bridge.cli", "bridge.commands.convert", "converters.megatron")]
    [True, False, False, False, False]
    """
    return module.startswith("bridge.") and module != "bridge.cli" and not module.startswith("bridge.commands")


def is_top(module: str) -> bool:
    """The command line and the facade, which sit on top of the core and the converters."""
    return module in ("bridge", "bridge.cli") or module.startswith("bridge.commands")


def layer_violations(root: Path) -> list[str]:
    """Every import that runs against the layers, as `importer -> imported: why` (sorted, once each)."""
    bad = set()
    for mod, deps in imports(root).items():
        for dep, _when, _line in deps:
            if is_core(mod) and dep.split(".")[0] == "converters":
                bad.add(f"{mod} -> {dep}: the core must not import converters")
            if not is_top(mod) and is_top(dep):
                bad.add(f"{mod} -> {dep}: only the command line and the facade build on the command line / facade")
            harness = dep == "bridge.testing" or dep.startswith("bridge.testing.")
            if harness and not (mod == "bridge.testing" or mod.startswith("bridge.testing.")):
                bad.add(f"{mod} -> {dep}: product code must not import the test harness")
    return sorted(bad)


def import_graph(root: Path) -> dict[str, dict[str, int]]:
    """Module -> {imported module: line of the first such import} over every import that runs
    (TOP and DEFERRED; see the module docstring for why TYPING is left out)."""
    graph: dict[str, dict[str, int]] = {}
    for mod, deps in imports(root).items():
        edges = graph.setdefault(mod, {})
        for dep, when, line in deps:
            if when != TYPING and dep != mod:
                edges.setdefault(dep, line)
    return graph


def import_cycles(root: Path) -> list[list[str]]:
    """Cycles among the imports that run (strongly connected components of more than one module)."""
    graph = {m: sorted(edges) for m, edges in import_graph(root).items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def describe_cycle(root: Path, component: list[str]) -> str:
    """One circle through the first module of a cycle `component`, each step with the line that imports.

    A shortest path back (breadth first) inside the component, e.g.
    `a (line 3) -> b (line 9) -> a`: a imports b on its line 3, b imports a on its line 9.
    """
    graph = import_graph(root)
    inside = set(component)
    start = component[0]
    came: dict[str, str] = {}
    frontier = [start]
    while frontier and start not in came:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v]):
                if w in inside and w not in came:
                    came[w] = v
                    nxt.append(w)
        frontier = nxt
    path = [start]
    while True:
        path.append(came[path[-1]])
        if path[-1] == start:
            break
    path.reverse()
    return " -> ".join(f"{a} (line {graph[a][b]})" for a, b in zip(path, path[1:])) + f" -> {start}"


def test_layers_run_one_way():
    assert layer_violations(REPO) == []


def test_no_import_cycle():
    """No circle among bridge/ and converters/, imports made inside functions included (issue 32)."""
    circles = [f"{{{', '.join(c)}}}, e.g. {describe_cycle(REPO, c)}" for c in import_cycles(REPO)]
    assert circles == [], "import circles:\n" + "\n".join(circles)


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text, encoding="utf-8")


def test_checks_catch_the_old_shapes(tmp_path):
    """The checks would have caught what the #19 redesign removed: the JAX side importing its naming
    engine from `converters.jax_naming` (the layers ran both ways), product code importing the
    reference trainer, and a cycle; and the circles of issue 32, hidden behind an import inside a
    function. An annotation-only import under TYPE_CHECKING makes no circle."""
    _write(tmp_path, {
        "bridge/__init__.py": "",
        "bridge/jaxside/__init__.py": "",
        "bridge/jaxside/abstract.py": "from converters.jax_naming import Group\n",
        "bridge/jaxside/restore.py": "def f():\n    from converters import jax_naming\n",
        "bridge/jaxside/save.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import converters.jax_naming\n",
        "bridge/live/__init__.py": "",
        "bridge/live/export.py": "from bridge.testing.scenario import run\nimport bridge.live.plan\n",
        "bridge/live/plan.py": "from bridge.live import export\n",
        "bridge/testing/__init__.py": "", "bridge/testing/scenario.py": "run = 1\n",
        "bridge/cli.py": "import converters.megatron\n",
        "converters/__init__.py": "", "converters/megatron/__init__.py": "",
        "converters/jax_naming.py": "import bridge.jaxside.abstract\n",
        "converters/megatron/convert.py": "from bridge.commands.convert import run\nfrom bridge import errors\n",
        "bridge/errors.py": "", "bridge/commands/__init__.py": "", "bridge/commands/convert.py": "run = 1\n",
        "bridge/store/__init__.py": "",
        "bridge/store/claim.py": "import os\n\n\ndef claim():\n    from bridge.store.remote import claim_remote\n",
        "bridge/store/remote.py": "from bridge.store import claim as local_claim\n",
        "bridge/live/api.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from bridge.live.fp8 import q\n",
        "bridge/live/fp8.py": "from bridge.live.api import LocalParam\n",
    })
    assert layer_violations(tmp_path) == [
        "bridge.jaxside.abstract -> converters.jax_naming: the core must not import converters",
        "bridge.jaxside.restore -> converters.jax_naming: the core must not import converters",
        "bridge.jaxside.save -> converters.jax_naming: the core must not import converters",
        "bridge.live.export -> bridge.testing.scenario: product code must not import the test harness",
        "converters.megatron.convert -> bridge.commands.convert: only the command line and the facade build on "
        "the command line / facade",
    ]
    cycles = import_cycles(tmp_path)
    assert cycles == [["bridge.jaxside.abstract", "converters.jax_naming"],
                      ["bridge.live.export", "bridge.live.plan"],
                      ["bridge.store.claim", "bridge.store.remote"]]
    assert describe_cycle(tmp_path, cycles[2]) == ("bridge.store.claim (line 5) -> bridge.store.remote (line 1) "
                                                   "-> bridge.store.claim")


def test_docstring_examples():
    import doctest

    res = doctest.testmod(sys.modules[__name__])
    assert res.attempted > 0 and res.failed == 0


def test_import_bridge_is_light():
    """`import bridge` (the facade) loads neither torch, nor JAX, nor TensorStore; its entry points
    resolve on first use."""
    code = ("import sys, bridge; heavy = [m for m in ('torch', 'jax', 'tensorstore', 'orbax', 'converters') "
            "if m in sys.modules]; print(heavy); assert heavy == [], heavy; "
            "assert bridge.verify.__name__ == 'verify_checkpoint' and callable(bridge.to_megatron)")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_facade_names_resolve():
    """Every name the facade lists is importable (torch, JAX and Orbax are installed in the test env)."""
    pytest.importorskip("torch")
    pytest.importorskip("jax")
    import bridge

    missing = [n for n in bridge.__all__ if getattr(bridge, n, None) is None]
    assert missing == []
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        bridge.nope  # noqa: B018


#: The places above the storage layer allowed to ask whether a location is remote (issue 32: at most 3).
#: The storage layer is `bridge/store/` and `bridge/location.py`, which parses the location strings.
MAX_REMOTE_QUESTIONS = 3
_REMOTE_PREFIXES = ("s3:", "gs:")


def remote_questions(root: Path) -> list[str]:
    """'module:line' of every place in bridge/ and converters/ above the storage layer that asks
    whether a location is remote: a call of `is_remote` / `scheme_of` / `parse_url`, or a string test
    against an object-store scheme (`x.startswith("s3://")`, `"gs://" in x`, `x[:5] == "s3://"`)."""
    def remote_literal(n: ast.AST) -> bool:
        return any(isinstance(c, ast.Constant) and isinstance(c.value, str) and c.value.lower().startswith(_REMOTE_PREFIXES)
                   for c in ast.walk(n))

    found = []
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")) if (root / pkg).is_dir() else []:
            rel = path.relative_to(root).as_posix()
            if rel.startswith("bridge/store/") or rel == "bridge/location.py":
                continue
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), rel)):
                if isinstance(node, ast.Call):
                    f = node.func
                    name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
                    asks = name in ("is_remote", "scheme_of", "parse_url") or (
                        name in ("startswith", "endswith") and any(remote_literal(a) for a in node.args))
                elif isinstance(node, ast.Compare):
                    asks = any(isinstance(op, (ast.In, ast.NotIn, ast.Eq, ast.NotEq)) for op in node.ops) and \
                        remote_literal(node)
                else:
                    continue
                if asks:
                    found.append(f"{module_name(root, path)}:{node.lineno}")
    return found


def test_nothing_above_the_store_asks_whether_a_location_is_remote():
    """The storage object (`bridge.store.open_storage`) decides local vs object storage once; the
    layers above call its methods instead of testing the location string again (issue 32)."""
    found = remote_questions(REPO)
    assert len(found) <= MAX_REMOTE_QUESTIONS, f"{len(found)} places above bridge/store ask whether a location is " \
                                               f"remote (at most {MAX_REMOTE_QUESTIONS}): {', '.join(found)}"


def test_remote_questions_are_found(tmp_path):
    """Each form of the question is counted; a message that merely mentions s3:// is not."""
    _write(tmp_path, {
        "bridge/store/claim.py": "from bridge.location import is_remote\nis_remote('s3://b/k')\n",
        "bridge/location.py": "def is_remote(x):\n    return x.startswith('s3://')\n",
        "bridge/a.py": "from bridge.location import is_remote, scheme_of\nif is_remote(d): pass\n"
                       "if scheme_of(d) == 's3': pass\n",
        "converters/b.py": "ok = d.startswith(('s3://', 'gs://'))\nif 'GS://' in d[:5]: pass\n"
                           "print(f'use a shared file system or s3:// / gs://')\nif x.startswith('/'): pass\n",
    })
    assert remote_questions(tmp_path) == ["bridge.a:2", "bridge.a:3", "converters.b:1", "converters.b:2"]
