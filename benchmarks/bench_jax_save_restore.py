"""JAX save and restore on a local path: the one path (the store's writer / reader) vs the Orbax path it replaced.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/bench_jax_save_restore.py [--mib 256] [--reps 3]

The same training state (fp32 params, mu, nu, bf16 model; stacked layer arrays) sharded on an 8-device
CPU mesh (2 x 4, the default `ShardingRules`) is saved and restored, interleaved, by:
- **new**: `bridge.jaxside.save` (store writer + commit) and `bridge.jaxside.restore` (block reads);
- **old**: what `save` / `restore` did on a local path before the fold: a digest pass over the
  shards (the new path's writers digest what they write), then Orbax `PyTreeCheckpointHandler(use_ocdbt=True,
  use_zarr3=True, use_compression=False)` with the store's inner chunk policy as `SaveArgs`; and
  Orbax's restore with `ArrayRestoreArgs` onto the same shardings the bridge restores to (Orbax's
  restore alone: the old path's metadata reads and planning are not counted, so the restore ratio
  leans against the new path).
Reported: median wall seconds per path and new / old ratios; and, to tell the reader from the format,
Orbax's restore of the new save's bytes. The restored params and model of
both paths are checked against the state saved (bit for bit) before timing.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402

from bridge.jaxside.abstract import Target, abstract_tree, stored_arrays  # noqa: E402
from bridge.jaxside.keypaths import leaves_by_path, nested_from_paths, to_path  # noqa: E402
from bridge.jaxside.restore import restore  # noqa: E402
from bridge.jaxside.save import save  # noqa: E402
from bridge.layout.boxes import Box  # noqa: E402
from bridge.store import digest as store_digest  # noqa: E402  (a benchmark computes the reference digest itself)
from bridge.jaxside.sharding_rules import ShardingRules  # noqa: E402
from bridge.store.specs import DEFAULT_INNER_CHUNK_BYTES, stacked_axes  # noqa: E402


def make_state(mib: int, mesh: Mesh) -> dict:
    """`save`'s keywords for a state of about `mib` MiB (params + mu + nu fp32, model bf16: 3.5x params)."""
    params_bytes = int(mib * (1 << 20) / 3.5)
    side = 1024
    layers = max(1, params_bytes // (4 * side * side * 4))  # four stacked [layers, side, side] matrices
    rng = np.random.default_rng(0)
    names = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
    flat = {("decoder", "layers", n, "weight"): rng.standard_normal((layers, side, side), dtype=np.float32)
            for n in names}
    rules = ShardingRules()
    on = {p: jax.device_put(a, NamedSharding(mesh, rules.spec_for(p, a.shape, dict(mesh.shape))))
          for p, a in flat.items()}
    params = nested_from_paths(on)
    mu = jax.tree.map(lambda x: x * 1e-3, params)
    nu = jax.tree.map(lambda x: x * x * 1e-6, params)
    count = jax.numpy.asarray(7, jax.numpy.int32)
    opt = (optax.ScaleByAdamState(count=count, mu=mu, nu=nu), optax.EmptyState(), optax.EmptyState())
    model = jax.tree.map(lambda x: x.astype(jax.numpy.bfloat16), params)
    return dict(params=params, opt_state=opt, step=7, model=model)


def old_digests(arrays: list) -> list[int]:
    """The former save's digest pass (one process): every replica-0 shard moved to the host and
    digested (the new path's writers digest the blocks they write instead)."""
    out = []
    for a in arrays:
        a = jax.numpy.asarray(a)
        total = 0
        for shard in a.addressable_shards:
            if shard.replica_id == 0:
                data = np.asarray(shard.data)
                start = tuple((s.start or 0) for s in shard.index)
                total += store_digest.digest_box(a.shape, Box.of(start, data.shape), data)
        out.append(store_digest.combine([total]))
    return out


def old_save(d: str, state: dict) -> None:
    """The former local save: digests, then Orbax with the store's chunk policy as SaveArgs."""
    tree = {"params": state["params"], "opt_state": state["opt_state"], "model": state["model"],
            "step": jax.numpy.asarray(state["step"], jax.numpy.int32)}
    old_digests(list(leaves_by_path(tree).values()))

    def args(kp, x):
        path = to_path(kp)
        return ocp.SaveArgs(chunk_byte_size=DEFAULT_INNER_CHUNK_BYTES,
                            shard_axes=tuple(range(stacked_axes(path, np.ndim(x)))))

    save_args = jax.tree_util.tree_map_with_path(args, tree)
    handler = ocp.PyTreeCheckpointHandler(use_ocdbt=True, use_zarr3=True, use_compression=False)
    ocp.Checkpointer(handler).save(d, args=ocp.args.PyTreeSave(tree, save_args=save_args))


def old_restore(d: str, abstract: dict) -> list:
    """The former local restore's read: Orbax with ArrayRestoreArgs onto the target shardings."""
    restore_args = jax.tree.map(
        lambda s: ocp.ArrayRestoreArgs(sharding=s.sharding, global_shape=s.shape, dtype=s.dtype), abstract)
    out = ocp.Checkpointer(ocp.PyTreeCheckpointHandler()).restore(
        d, args=ocp.args.PyTreeRestore(item=abstract, restore_args=restore_args))
    leaves = jax.tree.leaves(out)
    jax.block_until_ready(leaves)
    return leaves


def new_restore(d: str, mesh: Mesh) -> list:
    r = restore(d, mesh=mesh)
    leaves = jax.tree.leaves((r.params, r.opt_state, r.model, r.step))
    jax.block_until_ready(leaves)
    return leaves


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256, help="size of the state in MiB (about)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args()

    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("fsdp", "tp"))
    state = make_state(args.mib, mesh)
    total = sum(x.nbytes for x in jax.tree.leaves(state["params"])) * 3.5
    work = args.workdir or tempfile.mkdtemp(prefix="bench_jax_save_restore_")
    new_d, old_d = os.path.join(work, "new"), os.path.join(work, "old")

    # warm-up, and the values checked: both restores equal the state saved
    save(new_d, **state)
    old_save(old_d, state)
    abstract = abstract_tree(stored_arrays(new_d), Target(mesh=mesh))
    want = {p: np.asarray(jax.device_get(x)) for p, x in leaves_by_path(
        {"params": state["params"], "model": state["model"]}).items()}
    r = restore(new_d, mesh=mesh)
    old_tree = ocp.Checkpointer(ocp.PyTreeCheckpointHandler()).restore(old_d, args=ocp.args.PyTreeRestore(
        item=abstract, restore_args=jax.tree.map(lambda s: ocp.ArrayRestoreArgs(sharding=s.sharding), abstract)))
    for got in ({"params": r.params, "model": r.model}, {"params": old_tree["params"], "model": old_tree["model"]}):
        flat = leaves_by_path(got)
        assert set(flat) == set(want)
        for p, x in flat.items():
            assert np.array_equal(np.asarray(x).view(np.uint8), want[p].view(np.uint8)), p
    new_restore(new_d, mesh), old_restore(old_d, abstract)

    times: dict[str, list[float]] = {"new save": [], "old save": [], "new restore": [], "old restore": [],
                                     "orbax on new": []}
    for _ in range(args.reps):
        for d in (new_d, old_d):
            shutil.rmtree(d, ignore_errors=True)
        times["new save"].append(timed(lambda: save(new_d, **state)))
        times["old save"].append(timed(lambda: old_save(old_d, state)))
        times["new restore"].append(timed(lambda: new_restore(new_d, mesh)))
        times["old restore"].append(timed(lambda: old_restore(old_d, abstract)))
        times["orbax on new"].append(timed(lambda: old_restore(new_d, abstract)))
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"state {total / 2**20:.0f} MiB on 8 CPU devices (2 x 4); reps {args.reps} (interleaved, median); "
          f"{os.cpu_count()} CPUs")
    print("| step | new s | old s | new / old |")
    print("|---|---|---|---|")
    for step in ("save", "restore"):
        print(f"| {step} | {med['new ' + step]:.3f} | {med['old ' + step]:.3f} | "
              f"{med['new ' + step] / med['old ' + step]:.2f} |")
    print(f"restore, the same bytes (the new save's) read by both readers: new {med['new restore']:.3f} s, "
          f"Orbax {med['orbax on new']:.3f} s, new / Orbax {med['new restore'] / med['orbax on new']:.2f}; "
          f"Orbax reading the new bytes / its own: {med['orbax on new'] / med['old restore']:.2f} (the format's cost: "
          f"a crc32c per chunk, the store's chunking)")
    print("all times:", {k: [round(t, 3) for t in v] for k, v in times.items()})
    if args.workdir is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
