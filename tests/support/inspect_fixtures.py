"""Helpers for the inspection tests: checkpoints written by plain Orbax (no project code), CLI runner."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def save_plain_orbax(path: str, tree: dict, custom_metadata: dict | None = None,
                     chunk_byte_size: int | None = None, use_ocdbt: bool = True, use_zarr3: bool = True,
                     use_compression: bool = False) -> str:
    """Write `tree` (nested dicts of numpy arrays) with Orbax itself (default OCDBT + zarr3, no compression).

    `chunk_byte_size` makes Orbax cut arrays into chunks of at most that many bytes (default: one chunk).
    """
    import jax
    import orbax.checkpoint as ocp

    jtree = jax.tree.map(lambda x: jax.numpy.asarray(x), tree)
    ck = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=use_ocdbt, use_zarr3=use_zarr3,
                                                       use_compression=use_compression))
    save_args = jax.tree.map(lambda _: ocp.SaveArgs(chunk_byte_size=chunk_byte_size), jtree)
    ck.save(os.path.abspath(path),
            args=ocp.args.PyTreeSave(jtree, save_args=save_args, custom_metadata=custom_metadata or {}))
    return path


def small_state(seed: int = 0, layers: int = 3) -> dict:
    """A small logical tree: stacked fp32 masters, Adam moments, bf16 model weights, step."""
    import ml_dtypes

    rng = np.random.default_rng(seed)
    params = {"decoder": {"layers": {"mlp": {"linear_fc2": {"weight": rng.standard_normal((layers, 16, 24), np.float32)}}}},
              "embedding": {"word_embeddings": {"weight": rng.standard_normal((40, 16), np.float32)}}}
    mu = _map(params, lambda x: (0.01 * rng.standard_normal(x.shape)).astype(np.float32))
    nu = _map(params, lambda x: (1e-4 * rng.random(x.shape) ** 2).astype(np.float32))
    model = _map(params, lambda x: x.astype(ml_dtypes.bfloat16))
    return {"params": params, "opt_state": {"count": np.int32(7), "mu": mu, "nu": nu}, "model": model,
            "step": np.int32(7)}


def _map(tree: Any, f: Any) -> Any:
    return {k: _map(v, f) for k, v in tree.items()} if isinstance(tree, dict) else f(tree)


def run_cli(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run `gtp-bridge ARGS` in a fresh interpreter (stdout/stderr captured, not a tty)."""
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "bridge.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env=env)


def numpy_stats(x: np.ndarray) -> dict:
    """Independent whole-array reference for ArrayStats' definitions (finite-only min/max/mean/RMS)."""
    x = np.asarray(x, dtype=np.float64).reshape(-1)
    fin = x[np.isfinite(x)]
    return {"count": x.size, "nan": int(np.isnan(x).sum()), "posinf": int((x == np.inf).sum()),
            "neginf": int((x == -np.inf).sum()), "zeros": int((x == 0).sum()),
            "min": float(fin.min()) if fin.size else None, "max": float(fin.max()) if fin.size else None,
            "mean": float(fin.mean()) if fin.size else None,
            "rms": float(np.sqrt(np.mean(fin ** 2))) if fin.size else None}


def assert_stats_match(got: dict, want: dict) -> None:
    """Counts and extremes exactly; mean and RMS to float64 rounding of differently ordered sums."""
    import pytest

    for k in ("count", "nan", "posinf", "neginf", "zeros", "min", "max"):
        assert got[k] == want[k], k
    for k in ("mean", "rms"):
        if want[k] is None:
            assert got[k] is None
        else:
            assert got[k] == pytest.approx(want[k], rel=1e-9, abs=1e-12), k


def run_notebook(path: str, env: dict, timeout: int = 180) -> None:
    """Execute a notebook top to bottom with nbclient (env vars set for its kernel); raise on any error."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    env = dict(env, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the kernel inherits this process's environment
    try:
        NotebookClient(nb, timeout=timeout, kernel_name="python3",
                       resources={"metadata": {"path": REPO}}).execute()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
