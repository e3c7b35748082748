"""Compatibility with Orbax itself: identical `_METADATA`, and reading Orbax-written checkpoints."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from bridge.store import adamw_empty_paths, open_checkpoint, save_checkpoint
from bridge.store.verify import verify_checkpoint


def _jax_tree():
    import jax.numpy as jnp
    import optax

    rng = np.random.default_rng(5)
    params = {"decoder": {"layers": {"mlp": {"linear_fc1": {"weight": {
        "gate": jnp.asarray(rng.standard_normal((6, 4)).astype(np.float32)),
        "up": jnp.asarray(rng.standard_normal((6, 4)).astype(np.float32))}}}},
        "final_layernorm": {"weight": jnp.asarray(rng.standard_normal((4,)).astype(np.float32))}}}
    return {"params": params,
            "opt_state": optax.adamw(1e-3).init(params),
            "model": {"decoder": {"final_layernorm": {"weight": params["decoder"]["final_layernorm"]["weight"]
                                                      .astype(jnp.bfloat16)}}},
            "step": jnp.asarray(0, jnp.int32)}


def _flatten(tree) -> dict:
    import jax

    out = {}
    for kp, leaf in jax.tree_util.tree_leaves_with_path(tree):
        path = tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in kp)
        out[path] = np.asarray(leaf)
    return out


def test_metadata_equals_what_orbax_writes_for_the_same_tree(tmp_path):
    import orbax.checkpoint as ocp

    tree = _jax_tree()
    ours = save_checkpoint(str(tmp_path / "ours"), _flatten(tree), empty_paths=adamw_empty_paths())
    theirs = str(tmp_path / "orbax")
    ck = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_zarr3=True, use_compression=False))
    ck.save(theirs, tree)
    a = json.load(open(os.path.join(ours, "_METADATA")))
    b = json.load(open(os.path.join(theirs, "_METADATA")))
    assert b["custom_metadata"] is None
    assert "gtp_bridge" in a.pop("custom_metadata")
    b.pop("custom_metadata")
    assert a == b
    # And Orbax's bytes read through our reader are the same as ours.
    mine, orbax_ck = open_checkpoint(ours), open_checkpoint(theirs)
    assert orbax_ck.manifest is None and mine.paths() == orbax_ck.paths()
    for p in mine.paths():
        assert mine.read(p).tobytes() == orbax_ck.read(p).tobytes(), p


@pytest.mark.slow
@pytest.mark.parametrize("ocdbt", [True, False])
@pytest.mark.parametrize("zarr3", [True, False])
@pytest.mark.parametrize("compression", [True, False])
def test_reader_opens_orbax_checkpoints_of_every_layout(tmp_path, ocdbt, zarr3, compression):
    import jax
    import orbax.checkpoint as ocp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
    rng = np.random.default_rng(9)
    w = rng.standard_normal((16, 8)).astype(np.float32)
    tree = {"params": {"w": jax.device_put(w, NamedSharding(mesh, P("data", "model"))),
                       "b": jax.device_put(w[0], NamedSharding(mesh, P()))},
            "step": jax.numpy.asarray(3, jax.numpy.int32)}
    path = str(tmp_path / "ck")
    ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=ocdbt, use_zarr3=zarr3, use_compression=compression)
                     ).save(path, tree)
    ck = open_checkpoint(path)
    assert ck.manifest is None
    info = ck.arrays()
    assert info[("params", "w")].shape == (16, 8) and info[("params", "w")].dtype == "float32"
    assert info[("params", "w")].chunk_shape == (8, 2)          # Orbax's per-device write shape
    assert (info[("params", "w")].compression is not None) == compression
    assert ck.read(("params", "w")).tobytes() == w.tobytes()
    assert ck.read(("params", "b")).tobytes() == w[0].tobytes()
    assert int(ck.read(("step",))) == 3
    assert np.array_equal(ck.read(("params", "w"), _box((3, 1), (11, 7))), w[3:11, 1:7])
    assert verify_checkpoint(path).ok
    if ocdbt and zarr3 and compression:  # once: the reader itself needs no JAX
        code = ("import sys; from bridge.store import open_checkpoint; ck = open_checkpoint(sys.argv[1]); "
                "print(float(ck.read(('params', 'w')).sum())); assert 'jax' not in sys.modules")
        r = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        assert float(r.stdout) == float(w.sum())


def _box(start, stop):
    from bridge.layout.boxes import Box

    return Box(start, stop)
