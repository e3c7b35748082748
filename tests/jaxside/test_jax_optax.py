"""Optax templates filled from the checkpoint by key path; optimizer_from_manifest; template refusal."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from jax.sharding import Mesh

from bridge.errors import BridgeError
from bridge.jaxside.keypaths import leaves_by_path, nested_from_paths, path_str, to_path
from bridge.jaxside.manifest_view import megatron_default_no_decay, optimizer_from_manifest
from bridge.jaxside.optax_state import classify
from bridge.jaxside.restore import restore
from bridge.format.manifest import Manifest, OptimizerConfig
from jax_checkpoints import bits, logical_state, tiny_manifest, tiny_params, write_store_checkpoint

STEP = 100


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    arrays = logical_state(tiny_params(0), step=STEP)
    d = str(tmp_path_factory.mktemp("jaxoptax") / "ckpt")
    write_store_checkpoint(d, arrays, tiny_manifest(STEP), num_writers=2)
    return d, arrays


@pytest.fixture(scope="module")
def mesh():
    return Mesh(np.array(jax.devices()).reshape(2, 4), ("fsdp", "tp"))


def _abstract_params():
    return nested_from_paths({p: jax.ShapeDtypeStruct(a.shape, jnp.float32) for p, a in tiny_params(0).items()})


def _decay(p):
    return jax.tree_util.tree_map_with_path(lambda kp, x: to_path(kp)[-1] == "weight", p)


SCHED = optax.warmup_cosine_decay_schedule(0.0, 3e-3, 10, 1000)
LABELS = lambda p: jax.tree_util.tree_map_with_path(  # noqa: E731
    lambda kp, x: "embed" if to_path(kp)[0] == "embedding" else "rest", p)
TEMPLATES = {
    "adamw": lambda: optax.adamw(3e-3),
    "adamw_schedule_mask": lambda: optax.adamw(SCHED, b2=0.95, mask=_decay),
    "chain_clip": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(SCHED)),
    "multi_transform": lambda: optax.multi_transform(
        {"embed": optax.adamw(1e-3, weight_decay=0.0), "rest": optax.adamw(SCHED, mask=_decay)}, LABELS),
    "inject_hyperparams": lambda: optax.inject_hyperparams(optax.adamw)(learning_rate=1e-3),
}


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_fill_template_by_path(ckpt, mesh, name):
    d, arrays = ckpt
    tx = TEMPLATES[name]()
    template = jax.eval_shape(tx.init, _abstract_params())
    r = restore(d, mesh=mesh, optimizer=template)
    assert jax.tree.structure(r.opt_state) == jax.tree.structure(template)
    kinds = {"mu": 0, "nu": 0, "count": 0, "hyper": 0}
    for kp, leaf in jax.tree_util.tree_leaves_with_path(r.opt_state):
        role = classify(kp)
        kinds[role.kind] += 1
        if role.kind in ("mu", "nu"):
            ref = arrays[("opt_state", "0", role.kind) + role.param]
            assert np.array_equal(bits(leaf), bits(ref)), path_str(to_path(kp))
        elif role.kind == "count":
            assert int(leaf) == STEP and leaf.dtype == jnp.int32, path_str(to_path(kp))
    n = len(tiny_params(0))
    assert kinds["mu"] == kinds["nu"] == n
    expected_counts = {"adamw": 1, "adamw_schedule_mask": 2, "chain_clip": 2, "multi_transform": 3,
                       "inject_hyperparams": 2}[name]
    assert kinds["count"] == expected_counts
    if name == "inject_hyperparams":  # filled from the manifest's hyper-parameters
        hp = r.opt_state.hyperparams
        assert float(hp["b2"]) == np.float32(0.95) and float(hp["weight_decay"]) == np.float32(0.1)
        assert float(hp["learning_rate"]) == np.float32(3e-3)
    # the filled state is usable: one update step runs and advances every count
    grads = jax.tree.map(jnp.ones_like, r.params)
    _, new_state = jax.jit(tx.update)(grads, r.opt_state, r.params)
    counts = [int(l) for kp, l in jax.tree_util.tree_leaves_with_path(new_state) if classify(kp).kind == "count"]
    assert counts == [STEP + 1] * len(counts)


@pytest.mark.slow
def test_schedule_count_drives_learning_rate(ckpt, mesh):
    """The schedule's own count is filled too: the step uses lr(STEP), not lr(0) = 0."""
    d, _ = ckpt
    tx = optax.adamw(SCHED, weight_decay=0.0)
    r = restore(d, mesh=mesh, optimizer=jax.eval_shape(tx.init, _abstract_params()))
    grads = jax.tree.map(jnp.ones_like, r.params)
    u = np.asarray(tx.update(grads, r.opt_state, r.params)[0]["output_layer"]["weight"])
    const = optax.adamw(float(SCHED(STEP)), weight_decay=0.0)
    c_state = (r.opt_state[0],) + tuple(const.init(r.params)[1:])  # same Adam state, constant lr
    want = np.asarray(const.update(grads, c_state, r.params)[0]["output_layer"]["weight"])
    np.testing.assert_allclose(u, want, rtol=1e-6)
    assert np.abs(u).min() > 0  # lr(0) == 0 would give exactly zero updates


