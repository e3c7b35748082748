"""The full live scenario at world 8 with the reference GTP trainer (one spawned gloo group).

TP2 x GTP2 x DP2 (padding, native FP8 weights, DP boundaries that cut rows) trains 3 steps and
exports. Checks:
(a) plain Orbax restores exactly the state the ranks held, assembled from their raw dumps by
    `reference_check.assemble_global` (independent of `bridge.layout`), and is within fp32
    tolerance of the world-size-1 run;
(b) TP1 x GTP4 x DP2, TP4 x GTP1 x DP2 and TP2 x DP4 x EP2 jobs (and a world-size-1 job) reload
    exactly that state (re-assembled from their dumps) and their next step matches the original
    layout's next step to fp32 tolerance;
(c) JAX restores it on a different mesh and an optax.adamw step from it matches Megatron's FusedAdam
    formula; a JAX-trained, JAX-saved checkpoint reloads into the TP2 x GTP2 x DP2 trainer with
    params / mu / nu / count bit-exact.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from bridge.testing.scenario import abstract_tree, bits, check_restored, check_scenario, load_dumps, logical_from_assembled
from spawn_ranks import spawn

STEPS = 3
SEED = 3
SRC = {"tp": 2, "gtp": 2, "dp": 2, "egtp": 2}
TARGETS = {"tp1_gtp4_dp2": {"tp": 1, "gtp": 4, "dp": 2, "egtp": 4}, "tp4_gtp1_dp2": {"tp": 4, "gtp": 1, "dp": 2},
           "tp2_dp4_ep2": {"tp": 2, "dp": 4, "ep": 2}}
ADAM = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}


def _config():
    from bridge.live.api import AdamConfig
    from bridge.testing.trainer import TrainerConfig

    return TrainerConfig(adam=AdamConfig(**ADAM), weights="fp8", seed=SEED)


def _worker(rank, world, out, dst, jax_ckpt):
    import torch

    from bridge.testing.scenario import run_scenario

    torch.set_num_threads(1)
    return run_scenario(rank, out, dst, SRC, TARGETS, _config(), STEPS, extra_reloads={"from_jax": (jax_ckpt, SRC)})


def _fused_adam(p, m, v, g, t, lr, b1, b2, eps, wd):
    """TE/Apex FusedAdam (adam_w_mode=1) in fp32 with host-double bias corrections (DESIGN §4.2)."""
    f = np.float32
    m = f(b1) * m + f(1 - b1) * g
    v = f(b2) * v + f(1 - b2) * g * g
    bc1, bc2 = f(1 - b1 ** t), f(1 - b2 ** t)
    upd = (m / bc1) / (np.sqrt(v / bc2) + f(eps)) + f(wd) * p
    return p - f(lr) * upd, m, v


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_world8_trainer_export_reload_jax(tmp_path):
    from bridge.layout import ParallelLayout
    from bridge.testing.check import assemble_global
    from bridge.testing.trainer import train

    import jax_checkpoints as jc

    # world-size-1 reference, and a JAX-trained checkpoint of the same model to reload into torch
    ref1 = train(ParallelLayout(), STEPS, SEED, _config())
    from bridge.testing.check import dump_rank, logical_state

    want1 = logical_from_assembled(assemble_global([dump_rank(ref1.trainer)]))
    init = logical_state(ref1.trainer)["params"]
    from bridge.format.tree import megatron_key_to_path

    jax_ckpt = str(tmp_path / "jax_ckpt")
    jax_expected = jc.make_jax_checkpoint(jax_ckpt, params={megatron_key_to_path(k): v for k, v in init.items()},
                                          steps=2, seed=SEED)

    dst = str(tmp_path / "live")
    out = str(tmp_path / "dumps")
    os.makedirs(out)
    results, _ = spawn(8, _worker, (out, dst, jax_ckpt), tmp_path, timeout_s=800, pg_timeout_s=300)

    # (a) Orbax restore == the held state (bit-exact); (b) reloads exact, next step matches
    src = load_dumps(out, "src", 8)
    assert any(s["frag"] is not None and len(s["shape"]) == 2 and s["frag"]["f0"] % s["shape"][1]
               for d in src for s in d["slots"]), "scenario lost its DP boundary inside a row"
    problems, held = check_scenario(out, dst, 8, list(TARGETS), STEPS)
    assert problems == [], problems[:5]
    for name in TARGETS:
        assert results[0][name]["step"] == STEPS
    # ... and within fp32 tolerance of the world-size-1 run (different reduction order)
    for name, w in held["master"].items():
        for k, tol in (("master", 1e-5), ("exp_avg", 1e-7), ("exp_avg_sq", 1e-9)):
            np.testing.assert_allclose(held[k][name], want1[k][name], atol=tol, rtol=1e-5, err_msg=f"{k}/{name} vs world 1")
    # the checks are sharp: a one-element change of the held state is caught
    bad = {k: dict(v) for k, v in held.items()}
    first = next(iter(bad["exp_avg"]))
    bad["exp_avg"][first] = bad["exp_avg"][first].copy()
    bad["exp_avg"][first].reshape(-1)[0] += 1e-3
    import orbax.checkpoint as ocp

    assert check_restored(ocp.StandardCheckpointer().restore(dst, abstract_tree(held)), bad, STEPS)

    # another world size: a single-process (TP1 x GTP1 x DP1) job reloads it and takes the same next step
    _world1_reload(dst, held, out)

    # (c) JAX continues: restore on another mesh, one optax.adamw step == FusedAdam formula
    _jax_continue(dst, held)
    # a JAX-saved checkpoint reloads into torch bit-exactly
    assert results[0]["from_jax"]["step"] == int(jax_expected[("opt_state", "0", "count")])
    from_jax = logical_from_assembled(assemble_global(load_dumps(out, "from_jax", 8)), ("master", "exp_avg", "exp_avg_sq"))
    for root, k in (("params", "master"), ("opt_state/0/mu", "exp_avg"), ("opt_state/0/nu", "exp_avg_sq")):
        for arr, v in from_jax[k].items():
            want = jax_expected[tuple(root.split("/")) + megatron_key_to_path(arr)]
            assert np.array_equal(bits(v), bits(want)), f"from JAX {root}/{arr}"


def _world1_reload(dst, held, out):
    from bridge.layout import ParallelLayout
    from bridge.testing.check import assemble_global, compare, dump_rank
    from bridge.testing.trainer import ReferenceTrainer, step
    from bridge.live.reload import reload_state
    from bridge.testing.scenario import ATOL, KINDS

    tr = ReferenceTrainer(ParallelLayout(), _config(), init=False)
    res = reload_state(dst, tr.live_run(), tr.local_params())
    tr.resume(res.step)
    got = logical_from_assembled(assemble_global([dump_rank(tr)]))
    for k in KINDS:
        for arr, w in held[k].items():
            assert np.array_equal(bits(got[k][arr]), bits(w)), f"world 1: reloaded {k}/{arr}"
    losses = step(tr, 1)
    src_next = load_dumps(out, "src_next", 8)
    want = assemble_global(src_next)
    state = ("master", "exp_avg", "exp_avg_sq")
    nxt = assemble_global([dump_rank(tr)])
    assert compare({n: {k: v[k] for k in state} for n, v in nxt.items()},
                   {n: {k: v[k] for k in state} for n, v in want.items()}, ATOL) == []
    assert losses == pytest.approx(src_next[0]["losses"], rel=1e-5, abs=1e-6)


def _jax_continue(path, held):
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import orbax.checkpoint as ocp

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("a", "b"))

    def shard_of(x):
        spec = P("a") if x.ndim >= 1 and x.shape[0] % 4 == 0 else P()
        return NamedSharding(mesh, spec)

    st = ocp.StandardCheckpointer().restore(path, abstract_tree(held, shard_of))
    assert check_restored(st, held, STEPS) == []  # restored on a 4x2 mesh with NamedShardings
    lr, (b1, b2), eps, wd = ADAM["lr"], ADAM["betas"], ADAM["eps"], ADAM["weight_decay"]
    tx = optax.adamw(lr, b1=b1, b2=b2, eps=eps, weight_decay=wd)
    rng = np.random.default_rng(0)
    grads = jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape).astype(np.float32) * 1e-2), st["params"])
    upd, new_state = tx.update(grads, st["opt_state"], st["params"])
    new_params = optax.apply_updates(st["params"], upd)
    assert int(new_state[0].count) == STEPS + 1
    flat_p = jax.tree_util.tree_leaves_with_path(st["params"])
    g_l, np_l = jax.tree.leaves(grads), jax.tree.leaves(new_params)
    mu_l, nu_l = jax.tree.leaves(st["opt_state"][0].mu), jax.tree.leaves(st["opt_state"][0].nu)
    worst = 0.0
    for (path, p), g, pn, m, v in zip(flat_p, g_l, np_l, mu_l, nu_l):
        want, _, _ = _fused_adam(np.asarray(p), np.asarray(m), np.asarray(v), np.asarray(g), STEPS + 1, lr, b1, b2, eps, wd)
        got = np.asarray(pn)
        worst = max(worst, float(np.max(np.abs(got - want) / (np.abs(want) + 1e-6))))
        np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-7, err_msg=str(path))
    # the check is sharp: a count off by one moves the update by far more than the tolerance
    p0, g0, m0, v0 = (np.asarray(jax.tree.leaves(x)[0]) for x in (st["params"], grads, st["opt_state"][0].mu,
                                                                   st["opt_state"][0].nu))
    off, _, _ = _fused_adam(p0, m0, v0, g0, STEPS, lr, b1, b2, eps, wd)
    assert not np.allclose(np.asarray(np_l[0]), off, rtol=2e-6, atol=1e-7)
    return worst
