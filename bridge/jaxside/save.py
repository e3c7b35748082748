"""Save JAX training state back as a logical checkpoint that the PyTorch side can resume from.

    save(path, params=params, opt_state=opt_state, step=step, model=None, manifest=restored.manifest,
         plans=restored.plans)

Orbax writes it (`PyTreeCheckpointHandler`, OCDBT + zarr3, no compression, atomic tmp+rename,
each process writing its own shards): the tree is exactly what Orbax writes for
`{"params", "opt_state": optax.adamw(...).init(params), "model", "step"}`, whatever optax
structure the user trained with (moments and count are taken from it by key path). Arrays restored
through a naming map are inverted to the logical layout first (`plans` from `restore`). The manifest
in `_METADATA["custom_metadata"]["gtp_bridge"]` carries the base checkpoint's section tables and
hyper-parameters, the new step, the writer's layout and a digest per array computed with
`bridge.store.digest` from each process's addressable shards (partial sums added across processes).
"""

from __future__ import annotations

import copy
import dataclasses
import os
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from bridge.errors import BridgeError
from bridge.jaxside.keypaths import Path, leaves_by_path, nested_from_paths, path_str
from bridge.jaxside.manifest_view import as_manifest
from bridge.jaxside.optax_state import extract_adam
from bridge.layout.boxes import Box
from bridge.progress import progress
from bridge.store import digest as store_digest
from bridge.store.claim import claim_destination, tmp_dir_for
from bridge.store.commit import seal_checkpoint
from bridge.store.manifest import MANIFEST_KEY, ArrayRecord, Manifest, SourceLayout
from bridge.store.tree import check_tree_paths, path_to_name
from converters.jax_naming import Plan, jax_backend


def save(directory: str | os.PathLike, *, params: Any, opt_state: Any, step: Any, model: Any = None,
         manifest: Manifest | Mapping | None = None, plans: Mapping[str, Plan] | None = None,
         hyperparams: Mapping[str, Any] | None = None, chunk_byte_size: int | None = None,
         concurrent_gb: int | None = None) -> Manifest:
    """Write a logical checkpoint at `directory` (must not exist); returns the manifest written.

    `opt_state` is any optax state holding Adam moments (adamw, chain, multi_transform...).
    `manifest` is the base manifest (e.g. `restored.manifest`) whose section tables and
    hyper-parameters are kept; `hyperparams` ({"lr", "betas", "eps", "weight_decay"}) overrides them.
    `chunk_byte_size` asks Orbax for inner chunks of that size (cheaper resharded reads later);
    `concurrent_gb` bounds Orbax's in-flight save bytes (host memory).
    """
    import optax
    import orbax.checkpoint as ocp

    d = os.fspath(directory)
    if os.path.lexists(d):
        raise BridgeError(f"destination {d} exists; choose a new directory (checkpoints are never overwritten)")
    plans = dict(plans or {})
    flat_params = leaves_by_path(params)
    mu, nu, count = extract_adam(opt_state)
    for name, moments in (("mu", mu), ("nu", nu)):
        if set(moments) != set(flat_params):
            odd = sorted(set(moments) ^ set(flat_params))[0]
            raise BridgeError(f"optimizer {name} and params differ at {path_str(odd)}; save the state trained "
                              f"for these params")
        for p, m in moments.items():
            if tuple(m.shape) != tuple(flat_params[p].shape):
                raise BridgeError(f"optimizer {name} shape {tuple(m.shape)} at {path_str(p)} differs from the "
                                  f"param's {tuple(flat_params[p].shape)}")
    logical = {
        "params": _to_logical(flat_params, plans.get("params")),
        "mu": _to_logical(mu, plans.get("params")),
        "nu": _to_logical(nu, plans.get("params")),
    }
    if model is not None:
        logical["model"] = _to_logical(leaves_by_path(model), plans.get("model"))

    count = jnp.asarray(count, dtype=jnp.int32)
    step = jnp.asarray(step, dtype=jnp.int32)
    tree: dict[str, Any] = {
        "params": nested_from_paths(logical["params"]),
        "opt_state": (optax.ScaleByAdamState(count=count, mu=nested_from_paths(logical["mu"]),
                                             nu=nested_from_paths(logical["nu"])),
                      optax.EmptyState(), optax.EmptyState()),
        "step": step,
    }
    if model is not None:
        tree["model"] = nested_from_paths(logical["model"])
    check_tree_paths(leaves_by_path(tree))  # no '.' or '/' in names: Orbax joins names with '.'

    out = _manifest_for(tree, as_manifest(manifest), hyperparams, int(jax.device_get(count)))
    save_args = None
    if chunk_byte_size is not None:
        save_args = jax.tree.map(lambda _: ocp.SaveArgs(chunk_byte_size=int(chunk_byte_size)), tree)
    # One claim per save (bridge.store.claim, as every writer): process 0 claims `d`; Orbax commits
    # (its own tmp + rename) into a sub-directory of the claim; we seal _METADATA with the store's
    # checksum and publish it to `d` with a no-replace rename, so `d` only ever appears complete.
    claim = _claim_on_process_0(d)
    staging = os.path.join(tmp_dir_for(d), "item")
    try:
        handler = ocp.PyTreeCheckpointHandler(use_ocdbt=True, use_zarr3=True, use_compression=False,
                                              save_concurrent_gb=concurrent_gb)
        ck = ocp.Checkpointer(handler)
        ck.save(staging, args=ocp.args.PyTreeSave(tree, save_args=save_args,
                                                  custom_metadata={MANIFEST_KEY: out.to_json()}))
        if claim is not None:
            seal_checkpoint(staging)
            claim.publish(payload=staging)
    except BaseException:
        if claim is not None:
            claim.release()
        raise
    _barrier("gtpb-save-done")
    return out