def test_mu_dtype_template_casts_moments(ckpt, mesh):
    d, arrays = ckpt
    tx = optax.adamw(1e-3, mu_dtype=jnp.bfloat16)
    r = restore(d, mesh=mesh, optimizer=jax.eval_shape(tx.init, _abstract_params()))
    mu = leaves_by_path(r.opt_state[0].mu)
    for p, a in mu.items():
        assert a.dtype == jnp.bfloat16
        want = arrays[("opt_state", "0", "mu") + p].astype(ml_dtypes.bfloat16)
        assert np.array_equal(bits(a), bits(want)), p


def test_template_mismatch_names_first_path(ckpt, mesh):
    d, _ = ckpt
    params = tiny_params(0)
    tx = optax.adamw(1e-3)
    bad_shape = dict(params)
    bad_shape[("output_layer", "weight")] = np.zeros((33, 16), np.float32)
    tmpl = jax.eval_shape(tx.init, nested_from_paths({p: jax.ShapeDtypeStruct(a.shape, jnp.float32)
                                                      for p, a in bad_shape.items()}))
    with pytest.raises(BridgeError, match=r"shape \(33, 16\) at 0/mu/output_layer/weight differs .*\(32, 16\)"):
        restore(d, mesh=mesh, optimizer=tmpl)
    extra = dict(params)
    extra[("decoder", "extra", "weight")] = np.zeros((2, 2), np.float32)
    tmpl = jax.eval_shape(tx.init, nested_from_paths({p: jax.ShapeDtypeStruct(a.shape, jnp.float32)
                                                      for p, a in extra.items()}))
    with pytest.raises(BridgeError, match="parameter decoder/extra/weight .* the checkpoint lacks"):
        restore(d, mesh=mesh, optimizer=tmpl)
    fewer = {p: a for p, a in params.items() if p[0] != "output_layer"}
    tmpl = jax.eval_shape(tx.init, nested_from_paths({p: jax.ShapeDtypeStruct(a.shape, jnp.float32)
                                                      for p, a in fewer.items()}))
    with pytest.raises(BridgeError, match="no mu for parameter output_layer/weight"):
        restore(d, mesh=mesh, optimizer=tmpl)
    sgd = jax.eval_shape(optax.sgd(1e-3, momentum=0.9).init, _abstract_params())
    with pytest.raises(BridgeError, match="template leaf .*trace.* has no counterpart"):
        restore(d, mesh=mesh, optimizer=sgd)


def _numpy_adamw_step(p, g, m, v, count, lr, b1, b2, eps, wd):
    t = count + 1
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    mh = m / (1 - b1 ** t)
    vh = v / (1 - b2 ** t)
    return p - lr * (mh / (np.sqrt(vh) + eps) + wd * p)


