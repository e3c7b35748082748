"""Hostile and damaged sources (issue 17 items 1, 4, 5, 6, 10) and a bounded fuzz run of the parse path.

Every input must either parse or raise a one-line `BridgeError`: no other exception, no crash
(inputs run in a subprocess, so a SIGSEGV fails the test), no more memory than a bound
(`RLIMIT_AS` in that subprocess). The seeds in tests/fixtures/fuzz_seeds/ are the issue's crash
corpus (made by make_seeds.py there).
"""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SEEDS = ROOT / "tests" / "fixtures" / "fuzz_seeds"
FIXTURES = ROOT / "tests" / "fixtures" / "megatron"
BASE = FIXTURES / "tp1_buckets" / "fully_reshardable"  # the seeds were made from this save


# The code under test is the one this process imports (run from /work/main, or with its PYTHONPATH,
# to check a test against an older commit); subprocesses run the same code.
import bridge  # noqa: E402

CODE = Path(bridge.__file__).resolve().parent.parent


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=str(CODE), JAX_PLATFORMS="cpu")


def run_convert(src: Path, dst: Path, *extra: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """`gtp-bridge convert` in a subprocess (a crash is a negative return code, not a dead test run)."""
    return subprocess.run([sys.executable, "-m", "bridge.cli", "convert", str(src), str(dst), "--workers", "1", *extra],
                          env=_env(), capture_output=True, text=True, timeout=timeout, cwd=str(CODE))


def copy_base(tmp: Path, base: Path = BASE) -> Path:
    src = tmp / "src"
    shutil.copytree(base, src)
    return src


def replace_object(src: Path, fqn_prefix: str, blob: bytes) -> None:
    """Point the byte item `fqn_prefix*` at `blob`, appended to its .distcp file (the .metadata is ours: trusted)."""
    md = pickle.loads((src / ".metadata").read_bytes())
    for idx, info in md.storage_data.items():
        if idx.fqn.startswith(fqn_prefix):
            f = src / info.relative_path
            info.offset = f.stat().st_size
            info.length = len(blob)
            with open(f, "ab") as fh:
                fh.write(blob)
            break
    else:
        raise AssertionError(fqn_prefix)
    (src / ".metadata").write_bytes(pickle.dumps(md))


def assert_clean_refusal(r: subprocess.CompletedProcess, *words: str) -> None:
    """Exit 2 with one `error:` line naming what is wrong (no traceback, no signal)."""
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    for w in words:
        assert w in lines[0], (w, lines[0])


# ---------------------------------------------------------------------------------------------
# item 1: forged pointers (fails at e9efc35: convert dies with SIGSEGV)


@pytest.mark.parametrize("variant", ["relpath_array", "relpath_scalar", "args_array"])
def test_forged_object_pointer_refused(tmp_path, variant):
    src = copy_base(tmp_path)
    if variant.startswith("relpath"):
        shutil.copy(SEEDS / f"forged_{variant}.metadata", src / ".metadata")
        where = ".metadata"
    else:
        replace_object(src, "common_state", (SEEDS / "forged_args_array.common_state").read_bytes())
        where = "common_state"
    r = run_convert(src, tmp_path / "dst")
    assert r.returncode >= 0, f"convert crashed with signal {-r.returncode}"
    assert_clean_refusal(r, where, "numpy dtype")
    assert not (tmp_path / "dst").exists()
