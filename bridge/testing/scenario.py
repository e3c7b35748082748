"""End-to-end live export scenario with the reference GTP trainer (used by tests and GPU scripts).

Worker side (`run_scenario`, every rank of an initialized process group): train at the source
layout, dump the raw state, `export_state`, take the next step and dump; then for each target
layout build a fresh trainer, `reload_state`, dump, take one step and dump.

Checking side (`check_scenario`, one process): rebuild the state the ranks held from their raw
dumps with `reference_check.assemble_global` (written without `bridge.layout`), split fused
tensors into sections and stack experts here, and compare with (a) a plain Orbax restore of the
export (bit-exact), (b) each target's reloaded state (bit-exact) and its next step against the
source layout's next step (fp32 tolerance; FP8 weights within one storage rounding).
"""

from __future__ import annotations

import os
from typing import Mapping, Sequence

import numpy as np

ATOL = {"weight": 1e-5, "master": 1e-5, "exp_avg": 1e-7, "exp_avg_sq": 1e-9}
KINDS = ("weight", "master", "exp_avg", "exp_avg_sq")


def _save(obj, out: str, name: str, rank: int) -> None:
    import torch

    torch.save(obj, os.path.join(out, f"{name}.rank{rank}.pt"))


def load_dumps(out: str, name: str, world: int) -> list[dict]:
    """Every rank's dump `name` (torch.load with weights_only: plain tensors and containers)."""
    import torch

    return [torch.load(os.path.join(out, f"{name}.rank{r}.pt"), weights_only=True) for r in range(world)]


def run_scenario(rank: int, out: str, dst: str, src: Mapping, targets: Mapping[str, Mapping], config, steps: int,
                 device=None, backend: str = "gloo", extra_reloads: Mapping[str, tuple[str, Mapping]] | None = None) -> dict:
    """Worker body (see module docstring); returns per-target facts (step, bytes read, export report)."""
    from bridge.layout import ParallelLayout
    from bridge.live.export import export_state
    from bridge.testing.check import dump_rank
    from bridge.testing.collectives import RankGroups
    from bridge.testing.trainer import ReferenceTrainer, step
    from bridge.live.reload import reload_state

    layout = ParallelLayout(**src)
    trainer = ReferenceTrainer(layout, config, device=device, groups=RankGroups.build(layout, backend))
    step(trainer, steps)
    _save(dump_rank(trainer), out, "src", rank)
    rep = export_state(dst, trainer.live_run(), trainer.local_params())
    losses = step(trainer, 1)  # the source layout's next step
    _save({**dump_rank(trainer), "losses": losses}, out, "src_next", rank)
    facts: dict = {"export": {k: v for k, v in vars(rep).items() if isinstance(v, (int, float, str, dict))}}

    def reload(path: str, kw: Mapping, name: str):
        """A fresh trainer at layout `kw` loaded from `path`; its facts go under `name`."""
        lay = ParallelLayout(**kw)
        tr = ReferenceTrainer(lay, config, init=False, device=device, groups=RankGroups.build(lay, backend))
        res = reload_state(path, tr.live_run(), tr.local_params())
        facts[name] = {"step": res.step, "bytes_read": res.bytes_read}
        return tr, res

    for name, kw in targets.items():
        tr, res = reload(dst, kw, name)
        tr.resume(res.step)
        _save(dump_rank(tr), out, f"{name}_reloaded", rank)
        losses = step(tr, 1)
        _save({**dump_rank(tr), "losses": losses}, out, f"{name}_next", rank)
    for name, (path, kw) in (extra_reloads or {}).items():
        tr, _ = reload(path, kw, name)
        _save(dump_rank(tr), out, name, rank)
    return facts


def sections_tp1(geom, fused_tp1: np.ndarray) -> dict[str, np.ndarray]:
    """Split a TP=1 fused tensor into its section arrays (concat: row blocks; grouped: per-group units)."""
    spec = geom.fused
    if spec is None:
        return {geom.name: fused_tp1}
    parts: dict[str, list[np.ndarray]] = {s.name: [] for s in spec.sections}
    row = 0
    for _ in range(spec.groups):
        for s in spec.sections:
            n = s.rows // spec.groups
            parts[s.name].append(fused_tp1[row:row + n])
            row += n
    if row != fused_tp1.shape[0]:
        raise AssertionError(f"{geom.name}: sections cover {row} of {fused_tp1.shape[0]} rows")
    return {f"{geom.name}.{k}": np.concatenate(v) for k, v in parts.items()}