def test_optimizer_from_manifest(ckpt, mesh):
    d, arrays = ckpt
    m = tiny_manifest(STEP)
    tx = optimizer_from_manifest(m)
    r = restore(d, mesh=mesh, optimizer=jax.eval_shape(tx.init, _abstract_params()))
    grads = jax.tree.map(lambda x: jnp.full_like(x, 0.01), r.params)
    upd, _ = jax.jit(tx.update)(grads, r.opt_state, r.params)
    new = optax.apply_updates(r.params, upd)
    no_decay = {tuple(k.split("/")) for k in m.optimizer.no_decay}
    assert len(no_decay) == 5
    for p, a in leaves_by_path(new).items():
        wd = 0.0 if p in no_decay else 0.1
        ref = _numpy_adamw_step(arrays[("params",) + p].astype(np.float64), 0.01,
                                arrays[("opt_state", "0", "mu") + p].astype(np.float64),
                                arrays[("opt_state", "0", "nu") + p].astype(np.float64), STEP,
                                3e-3, 0.9, 0.95, 1e-8, wd)
        np.testing.assert_allclose(np.asarray(a), ref, rtol=2e-6, atol=1e-7, err_msg=path_str(p))
        if p not in no_decay:  # the decay term is visible: the no-wd step differs by far more than rounding
            alt = _numpy_adamw_step(arrays[("params",) + p].astype(np.float64), 0.01,
                                    arrays[("opt_state", "0", "mu") + p].astype(np.float64),
                                    arrays[("opt_state", "0", "nu") + p].astype(np.float64), STEP,
                                    3e-3, 0.9, 0.95, 1e-8, 0.0)
            assert np.abs(np.asarray(a) - alt).max() > 100 * np.abs(np.asarray(a) - ref).max()


def test_default_no_decay_rule_and_missing_lr():
    m = Manifest(optimizer=OptimizerConfig(betas=(0.9, 0.95), weight_decay=0.1))
    with pytest.raises(BridgeError, match="no learning rate"):
        optimizer_from_manifest(m)
    tx = optimizer_from_manifest(m, learning_rate=optax.constant_schedule(1e-3))
    mask = tx.init(nested_from_paths(tiny_params(0)))  # builds without error
    assert mask is not None
    got = {p: megatron_default_no_decay(p, a.shape) for p, a in tiny_params(0).items()}
    assert {p for p, nd in got.items() if nd} == {
        ("decoder", "layers", "self_attention", "linear_qkv", "layer_norm_weight"),
        ("decoder", "layers", "self_attention", "linear_proj", "bias"),
        ("decoder", "layers", "mlp", "linear_fc1", "layer_norm_weight"),
        ("decoder", "final_layernorm", "weight")}
    with pytest.raises(BridgeError, match="not Adam"):
        optimizer_from_manifest(Manifest(optimizer=OptimizerConfig(name="sgd", lr=1.0)))


def test_lr_multiplier_groups_become_multi_transform(ckpt, mesh):
    """A Megatron param group with lr_mult (e.g. a decoupled embedding lr) gets its own scaled adamw."""
    d, arrays = ckpt
    m = tiny_manifest(STEP)
    emb = ("embedding", "word_embeddings", "weight")
    m.optimizer.groups = [{"params": ["/".join(emb)], "lr_mult": 0.1, "wd_mult": 1.0}]
    tx = optimizer_from_manifest(m)
    r = restore(d, mesh=mesh, optimizer=jax.eval_shape(tx.init, _abstract_params()))
    assert type(r.opt_state).__name__ == "PartitionState"
    grads = jax.tree.map(lambda x: jnp.full_like(x, 0.01), r.params)
    upd, _ = jax.jit(tx.update)(grads, r.opt_state, r.params)
    new = leaves_by_path(optax.apply_updates(r.params, upd))
    no_decay = {tuple(k.split("/")) for k in m.optimizer.no_decay}
    for p in (emb, ("output_layer", "weight")):
        lr = 3e-3 * (0.1 if p == emb else 1.0)
        ref = _numpy_adamw_step(arrays[("params",) + p].astype(np.float64), 0.01,
                                arrays[("opt_state", "0", "mu") + p].astype(np.float64),
                                arrays[("opt_state", "0", "nu") + p].astype(np.float64), STEP,
                                lr, 0.9, 0.95, 1e-8, 0.0 if p in no_decay else 0.1)
        np.testing.assert_allclose(np.asarray(new[p]), ref, rtol=2e-6, atol=1e-7, err_msg=path_str(p))
    m.optimizer.groups = [{"lr_mult": 0.5}]
    with pytest.raises(BridgeError, match="lists no params"):
        optimizer_from_manifest(m)


