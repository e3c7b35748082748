"""The one JAX save write: the logical tree `bridge.jaxside.save` built, written by the store's
writer and committed by the store's commit, to a local path or an s3:// / gs:// prefix alike.

So a `save` writes the same logical bytes wherever it goes, and the same bytes `convert` writes for
the same state: the store's zarr3 metadata (crc32c codec on every chunk), `_sharding`, the sealed
`_METADATA`. Every JAX process is one writer of the regions its devices hold
(`bridge.jaxside.placement.shard_ownership`); process 0 claims and commits.
"""

from __future__ import annotations

from typing import Iterator

import jax
import numpy as np

from bridge.jaxside.placement import box_of, concurrent_bytes, process_local, shard_ownership
from bridge.layout.boxes import Box


def write_tree(directory: str, tree: dict, manifest, *, chunk_byte_size: int | None = None,
               concurrent_gb: float | None = None) -> str:
    """Write `tree` (nested dicts / optax state of jax.Arrays) as a logical checkpoint at `directory`
    (must not exist) with the store's writer and commit (claim, OCDBT databases, sealed `_METADATA`
    last); returns the committed location.

    Every JAX process calls it: process 0 claims the destination, each process is one writer of
    the regions its devices hold and writes them from its addressable shards, and process 0 commits
    once every writer reported; all processes return or raise the same error. With one process
    arrays move to host memory one at a time. `chunk_byte_size`: inner chunk bytes (default the
    store's); `concurrent_gb`: the writer's batches (host memory) held to it. (Tests that watch the
    writer's calls pass its class through `bridge._testing`'s `writer_class`.)"""
    from bridge import _testing
    from bridge.budget import save_batch
    from bridge.dist import JaxCoordinator
    from bridge.dtypes import check_name
    from bridge.format.schema import adamw_empty_paths
    from bridge.jaxside.keypaths import leaves_by_path
    from bridge.progress import progress
    from bridge.store import (DEFAULT_INNER_CHUNK_BYTES, ArraySpec, CheckpointWriter, begin_checkpoint, commit_checkpoint,
                              make_write_plan, max_chunk_bytes)

    writer_class = _testing.current().writer_class  # read on the caller's thread
    batch = None if concurrent_gb is None else save_batch(concurrent_bytes(concurrent_gb))
    coord = JaxCoordinator(job=f"save to {directory}")
    rank, world = coord.rank, coord.world
    flat = {p: a for p, a in leaves_by_path(tree).items() if a is not None}
    catalog = [ArraySpec(p, tuple(int(s) for s in np.shape(a)), check_name(np.dtype(a.dtype).name, "/".join(p)))
               for p, a in flat.items()]
    limit = max_chunk_bytes(directory)
    ownership = None
    if world > 1:  # chunks aligned to the shards, each owned by a process holding it
        ownership = {spec.name: shard_ownership(flat[tuple(spec.path)], limit, spec.name) for spec in catalog}
    plan = make_write_plan(catalog, world, ownership, empty_paths=adamw_empty_paths(),
                           inner_chunk_bytes=DEFAULT_INNER_CHUNK_BYTES if chunk_byte_size is None else chunk_byte_size,
                           max_chunk_bytes=limit)
    by_name = {spec.name: flat[tuple(spec.path)] for spec in catalog}
    claim = begin_checkpoint(directory, coordinator=coord)

    def write() -> dict:
        with progress(plan.bytes_of_writer(rank), "save" if world == 1 else f"save (process {rank})") as bar:
            writer = (writer_class or CheckpointWriter)(claim.tmp, plan, rank, batch_bytes=batch)
            for name, ap in plan.arrays.items():
                # A jax.Array's host blocks are the save's own copy or views of an immutable buffer:
                # the writer references them (no copy; released before `finish` returns). A numpy
                # leaf is the caller's live buffer: copied.
                donate = isinstance(by_name[name], jax.Array)
                for box, host in owned_blocks(by_name[name], ap.ownership, rank):
                    writer.write(name, box, host, donate=donate)
                    bar.update(host.nbytes)
            return writer.finish(publish=False)

    try:
        # every writer's report reaches process 0 through the coordinator (no report objects), and a
        # failing process's error reaches every process
        reports = coord.all_gather("writing", write)
        return coord.broadcast("the commit", lambda: commit_checkpoint(claim, plan, manifest, reports=reports))
    except BaseException:
        # process 0's claim removes what this run wrote (a failed commit released it already); the
        # other processes' handles remove nothing
        claim.release(reason="the save failed")
        raise


def owned_blocks(a, ownership, rank: int) -> Iterator[tuple[Box, np.ndarray]]:
    """(box, host data) of every region of `a` that process `rank` owns, from its addressable shards
    (one replica of each); an array held whole here moves to host memory once."""
    if jax.process_count() == 1 or process_local(a):
        boxes = ownership.boxes_owned_by(rank)
        host = np.asarray(jax.device_get(a)) if boxes else None
        for box in boxes:
            yield box, host[box.slices]
        return
    shape = tuple(int(s) for s in np.shape(a))
    owned = set(ownership.boxes_owned_by(rank))
    done = set()
    for shard in a.addressable_shards:
        box = box_of(shard.index, shape)
        if box in done:
            continue
        mine = [b for b in owned if box.contains(b)]
        if mine:
            done.add(box)
            data = np.asarray(shard.data)
            for b in mine:
                yield b, data[b.relative_to(box).slices]
