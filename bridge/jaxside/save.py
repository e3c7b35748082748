"""Save JAX training state back as a logical checkpoint that the PyTorch side can resume from.

    save(path, params=params, opt_state=opt_state, step=step, manifest=restored.manifest, plans=restored.plans)

The weights (`model/...`) are the masters cast to the run's weight dtype (bf16 unless the base
manifest records another), round-to-nearest-even as Megatron's `.to(torch.bfloat16)`: weights and
masters agree by construction. Weights passed as `model=` must equal that cast (else BridgeError naming
the array and the first differing index), unless `allow_inconsistent_model=True`.

The store's writer and commit write it (`bridge.jaxside.save_io`: OCDBT + zarr3, no compression,
a crc32c per chunk, one claim and one commit, each process writing its own shards), to a local path
and to s3:// / gs:// alike, so the same state saved anywhere, or converted, is the same logical
bytes; plain Orbax restores it. The tree is exactly what Orbax writes for
`{"params", "opt_state": optax.adamw(...).init(params), "model", "step"}`, whatever optax
structure the user trained with (moments and count are taken from it by key path). Arrays restored
through a naming map are inverted to the logical layout first (`plans` from `restore`). The manifest
in `_METADATA["custom_metadata"]["gtp_bridge"]` carries the base checkpoint's section tables and
hyper-parameters, the new step, the writer's layout and a digest per array computed with
`bridge.store.digest` by the store's writers from the blocks they write (partial sums combined at the
commit); `save` returns the manifest as committed.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from bridge.dist import JaxCoordinator
from bridge.errors import BridgeError
from bridge.jaxside.keypaths import Path, leaves_by_path, nested_from_paths, path_str
from bridge.jaxside.optax_state import extract_adam
from bridge.store import open_storage, open_checkpoint, check_destination_free
from bridge.format.manifest import MEGATRON_KEY, PREVIOUS_SOURCE_KEY, Manifest, SourceLayout, as_manifest
from bridge.format.schema import MODEL, MU, NU, OPT_STATE, PARAMS, SCALAR_DTYPE, STEP
from bridge.format.tree import check_tree_paths
from bridge.jaxside.naming import Plan, jax_backend
from bridge.jaxside.save_io import write_tree


def save(directory: str | os.PathLike, *, params: Any, opt_state: Any, step: Any, model: Any = None,
         manifest: Manifest | Mapping | None = None, plans: Mapping[str, Plan] | None = None,
         hyperparams: Mapping[str, Any] | None = None, chunk_byte_size: int | None = None,
         concurrent_gb: int | None = None, model_dtype: Any = None, with_model: bool = True,
         allow_inconsistent_model: bool = False, orbax_manager: bool = False,
         lr_schedule: Any = None) -> Manifest:
    """Write a logical checkpoint at `directory` (must not exist); returns the manifest written.

    `model` (the weights) defaults to `params` cast to `model_dtype` (default: the base manifest's
    weight dtype, else bfloat16). Passed weights must equal that cast of `params` bit for bit (e.g. not
    the weights from before the last optimizer step); `allow_inconsistent_model=True` writes them
    anyway. `with_model=False` writes no weights (a reload then casts the masters itself).
    `orbax_manager=True`: `directory` is an Orbax `CheckpointManager` root (created if missing); the
    checkpoint becomes its step `step` (`directory/<step>/default/` + the step metadata), which
    `CheckpointManager(directory).latest_step()` finds and `restore` reads.

    `opt_state` is any optax state holding Adam moments (adamw, chain, multi_transform...).
    `manifest` is the base manifest (e.g. `restored.manifest`) whose section tables and
    hyper-parameters are kept; `hyperparams` ({"lr", "betas", "eps", "weight_decay"}) overrides them.
    `chunk_byte_size`: inner chunks of about that size (default the store's; smaller ones make later
    resharded reads cheaper); `concurrent_gb` bounds the writer's batches in flight (host memory; an
    array is still moved to the host whole, one at a time, from a single process). `lr_schedule`: the optax
    schedule trained with, when it is Megatron's (`bridge.lr_schedule.megatron_schedule`, or the one
    `optimizer_from_manifest` built); recorded, so `to-megatron` writes the scheduler state Megatron-LM's
    `--load` needs (another schedule is refused: optax schedules are plain functions).
    """
    storage = open_storage(directory, "destination")  # a path, s3:// or gs://; an unknown scheme is refused
    directory = storage.root
    if orbax_manager:
        return _save_as_manager_step(directory, int(jax.device_get(step)), params=params, opt_state=opt_state,
                                     step=step, model=model, manifest=manifest, plans=plans,
                                     hyperparams=hyperparams, chunk_byte_size=chunk_byte_size,
                                     concurrent_gb=concurrent_gb, model_dtype=model_dtype, with_model=with_model,
                                     allow_inconsistent_model=allow_inconsistent_model, lr_schedule=lr_schedule)
    import optax

    d = os.fspath(directory)
    scheduler = None
    if lr_schedule is not None:
        from bridge.lr_schedule import recorded_scheduler

        scheduler = recorded_scheduler(lr_schedule)  # refused before anything is claimed
    check_destination_free(d)  # s3:// / gs:// too (bridge.store.remote.check_remote_free)
    plans = dict(plans or {})
    flat_params = leaves_by_path(params)
    mu, nu, count = extract_adam(opt_state)
    for name, moments in ((MU, mu), (NU, nu)):
        if set(moments) != set(flat_params):
            odd = sorted(set(moments) ^ set(flat_params))[0]
            raise BridgeError(f"optimizer {name} and params differ at {path_str(odd)}; save the state trained "
                              f"for these params")
        for p, m in moments.items():
            if tuple(m.shape) != tuple(flat_params[p].shape):
                raise BridgeError(f"optimizer {name} shape {tuple(m.shape)} at {path_str(p)} differs from the "
                                  f"param's {tuple(flat_params[p].shape)}")
    logical = {  # role -> parameter path -> array
        PARAMS: _to_logical(flat_params, plans.get(PARAMS)),
        MU: _to_logical(mu, plans.get(PARAMS)),
        NU: _to_logical(nu, plans.get(PARAMS)),
    }
    if with_model:
        if model is None:
            dtype = jnp.dtype(model_dtype) if model_dtype is not None else weight_dtype(as_manifest(manifest))
            logical[MODEL] = {p: _cast(a, dtype) for p, a in logical[PARAMS].items()}
        else:
            logical[MODEL] = _to_logical(leaves_by_path(model), plans.get(MODEL))
            if not allow_inconsistent_model:
                check_model_consistent(logical[MODEL], logical[PARAMS])
    elif model is not None:
        raise BridgeError("model= was given with with_model=False; pass one or the other")

    count = jnp.asarray(count, dtype=SCALAR_DTYPE)
    step = jnp.asarray(step, dtype=SCALAR_DTYPE)
    # Orbax names the leaves: the tree's schema (bridge.format.schema) is optax.adamw's state layout.
    tree: dict[str, Any] = {
        PARAMS: nested_from_paths(logical[PARAMS]),
        OPT_STATE: (optax.ScaleByAdamState(count=count, mu=nested_from_paths(logical[MU]),
                                           nu=nested_from_paths(logical[NU])),
                    optax.EmptyState(), optax.EmptyState()),
        STEP: step,
    }
    if with_model:
        tree[MODEL] = nested_from_paths(logical[MODEL])
    check_tree_paths(leaves_by_path(tree))  # no '.' or '/' in names: Orbax joins names with '.'

    out = _manifest_for(as_manifest(manifest), hyperparams, int(jax.device_get(count)), scheduler)
    # One claim, one writer per process, one commit: the store's, wherever `d` is (bridge.jaxside.save_io).
    written = write_tree(d, tree, out, chunk_byte_size=chunk_byte_size, concurrent_gb=concurrent_gb)
    return open_checkpoint(written).manifest  # as committed: with the digests the writers computed


def _to_logical(flat: dict[Path, Any], plan: Plan | None) -> dict[Path, Any]:
    """Invert a naming plan on device (identity when there is no plan)."""
    if plan is None:
        return dict(flat)
    plan.check({p: tuple(a.shape) for p, a in flat.items()})  # before any device work
    be = jax_backend()
    out: dict[Path, Any] = {}
    for g in plan.groups:
        outs = [flat[o] for o in g.outputs]
        srcs = outs if g.is_identity else jax.jit(lambda *xs, g=g: tuple(g.inverse(xs, be)))(*outs)
        out.update(zip(g.sources, srcs))
    return out


def _manifest_for(base: Manifest | None, hyperparams: Mapping[str, Any] | None, count: int,
                  scheduler: Any = None) -> Manifest:
    """The manifest of the checkpoint being saved: base tables + this writer (+ the Megatron scheduler
    record of the schedule trained with); the commit adds the arrays' records."""
    m = copy.deepcopy(base) if base is not None else Manifest()
    if scheduler is not None:
        m.extra = dict(m.extra)
        m.extra[MEGATRON_KEY] = {**dict(m.extra.get(MEGATRON_KEY) or {}), "scheduler": scheduler.to_json()}
    previous = m.source
    # The data is layout-free; keep the model-config property a Megatron reload needs (GTP alignment).
    m.source = SourceLayout(framework="jax", world_size=jax.process_count(), optimizer_format="optax",
                            pad_for_alignment=previous.pad_for_alignment)
    if base is not None:
        m.extra = dict(m.extra)
        m.extra[PREVIOUS_SOURCE_KEY] = dataclasses.asdict(previous)
    for key, value in dict(hyperparams or {}).items():
        if key not in ("lr", "betas", "eps", "weight_decay", "no_decay"):
            raise BridgeError(f"unknown hyper-parameter {key!r}; use lr, betas, eps, weight_decay, no_decay")
        setattr(m.optimizer, key, tuple(value) if key == "betas" else value)
    m.optimizer.step = count
    m.optimizer.check("save: hyperparams")
    return m  # its arrays (shape, dtype, digest): recorded by the commit, from what the writers wrote