def test_template_shardings_place_the_moments(ckpt, mesh):
    """Explicit placement through the template: nu replicated, mu as its param (default rules)."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    d, arrays = ckpt
    tx = optax.adamw(1e-3)
    tmpl = jax.eval_shape(tx.init, _abstract_params())
    rep = NamedSharding(mesh, P())
    nu = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=rep), tmpl[0].nu)
    tmpl = (tmpl[0]._replace(nu=nu),) + tuple(tmpl[1:])
    r = restore(d, mesh=mesh, optimizer=tmpl)
    w = r.opt_state[0]
    p = ("decoder", "layers", "mlp", "linear_fc2", "weight")
    assert leaves_by_path(w.nu)[p].sharding.is_fully_replicated
    assert leaves_by_path(w.mu)[p].sharding == leaves_by_path(r.params)[p].sharding
    assert not leaves_by_path(r.params)[p].sharding.is_fully_replicated
    assert np.array_equal(bits(leaves_by_path(w.nu)[p]), bits(arrays[("opt_state", "0", "nu") + p]))


@pytest.mark.slow
def test_clip_grad_is_megatrons_and_opt_in(ckpt, mesh):
    """optimizer_from_manifest(clip_grad=True) clips with Megatron's formula at the recorded threshold,
    restores into its (EmptyState, adamw state) template, and refuses when nothing is recorded."""
    d, arrays = ckpt
    m = tiny_manifest(STEP)
    with pytest.raises(BridgeError, match="no clip_grad"):
        optimizer_from_manifest(m, clip_grad=True)
    m.optimizer.clip_grad = 0.05
    tx = optimizer_from_manifest(m, clip_grad=True)
    r = restore(d, mesh=mesh, optimizer=jax.eval_shape(tx.init, _abstract_params()))
    assert int(r.opt_state[1][0].count) == STEP
    rng = np.random.default_rng(0)
    g = {p: (rng.standard_normal(a.shape) * 0.01).astype(np.float32) for p, a in tiny_params(0).items()}
    norm = np.sqrt(sum(np.sum(np.square(a, dtype=np.float64)) for a in g.values()))
    assert norm > 0.05
    coeff = 0.05 / (norm + 1e-6)  # megatron.core.optimizer.clip_grads.clip_grad_by_total_norm_fp32
    grads = nested_from_paths({p: jnp.asarray(a) for p, a in g.items()})
    # on one device: the global norm is a reduction, and XLA's CPU collectives over 8 virtual devices
    # can stall on a loaded 2-core machine
    local = lambda t: jax.tree.map(lambda a: jnp.asarray(np.asarray(a)), t)  # noqa: E731
    params, state = local(r.params), local(r.opt_state)
    upd, _ = jax.jit(tx.update)(grads, state, params)
    new = leaves_by_path(optax.apply_updates(params, upd))
    no_decay = {tuple(k.split("/")) for k in m.optimizer.no_decay}
    for p in tiny_params(0):
        ref = _numpy_adamw_step(arrays[("params",) + p].astype(np.float64), g[p] * coeff,
                                arrays[("opt_state", "0", "mu") + p].astype(np.float64),
                                arrays[("opt_state", "0", "nu") + p].astype(np.float64), STEP,
                                3e-3, 0.9, 0.95, 1e-8, 0.0 if p in no_decay else 0.1)
        np.testing.assert_allclose(np.asarray(new[p]), ref, rtol=2e-6, atol=1e-7, err_msg=path_str(p))
    # below the threshold nothing is scaled; an explicit float overrides the record
    from bridge.jaxside.manifest_view import megatron_clip_by_global_norm

    small = jax.tree.map(lambda x: x * 1e-3, grads)

    out, _ = megatron_clip_by_global_norm(0.05).update(small, optax.EmptyState())
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(small)))
    out, _ = megatron_clip_by_global_norm(1e-4).update(small, optax.EmptyState())
    scale = 1e-4 / (norm * 1e-3 + 1e-6)
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(small)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b) * scale, rtol=1e-5)
    assert optimizer_from_manifest(m, clip_grad=False).init(_abstract_params()) is not None


def test_fused_parameter_keys_cover_their_sections(mesh):
    """The live adapter lists no-decay params by fused key (`.../linear_qkv/bias`), the converter by section
    (`.../linear_qkv/bias/query`): both mean the same parameters (found on real Megatron live data)."""
    from bridge.jaxside.manifest_view import decay_mask

    m = tiny_manifest(STEP)
    fused = [k for k in m.fused if k.endswith("linear_fc1/weight")]
    assert fused
    by_section = decay_mask(m)(nested_from_paths(tiny_params(0)))
    m.optimizer.no_decay = [k for k in m.optimizer.no_decay if not k.startswith(fused[0] + "/")] + fused
    by_key = leaves_by_path(decay_mask(m)(nested_from_paths(tiny_params(0))))
    for p, decayed in leaves_by_path(by_section).items():
        want = False if "/".join(p).startswith(fused[0] + "/") else decayed
        assert by_key[p] == want, p