def _claim_on_process_0(d: str):
    """Process 0 claims `d`; every process raises if that failed (no process starts writing)."""
    claim, err = None, ""
    if jax.process_index() == 0:
        try:
            claim = claim_destination(d)
        except BridgeError as e:
            err = str(e)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        failed = int(multihost_utils.broadcast_one_to_all(np.int32(1 if err else 0)))
        if failed and not err:
            err = f"process 0 could not claim the destination {d} (see its error); nothing was written"
    if err:
        raise BridgeError(err)
    return claim


def _barrier(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


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


def _manifest_for(tree: dict, base: Manifest | None, hyperparams: Mapping[str, Any] | None, count: int) -> Manifest:
    """The manifest of the checkpoint being saved: base tables + this writer + digests."""
    m = copy.deepcopy(base) if base is not None else Manifest()
    previous = m.source
    # The data is layout-free; keep the model-config property a Megatron reload needs (GTP alignment).
    m.source = SourceLayout(framework="jax", world_size=jax.process_count(), optimizer_format="optax",
                            pad_for_alignment=previous.pad_for_alignment)
    if base is not None:
        m.extra = dict(m.extra)
        m.extra["previous_source"] = dataclasses.asdict(previous)
    for key, value in dict(hyperparams or {}).items():
        if key not in ("lr", "betas", "eps", "weight_decay", "no_decay"):
            raise BridgeError(f"unknown hyper-parameter {key!r}; use lr, betas, eps, weight_decay, no_decay")
        setattr(m.optimizer, key, tuple(value) if key == "betas" else value)
    m.optimizer.step = count
    m.digest_algorithm = store_digest.ALGORITHM
    m.arrays = {}
    leaves = leaves_by_path(tree)
    digests = _digests(list(leaves.values()))
    for (path, arr), dig in zip(leaves.items(), digests):
        m.arrays[path_to_name(path)] = ArrayRecord(tuple(int(s) for s in arr.shape), np.dtype(arr.dtype).name,
                                                   store_digest.to_hex(dig))
    return m


def _digests(arrays: list[jax.Array]) -> list[int]:
    """Per-array digests: each process digests its addressable replica-0 shards; sums are combined."""
    partial = np.zeros(len(arrays), dtype=np.uint64)
    local = sum(int(np.prod(s.data.shape)) * np.dtype(a.dtype).itemsize
                for a in arrays for s in jnp.asarray(a).addressable_shards if s.replica_id == 0)
    with progress(local, f"digest (process {jax.process_index()})") as bar:
        for i, a in enumerate(arrays):
            a = jnp.asarray(a)
            total = 0
            for shard in a.addressable_shards:
                if shard.replica_id != 0:
                    continue  # one replica digests each region, so the cross-process sum counts it once
                start = tuple((s.start or 0) for s in shard.index)
                data = np.asarray(shard.data)
                total += store_digest.digest_box(a.shape, Box.of(start, data.shape), data)
                bar.update(data.nbytes)
            partial[i] = np.uint64(store_digest.combine([total]))
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        halves = np.stack([(partial & np.uint64(0xFFFFFFFF)).astype(np.uint32),
                           (partial >> np.uint64(32)).astype(np.uint32)], axis=-1)
        gathered = np.asarray(multihost_utils.process_allgather(halves))  # (processes, n, 2)
        parts = gathered[..., 0].astype(np.uint64) | (gathered[..., 1].astype(np.uint64) << np.uint64(32))
        return [store_digest.combine(parts[:, i].tolist()) for i in range(len(arrays))]
    return [int(p) for p in partial]