def _save_as_manager_step(root: str, number: int, **kwargs: Any) -> Manifest:
    """`save` into a hidden staging step of manager root `root`, then commit it as `root/<number>`."""
    from bridge.store import begin_step, check_step_free, commit_step

    coord = JaxCoordinator(job=f"save to {root}")
    check_step_free(root, number)  # on every process, so that all refuse together
    item = coord.broadcast("the start", lambda: begin_step(root, number))
    out = save(item, **kwargs)
    coord.broadcast("the commit", lambda: commit_step(item, number))
    return out


def weight_dtype(base: Manifest | None) -> np.dtype:
    """The run's weight dtype: the one the base manifest records for its `model` arrays, else bfloat16."""
    found = {rec.dtype for name, rec in (base.arrays if base is not None else {}).items()
             if name.split(".")[0] == MODEL}
    return jnp.dtype(found.pop()) if len(found) == 1 else jnp.dtype(jnp.bfloat16)


def _cast(x: Any, dtype: Any) -> jax.Array:
    """`x` cast to `dtype` on its devices, keeping its sharding (XLA's convert rounds to nearest even)."""
    return jnp.asarray(x).astype(dtype)


def check_model_consistent(model: Mapping[Path, Any], params: Mapping[Path, Any]) -> None:
    """BridgeError unless every weight equals its master cast to the weight's dtype, bit for bit (NaN == NaN).

    Names the first inconsistent array and its first differing index: stale weights (from before an
    optimizer step) would otherwise be written silently and a Megatron resume would train from them.
    """
    if set(model) != set(params):
        odd = sorted(set(model) ^ set(params))[0]
        side = MODEL if odd in model else PARAMS
        raise BridgeError(f"model and params differ in their arrays at {path_str(odd)} (only in {side}); "
                          f"omit model= to derive the weights from params")
    for p in sorted(params):
        w = jnp.asarray(model[p])
        if tuple(w.shape) != tuple(params[p].shape):
            raise BridgeError(f"model/{path_str(p)} has shape {tuple(w.shape)}, params/{path_str(p)} "
                              f"{tuple(params[p].shape)}; omit model= to derive the weights from params")
        first = _first_difference(w, params[p])
        if first is not None:
            idx, got, want = first
            raise BridgeError(
                f"model/{path_str(p)} is not params/{path_str(p)} cast to {w.dtype.name}: first difference at index "
                f"{idx} (weight {got!r}, cast master {want!r}); weights from before the last optimizer step? "
                f"Omit model= to save the cast masters, or pass allow_inconsistent_model=True to keep them")


