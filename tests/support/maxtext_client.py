"""Real MaxText client for tests/maxtext/test_maxtext_client.py (runs in a Python 3.12 venv with `maxtext` 0.2.5).

    python tests/support/maxtext_client.py step --base-dir DIR --run RUN --overrides JSON --batch JSON --grads JSON --out JSON
    python tests/support/maxtext_client.py fresh --base-dir DIR --run RUN --overrides JSON --out JSON
    python tests/support/maxtext_client.py train --base-dir DIR --run RUN --overrides JSON --batch JSON --out JSON

`step`: MaxText's own code restores the train state under DIR/RUN/checkpoints (the latest step, as
its trainer does), computes its loss on the given tokens (`loss_fn`, eval mode), applies its own
optimizer (`TrainStateNNX.apply_gradients`: the optax.adamw its `get_optimizer` built from the
config) to the given gradients (a .npz of MaxText-layout leaves under `params/...`), computes the
loss on the next batch, and saves the new state with its own `checkpointing.save_checkpoint`.
`train`: as `step`, but the gradients are MaxText's own (`nnx.grad` of its `loss_fn`, training mode,
on batch 3), so the step is wholly MaxText's (used for the MoE fixture, whose grads were not kept).
`fresh`: a fresh tiny MaxText run (`train_loop`, synthetic data, 2 steps) saves a checkpoint we
did not write. Prints and writes a JSON report. Imports nothing from gtp-bridge.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np


def config_of(base_dir: str, run: str, overrides: dict, extra: dict):
    from maxtext.configs import pyconfig

    base_yml = os.path.join(os.path.dirname(pyconfig.__file__), "base.yml")
    kv = dict(overrides)
    kv.update(run_name=run, base_output_directory=base_dir, dataset_type="synthetic", hardware="cpu",
              attention="dot_product", skip_jax_distributed_system=True, enable_checkpointing=True,
              async_checkpointing=False, tokenizer_type="huggingface", dtype="bfloat16")
    kv.update(extra)
    argv = [sys.argv[0], base_yml] + [f"{k}={json.dumps(v) if isinstance(v, (list, bool)) else v}"
                                      for k, v in kv.items()]
    return pyconfig.initialize(argv)


def batch_of(tokens, labels) -> dict:
    import jax.numpy as jnp

    tokens = np.asarray(tokens, np.int32)
    labels = np.asarray(labels, np.int32)
    b, s = tokens.shape
    pos = np.broadcast_to(np.arange(s, dtype=np.int32), (b, s))
    seg = np.ones((b, s), np.int32)
    return {"inputs": jnp.asarray(tokens), "inputs_position": jnp.asarray(pos), "inputs_segmentation": jnp.asarray(seg),
            "targets": jnp.asarray(labels), "targets_position": jnp.asarray(pos),
            "targets_segmentation": jnp.asarray(seg)}


def eval_loss(state, config, batch) -> float:
    from maxtext.trainers.pre_train.train import loss_fn

    loss, _ = loss_fn(state.model, config, dict(batch), None, None, is_train=False)
    return float(loss)


def flat_params(tree, prefix=()):
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(flat_params(v, prefix + (str(k),)))
        else:
            out[prefix + (str(k),)] = v
    return out


def cmd_step(a) -> dict:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from maxtext.common import checkpointing
    from maxtext.utils import train_utils

    overrides = json.load(open(a.overrides))
    batches = json.load(open(a.batch))
    config = config_of(a.base_dir, a.run, overrides, {"steps": 100, "per_device_batch_size": len(batches["3"][0]),
                                                      "max_target_length": len(batches["3"][0][0])})
    (_, manager, _, _, _, _, _, _, _, _, state) = train_utils.setup_train_loop(config, None)
    report: dict = {"restored_step": int(state.optimizer.step[...])}
    report["loss_batch3"] = eval_loss(state, config, batch_of(*batches["3"]))
    # control: the loss the step must move (the state before the update on the next batch)
    report["loss_batch4_before"] = eval_loss(state, config, batch_of(*batches["4"]))

    grads_np = dict(np.load(a.grads))
    params_state = nnx.state(state.model, nnx.Param)
    pure = params_state.to_pure_dict()
    flat = flat_params(pure)
    missing = sorted("/".join(p) for p in flat if "/".join(p) not in grads_np)
    if missing:
        raise SystemExit(f"grads lack {missing[:3]}")
    grads = jax.tree_util.tree_map_with_path(
        lambda kp, x: jnp.asarray(grads_np["/".join(str(getattr(k, "key", k)) for k in kp)], dtype=x.dtype), pure)
    nnx.replace_by_pure_dict(params_state, grads)
    state.apply_gradients(params_state)
    report["step_after"] = int(state.optimizer.step[...])
    report["loss_batch4_after"] = eval_loss(state, config, batch_of(*batches["4"]))
    saved_step = report["step_after"] - 1  # MaxText names a step dir by the last step index taken
    checkpointing.save_checkpoint(manager, saved_step, state, config=config, force=True)
    checkpointing.wait_until_finished(manager)
    report["saved_step_dir"] = saved_step
    return report


def cmd_train(a) -> dict:
    from flax import nnx

    from maxtext.trainers.pre_train.train import loss_fn
    from maxtext.utils import train_utils

    overrides = json.load(open(a.overrides))
    batches = json.load(open(a.batch))
    config = config_of(a.base_dir, a.run, overrides, {"steps": 100, "per_device_batch_size": len(batches["3"][0]),
                                                      "max_target_length": len(batches["3"][0][0])})
    (_, _, _, _, _, _, _, _, _, _, state) = train_utils.setup_train_loop(config, None)
    report: dict = {"restored_step": int(state.optimizer.step[...])}
    b3, b4 = batch_of(*batches["3"]), batch_of(*batches["4"])
    report["loss_batch3"] = eval_loss(state, config, b3)
    report["loss_batch4_before"] = eval_loss(state, config, b4)

    def train_loss(model):
        loss, _ = loss_fn(model, config, dict(b3), None, None, is_train=True)
        return loss

    grads = nnx.grad(train_loss, argnums=nnx.DiffState(0, nnx.Param))(state.model)
    report["grad_norm"] = float(np.sqrt(sum(float((np.asarray(g, np.float64) ** 2).sum())
                                            for g in jax_leaves(grads))))
    state.apply_gradients(grads)
    report["step_after"] = int(state.optimizer.step[...])
    report["loss_batch4_after"] = eval_loss(state, config, b4)
    return report


def jax_leaves(tree) -> list:
    import jax

    return jax.tree_util.tree_leaves(tree)


def cmd_fresh(a) -> dict:
    from maxtext.trainers.pre_train import train

    overrides = json.load(open(a.overrides))
    config = config_of(a.base_dir, a.run, overrides, {"steps": 2, "checkpoint_period": 100,
                                                      "per_device_batch_size": 2, "max_target_length": 16})
    train.train_loop(config, None)
    return {"run_dir": os.path.join(a.base_dir, a.run)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("cmd", choices=["step", "fresh", "train"])
    ap.add_argument("--base-dir", required=True)
    ap.add_argument("--run", required=True)
    ap.add_argument("--overrides", required=True)
    ap.add_argument("--batch")
    ap.add_argument("--grads")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    report = {"step": cmd_step, "fresh": cmd_fresh, "train": cmd_train}[a.cmd](a)
    with open(a.out, "w") as f:
        json.dump(report, f, indent=1)
    print("REPORT", json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
