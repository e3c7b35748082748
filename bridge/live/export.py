"""Live export: every rank of a torch.distributed run writes the full training state in parallel.

    export_state(dst, run, params)       # called by every rank of run.group, same dst

1. each rank cuts what it holds into logical pieces (`holdings`, layout engine);
2. one small JSON all-gather shares the summaries; every rank computes the same plan
   (`plan`: catalog, replica election, tiling check, chunk owners, transfers);
3. one `all_to_all_single` over flat byte buffers moves every piece to its chunk owner (NCCL on
   GPU, gloo on CPU); pieces of a logical section that spans GTP shards meet at the owner of each
   of its chunks, so no rank ever gathers a whole tensor;
4. each rank writes the chunks it owns (device -> host through pinned buffers under a budget)
   into its own OCDBT database; `finalize` barriers and rank 0 merges and commits atomically.

Any rank's bad input is reported on every rank (one line naming rank and parameter) before
anything is written; a rank that dies mid-export leaves only the `*.orbax-checkpoint-tmp`
directory, and the others fail in the next collective or the commit barrier.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist

from bridge.errors import BridgeError
from bridge.layout.boxes import Box
from bridge.layout.chunks import ArrayOwnership
from bridge.live.api import LiveRun, LocalParam
from bridge.live.exchange import all_gather_json, all_to_all_bytes, collective_device, pack
from bridge.live.holdings import Holding, rank_holdings, tree_name
from bridge.live.plan import ExportPlan, Transfer, build_plan
from bridge.live.staging import WriteItem, stage_and_write
from bridge.progress import progress
from bridge.store.commit import begin_checkpoint, finalize
from bridge.store.manifest import Manifest, OptimizerConfig, SourceLayout
from bridge.store.plan import ArraySpec, make_write_plan
from bridge.store.tree import adamw_empty_paths, megatron_key_to_path, path_str
from bridge.store.writer import CheckpointWriter

COUNT_PATH = ("opt_state", "0", "count")
STEP_PATH = ("step",)


@dataclass
class ExportReport:
    """What this rank did (figures for benchmarks and logs)."""

    path: str
    rank: int
    bytes_written: int
    bytes_sent: int
    bytes_received: int
    plan_s: float
    exchange_s: float
    write_s: float
    commit_s: float
    staging_peak_bytes: int
    arrays: int
    sent_by_group: dict = field(default_factory=dict)  # payload bytes to GTP peers / DistOpt (DP) peers / others


def _summary(params: Sequence[LocalParam], run: LiveRun, rank: int) -> tuple[list[Holding], dict]:
    holdings, catalog = rank_holdings(params, run.layout, rank, with_optim=run.optimizer is not None)
    fused = {path_str(megatron_key_to_path(p.geometry.name)): p.geometry.fused.to_json()
             for p in params if p.geometry.fused is not None}
    pads = sorted({p.geometry.pad_for_alignment for p in params if p.geometry.gtp})
    return holdings, {"catalog": catalog, "holdings": [h.describe() for h in holdings], "fused": fused, "pads": pads}


def _manifest(run: LiveRun, summaries: Sequence[dict]) -> Manifest:
    lay = run.layout
    pads = sorted({p for s in summaries for p in s["pads"]})
    fused: dict = {}
    for s in summaries:
        fused.update(s["fused"])
    src = SourceLayout(framework="torch-live", tp=lay.tp, gtp=lay.gtp, dp=lay.dp, ep=lay.ep, etp=lay.etp,
                       egtp=lay.egtp, pp=lay.pp, cp=lay.cp, pad_for_alignment=pads[-1] if pads else 0,
                       optimizer_format="distributed_optimizer", world_size=lay.world)
    opt = OptimizerConfig(step=int(run.step))
    if run.optimizer is not None:
        a = run.optimizer
        opt = OptimizerConfig(name="adamw", lr=float(a.lr), betas=tuple(float(b) for b in a.betas), eps=float(a.eps),
                              weight_decay=float(a.weight_decay), step=int(run.step),
                              groups=[{"params": [path_str(megatron_key_to_path(k))], "lr_mult": float(v)}
                                      for k, v in sorted(a.lr_mult.items())],
                              no_decay=[path_str(megatron_key_to_path(k)) for k in a.no_decay],
                              clip_grad=None if a.clip_grad is None else float(a.clip_grad))
    extra = dict(run.extra)
    if run.optimizer is not None and run.optimizer.extra:
        extra["optimizer_extra"] = dict(run.optimizer.extra)
    if len(pads) > 1:
        extra["pad_for_alignment_values"] = pads
    return Manifest(source=src, optimizer=opt, fused=fused, extra=extra)


def _piece_tensor(h: Holding, t: Transfer) -> torch.Tensor:
    """The data of transfer `t` out of local holding `h` (contiguous; a copy only for sub-boxes)."""
    s = t.src
    flat = h.data[s.local_start:s.local_start + s.box.size]
    if t.box == s.box:
        return flat.reshape(s.box.shape)
    rel = t.box.relative_to(s.box)
    return flat.reshape(s.box.shape)[rel.slices].contiguous()


def _send_buffer(plan: ExportPlan, holdings: Sequence[Holding], rank: int, device) -> torch.Tensor:
    segs = []
    for dst in range(plan.world):
        if dst == rank:
            continue
        segs.extend(_piece_tensor(holdings[t.src.holding], t) for t in plan.sends(rank, dst))
        pad = plan.split_bytes(rank, dst) - plan.payload_bytes(rank, dst)
        if pad:
            segs.append(torch.zeros(pad, dtype=torch.uint8, device=device))
    return pack(segs, device)


def _received_items(plan: ExportPlan, recv: torch.Tensor, rank: int, dtypes: dict[str, torch.dtype]) -> list[WriteItem]:
    items, off = [], 0
    for src in range(plan.world):
        if src == rank:
            continue
        block_end = off + plan.split_bytes(src, rank)
        for t in plan.sends(src, rank):
            dt = dtypes[t.array]
            nb = t.box.size * plan.itemsize[t.array]
            data = recv[off:off + nb].view(dt).reshape(t.box.shape)  # aligned: wide dtypes first, blocks padded
            items.append(WriteItem(t.array, t.box, data))
            off += nb
        off = block_end
    if off != recv.numel():
        raise BridgeError(f"rank {rank}: received {recv.numel()} bytes, the plan accounts for {off} (plans differ between ranks)")
    return items


@contextmanager
def _collective(stage: str, rank: int, dst: str):
    """Turn a collective failure (a peer died, a timeout) into one BridgeError line naming rank and stage."""
    try:
        yield
    except BridgeError:
        raise
    except RuntimeError as e:  # torch.distributed.DistBackendError and gloo/NCCL failures are RuntimeErrors
        first = " ".join(str(e).split())[:300]
        raise BridgeError(f"rank {rank}: export to {dst} aborted during {stage}: a peer failed or timed out "
                          f"({first}); nothing was committed, rerun the export") from e


def _sent_by_group(plan: ExportPlan, layout, rank: int) -> dict:
    """Payload bytes this rank sent, by the group the peer shares with it (dense grid)."""
    gtp, dp = set(layout.gtp_group(rank)), set(layout.distopt_group(rank))
    out = {"gtp": 0, "distopt": 0, "other": 0}
    for dst in range(plan.world):
        if dst != rank:
            out["gtp" if dst in gtp else "distopt" if dst in dp else "other"] += plan.payload_bytes(rank, dst)
    return out


_STORE_TO_TORCH = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
                   "float64": torch.float64}


def export_state(dst: str, run: LiveRun, params: Sequence[LocalParam], *, inflight_bytes: int = 256 << 20,
                 target_chunk_bytes: int = 4 << 20, compression: str | None = None, timeout: float = 600.0,
                 digest: bool = True, inner_chunk_bytes: int = 256 << 10,
                 on_stage: Callable[[str], None] | None = None) -> ExportReport:
    """Write this run's full training state to the logical checkpoint `dst` (collective call).

    Every rank of `run.group` calls it with the same `dst` and its own `params`. `inflight_bytes`
    bounds host memory for staging and for each writer's pending TensorStore transaction.
    `inner_chunk_bytes` sizes the zarr3 inner (read) chunks: small enough that a reader at another
    TP / GTP split reads little beyond its boxes. `digest=False` skips the per-array integrity digests (faster; `gtp-bridge verify` can then only
    check structure). `on_stage(name)` is called after "planned", "exchanged", "written".
    Returns this rank's `ExportReport`; raises BridgeError on every rank if any rank's input is bad.
    """
    group = run.group
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    if world != dist.get_world_size():
        # every rank of a subgroup sees this too: all of them raise, none waits in a collective
        raise BridgeError(f"export_state runs over the whole world ({dist.get_world_size()} ranks), got a group of "
                          f"{world}; pass LiveRun.group=None (the store's commit barrier spans all ranks)")
    device = collective_device(group)
    t0 = time.perf_counter()
    error = None
    holdings: list[Holding] = []
    summary: dict = {}
    try:
        if rank != run.rank:
            raise BridgeError(f"LiveRun.rank is {run.rank} but this process is rank {rank} of the export group")
        if run.layout.world != world:
            raise BridgeError(f"layout world size {run.layout.world} != process group size {world}; "
                              "pass the group the layout describes")
        holdings, summary = _summary(params, run, rank)
    except BridgeError as e:
        error = str(e)
    with _collective("planning", rank, dst):
        summaries = all_gather_json({"error": error, **summary}, group, device)
    bad = [(r, s["error"]) for r, s in enumerate(summaries) if s["error"]]
    if bad:
        r, e = bad[0]
        raise BridgeError(e if r == rank else f"export aborted: rank {r} reported: {e}")
    plan = build_plan(summaries, tree_name, target_chunk_bytes)
    catalog = list(plan.catalog)
    ownership: dict[str, ArrayOwnership] = dict(plan.ownership)
    scalars = [ArraySpec(STEP_PATH, (), "int32")]
    if run.optimizer is not None:
        scalars.insert(0, ArraySpec(COUNT_PATH, (), "int32"))
    for spec in scalars:
        ownership[spec.name] = ArrayOwnership((), (), np.array(0, dtype=np.int32))
    wplan = make_write_plan(catalog + scalars, world, ownership,
                            empty_paths=adamw_empty_paths() if run.optimizer is not None else (),
                            compression=compression, inner_chunk_bytes=inner_chunk_bytes)
    manifest = _manifest(run, summaries)
    with _collective("the start", rank, dst):
        tmp = begin_checkpoint(dst)  # collective: rank 0 prepares, every rank gets the path or the error
    t_plan = time.perf_counter()
    if on_stage:
        on_stage("planned")

    send = _send_buffer(plan, holdings, rank, device)
    with _collective("the exchange", rank, dst):
        recv = all_to_all_bytes(send, plan.send_splits(rank), plan.recv_splits(rank), group)
    bytes_sent = send.numel()
    del send
    t_x = time.perf_counter()
    if on_stage:
        on_stage("exchanged")

    dtypes = {a.name: _STORE_TO_TORCH[a.dtype] for a in catalog}
    items = [WriteItem(t.array, t.box, _piece_tensor(holdings[t.src.holding], t)) for t in plan.sends(rank, rank)]
    items += _received_items(plan, recv, rank, dtypes)
    writer = CheckpointWriter(tmp, wplan, rank, inflight_bytes=inflight_bytes, compute_digest=digest)
    total = sum(it.box.size * plan.itemsize[it.name] for it in items)
    with progress(total, f"export rank {rank}") as bar:
        # CPU items (views of `recv` and of the holdings) stay alive until writer.finish() returns,
        # so the writer may reference them instead of copying (donate).
        peak = stage_and_write(items, writer.write, inflight_bytes, bar.update,
                               write_cpu=lambda n, b, a: writer.write(n, b, a, donate=True))
    if rank == 0:
        writer.write(STEP_PATH, Box((), ()), np.asarray(run.step, dtype=np.int32))
        if run.optimizer is not None:
            writer.write(COUNT_PATH, Box((), ()), np.asarray(run.step, dtype=np.int32))
    writer.finish()
    del recv, items
    t_w = time.perf_counter()
    if on_stage:
        on_stage("written")
    with _collective("the commit", rank, dst):
        path = finalize(dst, wplan, rank, manifest, timeout=timeout)
    t_c = time.perf_counter()
    return ExportReport(path=path or os.path.abspath(dst), rank=rank, bytes_written=writer.bytes_written,
                        bytes_sent=bytes_sent, bytes_received=sum(plan.recv_splits(rank)), plan_s=t_plan - t0,
                        exchange_s=t_x - t_plan, write_s=t_w - t_x, commit_s=t_c - t_w, staging_peak_bytes=peak,
                        arrays=len(catalog), sent_by_group=_sent_by_group(plan, run.layout, rank))
