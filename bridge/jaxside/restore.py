"""Restore a logical checkpoint as sharded `jax.Array`s, read by the store's reader onto the target shardings.

    state = restore(path, mesh=mesh)                                  # default PartitionSpec rules
    state = restore(path, mesh=mesh, rules=ShardingRules([("*/linear_fc2/weight", (None, "tp"))]))
    state = restore(path, shardings=my_named_shardings)                # explicit, per parameter path
    state = restore(path, mesh=mesh, optimizer=jax.eval_shape(tx.init, params_abstract))
    state.params, state.opt_state, state.model, state.step

Each process reads the device boxes its addressable devices hold, each box once, all at once within
`concurrent_gb` (`bridge.jaxside.restore_io`), from a local path or s3:// / gs:// alike; multi-process
JAX (`jax.distributed`) works unchanged (every process passes the same arguments). Optional `dtypes`
casts on read. An optional `NamingMap` presents the tree the way a JAX model expects (joined sections,
`[in, out]` kernels, unstacked layers): stored arrays are restored with shardings derived from the
target ones, then transformed on device under `jit` with the target shardings.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

import jax
import numpy as np
from jax.sharding import NamedSharding, Sharding

from bridge.errors import BridgeError
from bridge.format import schema
from bridge.format.manifest import Manifest, manifest_from_custom
from bridge.format.schema import (COUNT_PATH, MODEL, MODEL_PATH, MOMENTS, MU, MU_PATH, NU, NU_PATH, OPT_STATE, PARAMS,
                                  PARAMS_PATH, STEP, STEP_PATH)
from bridge.jaxside.abstract import CASTABLE, StoredTree, Target, stored_arrays
from bridge.jaxside.keypaths import Path, nested_from_paths, path_str
from bridge.jaxside.manifest_view import adam_hparams, section_orders
from bridge.jaxside.optax_state import check_template, fill_template, template_roles
from bridge.jaxside.restore_io import read_arrays
from bridge.jaxside.sharding_rules import ShardingRules
from bridge.jaxside.naming import Group, NamingMap, Plan, jax_backend

ITEMS = schema.ROOTS


@dataclass
class Restored:
    """Restored training state (nested dicts of jax.Array, JAX-facing names).

    `opt_state` is the filled optax template, or `(ScaleByAdamState, EmptyState, EmptyState)` when
    no template was given. `manifest` is the checkpoint's `gtp_bridge` custom metadata (or None);
    `plans` are the naming plans used (params, model), needed to save back in logical form.
    """

    params: dict | None
    opt_state: Any
    model: dict | None
    step: jax.Array | None
    manifest: Manifest | None
    plans: dict[str, Plan] = field(default_factory=dict)


def restore(directory: str | os.PathLike, *, mesh: jax.sharding.Mesh | None = None,
            rules: ShardingRules | None = None, shardings: Mapping | Any = None, optimizer: Any = None,
            dtypes: Mapping[str, Any] | None = None, items: tuple[str, ...] = ITEMS,
            naming: NamingMap | None = None, strict: bool = True, concurrent_gb: int | None = None) -> Restored:
    """Restore `items` of a logical checkpoint onto a mesh (see module docstring).

    `optimizer` is an optax template (`jax.eval_shape(tx.init, params)`), filled by key path; it
    must match the (named) parameter tree and shapes, else BridgeError names the first differing path.
    `dtypes` ({"params"|"model"|"mu"|"nu": dtype}) casts on read; moments default to the template's dtype.
    Moments whose template leaf carries a NamedSharding are restored with it (else their param's).
    `concurrent_gb` bounds the bytes read in flight (host memory; GB, Orbax's knob and default), from
    a local path and from s3:// / gs:// alike (`bridge.jaxside.restore_io.read_arrays`).
    """
    bad = set(items) - set(ITEMS)
    if bad:
        raise BridgeError(f"unknown items {sorted(bad)}; choose from {list(ITEMS)}")
    dtypes = dict(dtypes or {})
    if set(dtypes) - set(CASTABLE):
        raise BridgeError(f"dtypes keys {sorted(set(dtypes) - set(CASTABLE))} unknown; use {', '.join(CASTABLE)}")
    stored = stored_arrays(directory)
    target = Target(mesh=mesh, rules=rules or ShardingRules(), shardings=shardings)
    manifest = manifest_from_custom(stored.custom_metadata)
    naming = naming or NamingMap()
    orders = section_orders(manifest)
    plans = {PARAMS: naming.plan({p: a.shape for p, a in stored.section(PARAMS_PATH).items()}, orders)}
    if MODEL in items and stored.has(MODEL_PATH):
        plans[MODEL] = naming.plan({p: a.shape for p, a in stored.section(MODEL_PATH).items()}, orders)

    want_opt = OPT_STATE in items or optimizer is not None
    if want_opt and not stored.has(MU_PATH):
        raise BridgeError(f"{stored.directory} holds no optimizer state ({path_str(MU_PATH)}); "
                          f"restore without {OPT_STATE}")
    moment_dtypes: dict[str, dict[Path, Any]] = {m: {} for m in MOMENTS}
    moment_shardings: dict[str, dict[Path, Sharding]] = {m: {} for m in MOMENTS}
    if optimizer is not None:
        check_template(optimizer, {o: (s, None) for o, s in plans[PARAMS].out_shapes().items()}, strict)
        for _, role, leaf in template_roles(optimizer):
            if role.kind in MOMENTS:
                moment_dtypes[role.kind][role.param] = leaf.dtype
                sharding = getattr(leaf, "sharding", None)
                # The template's own placement wins, but only on a concrete mesh: eval_shape under a
                # mesh context yields AbstractMesh shardings, which cannot place data.
                if isinstance(sharding, NamedSharding) and isinstance(sharding.mesh, jax.sharding.Mesh):
                    moment_shardings[role.kind][role.param] = sharding

    requests: list[tuple[Path, str, Plan, Any]] = []  # (stored prefix, kind, plan, dtype override)
    if PARAMS in items:
        requests.append((PARAMS_PATH, PARAMS, plans[PARAMS], dtypes.get(PARAMS)))
    if MODEL in plans:
        requests.append((MODEL_PATH, MODEL, plans[MODEL], dtypes.get(MODEL)))
    if want_opt:
        requests.append((MU_PATH, MU, plans[PARAMS], dtypes.get(MU)))
        requests.append((NU_PATH, NU, plans[PARAMS], dtypes.get(NU)))
    scalars = ([COUNT_PATH] if want_opt else []) + ([STEP_PATH] if STEP in items else [])
    abstract, jobs = _plan_reads(stored, target, requests, moment_dtypes, moment_shardings, scalars)
    flat = read_arrays(stored.directory, abstract, concurrent_gb, checkpoint=stored.checkpoint)

    results: dict[str, dict[Path, Any]] = {role: {} for role in CASTABLE}
    for prefix, kind, g, outs, _ in jobs:
        srcs = [flat[prefix + s] for s in g.sources]
        arrays = srcs if g.is_identity else _transform(g, tuple(outs))(*srcs)
        results[kind].update(zip(g.outputs, arrays))

    opt_state = None
    if want_opt:
        opt_state = _optimizer_state(stored, flat.get(COUNT_PATH), results, optimizer, manifest, target)
    return Restored(
        params=nested_from_paths(results[PARAMS]) if PARAMS in items else None,
        opt_state=opt_state,
        model=nested_from_paths(results[MODEL]) if MODEL in plans else None,
        step=flat.get(STEP_PATH) if STEP in items else None,
        manifest=manifest,
        plans=plans,
    )


Job = tuple[Path, str, Group, list[Sharding], Any]  # (stored prefix, kind, group, target shardings, dtype)


def _plan_reads(stored: StoredTree, target: Target, requests: list[tuple[Path, str, Plan, Any]],
                moment_dtypes: Mapping[str, Mapping[Path, Any]],
                moment_shardings: Mapping[str, Mapping[Path, Sharding]], scalars: list[Path],
                ) -> tuple[dict[Path, jax.ShapeDtypeStruct], list[Job]]:
    """Which stored arrays to read, with which sharding and dtype, and the transforms after reading."""
    abstract: dict[Path, jax.ShapeDtypeStruct] = {}
    jobs: list[Job] = []
    for prefix, kind, plan, dt in requests:
        for g in plan.groups:
            outs = target.group_shardings(g)
            given = moment_shardings.get(kind, {})
            outs = [given.get(o, s) for o, s in zip(g.outputs, outs)]
            want_dt = dt if dt is not None else moment_dtypes.get(kind, {}).get(g.outputs[0])
            src_sh = outs[0] if g.is_identity else _source_sharding(g, outs[0], target)
            for s, shape in zip(g.sources, g.source_shapes):
                a = stored.arrays[prefix + s]
                abstract[prefix + s] = jax.ShapeDtypeStruct(shape, np.dtype(want_dt) if want_dt else a.dtype,
                                                            sharding=src_sh)
            jobs.append((prefix, kind, g, outs, want_dt))
    for p in scalars:
        if p in stored.arrays:
            a = stored.arrays[p]
            abstract[p] = jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=target.replicated())
    return abstract, jobs


def _optimizer_state(stored: StoredTree, count: Any, results: Mapping[str, Mapping[Path, Any]], optimizer: Any,
                     manifest: Manifest | None, target: Target) -> Any:
    """The filled optax template, or the canonical adamw state when there is no template."""
    if count is None:
        raise BridgeError(f"{stored.directory} has moments but no {path_str(COUNT_PATH)}; the checkpoint is incomplete")
    if optimizer is not None:
        return fill_template(optimizer, results[MU], results[NU], count, _injectable_hyperparams(manifest),
                             place=functools.partial(_place, replicated=target.replicated()))
    import optax

    return (optax.ScaleByAdamState(count=count, mu=nested_from_paths(results[MU]),
                                   nu=nested_from_paths(results[NU])),
            optax.EmptyState(), optax.EmptyState())


def _source_sharding(g: Group, out: Sharding, target: Target) -> Sharding:
    """Sharding to read a group's sources with, so its transform is local where possible."""
    if not isinstance(out, NamedSharding):
        return target.replicated()
    spec = list(g.source_spec(tuple(out.spec)))
    sizes = dict(out.mesh.shape)
    for shape in g.source_shapes:  # drop axes that do not divide a section
        for d, entry in enumerate(spec):
            if entry is None:
                continue
            n = int(np.prod([sizes[a] for a in (entry if isinstance(entry, tuple) else (entry,))]))
            if shape[d] % n:
                spec[d] = None
    return NamedSharding(out.mesh, jax.sharding.PartitionSpec(*spec))


@functools.lru_cache(maxsize=256)
def _transform(g: Group, outs: tuple[Sharding, ...]):
    """Jitted forward of a naming group, producing arrays with the target shardings."""
    be = jax_backend()
    return jax.jit(lambda *srcs: tuple(g.forward(srcs, be)), out_shardings=outs)


def _place(value: Any, leaf: Any, replicated: NamedSharding) -> Any:
    """Put a filled value where an optax template leaf wants it (dtype; scalars replicated)."""
    dtype = getattr(leaf, "dtype", None)
    if isinstance(value, jax.Array):
        if dtype is not None and value.dtype != dtype:
            value = jax.jit(lambda x: x.astype(dtype), out_shardings=value.sharding)(value)
        return value
    arr = np.asarray(value, dtype=dtype)
    return jax.device_put(arr, replicated)


def _injectable_hyperparams(manifest: Manifest | None) -> dict[str, float] | None:
    """inject_hyperparams values from the manifest (None when it has no optimizer record)."""
    if manifest is None:
        return None
    h = adam_hparams(manifest)
    out = {"b1": h.b1, "b2": h.b2, "eps": h.eps, "eps_root": 0.0, "weight_decay": h.weight_decay}
    if h.lr is not None:
        out["learning_rate"] = h.lr
    return out


__all__ = ["Restored", "restore"]
