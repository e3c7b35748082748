"""Integration defects: `save(model=...)` on a `jax.make_mesh` mesh (explicit axis types), and
relative checkpoint paths for save / restore / open_checkpoint / verify.

References are independent: torch's `.to(torch.bfloat16)` for the cast masters and numpy for the
first differing index; the relative-path checkpoint is compared with one written at an absolute path.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from jax.sharding import NamedSharding, PartitionSpec as P

from bridge.errors import BridgeError
from bridge.jaxside.restore import restore
from bridge.jaxside.save import save
from bridge.store.reader import open_checkpoint
from jax_checkpoints import bits


def _torch_bf16(a: np.ndarray) -> np.ndarray:
    return torch.from_numpy(np.asarray(a, np.float32)).to(torch.bfloat16).float().numpy()


@pytest.fixture(scope="module")
def explicit_state():
    mesh = jax.make_mesh((2, 4), ("fsdp", "tp"))
    assert all(str(t).endswith("Explicit") for t in mesh.axis_types)  # the case that failed
    rng = np.random.default_rng(3)
    # sharded on a non-leading axis ("k", "e"): the flattening reshape is refused on explicit meshes
    specs = {"w": P("fsdp", "tp"), "b": P("tp"), "k": P(None, ("fsdp", "tp")), "e": P(None, "fsdp", "tp")}
    shapes = {"w": (16, 24), "b": (24,), "k": (6, 16), "e": (4, 16, 24)}
    host = {k: rng.standard_normal(shapes[k]).astype(np.float32) for k in specs}
    params = {k: jax.device_put(host[k], NamedSharding(mesh, specs[k])) for k in specs}
    tx = optax.adam(1e-3)
    return mesh, host, params, tx.init(params)


@pytest.mark.slow
def test_consistent_model_on_explicit_mesh_is_accepted(explicit_state, tmp_path):
    mesh, host, params, opt_state = explicit_state
    model = {k: jax.device_put(_torch_bf16(v).astype(jnp.bfloat16), params[k].sharding) for k, v in host.items()}
    save(str(tmp_path / "ok"), params=params, opt_state=opt_state, step=1, model=model)
    ck = open_checkpoint(str(tmp_path / "ok"))
    for k in host:
        assert np.array_equal(np.asarray(ck.read(("model", k)), np.float32), _torch_bf16(host[k])), k


@pytest.mark.parametrize("name,sharding", [("w", P("fsdp", "tp")), ("w", P(None, "tp")), ("b", P("tp")),
                                           ("e", P(None, "fsdp", "tp")), ("e", P("tp", None, "fsdp"))])
@pytest.mark.slow
def test_inconsistent_model_on_explicit_mesh_is_refused(explicit_state, tmp_path, name, sharding):
    mesh, host, params, opt_state = explicit_state
    model_host = {k: _torch_bf16(v) for k, v in host.items()}
    # two wrong elements, the later one in an earlier shard for "w" (row-major order decides "first")
    wrong = {"w": [(11, 3), (9, 20)], "b": [(17,), (5,)], "e": [(2, 1, 2), (1, 15, 23)]}[name]
    for i in wrong:
        model_host[name][i] = model_host[name][i] + 1.0
    model = {k: jax.device_put(v.astype(jnp.bfloat16),
                               NamedSharding(mesh, sharding) if k == name else params[k].sharding)
             for k, v in model_host.items()}
    dst = tmp_path / "bad"
    with pytest.raises(BridgeError) as e:
        save(str(dst), params=params, opt_state=opt_state, step=1, model=model)
    diff = np.asarray(model[name], np.float32) != _torch_bf16(host[name])
    first = tuple(int(i) for i in np.argwhere(diff)[0])
    assert first == min(wrong)
    msg = str(e.value)
    assert f"model/{name}" in msg and f"index {first}" in msg and "\n" not in msg
    assert not os.path.exists(dst)


@pytest.mark.slow
def test_relative_paths(explicit_state, tmp_path, monkeypatch):
    from bridge.store.verify import verify_checkpoint
    mesh, host, params, opt_state = explicit_state
    save(str(tmp_path / "abs"), params=params, opt_state=opt_state, step=5)
    monkeypatch.chdir(tmp_path)
    save("rel/ckpt", params=params, opt_state=opt_state, step=5)
    ck = open_checkpoint("rel/ckpt")
    want = open_checkpoint(str(tmp_path / "abs"))
    for p in want.paths():
        assert np.array_equal(bits(np.asarray(ck.read(p))), bits(np.asarray(want.read(p)))), p
    res = verify_checkpoint("rel/ckpt")
    assert res.ok and res.has_manifest, res
    state = restore("rel/ckpt", mesh=mesh)
    for k in host:
        assert np.array_equal(bits(np.asarray(state.params[k])), bits(host[k])), k
