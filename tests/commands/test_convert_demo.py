"""`gtp-bridge demo` on a fresh process (XLA_FLAGS set in-process) passes all its checks."""

import os
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_demo_runs_end_to_end(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    r = subprocess.run([sys.executable, "-m", "bridge.cli", "demo", "--workdir", str(tmp_path / "w")],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    out = r.stdout
    assert "all checks passed" in out and "bit-exact vs TensorStore" in out and "identical to the first conversion" in out
    assert "fully_reshardable (0.19.2 padded GTP grid) TP=1 GTP=2" in out
    for d in ("logical", "megatron_tp2_dp2", "logical_again"):
        assert (tmp_path / "w" / d).is_dir()
    # a second run into the same workdir refuses, one line, exit 2
    r2 = subprocess.run([sys.executable, "-m", "bridge.cli", "demo", "--workdir", str(tmp_path / "w")],
                        capture_output=True, text=True, env=env, timeout=600)
    assert r2.returncode == 2 and r2.stderr.strip().count("\n") == 0 and "already exist" in r2.stderr
