"""Many small arrays: the store's per-array cost vs Orbax and torch DCP saving the same arrays.

    python benchmarks/bench_many_arrays.py [--arrays 2000] [--shape 64 64] [--reps 5]

A model has thousands of arrays (every layer's weights, biases and norms, times the master copy
and two Adam moments), many of them small, so per-array costs (opening, metadata, B-tree entries)
matter as much as bandwidth. One process, one writer, the same N fp32 arrays, reps interleaved:
  store   `bridge.store.save_checkpoint` (create, write, commit: merge, _METADATA, fsync, rename)
  orbax   Orbax `PyTreeCheckpointHandler` save of the same dict (zarr3, OCDBT, no compression)
  dcp     `torch.distributed.checkpoint.save` of the same tensors (no process group)
and reading back: `Checkpoint.open_many` (every array opened at once) vs `Checkpoint.open` one by
one (what a loop over arrays costs), on the store's checkpoint. Reported: median seconds and the
store's time / anchor's time (lower is better), plus ms per array.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

import numpy as np  # noqa: E402


def arrays_of(n: int, shape: tuple[int, ...]) -> dict[str, np.ndarray]:
    """`n` distinct fp32 arrays named like a model's leaves.

    >>> a = arrays_of(3, (2, 2)); sorted(a), float(a["layer_2.w"][0, 0])
    (['layer_0.w', 'layer_1.w', 'layer_2.w'], 2.0)
    """
    return {f"layer_{i}.w": np.full(shape, i, dtype=np.float32) for i in range(n)}


def run_store(arrs: dict, out: str) -> None:
    from bridge.store import save_checkpoint

    save_checkpoint(out, {("params",) + tuple(k.split(".")): v for k, v in arrs.items()})


def run_orbax(arrs: dict, out: str) -> None:
    import orbax.checkpoint as ocp

    tree: dict = {}
    for k, v in arrs.items():
        layer, leaf = k.split(".")
        tree.setdefault(layer, {})[leaf] = v
    ck = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_zarr3=True, use_compression=False))
    ck.save(out, {"params": tree})


def run_dcp(arrs: dict, out: str) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():  # no process group: DCP warns that it saves as a single process
        warnings.simplefilter("ignore")
        dcp.save({k: torch.from_numpy(v) for k, v in arrs.items()}, checkpoint_id=out)


def open_all(path: str, together: bool) -> int:
    from bridge.store import open_checkpoint

    ck = open_checkpoint(path)
    paths = list(ck.paths())
    if together:
        ck.open_many(paths)
    else:
        for p in paths:
            ck.open(p)
    return len(paths)


VARIANTS = {"store": run_store, "orbax": run_orbax, "dcp": run_dcp}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arrays", type=int, default=2000)
    ap.add_argument("--shape", type=int, nargs="+", default=[64, 64])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
    a = ap.parse_args(argv)
    arrs = arrays_of(a.arrays, tuple(a.shape))
    root = a.dir or tempfile.mkdtemp(prefix="bench_many_")
    times: dict[str, list] = {k: [] for k in (*VARIANTS, "open_many", "open_each")}
    try:
        for rep in range(-1, a.reps):  # rep -1: untimed warm-up (imports, first allocations)
            names = list(VARIANTS)
            for name in names[rep % len(names):] + names[:rep % len(names)]:
                out = os.path.join(root, f"{name}_{rep + 1}")
                t0 = time.perf_counter()
                VARIANTS[name](arrs, out)
                if rep >= 0:
                    times[name].append(time.perf_counter() - t0)
            store_ck = os.path.join(root, f"store_{rep + 1}")
            for name, together in (("open_many", True), ("open_each", False)):
                t0 = time.perf_counter()
                open_all(store_ck, together)
                if rep >= 0:
                    times[name].append(time.perf_counter() - t0)
            for name in names:
                shutil.rmtree(os.path.join(root, f"{name}_{rep + 1}"), ignore_errors=True)
    finally:
        if a.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    nbytes = sum(v.nbytes for v in arrs.values())
    print(f"{a.arrays} arrays of {tuple(a.shape)} fp32 ({nbytes / 2 ** 20:.1f} MiB), {a.reps} interleaved reps, "
          f"{os.cpu_count()} CPUs")
    for k, v in med.items():
        print(f"{k:10} median {v:.3f} s  {v / a.arrays * 1e3:.2f} ms/array  runs {[round(t, 3) for t in times[k]]}")
    print(f"store / orbax time {med['store'] / med['orbax']:.2f}, store / dcp time {med['store'] / med['dcp']:.2f}, "
          f"open_many / one by one {med['open_many'] / med['open_each']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
