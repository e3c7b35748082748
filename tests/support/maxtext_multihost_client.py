"""One process of a MaxText restore under `jax.distributed`, for tests/maxtext/test_maxtext_multihost.py (MAXTEXT_PYTHON).

    python tests/support/maxtext_multihost_client.py --process-id I --num-processes N --port P --base-dir DIR --run RUN \\
        --overrides JSON --out NPZ

Each process joins `jax.distributed` on localhost (CPU collectives over gloo), then MaxText's own trainer
setup (`train_utils.setup_train_loop`: its device mesh over the devices of every process, its shardings,
its `checkpointing.load_state_if_possible` restoring the latest step of DIR/RUN/checkpoints) builds the
train state. Each process writes the shards of every array it holds (`addressable_shards`, named by their
place in the global array) to OUT.<process>.npz, and per array its global shape and whether its sharding
spans devices of more than one process to OUT.<process>.json (no collective: gloo's TCP transport is not
needed). Imports nothing from gtp-bridge.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser()
    for name in ("--process-id", "--num-processes", "--port"):
        ap.add_argument(name, type=int, required=True)
    for name in ("--base-dir", "--run", "--overrides", "--out"):
        ap.add_argument(name, required=True)
    a = ap.parse_args()

    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"localhost:{a.port}", num_processes=a.num_processes,
                               process_id=a.process_id)
    from flax import nnx

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from maxtext_client import config_of
    from maxtext.utils import train_utils

    overrides = json.load(open(a.overrides))
    config = config_of(a.base_dir, a.run, overrides, {"steps": 100, "per_device_batch_size": 1,
                                                      "max_target_length": 16})
    *_, state = train_utils.setup_train_loop(config, None)
    leaves = jax.tree_util.tree_flatten_with_path(nnx.state(state))[0]
    out, report = {}, {"shapes": {}, "spans": {}, "devices": jax.device_count(), "processes": jax.process_count(),
                       "step": int(state.optimizer.step[...])}
    for kp, x in leaves:
        if not isinstance(x, jax.Array) or jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            continue   # MaxText's rng keys are not in the checkpoint (it re-seeds them)
        name = jax.tree_util.keystr(kp)
        report["shapes"][name] = list(x.shape)
        report["spans"][name] = len({d.process_index for d in x.sharding.device_set}) > 1
        for shard in x.addressable_shards:   # this process's part, named by where it sits in the global array
            where = ",".join(f"{sl.start or 0}:{sl.stop if sl.stop is not None else n}"
                             for sl, n in zip(shard.index, x.shape))
            out[f"{name}@{where}"] = np.asarray(shard.data)
    np.savez(f"{a.out}.{a.process_id}.npz", **out)
    with open(f"{a.out}.{a.process_id}.json", "w") as f:
        json.dump(report, f)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
