"""Cross-framework AdamW step from one restored state: optax vs Megatron/TE FusedAdam vs torch AdamW.

Bit-identity across frameworks is not achievable (XLA contracts to FMA, computes bias correction in
fp32; TE uses host-double bias correction; torch uses another operation order), so the bar is a few
ulp (docs/orbax-tensorstore-optax.md §4.3). The test is sharp: restoring with a wrong count or with
mu/nu swapped must miss the reference by a wide, asserted margin.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from jax.sharding import Mesh

from bridge.jaxside.keypaths import Path, leaves_by_path, nested_from_paths
from bridge.jaxside.manifest_view import adam_hparams, optimizer_from_manifest
from bridge.jaxside.restore import restore
from jax_checkpoints import logical_state, tiny_manifest, tiny_params, write_store_checkpoint
from ulp import max_ulp as _max_ulp

STEP = 100
ULP_TOL = 4  # allowed deviation in float32 ulp at the parameter's magnitude (floored at lr)
# Moments: TE computes (1 - beta) in float32 (0.95f -> 0.050000012), optax and torch in double
# (-> 0.05f), a 2.4e-7 relative difference in the new-gradient term: up to ~5 ulp of v.
MOMENT_ULP_TOL = 6


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    arrays = logical_state(tiny_params(0), step=STEP, seed=3)
    d = str(tmp_path_factory.mktemp("jaxxf") / "ckpt")
    manifest = tiny_manifest(STEP)
    write_store_checkpoint(d, arrays, manifest, num_writers=2)
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("fsdp", "tp"))
    tx = optimizer_from_manifest(manifest)
    abstract = nested_from_paths({p: jax.ShapeDtypeStruct(a.shape, jnp.float32) for p, a in tiny_params(0).items()})
    r = restore(d, mesh=mesh, optimizer=jax.eval_shape(tx.init, abstract))
    rng = np.random.default_rng(7)
    grads = {p: (rng.standard_normal(a.shape) * 1e-3).astype(np.float32) for p, a in tiny_params(0).items()}
    return dict(restored=r, tx=tx, grads=grads, manifest=manifest, mesh=mesh)


def _state_np(r) -> dict[str, dict[Path, np.ndarray]]:
    adam = r.opt_state[0]
    return {"p": {p: np.asarray(a) for p, a in leaves_by_path(r.params).items()},
            "m": {p: np.asarray(a) for p, a in leaves_by_path(adam.mu).items()},
            "v": {p: np.asarray(a) for p, a in leaves_by_path(adam.nu).items()},
            "count": int(adam.count)}


def _optax_step(tx, r, grads, opt_state=None):
    g = nested_from_paths({p: jnp.asarray(a) for p, a in grads.items()})
    state = r.opt_state if opt_state is None else opt_state
    upd, new = jax.jit(tx.update)(g, state, r.params)
    p = optax.apply_updates(r.params, upd)
    return ({k: np.asarray(a) for k, a in leaves_by_path(p).items()},
            {k: np.asarray(a) for k, a in leaves_by_path(new[0].mu).items()},
            {k: np.asarray(a) for k, a in leaves_by_path(new[0].nu).items()})


def _fused_adam_np(p, g, m, v, step, lr, b1, b2, eps, wd):
    """Megatron/TE FusedAdam (adam_w_mode=1) element-wise in float32, bias correction in host double."""
    f = np.float32
    b1f, b2f = f(b1), f(b2)
    bc1 = f(1.0 - b1 ** step)   # std::pow in double, then to float
    bc2 = f(1.0 - b2 ** step)
    m = b1f * m + (f(1) - b1f) * g
    v = b2f * v + (f(1) - b2f) * g * g
    denom = np.sqrt(v / bc2) + f(eps)
    update = (m / bc1) / denom + f(wd) * p
    return p - f(lr) * update, m, v


def _torch_adamw(state, grads, h, no_decay):
    params, opt_groups = {}, {"decay": [], "no_decay": []}
    for k, a in state["p"].items():
        t = torch.nn.Parameter(torch.from_numpy(a.copy()))
        t.grad = torch.from_numpy(grads[k].copy())
        params[k] = t
        opt_groups["no_decay" if k in no_decay else "decay"].append(t)
    opt = torch.optim.AdamW([{"params": opt_groups["decay"], "weight_decay": h.weight_decay},
                             {"params": opt_groups["no_decay"], "weight_decay": 0.0}],
                            lr=h.lr, betas=(h.b1, h.b2), eps=h.eps, foreach=False)
    for k, t in params.items():
        opt.state[t] = {"step": torch.tensor(float(state["count"])),
                        "exp_avg": torch.from_numpy(state["m"][k].copy()),
                        "exp_avg_sq": torch.from_numpy(state["v"][k].copy())}
    opt.step()
    return ({k: t.detach().numpy() for k, t in params.items()},
            {k: opt.state[t]["exp_avg"].numpy() for k, t in params.items()},
            {k: opt.state[t]["exp_avg_sq"].numpy() for k, t in params.items()})


def _te_reference(state, grads, h, no_decay):
    out_p, out_m, out_v = {}, {}, {}
    for k in state["p"]:
        wd = 0.0 if k in no_decay else h.weight_decay
        out_p[k], out_m[k], out_v[k] = _fused_adam_np(state["p"][k], grads[k], state["m"][k], state["v"][k],
                                                      state["count"] + 1, h.lr, h.b1, h.b2, h.eps, wd)
    return out_p, out_m, out_v


@pytest.mark.slow
def test_one_step_agrees_across_frameworks(setup):
    r, tx, grads = setup["restored"], setup["tx"], setup["grads"]
    h = adam_hparams(setup["manifest"])
    state = _state_np(r)
    assert state["count"] == STEP
    te_p, te_m, te_v = _te_reference(state, grads, h, h.no_decay)
    ox_p, ox_m, ox_v = _optax_step(tx, r, grads)
    th_p, th_m, th_v = _torch_adamw(state, grads, h, h.no_decay)

    tol_floor = h.lr  # an update is ~lr in size: rounding below lr*eps is noise, not a mapping error
    P0 = state["p"]
    dev = {"optax_vs_te": _max_ulp(ox_p, te_p, tol_floor, P0), "torch_vs_te": _max_ulp(th_p, te_p, tol_floor, P0),
           "optax_vs_torch": _max_ulp(ox_p, th_p, tol_floor, P0)}
    print("max ulp deviations", dev)
    assert max(dev.values()) <= ULP_TOL, dev
    # m = b1*m + (1-b1)*g may cancel: measure at the magnitude of its terms
    m_terms = {k: np.maximum(np.abs(state["m"][k]), np.abs(grads[k]) * (1 - h.b1)) for k in grads}
    moments = {"optax_m": _max_ulp(ox_m, te_m, 1e-30, m_terms), "optax_v": _max_ulp(ox_v, te_v, 1e-30),
               "torch_m": _max_ulp(th_m, te_m, 1e-30, m_terms), "torch_v": _max_ulp(th_v, te_v, 1e-30)}
    print("moment max ulp deviations", moments)
    assert max(moments.values()) <= MOMENT_ULP_TOL, moments
    total = sum(a.size for a in te_p.values())
    same = sum(int(np.sum(ox_p[k] == te_p[k])) for k in te_p)
    print("bit-identical to the TE formula:", same / total)
    assert same / total > 0.9  # most elements are bit-identical to the TE formula (§4.3: 99.4%)

    # A wrong count (off by one, either way) or swapped moments must miss by a wide margin.
    noise = max(dev["optax_vs_te"], 1.0)
    for wrong in (STEP - 1, STEP + 1):
        bad_state = jax.tree.map(lambda x: x, r.opt_state)
        bad_state = (bad_state[0]._replace(count=jnp.asarray(wrong, jnp.int32)),) + tuple(bad_state[1:])
        bad_p, _, _ = _optax_step(tx, r, grads, bad_state)
        miss = _max_ulp(bad_p, te_p, tol_floor, P0)
        print("wrong count", wrong, "misses by", miss, "ulp")
        assert miss >= 10 * noise and miss > 4 * ULP_TOL, (wrong, miss, noise)
    swapped = (r.opt_state[0]._replace(mu=r.opt_state[0].nu, nu=r.opt_state[0].mu),) + tuple(r.opt_state[1:])
    sw_p, _, _ = _optax_step(tx, r, grads, swapped)
    miss = _max_ulp(sw_p, te_p, tol_floor, P0)
    assert miss >= 1000 * noise, (miss, noise)
