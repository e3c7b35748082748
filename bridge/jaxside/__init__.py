"""JAX side of gtp-bridge: restore a logical checkpoint onto any mesh as optax state, save back.

    from bridge.jaxside import restore, save, ShardingRules, optimizer_from_manifest
    tx = optimizer_from_manifest(manifest)                       # Megatron's AdamW as optax.adamw
    state = restore(path, mesh=mesh, optimizer=jax.eval_shape(tx.init, abstract_params))
    ...train...
    save(new_path, params=p, opt_state=s, step=n, manifest=state.manifest, plans=state.plans)

Everything is read and written by the store (TensorStore), on a local path and s3:// / gs://
alike, in the layout plain Orbax restores; this package builds abstract trees, shardings, the
block reads and the optax mapping (docs/ARCHITECTURE.md maps the modules).
"""

from bridge.errors import require

require("bridge.jaxside (restore / save)", "jax", "orbax.checkpoint", "optax")  # one line naming the extra

from bridge.jaxside.abstract import Target, abstract_tree, stored_arrays
from bridge.jaxside.manifest_view import adam_hparams, decay_mask, optimizer_from_manifest
from bridge.jaxside.restore import Restored, restore
from bridge.jaxside.save import save
from bridge.jaxside.sharding_rules import MeshAxes, ShardingRules, default_spec

__all__ = ["MeshAxes", "Restored", "ShardingRules", "Target", "abstract_tree", "adam_hparams", "decay_mask",
           "default_spec", "optimizer_from_manifest", "restore", "save", "stored_arrays"]
