"""Resharded JAX restore: bridge store checkpoint vs Orbax restoring its own save, same target sharding.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/bench_jax_restore.py [--mib 64] [--arrays 2]

The same fp32 arrays are saved twice, both laid out the way a 2-writer export holds them (row
blocks of the leading axis):
- **bridge**: the store's writer (2 writers, OCDBT + zarr3, inner chunks from `bridge.store.specs`,
  or `--inner-chunk-bytes` as a tuning hook for that choice);
- **orbax**: plain Orbax `PyTreeCheckpointHandler(use_ocdbt, use_zarr3, no compression)` saving
  jax.Arrays sharded the same way (its own chunking: one chunk per shard).
Each is restored by `bridge.jaxside.restore` (for the bridge store) and by plain Orbax (for its own
save) onto 8-device TP-style targets: column split `P(None, "tp")` and row split `P("tp", None)`.
Reported: median wall time over interleaved repetitions and TensorStore file bytes read, as ratios
(bridge / orbax time, bytes read / bytes needed). Targets: time <= 1.1x, bytes <= 1.25x.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import statistics
import tempfile
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
import tensorstore as ts  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from bridge.jaxside.restore import restore  # noqa: E402
from bridge.jaxside.sharding_rules import ShardingRules  # noqa: E402
from bridge.store import specs  # noqa: E402
from bridge.store.commit import begin_checkpoint, catalog_of, commit_checkpoint  # noqa: E402
from bridge.store.plan import make_write_plan  # noqa: E402
from bridge.store.writer import CheckpointWriter  # noqa: E402


def bytes_read() -> int:
    """TensorStore file bytes read so far in this process."""
    total = 0
    for m in ts.experimental_collect_matching_metrics("/tensorstore/kvstore/file/bytes_read"):
        total += sum(int(v.get("value", 0)) for v in m["values"])
    return total


def tp_aligned_inner_chunk(chunk_shape, itemsize: int, target_bytes: int, global_shape, split: int = 8):
    """Proposed inner-chunk choice: cap the parameter's own (last two) dims at global/split, so a
    TP-style row or column split by `split` (or any divisor of it) never cuts an inner chunk; then
    shrink as the store does (`specs.choose_inner_chunk`) down to `target_bytes`.

    >>> tp_aligned_inner_chunk((2048, 4096), 4, 4 << 20, (4096, 4096))
    (512, 512)
    """
    inner = [int(c) for c in chunk_shape]
    for k in range(max(0, len(inner) - 2), len(inner)):
        g = int(global_shape[k])
        if g % split == 0 and inner[k] % (g // split) == 0:
            inner[k] = min(inner[k], g // split)
    return specs.choose_inner_chunk(tuple(inner), itemsize, target_bytes)


def write_bridge(dst: str, arrays: dict, writers: int, inner_chunk_bytes: int, tp_aligned: int = 0) -> None:
    """The store's own multi-writer path (what an export produces). `tp_aligned` > 0 is the tuning
    hook: inner chunks from `tp_aligned_inner_chunk(..., split=tp_aligned)` instead of the store's."""
    catalog = catalog_of(arrays)
    plan = make_write_plan(catalog, writers, inner_chunk_bytes=inner_chunk_bytes)
    if tp_aligned:
        for name, ap in list(plan.arrays.items()):
            inner = tp_aligned_inner_chunk(ap.ownership.chunk_shape, ap.spec.itemsize, inner_chunk_bytes,
                                           ap.spec.shape, tp_aligned)
            plan.arrays[name] = dataclasses.replace(ap, inner_chunk_shape=inner)
    claim = begin_checkpoint(dst)
    tmp = claim.tmp
    for w in range(writers):
        writer = CheckpointWriter(tmp, plan, w)
        for name, ap in plan.arrays.items():
            for box in ap.ownership.boxes_owned_by(w):
                writer.write(name, box, arrays[ap.spec.path][box.slices])
        writer.finish()
    commit_checkpoint(claim, plan, None, timeout=30.0)


def write_orbax(dst: str, arrays: dict, writers: int) -> None:
    """Plain Orbax saving the same arrays sharded as `writers` row blocks."""
    mesh = Mesh(np.array(jax.devices()[:writers]), ("w",))
    tree: dict = {}
    for path, a in arrays.items():
        node = tree
        for c in path[:-1]:
            node = node.setdefault(c, {})
        node[path[-1]] = jax.device_put(a, NamedSharding(mesh, P("w")))
    ck = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=True, use_zarr3=True, use_compression=False))
    ck.save(dst, args=ocp.args.PyTreeSave(tree))


