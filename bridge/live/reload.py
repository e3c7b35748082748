"""Live reload: fill a run's physical shards and optimizer fragments from a logical checkpoint.

    result = reload_state(src, run, params)   # per rank; params allocated at the new layout

Each rank reads exactly the boxes its own shards and fragments need (the layout engine's pieces
of its placement), with all reads of a batch in flight at once; padding (GTP tail rows,
alignment gaps) comes back as zeros. Weights come from `model/...` (FP8 targets are
re-quantized), or from the fp32 masters when the checkpoint has no model tree. No collectives:
any layout and world size can reload any checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Sequence

import numpy as np
import torch

from bridge.errors import BridgeError
from bridge.layout.boxes import Box
from bridge.layout.rectangles import Piece
from bridge.live.api import AdamConfig, LiveRun, LocalParam, QuantizedWeight, ReloadResult
from bridge.live.fp8 import quantize_into
from bridge.live.holdings import tree_name
from bridge.dtypes import from_numpy
from bridge.progress import progress
from bridge.renamed import renamed
from bridge.store import Checkpoint, open_checkpoint
from bridge.format.schema import MODEL, PARAMS, SCALAR_PATHS, has_role
from bridge.format.tree import name_to_path, path_str


@dataclass
class _Job:
    """One local flat buffer to fill: from which root, which pieces, into which tensor."""

    param: LocalParam
    root: str
    pieces: list[Piece]
    numel: int
    target: torch.Tensor | QuantizedWeight


def _jobs(p: LocalParam, run: LiveRun, have_model: bool) -> list[_Job]:
    geom = p.geometry
    tp, gtp, t, g = geom.placement(run.layout, run.rank)
    index = tuple(p.index) or None
    shape = geom.physical_shape(tp, gtp)
    numel = prod(shape)
    where = f"rank {run.rank}: {p.key}"
    out = []
    if p.weight is not None:
        if tuple(p.weight.shape) != tuple(shape):
            raise BridgeError(f"{where}: target weight has shape {tuple(p.weight.shape)}, the layout (TP={tp}, GTP={gtp}) "
                              f"gives the physical shard shape {tuple(shape)}; allocate it at that shape")
        out.append(_Job(p, MODEL if have_model else PARAMS, geom.shard_pieces(tp, gtp, t, g, index), numel,
                        p.weight))
    o = p.optim
    if o is not None:
        o.check(where, numel)
        pieces = geom.fragment_pieces(tp, gtp, t, g, o.f0, o.f1, index)
        for root, tensor in o.tensors().items():
            out.append(_Job(p, root, pieces, o.numel, tensor))
    return out


def _check_arrays(ck: Checkpoint, jobs: Sequence[_Job]) -> dict[str, object]:
    """Open every array the jobs need once; shapes must match the geometry (BridgeError naming it)."""
    wanted: dict[str, tuple] = {}  # name -> (path, expected shape, the parameter needing it)
    for j in jobs:
        for array, shape in j.param.geometry.logical_arrays().items():
            name = tree_name(j.root, array)
            if name not in wanted:
                wanted[name] = (name_to_path(name), tuple(shape), j.param.key)
    available = set(ck.paths())
    for path, _shape, key in wanted.values():
        if path not in available:
            raise BridgeError(f"checkpoint {ck.root} has no array {path_str(path)} needed by {key}; "
                              "it was written for another model (or without optimizer state)")
    stores = dict(zip(wanted, ck.open_many([path for path, _, _ in wanted.values()])))  # all at once
    for path, shape, key in wanted.values():
        info = ck.info(path)
        if tuple(info.shape) != shape:
            raise BridgeError(f"{path_str(path)}: checkpoint shape {list(info.shape)} != {list(shape)} expected by "
                              f"{key}'s geometry; reload with the model the checkpoint was written for")
    return stores


def _read_plan(pieces: Sequence[Piece], slack: float = 2.0) -> list[tuple[str, Box, list[Piece]]]:
    """Group a buffer's pieces per array into reads: the bounding box of an array's pieces when it
    is at most `slack` x their volume (pieces of one flat run: partial first/last rows), else one
    read per piece. One read per region avoids re-reading the inner chunks that several pieces share.

    >>> ps = [Piece("a", Box((0, 5), (1, 8)), 0), Piece("a", Box((1, 0), (3, 8)), 3), Piece("a", Box((3, 0), (4, 2)), 19)]
    >>> [(a, str(b), len(p)) for a, b, p in _read_plan(ps)]
    [('a', '[0:4, 0:8]', 3)]
    """
    by_array: dict[str, list[Piece]] = {}
    for p in pieces:
        by_array.setdefault(p.array, []).append(p)
    out = []
    for array, ps in by_array.items():
        lo = tuple(min(p.logical.start[d] for p in ps) for d in range(ps[0].logical.ndim))
        hi = tuple(max(p.logical.stop[d] for p in ps) for d in range(ps[0].logical.ndim))
        bound = Box(lo, hi)
        if len(ps) > 1 and bound.size <= slack * sum(p.logical.size for p in ps):
            out.append((array, bound, ps))
        else:
            out.extend((array, p.logical, [p]) for p in ps)
    return out


def _fill(jobs: Sequence[_Job], stores: dict) -> int:
    """Issue every read of the batch, then assemble flat buffers and copy them into the targets."""
    reads = []
    for j in jobs:
        plan = _read_plan(j.pieces)
        reads.append([(box, ps, stores[tree_name(j.root, array)][box.slices].read()) for array, box, ps in plan])
    nbytes = 0
    for j, rs in zip(jobs, reads):
        first = stores[tree_name(j.root, j.pieces[0].array)] if j.pieces else None
        dtype = np.dtype(first.dtype.numpy_dtype) if first is not None else np.float32
        flat = np.zeros(j.numel, dtype=dtype)
        for box, ps, fut in rs:
            data = np.asarray(fut.result())
            nbytes += data.nbytes
            for p in ps:
                p.put(flat, data[p.logical.relative_to(box).slices])
        _copy_into(j, flat)
    return nbytes


def _copy_into(j: _Job, flat: np.ndarray) -> None:
    target = j.target
    src = from_numpy(flat)
    if isinstance(target, QuantizedWeight):
        quantize_into(target, src.reshape(target.shape).to(torch.float32))
        return
    with torch.no_grad():
        target.view(-1).copy_(src.to(target.device, target.dtype))


RELOAD_BUDGET = 256 << 20  # bytes read at a time by default


def reload_state(src: str, run: LiveRun, params: Sequence[LocalParam], *, budget: int | None = None,
                 inflight_bytes: int | None = None) -> ReloadResult:
    """Fill `params` (allocated for `run.layout` at `run.rank`) in place from checkpoint `src`.

    Weights come from `model/...` (bf16; FP8 targets re-quantized with current scaling), or from
    `params/...` when the checkpoint has no model tree; optimizer fragments from `params`, `mu`,
    `nu`. Reads at most about `budget` bytes at a time (None: `RELOAD_BUDGET`; `inflight_bytes` is
    its former name, deprecated). Returns the step and the recorded optimizer settings.
    """
    budget = renamed("reload_state", "inflight_bytes", "budget", inflight_bytes, budget)
    budget = RELOAD_BUDGET if budget is None else int(budget)
    ck = open_checkpoint(src)
    have_model = has_role(ck.paths(), MODEL)
    jobs = [j for p in params for j in _jobs(p, run, have_model)]
    stores = _check_arrays(ck, jobs)
    total = 0
    batch: list[_Job] = []
    used = 0
    with progress(sum(j.numel * 4 for j in jobs), f"reload rank {run.rank}") as bar:
        for j in jobs:
            batch.append(j)
            used += j.numel * 4
            if used >= budget:
                total += _fill(batch, stores)
                bar.update(used)
                batch, used = [], 0
        if batch:
            total += _fill(batch, stores)
            bar.update(used)
    step = _read_step(ck)
    m = ck.manifest
    opt = None
    if m is not None and m.optimizer.lr is not None:
        o = m.optimizer.with_defaults().check(ck.root)
        opt = AdamConfig(lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay, no_decay=tuple(o.no_decay),
                         clip_grad=o.clip_grad)
    source = dict(vars(m.source)) if m is not None else {}
    return ReloadResult(step=step, optimizer=opt, source_layout=source, bytes_read=total)


def _read_step(ck: Checkpoint) -> int:
    """optax `count` when present (completed optimizer steps), else the `step` leaf, else the manifest."""
    available = set(ck.paths())
    for path in SCALAR_PATHS:
        if path in available:
            return int(np.asarray(ck.read(path)))
    if ck.manifest is not None and ck.manifest.optimizer.step is not None:
        return int(ck.manifest.optimizer.step)
    raise BridgeError(f"checkpoint {ck.root} records no step (no {', '.join(path_str(p) for p in SCALAR_PATHS)}, "
                      f"or manifest step)")
