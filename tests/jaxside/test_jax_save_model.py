"""JAX `save` keeps the bf16 weights consistent with the fp32 masters (issue 18 item 2).

The reference for the weights is torch's own `.to(torch.bfloat16)` (what Megatron does to its
masters), applied to the masters read back from the checkpoint: an independent implementation of
round-to-nearest-even, checked on values chosen at rounding ties and at the special values.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
import torch
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from bridge.errors import BridgeError
from bridge.jaxside.keypaths import leaves_by_path
from bridge.jaxside.save import save
from bridge.store.reader import open_checkpoint
from jax_checkpoints import bits


def _tricky_fp32(shape, seed) -> np.ndarray:
    """Random fp32 values plus every rounding case: ties to even (both directions), near-ties, the
    largest finite value (rounds to inf in bf16), subnormals, +-0, +-inf, NaN."""
    rng = np.random.default_rng(seed)
    a = rng.standard_normal(shape).astype(np.float32)
    flat = a.reshape(-1)
    u = flat.view(np.uint32)
    specials = np.array([0x3F808000, 0x3F818000,      # ties: 1+2^-8 (rounds down to even), next (rounds up)
                         0x3F807FFF, 0x3F808001,      # just below / above a tie
                         0x7F7FFFFF, 0x00000001, 0x807FFFFF, 0x80000000, 0x00000000,
                         0x7F800000, 0xFF800000, 0x7FC00000], np.uint32)
    u[:specials.size] = specials
    u[specials.size:specials.size + 64] = (u[specials.size:specials.size + 64] & 0xFFFF0000) | 0x8000  # random ties
    return a


def _torch_bf16_bits(a: np.ndarray) -> np.ndarray:
    return torch.from_numpy(np.array(a, np.float32)).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def _same_bf16(got_bits: np.ndarray, want_bits: np.ndarray) -> bool:
    """Bit-equal, except that a NaN may carry any payload (torch and XLA pick different quiet NaNs)."""
    nan_got = (got_bits & 0x7FFF) > 0x7F80
    nan_want = (want_bits & 0x7FFF) > 0x7F80
    return bool(np.array_equal(nan_got, nan_want) and np.array_equal(got_bits[~nan_got], want_bits[~nan_want]))


@pytest.fixture(scope="module")
def state():
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("fsdp", "tp"))
    host = {"w": _tricky_fp32((16, 24), 0), "b": _tricky_fp32((24,), 1)}
    params = {"w": jax.device_put(host["w"], NamedSharding(mesh, P("fsdp", "tp"))),
              "b": jax.device_put(host["b"], NamedSharding(mesh, P()))}
    tx = optax.adam(1e-3)
    return params, tx.init(params), tx


def _step(params, opt_state, tx):
    grads = jax.tree.map(lambda x: jnp.where(jnp.isfinite(x), x, 0.0) * 0.5 + 0.25, params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


def test_default_weights_are_torch_bf16_of_the_masters(state, tmp_path):
    params, opt_state, _ = state
    dst = str(tmp_path / "out")
    save(dst, params=params, opt_state=opt_state, step=7)
    ck = open_checkpoint(dst)
    for name in ("w", "b"):
        master = ck.read(("params", name))
        assert np.array_equal(bits(master), bits(np.asarray(params[name])))
        weight = ck.read(("model", name))
        assert weight.dtype.name == "bfloat16"
        assert _same_bf16(bits(weight), _torch_bf16_bits(master)), name


@pytest.mark.slow
def test_weights_from_before_the_step_are_refused_naming_array_and_index(state, tmp_path):
    params, opt_state, tx = state
    stale = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)   # weights of the previous step
    new_params, new_state = _step(params, opt_state, tx)
    dst = tmp_path / "stale"
    with pytest.raises(BridgeError) as e:
        save(str(dst), params=new_params, opt_state=new_state, step=8, model=stale)
    msg = str(e.value)
    # the first differing element, found independently with numpy + torch
    want = _torch_bf16_bits(np.asarray(new_params["b"]))
    got = bits(np.asarray(stale["b"]))
    both_nan = ((want & 0x7FFF) > 0x7F80) & ((got & 0x7FFF) > 0x7F80)
    first = tuple(int(i) for i in np.argwhere((want != got) & ~both_nan)[0])
    assert "model/b" in msg and f"index {first}" in msg and "allow_inconsistent_model" in msg
    assert "\n" not in msg
    assert not os.path.exists(dst) and not os.listdir(tmp_path)  # nothing written
    # asked for explicitly, the stale weights are written as given
    save(str(dst), params=new_params, opt_state=new_state, step=8, model=stale, allow_inconsistent_model=True)
    assert np.array_equal(bits(open_checkpoint(str(dst)).read(("model", "w"))), bits(np.asarray(stale["w"])))


def test_consistent_weights_are_accepted_and_no_weights_on_request(state, tmp_path):
    params, opt_state, tx = state
    new_params, new_state = _step(params, opt_state, tx)
    model = {k: torch.from_numpy(np.asarray(v)).to(torch.bfloat16).float().numpy() for k, v in new_params.items()}
    model = {k: jnp.asarray(v, jnp.bfloat16) for k, v in model.items()}  # exact: bf16 values widened and back
    save(str(tmp_path / "ok"), params=new_params, opt_state=new_state, step=8, model=model)
    assert _same_bf16(bits(open_checkpoint(str(tmp_path / "ok")).read(("model", "w"))),
                      _torch_bf16_bits(np.asarray(new_params["w"])))
    save(str(tmp_path / "nomodel"), params=new_params, opt_state=new_state, step=8, with_model=False)
    assert not any(p[0] == "model" for p in open_checkpoint(str(tmp_path / "nomodel")).paths())
    with pytest.raises(BridgeError, match="shape"):
        save(str(tmp_path / "bad"), params=new_params, opt_state=new_state, step=8,
             model={"w": model["w"][:8], "b": model["b"]})


def test_save_into_an_orbax_checkpoint_manager_root(state, tmp_path):
    """`orbax_manager=True`: a real CheckpointManager lists our step as its latest and restores our arrays."""
    params, opt_state, _ = state
    root = str(tmp_path / "mgr")
    mgr = ocp.CheckpointManager(root)
    mgr.save(3, args=ocp.args.StandardSave({"x": jnp.arange(4.0)}))  # an earlier step Orbax wrote itself
    mgr.wait_until_finished()
    mgr.close()
    save(root, params=params, opt_state=opt_state, step=12, orbax_manager=True)
    assert sorted(os.listdir(root)) == ["12", "3"]  # no staging left behind
    mgr = ocp.CheckpointManager(root)
    assert mgr.all_steps() == [3, 12] and mgr.latest_step() == 12
    restored = mgr.restore(12)
    want = leaves_by_path(restored)
    for name in ("w", "b"):
        assert np.array_equal(bits(np.asarray(want[("params", name)])), bits(np.asarray(params[name])))
        assert _same_bf16(bits(np.asarray(want[("model", name)])), _torch_bf16_bits(np.asarray(params[name])))
    mgr.close()
    # our own readers take the root (latest step) or the step directory
    assert np.array_equal(bits(open_checkpoint(root).read(("params", "w"))), bits(np.asarray(params["w"])))
    assert open_checkpoint(os.path.join(root, "12")).root == os.path.join(root, "12", "default")
    with pytest.raises(BridgeError, match="already has step 12"):
        save(root, params=params, opt_state=opt_state, step=12, orbax_manager=True)
