"""Real Megatron-Core fixtures, converted to the logical store, restored by JAX on several meshes."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from bridge.jaxside.abstract import PARAMS, stored_arrays
from bridge.jaxside.keypaths import leaves_by_path, nested_from_paths
from bridge.jaxside.manifest_view import adam_hparams, optimizer_from_manifest
from bridge.jaxside.optax_state import classify
from bridge.jaxside.restore import restore
from jax_checkpoints import bits, read_with_tensorstore

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "megatron")
RUNS = [r for r in ("tp1", "moe_ep1") if os.path.isdir(os.path.join(FIXTURES, r, "dp_reshardable"))]


@pytest.fixture(scope="module", params=RUNS)
def converted(request, tmp_path_factory):
    from converters.megatron_convert import ConvertOptions, convert
    from converters.megatron_format import Hints

    hints = Hints(kv_channels=6) if request.param == "tp1" else None  # tp1 was saved without args
    dst = str(tmp_path_factory.mktemp("jaxfx") / request.param)
    convert(os.path.join(FIXTURES, request.param, "dp_reshardable"), dst, ConvertOptions(workers=1, hints=hints))
    return dst


@pytest.mark.skipif(not RUNS, reason="Megatron fixtures not present")
@pytest.mark.parametrize("mesh_shape", [(2, 4), (4, 2)])
def test_real_fixture_restores_bit_exact(converted, mesh_shape):
    stored = stored_arrays(converted)
    h = adam_hparams(stored.custom_metadata["gtp_bridge"])
    assert (h.lr, h.b1, h.b2, h.weight_decay) == (1e-2, 0.9, 0.95, 0.1)  # Megatron's recorded hyper-parameters
    tx = optimizer_from_manifest(stored.custom_metadata["gtp_bridge"])
    abstract = nested_from_paths({p: jax.ShapeDtypeStruct(a.shape, jnp.float32)
                                  for p, a in stored.section(PARAMS).items()})
    devices = np.array(jax.devices())
    mesh = Mesh(devices.reshape(mesh_shape) if mesh_shape[0] == 2 else devices[::-1].reshape(mesh_shape),
                ("fsdp", "tp"))
    r = restore(converted, mesh=mesh, optimizer=jax.eval_shape(tx.init, abstract))
    n = 0
    for p, a in leaves_by_path(r.params).items():
        assert np.array_equal(bits(a), bits(read_with_tensorstore(converted, ("params",) + p))), p
        n += 1
    for kp, leaf in jax.tree_util.tree_leaves_with_path(r.opt_state):
        role = classify(kp)
        if role.kind in ("mu", "nu"):
            want = read_with_tensorstore(converted, ("opt_state", "0", role.kind) + role.param)
            assert np.array_equal(bits(leaf), bits(want)), role
        elif role.kind == "count":
            assert int(leaf) == int(read_with_tensorstore(converted, ("opt_state", "0", "count")))
    assert n > 5 and int(r.step) == 3
    # one AdamW step runs on the restored real state
    grads = jax.tree.map(lambda x: jnp.full_like(x, 1e-3), r.params)
    _, new = jax.jit(tx.update)(grads, r.opt_state, r.params)
    assert int(new[0].count) == int(r.opt_state[0].count) + 1