@jax.jit
def _differ(w, master):
    """(any difference, flat index of the first) between one shard of `w` and of its master."""
    cast = master.astype(w.dtype)
    uint = jnp.dtype(f"uint{8 * w.dtype.itemsize}")
    neq = jax.lax.bitcast_convert_type(w, uint) != jax.lax.bitcast_convert_type(cast, uint)
    if jnp.issubdtype(w.dtype, jnp.floating):
        neq = neq & ~(jnp.isnan(w) & jnp.isnan(cast))
    flat = neq.reshape(-1)
    return jnp.any(flat), jnp.argmax(flat)


def _first_difference(w: jax.Array, master: Any) -> tuple[tuple[int, ...], float, float] | None:
    """(index, weight, cast master) of the first element where `w` != cast(master), or None.

    Compares shard by shard on each shard's own device: whole-array index math under jit is refused
    on meshes with explicit axis types (`jax.make_mesh`'s default), and gathering the array on one
    host would cost its full size. One copy of each distinct shard is compared (replica 0).
    """
    if w.size == 0:
        return None
    master = jax.device_put(jnp.asarray(master), w.sharding)  # shards of both line up by device
    masters = {s.device: s.data for s in master.addressable_shards}
    found: list[tuple[tuple[int, ...], float, float]] = []
    for s in w.addressable_shards:
        if s.replica_id != 0 or s.data.size == 0:
            continue
        any_diff, at = _differ(s.data, masters[s.device])
        if not bool(jax.device_get(any_diff)):
            continue
        local = tuple(int(i) for i in np.unravel_index(int(jax.device_get(at)), s.data.shape))
        got = jax.device_get(s.data[local])
        want = jax.device_get(masters[s.device][local].astype(w.dtype))
        origin = tuple(sl.start or 0 for sl in s.index)
        found.append((tuple(o + i for o, i in zip(origin, local)), float(got), float(want)))
    if jax.process_count() > 1:
        found = _gather_first(found, w.ndim)
    return min(found) if found else None


def _gather_first(found: list[tuple[tuple[int, ...], float, float]], ndim: int
                  ) -> list[tuple[tuple[int, ...], float, float]]:
    """Every process's first difference, so that all processes agree on whether to refuse and on what."""
    from jax.experimental import multihost_utils

    mine = min(found) if found else None
    idx = np.array([1, *mine[0]] if mine else [0] * (ndim + 1), np.int32)
    vals = np.array(mine[1:] if mine else (0.0, 0.0), np.float32)
    all_idx = np.asarray(multihost_utils.process_allgather(idx)).reshape(-1, ndim + 1)
    all_vals = np.asarray(multihost_utils.process_allgather(vals)).reshape(-1, 2)
    return [(tuple(int(i) for i in row[1:]), float(v[0]), float(v[1]))
            for row, v in zip(all_idx, all_vals) if row[0]]
