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

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures", "megatron")
RUNS = [r for r in ("tp1", "moe_ep1") if os.path.isdir(os.path.join(FIXTURES, r, "dp_reshardable"))]


@pytest.fixture(scope="module", params=RUNS)
def converted(request, tmp_path_factory):
    from converters.megatron.convert import ConvertOptions
    from converters.megatron.convert_entry import convert
    from converters.megatron.plan.format import Hints

    hints = Hints(kv_channels=6) if request.param == "tp1" else None  # tp1 was saved without args
    dst = str(tmp_path_factory.mktemp("jaxfx") / request.param)
    convert(os.path.join(FIXTURES, request.param, "dp_reshardable"), dst, ConvertOptions(workers=1, hints=hints))
    return dst


@pytest.mark.slow
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


@pytest.mark.slow
@pytest.mark.skipif("tp1" not in RUNS, reason="Megatron fixtures not present")
def test_jax_trained_state_goes_back_to_megatron(tmp_path):
    """Real fixture -> JAX AdamW step -> JAX save -> `gtp-bridge to-megatron --tp 2` -> `convert` back:
    the Megatron checkpoint holds exactly the JAX-trained params, moments, count and model weights."""
    pytest.importorskip("converters.megatron.write.torch_dist")
    from bridge.cli import main as cli_main
    from bridge.jaxside.save import save
    from bridge.store.reader import open_checkpoint
    from converters.megatron.convert import ConvertOptions
    from converters.megatron.convert_entry import convert
    from converters.megatron.plan.format import Hints

    src = str(tmp_path / "logical")
    convert(os.path.join(FIXTURES, "tp1", "dp_reshardable"), src, ConvertOptions(workers=1, hints=Hints(kv_channels=6)))
    stored = stored_arrays(src)
    tx = optimizer_from_manifest(stored.custom_metadata["gtp_bridge"])
    abstract = nested_from_paths({p: jax.ShapeDtypeStruct(a.shape, jnp.float32)
                                  for p, a in stored.section(PARAMS).items()})
    r = restore(src, mesh=Mesh(np.array(jax.devices()).reshape(2, 4), ("fsdp", "tp")),
                optimizer=jax.eval_shape(tx.init, abstract))
    grads = jax.tree.map(lambda x: jnp.full_like(x, 1e-3), r.params)
    upd, state = jax.jit(tx.update)(grads, r.opt_state, r.params)
    params = jax.tree.map(lambda p, u: p + u, r.params, upd)
    model = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    jdir, mdir, back = str(tmp_path / "jax"), str(tmp_path / "megatron_tp2"), str(tmp_path / "back")
    save(jdir, params=params, opt_state=state, step=int(r.step) + 1, model=model, manifest=r.manifest)
    assert cli_main(["verify", jdir]) == 0
    assert cli_main(["to-megatron", "--no-scheduler", jdir, mdir, "--tp", "2"]) == 0
    convert(mdir, back, ConvertOptions(workers=1))
    a, b = open_checkpoint(jdir), open_checkpoint(back)
    common = set(a.paths()) & set(b.paths())
    assert {p[0] for p in common} >= {"params", "opt_state", "step"}
    assert len([p for p in common if p[0] == "params"]) == len(stored.section(PARAMS))
    for p in sorted(common):
        assert np.array_equal(bits(a.read(p)), bits(b.read(p))), p
    assert int(b.read(("opt_state", "0", "count"))) == int(r.opt_state[0].count) + 1
