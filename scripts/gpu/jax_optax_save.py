"""Hand-off (c) of issue 30: a checkpoint written by the JAX `save` after optax steps, with the schedule
it trained with recorded, for Megatron-LM's `--load` (scripts/gpu/run_handoffs.sh loads it on the GPU).

    python3 scripts/gpu/jax_optax_save.py LOGICAL OUT [--steps 2]

LOGICAL: a logical checkpoint (e.g. `gtp-bridge convert` of tests/fixtures/megatron/tp1/dp_reshardable).
Builds Megatron's schedule from Megatron-LM's argument names (`bridge.lr_schedule.megatron_schedule`, the
same arguments scripts/gpu/megatron_resume.py gives Megatron-LM), restores LOGICAL as optax AdamW state
with it, takes `--steps` optax steps with stand-in gradients, and saves with `save(..., lr_schedule=...)`.
Runs on the CPU (8 host devices) or wherever JAX runs.
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

#: the scheduler arguments of the Megatron-LM run that loads the result (megatron_resume.py passes the same)
SCHEDULER_ARGS = {"lr": 0.01, "min_lr": 0.01, "lr_decay_style": "constant", "train_iters": 100,
                  "global_batch_size": 4, "weight_decay": 0.1}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("logical")
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=2)
    a = ap.parse_args()
    import jax
    import jax.numpy as jnp
    import optax

    from bridge import open_checkpoint, optimizer_from_manifest, restore, save
    from bridge.lr_schedule import megatron_schedule

    sched = megatron_schedule(SCHEDULER_ARGS)
    tx = optimizer_from_manifest(open_checkpoint(a.logical).manifest, learning_rate=sched)
    mesh = jax.make_mesh((len(jax.devices()),), ("data",))
    shapes = restore(a.logical, mesh=mesh, items=("params",)).params
    state = restore(a.logical, mesh=mesh, optimizer=jax.eval_shape(tx.init, shapes))
    params, opt_state = state.params, state.opt_state
    update = jax.jit(tx.update)
    for i in range(a.steps):
        # stand-in gradients (a real run takes jax.grad of its loss): deterministic, different per step
        grads = jax.tree.map(lambda p, i=i: (1e-3 * (i + 1)) * jnp.sin(p.astype(jnp.float32) * (7 + i)), params)
        updates, opt_state = update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
    step = int(state.step) + a.steps
    save(a.out, params=params, opt_state=opt_state, step=step, manifest=state.manifest, plans=state.plans,
         lr_schedule=sched)
    print(f"saved {a.out}: step {step} (restored at {int(state.step)}, {a.steps} optax steps), schedule recorded")
    return 0


if __name__ == "__main__":
    sys.exit(main())
