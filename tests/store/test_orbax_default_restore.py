"""Orbax's default restores (no target, no args) on every checkpoint gtp-bridge writes (issue #30, item 3).

`ocp.PyTreeCheckpointer().restore(path)` and `ocp.CheckpointManager(root).restore(step)` are the
calls JAX training loops make; they need each array's sharding from the checkpoint's `_sharding`
file. Each writer's output is restored that way with real Orbax (8 CPU devices here, and 1 device
in a fresh process) and compared bit for bit with the same arrays read with plain TensorStore
(specs written out here, not the bridge's reader). The file is covered by the metadata seal:
`verify` reports an edited or removed `_sharding`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/
REPO = os.path.dirname(HERE)
TP2 = os.path.join(HERE, "fixtures", "megatron", "tp2", "dp_reshardable")
LLAMA_LIVE = os.path.join(HERE, "fixtures", "maxtext", "llama", "live")


def stored_names(root: str) -> list[str]:
    """Orbax names of the arrays `_METADATA` lists (keys joined with '.')."""
    tree = json.load(open(os.path.join(root, "_METADATA")))["tree_metadata"]
    return sorted(".".join(k["key"] for k in v["key_metadata"]) for v in tree.values()
                  if v["value_metadata"]["value_type"] == "jax.Array")


def ts_read(root: str, name: str) -> np.ndarray:
    """One array read with plain TensorStore: zarr3 over the checkpoint's OCDBT database."""
    import tensorstore as ts

    spec = {"driver": "zarr3", "kvstore": {"driver": "ocdbt", "base": f"file://{root}/", "path": name + "/"}}
    return ts.open(spec, open=True, read=True).result().read().result()


def flat(tree, prefix=()) -> dict[str, object]:
    """Leaves of a restored nested dict / list by Orbax name."""
    if isinstance(tree, dict):
        items = tree.items()
    elif isinstance(tree, (list, tuple)):
        items = ((str(i), v) for i, v in enumerate(tree))
    else:
        return {".".join(prefix): tree}
    out = {}
    for k, v in items:
        out.update(flat(v, prefix + (str(k),)))
    return out


def bits(a) -> bytes:
    return np.ascontiguousarray(np.asarray(a)).tobytes()


def assert_restored_equals_stored(root: str, restored) -> None:
    import jax

    leaves = {k: v for k, v in flat(restored).items() if isinstance(v, jax.Array)}
    names = stored_names(root)
    assert sorted(leaves) == names
    device0 = jax.devices()[0]
    for name in names:
        got, want = leaves[name], ts_read(root, name)
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert bits(got) == bits(want), name
        assert got.sharding.device_set == {device0}, (name, got.sharding)


def default_restore(path: str):
    """`ocp.PyTreeCheckpointer().restore(path)`: no target, no args (Orbax warns that it reads `_sharding`)."""
    import orbax.checkpoint as ocp

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Sharding info not provided")
        return ocp.PyTreeCheckpointer().restore(path)


ONE_DEVICE = """
import json, sys, numpy as np, jax, orbax.checkpoint as ocp
sys.path.insert(0, {here!r})
from test_orbax_default_restore import assert_restored_equals_stored
assert len(jax.devices()) == 1
root = {root!r}
assert_restored_equals_stored(root, ocp.PyTreeCheckpointer().restore(root))
print("ONE-DEVICE-OK")
"""


