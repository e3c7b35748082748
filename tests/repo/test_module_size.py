"""No product module over 1,000 lines (issue 32): a module that grows past it holds more than one idea;
split it where its parts meet (see docs/ARCHITECTURE.md for the folders)."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("bridge", "converters")
MAX_LINES = 1000


def long_modules(root: Path, limit: int = MAX_LINES) -> list[str]:
    """`path: N lines` for every module of PACKAGES under `root` longer than `limit` lines, sorted."""
    out = []
    for pkg in PACKAGES:
        for p in sorted((root / pkg).rglob("*.py")):
            n = len(p.read_text(encoding="utf-8").splitlines())
            if n > limit:
                out.append(f"{p.relative_to(root)}: {n} lines")
    return out


def test_no_module_over_the_limit():
    assert long_modules(REPO) == []


def test_the_count_catches_a_long_module(tmp_path):
    """The check counts lines of every module, nested packages included, and nothing outside them."""
    (tmp_path / "converters" / "megatron" / "read").mkdir(parents=True)
    (tmp_path / "bridge").mkdir()
    (tmp_path / "tests").mkdir()
    (tmp_path / "converters" / "megatron" / "read" / "dcp.py").write_text("x = 1\n" * (MAX_LINES + 1))
    (tmp_path / "bridge" / "ok.py").write_text("x = 1\n" * MAX_LINES)
    (tmp_path / "tests" / "long_test.py").write_text("x = 1\n" * (MAX_LINES + 5))
    assert long_modules(tmp_path) == [f"converters/megatron/read/dcp.py: {MAX_LINES + 1} lines"]