def restore_orbax(path: str, arrays: dict, spec: P, mesh: Mesh) -> list:
    """Plain Orbax restore of its own save onto the target sharding."""
    tree: dict = {}
    for p, a in arrays.items():
        node = tree
        for c in p[:-1]:
            node = node.setdefault(c, {})
        node[p[-1]] = jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, spec))
    out = ocp.StandardCheckpointer().restore(path, tree)
    leaves = jax.tree.leaves(out)
    jax.block_until_ready(leaves)
    return leaves


def restore_bridge(path: str, spec: P, mesh: Mesh) -> list:
    r = restore(path, mesh=mesh, rules=ShardingRules([("*", tuple(spec))]), items=("params",))
    leaves = jax.tree.leaves(r.params)
    jax.block_until_ready(leaves)
    return leaves


def _inner_chunks(path: str) -> list:
    from bridge.store.reader import open_checkpoint

    ck = open_checkpoint(path)
    return [ck.info(p).inner_chunk_shape for p in ck.paths()]


def measure(fn) -> tuple[float, int]:
    b0, t0 = bytes_read(), time.perf_counter()
    out = fn()
    dt, db = time.perf_counter() - t0, bytes_read() - b0
    del out
    return dt, db


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=64, help="size of each fp32 array in MiB (square)")
    ap.add_argument("--arrays", type=int, default=2)
    ap.add_argument("--writers", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--inner-chunk-bytes", type=int, default=specs.DEFAULT_INNER_CHUNK_BYTES,
                    help="tuning hook for the store's inner chunk choice (default: the store's)")
    ap.add_argument("--tp-aligned", type=int, default=0, metavar="N",
                    help="tuning hook: inner chunks aligned to TP splits by N (proposed store change); 0 = store's")
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args()

    side = int((args.mib * (1 << 20) / 4) ** 0.5)
    side -= side % 64
    rng = np.random.default_rng(0)
    arrays = {("params", f"layer{i}", "weight"): rng.standard_normal((side, side), dtype=np.float32)
              for i in range(args.arrays)}
    needed = sum(a.nbytes for a in arrays.values())
    work = args.workdir or tempfile.mkdtemp(prefix="bench_jax_restore_")
    bdir, odir = os.path.join(work, "bridge"), os.path.join(work, "orbax")
    for d in (bdir, odir):
        shutil.rmtree(d, ignore_errors=True)
    write_bridge(bdir, arrays, args.writers, args.inner_chunk_bytes, args.tp_aligned)
    write_orbax(odir, arrays, args.writers)
    mesh = Mesh(np.array(jax.devices()), ("tp",))
    print(f"{args.arrays} x ({side}, {side}) fp32 = {needed / 2**20:.0f} MiB, saved by {args.writers} writers "
          f"(row blocks); target: 8 devices; reps {args.reps} (interleaved, median); "
          f"bridge inner chunks {next(iter(_inner_chunks(bdir)))} (tp-aligned {args.tp_aligned or 'off'})")
    print("| target | bridge s | orbax s | time ratio | bridge read/needed | orbax read/needed |")
    print("|---|---|---|---|---|---|")
    for name, spec in (("column P(None,'tp')", P(None, "tp")), ("row P('tp',None)", P("tp", None))):
        # warm-up (compilation, page cache) and a value check against the source arrays
        for leaf, want in zip(restore_bridge(bdir, spec, mesh), arrays.values()):
            assert np.array_equal(np.asarray(leaf), want)
        restore_orbax(odir, arrays, spec, mesh)
        bt, ot, bb, ob = [], [], [], []
        for _ in range(args.reps):
            t, b = measure(lambda: restore_bridge(bdir, spec, mesh))
            bt.append(t), bb.append(b)
            t, b = measure(lambda: restore_orbax(odir, arrays, spec, mesh))
            ot.append(t), ob.append(b)
        b_med, o_med = statistics.median(bt), statistics.median(ot)
        print(f"| {name} | {b_med:.3f} | {o_med:.3f} | {b_med / o_med:.2f} | "
              f"{statistics.median(bb) / needed:.2f} | {statistics.median(ob) / needed:.2f} |")
    if args.workdir is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