def restore_on_one_device(root: str) -> None:
    env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1")
    r = subprocess.run([sys.executable, "-c", ONE_DEVICE.format(here=os.path.dirname(os.path.abspath(__file__)), root=root)], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "ONE-DEVICE-OK" in r.stdout, r.stderr[-3000:]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    from converters.megatron.convert_entry import convert

    dst = str(tmp_path_factory.mktemp("conv") / "tp2")
    convert(TP2, dst)
    return dst


@pytest.mark.slow
def test_convert_output_restores_by_default_on_8_devices_and_on_1(converted):
    assert_restored_equals_stored(converted, default_restore(converted))
    restore_on_one_device(converted)


@pytest.mark.slow
def test_convert_step_dir_restores_with_checkpoint_manager_defaults(tmp_path):
    import orbax.checkpoint as ocp

    root = str(tmp_path / "run")
    r = subprocess.run([sys.executable, "-m", "bridge.cli", "convert", TP2, root, "--orbax-step-dir"],
                       env=dict(os.environ, PYTHONPATH=REPO), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    manager = ocp.CheckpointManager(root)
    try:
        step = manager.latest_step()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Sharding info not provided")
            restored = manager.restore(step)
    finally:
        manager.close()
    assert_restored_equals_stored(os.path.join(root, str(step), "default"), restored)


def test_store_save_restores_by_default(tmp_path):
    import ml_dtypes

    from bridge.store import save_checkpoint

    rng = np.random.default_rng(0)
    arrays = {("params", "w"): rng.standard_normal((6, 5)).astype(np.float32),
              ("model", "w"): rng.standard_normal((6, 5)).astype(ml_dtypes.bfloat16),
              ("step",): np.asarray(3, np.int32)}
    dst = save_checkpoint(str(tmp_path / "ck"), arrays, num_writers=2)
    assert_restored_equals_stored(dst, default_restore(dst))


def test_maxtext_writers_restore_by_default(tmp_path):
    """to-maxtext's items (an Orbax tree under a MaxText CheckpointManager root) and from-maxtext's output."""
    from bridge.jaxside.presets.maxtext_stream import read_maxtext, write_maxtext

    w = write_maxtext(LLAMA_LIVE, str(tmp_path / "mt"))
    items = os.path.join(w.step_dir, "items")
    assert_restored_equals_stored(items, default_restore(items))
    read_maxtext(str(tmp_path / "mt"), str(tmp_path / "back"))
    back = str(tmp_path / "back")
    assert_restored_equals_stored(back, default_restore(back))


def _export(rank, world, dst):
    from live_model import MODEL, STEP, local_params

    from bridge.layout import ParallelLayout
    from bridge.live.api import AdamConfig, LiveRun
    from bridge.live.export import export_state

    params, _ = local_params(MODEL, 1, 2, 1, 4, rank, None)
    export_state(dst, LiveRun(ParallelLayout(gtp=2), rank, STEP, AdamConfig(lr=1e-3)), params, target_chunk_bytes=64)
    return {}


@pytest.mark.slow
def test_live_export_restores_by_default(tmp_path):
    from spawn_ranks import spawn

    dst = str(tmp_path / "live")
    _, errors = spawn(2, _export, (dst,), tmp_path)
    assert not errors, errors
    assert_restored_equals_stored(dst, default_restore(dst))


@pytest.mark.slow
def test_sharding_file_is_sealed(converted, tmp_path):
    """Editing or removing `_sharding` is reported by verify (the metadata checksum covers it);
    restore, inspect, verify and Orbax's StandardRestore keep working on the intact checkpoint."""
    import shutil

    import jax
    import orbax.checkpoint as ocp

    from bridge import open_checkpoint, restore
    from bridge import verify as verify_checkpoint

    assert verify_checkpoint(converted).ok
    mesh = jax.make_mesh((8,), ("x",))
    state = restore(converted, mesh=mesh, items=("params",))
    name = "params.decoder.final_layernorm.weight"
    assert bits(state.params["decoder"]["final_layernorm"]["weight"]) == bits(ts_read(converted, name))
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec())), default_restore(converted))
    got = ocp.StandardCheckpointer().restore(converted, abstract)
    assert bits(got["params"]["decoder"]["final_layernorm"]["weight"]) == bits(ts_read(converted, name))
    r = subprocess.run([sys.executable, "-m", "bridge.cli", "inspect", converted], env=dict(os.environ, PYTHONPATH=REPO),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr

    edited = str(tmp_path / "edited")
    shutil.copytree(converted, edited)
    doc = json.load(open(os.path.join(edited, "_sharding")))
    first = sorted(doc)[0]
    doc[first] = doc[first].replace('"id": 0', '"id": 5')
    json.dump(doc, open(os.path.join(edited, "_sharding"), "w"))
    res = verify_checkpoint(edited)
    assert not res.ok and any("_sharding was modified" in p for p in res.metadata_problems), res.metadata_problems
    os.remove(os.path.join(edited, "_sharding"))
    assert any("_sharding is missing" in p for p in verify_checkpoint(edited).metadata_problems)
    assert open_checkpoint(converted).manifest is not None


def test_jax_save_writes_the_stores_sharding_file_and_seals_it(tmp_path):
    """The JAX save writes the store's `_sharding` as every writer does (one device, device 0, not the
    saving mesh), so Orbax's default restore works on any machine; its digest is sealed."""
    import jax
    import jax.numpy as jnp
    import optax

    from bridge import save
    from bridge import verify as verify_checkpoint

    mesh = jax.make_mesh((2, 4), ("a", "b"))
    sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("a", "b"))
    params = {"w": jax.device_put(jnp.arange(32, dtype=jnp.float32).reshape(4, 8), sh)}
    opt_state = optax.adamw(1e-3).init(params)
    dst = str(tmp_path / "jax")
    save(dst, params=params, opt_state=opt_state, step=1, with_model=False)
    recorded = json.loads(json.loads(open(os.path.join(dst, "_sharding")).read())["cGFyYW1zLnc="])
    assert recorded["shape"] == [1] and recorded["device_mesh"] == {"mesh": [{"id": 0}]}, recorded
    restored = default_restore(dst)
    assert_restored_equals_stored(dst, restored)
    assert bits(restored["params"]["w"]) == bits(np.arange(32, dtype=np.float32).reshape(4, 8))
    assert verify_checkpoint(dst).ok
    with open(os.path.join(dst, "_sharding"), "a") as f:
        f.write(" ")
    assert any("_sharding was modified" in p for p in verify_checkpoint(dst).metadata_problems)
