"""The plan of a streamed MaxText move (pure) and the options objects its layers hand down.

    job = plan_job(moves, scalars, workers, share)          # the blocks, their writers, the write plan
    writers = StreamWriterJob(src, job, share, dims, opts, forward=True, scalars=scalars)
    run_job(writers, StreamOutput(dst, manifest, label, show_progress))   # maxtext_stream: claim, write, commit

What every writer of one move shares is one frozen dataclass (`StreamWriterJob`), as `convert`'s
writers share a `converters.megatron.writer_job.WriterJob`: handed down `run_job` -> `_run_parallel`
-> a spawned writer -> `write_blocks` (pickled once per writer process) instead of a chain of
positional arguments. The claimed temporary directory and the writer id travel beside it: the job is
planned before the claim and is the same for every writer. What only the process that claims and
commits needs is `StreamOutput`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from bridge.budget import ShareSplit
from bridge.jaxside.presets.maxtext import Dims, Options
from bridge.jaxside.presets.maxtext_plan import Move, blocks_of, chunk_shape
from bridge.layout.boxes import Box
from bridge.layout.shares import contiguous_parts

Path = tuple[str, ...]


@dataclass(frozen=True)
class Job:
    """The blocks of a conversion and who writes them."""

    moves: list[Move]
    blocks: list[tuple[int, Box]]      # (move index, output box): one output chunk each
    owners: list[int]
    workers: int
    plan: Any                          # bridge.store.plan.WritePlan

    @property
    def nbytes(self) -> int:
        """Bytes of every block together (what the progress counts)."""
        return sum(b.size * np.dtype(self.moves[i].dtype).itemsize for i, b in self.blocks)


@dataclass(frozen=True)
class StreamWriterJob:
    """What every writer of one streamed MaxText move shares (its id and the claimed temporary
    directory travel beside it)."""

    src: str                            # what the writers read: the logical checkpoint, or MaxText's items directory
    job: Job                            # the blocks, who writes them, the output's write plan
    share: ShareSplit                   # one writer's budget, split (`bridge.budget.split_share`)
    dims: Dims                          # the model's sizes (the value transforms need them)
    opts: Options                       # the preset's options (decoder block, scanned layers, rotary layout)
    forward: bool                       # True: logical -> MaxText; False: MaxText -> logical
    scalars: Mapping[Path, np.ndarray]  # written whole by writer 0 (counts, step)


@dataclass(frozen=True)
class StreamOutput:
    """What the process that claims and commits needs beside the writers' job."""

    dst: str                            # the checkpoint written (to-maxtext: the step's items directory)
    manifest: Any                       # bridge.format.manifest.Manifest recorded at the commit, or None
    label: str                          # the progress bar's label, e.g. "to-maxtext root"
    show_progress: bool | None = None


def plan_job(moves: Sequence[Move], scalars: Mapping[Path, np.ndarray], workers: int, share: ShareSplit, *,
             empty_paths: Sequence[Path] = (), stacked_outputs: bool = True, max_chunk_bytes: int = 1 << 30) -> Job:
    """Cut every output on its chunk grid, give contiguous runs of chunks to `workers` writers, and
    build the write plan (scalars to writer 0). `stacked_outputs=False`: the outputs have no leading
    stacked axis (MaxText's layer axis is the second), so inner chunks are cut freely."""
    from bridge.layout.chunks import ArrayOwnership, grid_shape
    from bridge.store import ArraySpec, make_write_plan

    blocks: list[tuple[int, Box]] = []
    chunks = []
    for i, m in enumerate(moves):
        cs = chunk_shape(m, np.dtype(m.dtype).itemsize, min(share.block, max_chunk_bytes))
        chunks.append(cs)
        blocks += [(i, b) for b in blocks_of(m.shape, cs)]
    workers = max(1, min(workers, len(blocks)))
    owners = contiguous_parts([b.size * np.dtype(moves[i].dtype).itemsize for i, b in blocks], workers)
    catalog, ownership, stacked = [], {}, {}
    grids = {i: np.zeros(grid_shape(m.shape, chunks[i]), dtype=np.int32) for i, m in enumerate(moves)}
    for (i, b), w in zip(blocks, owners):
        grids[i][tuple(s // c for s, c in zip(b.start, chunks[i]))] = w
    for i, m in enumerate(moves):
        catalog.append(ArraySpec(m.dst, m.shape, m.dtype))
        ownership[m.dst] = ArrayOwnership(m.shape, chunks[i], grids[i])
        if not stacked_outputs:
            stacked[m.dst] = 0
    for p, a in scalars.items():
        catalog.append(ArraySpec(p, (), a.dtype.name))
        ownership[p] = ArrayOwnership((), (), np.zeros((), dtype=np.int32))
    plan = make_write_plan(catalog, workers, ownership, empty_paths=empty_paths, stacked=stacked)
    return Job(list(moves), blocks, owners, workers, plan)
