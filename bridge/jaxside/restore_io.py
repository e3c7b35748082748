"""The one JAX restore read: arrays of a committed checkpoint placed straight onto their shardings.

The store's reader (`bridge.store.reader`, which checks `_METADATA`'s seal and refuses uncommitted
directories and prefixes) opens the arrays, on a local path and on s3:// / gs:// alike; every
distinct device box is one TensorStore read, all of them issued at once within a host-memory budget
(plans: `bridge.jaxside.placement`), so a process reads only what its devices hold and reads of
neighbouring chunks (and object storage's round trips) overlap.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import jax
import numpy as np

from bridge.errors import IntegrityError
from bridge.jaxside.keypaths import Path, path_str
from bridge.jaxside.placement import BlockRead, concurrent_bytes, plan_block_reads, run_bounded
from bridge.layout.boxes import Box


def read_arrays(directory: str, abstract: Mapping[Path, jax.ShapeDtypeStruct],
                concurrent_gb: float | None = None, checkpoint: Any = None) -> dict[Path, jax.Array]:
    """Every requested array of the committed checkpoint at `directory` (a path or a URL) on its
    sharding, cast to its dtype.

    All device boxes of all arrays are read at once (TensorStore futures) within a host-memory
    budget of `concurrent_gb` (GB, 10**9 bytes; default Orbax's): a read starts only while the
    blocks read and not yet placed on their devices fit in it (a block larger than the budget is
    read alone). Each finished block goes to its devices and the array is built from the placed
    shards. (Tests of the budget hear each block's "read" and "placed" through `bridge._testing`'s
    `restore_watch`.) `checkpoint`: `directory` already open (`bridge.store.Checkpoint`), its
    metadata and arrays' handles reused."""
    from bridge import _testing
    from bridge.progress import progress
    from bridge.store import open_checkpoint

    watch = _testing.current().restore_watch
    budget = concurrent_bytes(concurrent_gb)
    ck = checkpoint if checkpoint is not None else open_checkpoint(directory)
    paths = list(abstract)
    stores = dict(zip(paths, ck.open_many(paths)))
    reads = plan_block_reads(abstract, {p: t.dtype.numpy_dtype.itemsize for p, t in stores.items()})
    placed: dict[Path, list[jax.Array]] = {p: [] for p in paths}

    def start(r: BlockRead):
        if watch is not None:
            watch("read", r.nbytes)
        return _start_read(stores[r.path], r.box)

    def finish(r: BlockRead, future) -> None:
        try:
            block = np.asarray(future.result())
        except Exception as e:
            from bridge.store import one_line

            raise IntegrityError(f"process {jax.process_index()}: array {path_str(r.path)}: read of {r.box} "
                                 f"from {directory} failed: {one_line(e)}") from e
        placed[r.path].extend(_to_devices(block.astype(abstract[r.path].dtype, copy=False), r.devices))
        if watch is not None:
            watch("placed", r.nbytes)
        bar.update(r.nbytes)

    with progress(sum(r.nbytes for r in reads), "restore") as bar:
        run_bounded(reads, budget, start, finish)
    return {p: jax.make_array_from_single_device_arrays(tuple(int(s) for s in want.shape), want.sharding, placed[p])
            for p, want in abstract.items()}


def _start_read(store, box: Box):
    """A TensorStore read of `box` (a future)."""
    return (store[box.slices] if box.ndim else store).read()


def _to_devices(block: np.ndarray, devices: Sequence) -> list[jax.Array]:
    """`block` placed on each of `devices` (the shards they hold)."""
    return [jax.device_put(block, d) for d in devices]
