"""A small, realistic logical checkpoint for the inspection notebook and tests (numpy + the store only).

A few AdamW steps of a toy stacked-layer model with random gradients, so the state shows what
inspection is for: Adam second moments spanning many decades, embedding rows that never received a
gradient (nu == 0, dead rows), and one layer whose bf16 `model` weights are stale (not the bf16
rounding of the current fp32 masters), as after a missed master->model copy. The demo checkpoint
also plants an exploded second moment: a block of huge `nu` values and one NaN in one layer.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from bridge.store import save_checkpoint
from bridge.format.manifest import Manifest, OptimizerConfig, SourceLayout
from bridge.format.schema import adamw_empty_paths

# AdamW hyper-parameters of the demo run (recorded in the manifest).
LR, BETAS, EPS, WD = 1e-3, (0.9, 0.95), 1e-8, 0.1


def demo_params(layers: int = 4, hidden: int = 32, ffn: int = 64, vocab: int = 96, seed: int = 0) -> dict[str, np.ndarray]:
    """Initial fp32 masters keyed by '/'-joined logical path (stacked layer axis first; fused fc1 as gate/up)."""
    rng = np.random.default_rng(seed)
    p = "decoder/layers"
    return {
        "embedding/word_embeddings/weight": rng.normal(0, 0.02, (vocab, hidden)).astype(np.float32),
        f"{p}/mlp/linear_fc1/weight/gate": rng.normal(0, 0.02, (layers, ffn, hidden)).astype(np.float32),
        f"{p}/mlp/linear_fc1/weight/up": rng.normal(0, 0.02, (layers, ffn, hidden)).astype(np.float32),
        f"{p}/mlp/linear_fc2/weight": rng.normal(0, 0.02, (layers, hidden, ffn)).astype(np.float32),
        f"{p}/input_layernorm/weight": np.ones((layers, hidden), np.float32),
    }


def adamw_steps(params: dict[str, np.ndarray], steps: int, seed: int = 0, dead_rows: int = 16,
                stale_layer: int | None = 2) -> dict[str, Any]:
    """Run `steps` AdamW steps (FusedAdam formula order) on random gradients; returns the logical tree.

    Gradients grow with depth (layer l scaled by 2**l) so per-layer RMS has a visible trend; the last
    `dead_rows` embedding rows never get a gradient. The bf16 `model` copy of `stale_layer` is taken
    before the last step.
    """
    rng = np.random.default_rng(seed + 1)
    p = {k: v.copy() for k, v in params.items()}
    mu = {k: np.zeros_like(v) for k, v in p.items()}
    nu = {k: np.zeros_like(v) for k, v in p.items()}
    stale = {}
    for t in range(1, steps + 1):
        if t == steps:
            stale = {k: v.copy() for k, v in p.items()}
        for k in p:
            g = _gradient(k, p[k].shape, rng, dead_rows)
            mu[k] = (BETAS[0] * mu[k] + (1 - BETAS[0]) * g).astype(np.float32)
            nu[k] = (BETAS[1] * nu[k] + (1 - BETAS[1]) * g * g).astype(np.float32)
            mhat = mu[k] / (1 - BETAS[0] ** t)
            vhat = nu[k] / (1 - BETAS[1] ** t)
            p[k] = (p[k] - LR * (mhat / (np.sqrt(vhat) + EPS) + WD * p[k])).astype(np.float32)
    import ml_dtypes

    model = {}
    for k, v in p.items():
        src = v
        if stale_layer is not None and k.startswith("decoder/layers/") and v.shape[0] > stale_layer:
            src = v.copy()
            src[stale_layer] = stale[k][stale_layer]
        model[k] = src.astype(ml_dtypes.bfloat16)
    return {"params": p, "mu": mu, "nu": nu, "model": model, "step": steps}


def _gradient(key: str, shape: tuple[int, ...], rng: np.random.Generator, dead_rows: int) -> np.ndarray:
    g = rng.standard_normal(shape) * 10.0 ** rng.uniform(-4, -1, shape)  # many decades, like real grads
    if key.startswith("decoder/layers/"):
        g *= (2.0 ** np.arange(shape[0])).reshape((-1,) + (1,) * (len(shape) - 1))
    if key.startswith("embedding/") and dead_rows:
        g[-dead_rows:] = 0.0
    return g.astype(np.float32)


def logical_arrays(state: dict[str, Any]) -> dict[str, np.ndarray]:
    """The logical tree's arrays keyed by '/'-joined path (params, opt_state/0/{count,mu,nu}, model, step)."""
    out: dict[str, np.ndarray] = {}
    for k, v in state["params"].items():
        out[f"params/{k}"] = v
        out[f"opt_state/0/mu/{k}"] = state["mu"][k]
        out[f"opt_state/0/nu/{k}"] = state["nu"][k]
        out[f"model/{k}"] = state["model"][k]
    out["opt_state/0/count"] = np.int32(state["step"])
    out["step"] = np.int32(state["step"])
    return out


# Where the demo checkpoint's exploded second moment is planted: array, layer, and a block of rows.
EXPLODED = ("opt_state/0/nu/decoder/layers/mlp/linear_fc2/weight", 3, slice(0, 4))


def plant_exploded_moment(arrays: dict[str, np.ndarray], name: str, layer: int, rows: slice) -> None:
    """Scale `arrays[name][layer, rows]` by 1e8 and make its first element NaN (in place)."""
    block = arrays[name][layer, rows]
    block *= np.float32(1e8)
    block.flat[0] = np.nan


def make_demo_checkpoint(path: str | os.PathLike, steps: int = 5, seed: int = 0, **shape: int) -> dict[str, np.ndarray]:
    """Write the demo logical checkpoint at `path` (must not exist); return its arrays by '/'-joined path."""
    state = adamw_steps(demo_params(seed=seed, **shape), steps, seed)
    arrays = logical_arrays(state)
    plant_exploded_moment(arrays, *EXPLODED)
    manifest = Manifest(
        source=SourceLayout(framework="numpy-demo", optimizer_format="logical"),
        optimizer=OptimizerConfig(lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, step=steps),
        extra={"note": "gtp-bridge inspection demo: random gradients, dead embedding rows, one stale bf16 layer, "
                        "an exploded nu block with a NaN"})
    save_checkpoint(os.fspath(path), arrays, manifest, empty_paths=adamw_empty_paths())
    return arrays