def logical_from_assembled(assembled: Mapping, kinds: Sequence[str] = KINDS, pad_for_alignment: int = 8) -> dict:
    """{kind: {logical array: ndarray}} from `assemble_global` output (fused split, experts stacked)."""
    from bridge.testing.model import ModelConfig, param_table
    from bridge.testing.trainer import geometry_of

    c = ModelConfig()
    out: dict = {k: {} for k in kinds}
    for p in param_table(c):
        geom = geometry_of(p, c, pad_for_alignment)
        for e in range(max(p.experts, 1)):
            name = p.key + (str(e) if p.experts else "")
            for k in kinds:
                for arr, v in sections_tp1(geom, assembled[name][k].cpu().numpy()).items():
                    if p.experts:
                        out[k].setdefault(arr, np.zeros((p.experts,) + v.shape, np.float32))[e] = v
                    else:
                        out[k][arr] = v
    return out


def bits(a) -> np.ndarray:
    """Raw bits (NaN == NaN, -0.0 != 0.0) for bit-exact comparisons."""
    from bridge.dtypes import uint_view

    return uint_view(np.ascontiguousarray(np.asarray(a)))


def leaf(tree, name: str):
    """The leaf of a nested restored tree at logical array `name`."""
    from bridge.format.tree import megatron_key_to_path

    for c in megatron_key_to_path(name):
        tree = tree[c]
    return np.asarray(tree)


def abstract_tree(held: Mapping, sharding=None, with_model: bool = True):
    """The abstract tree plain Orbax restores (params, optax.adamw state, bf16 model, step).

    `held` maps "master" (and "weight" when `with_model`) to {Megatron key: array}.
    """
    import jax
    import jax.numpy as jnp
    import optax

    from bridge.jaxside.keypaths import nested_from_paths
    from bridge.format.tree import megatron_key_to_path

    def nest(flat, dtype):
        return nested_from_paths({megatron_key_to_path(n): jax.ShapeDtypeStruct(a.shape, dtype) for n, a in flat.items()})

    params = nest(held["master"], jnp.float32)
    tree = {"params": params, "opt_state": jax.eval_shape(optax.adamw(1e-3).init, params),
            "step": jax.ShapeDtypeStruct((), jnp.int32)}
    if with_model:
        tree["model"] = nest(held["weight"], jnp.bfloat16)
    if sharding is not None:
        tree = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding(s)), tree)
    return tree


def check_restored(got, held: Mapping, steps: int) -> list[str]:
    """A restored tree vs the held state: params/mu/nu bit-exact, model = bf16(held weight), count."""
    import ml_dtypes

    bad = []
    for name, w in held["master"].items():
        pairs = (("params", leaf(got["params"], name), w),
                 ("mu", leaf(got["opt_state"][0].mu, name), held["exp_avg"][name]),
                 ("nu", leaf(got["opt_state"][0].nu, name), held["exp_avg_sq"][name]),
                 ("model", leaf(got["model"], name), held["weight"][name].astype(ml_dtypes.bfloat16)))
        bad += [f"restored {root}/{name} differs" for root, g, want in pairs if not np.array_equal(bits(g), bits(want))]
    if int(np.asarray(got["opt_state"][0].count)) != steps or int(np.asarray(got["step"])) != steps:
        bad.append(f"restored count/step {int(np.asarray(got['opt_state'][0].count))}/{int(np.asarray(got['step']))} != {steps}")
    return bad


def check_scenario(out: str, dst: str, world: int, targets: Sequence[str], steps: int, sharding=None) -> tuple[list[str], dict]:
    """(a) and (b) of the module docstring; returns (problems, the held logical state)."""
    import orbax.checkpoint as ocp

    from bridge.testing.check import assemble_global, compare

    problems: list[str] = []
    src = load_dumps(out, "src", world)
    held = logical_from_assembled(assemble_global(src))
    got = ocp.StandardCheckpointer().restore(dst, abstract_tree(held, sharding))
    problems += check_restored(got, held, steps)
    src_next = load_dumps(out, "src_next", world)
    next_want = assemble_global(src_next)
    state = ("master", "exp_avg", "exp_avg_sq")
    for name in targets:
        reloaded = logical_from_assembled(assemble_global(load_dumps(out, f"{name}_reloaded", world)))
        for k in KINDS:
            problems += [f"{name}: reloaded {k}/{a} differs from the exported state" for a, w in held[k].items()
                         if not np.array_equal(bits(reloaded[k][a]), bits(w))]
        nxt_dumps = load_dumps(out, f"{name}_next", world)
        nxt = assemble_global(nxt_dumps)
        problems += [f"{name}: next step {b}" for b in compare({n: {k: v[k] for k in state} for n, v in nxt.items()},
                                                              {n: {k: v[k] for k in state} for n, v in next_want.items()},
                                                              ATOL)]
        problems += [f"{name}: next step {b}" for b in compare({n: {"weight": v["weight"]} for n, v in nxt.items()},
                                                              {n: {"weight": v["weight"]} for n, v in next_want.items()},
                                                              ATOL, rtol=2 ** -2)]
        a, b = nxt_dumps[0]["losses"], src_next[0]["losses"]
        if any(abs(x - y) > 1e-5 * abs(y) + 1e-6 for x, y in zip(a, b)):
            problems.append(f"{name}: next-step loss {a} != source layout's {b}")
    return problems, held
