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

import hashlib
import time
from itertools import product
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist

from bridge.dtypes import torch_dtype
from bridge.errors import BridgeError
from bridge.location import absolute, location
from bridge.layout.boxes import Box
from bridge.layout.chunks import ArrayOwnership
from bridge.live.api import LiveRun, LocalParam
from bridge.live.exchange import all_gather_json, collective_device, pack, start_all_to_all_bytes
from bridge.live.holdings import (Holding, RankSummary, holdings_signature, rank_holdings, refresh_holdings,
                                  tree_name)
from bridge.live.plan import ExportPlan, PlanCache, Transfer, build_plan, choose_inner_bytes, plan_key
from bridge.live.staging import WriteItem, stage_and_write
from bridge.progress import progress
from bridge.store.commit import begin_checkpoint, finalize
from bridge.format.manifest import (GROUP_PARAMS, OPTIMIZER_EXTRA_KEY, PADS_KEY, Manifest, OptimizerConfig,
                                    SourceLayout)
from bridge.format.schema import COUNT_PATH, SCALAR_DTYPE, STEP_PATH, adamw_empty_paths
from bridge.store.plan import ArraySpec, WritePlan, make_write_plan
from bridge.format.tree import megatron_key_to_path, path_str
from bridge.store.writer import CheckpointWriter, default_batch_bytes


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
    plan_cached: bool = False  # the plan of an earlier export with the same layout was reused
    timings: dict = field(default_factory=dict)  # seconds per step (see TIMING_STEPS), this rank
    write_calls: int = 0  # CheckpointWriter.write calls this rank made
    staged_bytes: int = 0  # bytes copied device -> host through the staging buffers
    donated_staging: bool = False  # staging buffers were donated to the writer (no copy in the writer)
    inner_chunk_bytes: int | None = None  # inner (read) chunk size used ("auto" resolved)


# Steps of `ExportReport.timings`, in order. plan_s = holdings..begin, exchange_s = pack + exchange_wait,
# write_s = write_local..finish, commit_s = barrier + commit. write_local overlaps the exchange on CPU.
# Not steps but parts of write_local / write_recv / finish: `timings["d2h_wait"]` = time blocked on
# device -> host copies, `timings["commit_wait"]` = time blocked on the store writer's commits.
TIMING_STEPS = ("holdings", "gather", "plan", "begin", "pack", "write_local", "exchange_wait", "write_recv",
                "finish", "barrier", "commit")


class _Clock:
    """Seconds spent per named step (consecutive marks)."""

    def __init__(self) -> None:
        self.t = time.perf_counter()
        self.steps = dict.fromkeys(TIMING_STEPS, 0.0)

    def mark(self, step: str) -> None:
        now = time.perf_counter()
        self.steps[step] += now - self.t
        self.t = now

    def total(self, *steps: str) -> float:
        return sum(self.steps[k] for k in steps)


@dataclass
class _Planned:
    """Everything an export derives from the ranks' summaries alone (cached across exports)."""

    plan: ExportPlan
    wplan: WritePlan
    fused: dict
    pads: list
    inner_chunk_bytes: int | None = None  # what "auto" chose (or what was passed)
    moved: bool = True  # some rank sends bytes to another (else the exchange is skipped)


@dataclass
class _Local:
    """This rank's holdings template (pieces, no data) and summary for one holdings signature."""

    holdings: list[Holding]
    summary: RankSummary
    key: str  # digest of the signature, exchanged instead of the summary when every rank has a plan


# A run exports every N steps with the same layout: plan once, reuse while nothing but values changed.
# Keys: the holdings signature (a hashable tuple, compared exactly) and the global plan key.
_LOCAL_CACHE = PlanCache(size=2)
_PLAN_CACHE = PlanCache(size=2)


def clear_plan_cache() -> None:
    """Forget every cached plan (the next export plans from scratch)."""
    _LOCAL_CACHE.clear()
    _PLAN_CACHE.clear()


def _summary(params: Sequence[LocalParam], run: LiveRun, rank: int) -> tuple[list[Holding], RankSummary]:
    holdings, catalog = rank_holdings(params, run.layout, rank, with_optim=run.optimizer is not None)
    fused = {path_str(megatron_key_to_path(p.geometry.name)): p.geometry.fused.to_json()
             for p in params if p.geometry.fused is not None}
    pads = sorted({p.geometry.pad_for_alignment for p in params if p.geometry.gtp})
    return holdings, RankSummary(catalog, tuple(h.describe() for h in holdings), fused, tuple(pads))


def _local(params: Sequence[LocalParam], run: LiveRun, rank: int) -> tuple[list[Holding], _Local]:
    """This rank's holdings (current tensors) and its summary, reusing the pieces of an equal signature."""
    sig = holdings_signature(params, run.layout, rank, run.optimizer is not None)
    cached = _LOCAL_CACHE.get(sig)
    if cached is not None:
        return refresh_holdings(cached.holdings, params), cached
    holdings, summary = _summary(params, run, rank)
    template = [Holding(h.root, h.param, torch.empty(0, dtype=h.data.dtype), h.pieces, h.main_replica, h.slot)
                for h in holdings]  # no reference to the tensors: the cache must not keep them alive
    entry = _Local(template, summary, hashlib.sha256(repr(sig).encode()).hexdigest())
    _LOCAL_CACHE.put(sig, entry)
    return holdings, entry


def _array_paths(key: str, fused: dict) -> list[str]:
    """The logical arrays of parameter `key` as the manifest names them ("/"-joined, the same as
    `convert` writes): one per section of a fused parameter, else the parameter's own path.

    >>> _array_paths("decoder.layers.mlp.linear_fc1.bias", {"decoder/layers/mlp/linear_fc1/bias":
    ...     {"sections": [["gate", 40], ["up", 40]]}})
    ['decoder/layers/mlp/linear_fc1/bias/gate', 'decoder/layers/mlp/linear_fc1/bias/up']
    >>> _array_paths("module.decoder.final_layernorm.weight", {})
    ['decoder/final_layernorm/weight']
    """
    p = path_str(megatron_key_to_path(key))
    spec = fused.get(p)
    return [f"{p}/{name}" for name, _rows in spec["sections"]] if spec else [p]


def _manifest(run: LiveRun, fused: dict, pads: list) -> Manifest:
    lay = run.layout
    src = SourceLayout.of(lay, "torch-live", "distributed_optimizer", pads[-1] if pads else 0)
    opt = OptimizerConfig(step=int(run.step))
    if run.optimizer is not None:
        a = run.optimizer
        opt = OptimizerConfig(name="adamw", lr=float(a.lr), betas=tuple(float(b) for b in a.betas), eps=float(a.eps),
                              weight_decay=float(a.weight_decay), step=int(run.step),
                              groups=[{GROUP_PARAMS: _array_paths(k, fused), "lr_mult": float(v)}
                                      for k, v in sorted(a.lr_mult.items())],
                              no_decay=[p for k in a.no_decay for p in _array_paths(k, fused)],
                              clip_grad=None if a.clip_grad is None else float(a.clip_grad))
    extra = dict(run.extra)
    if run.optimizer is not None and run.optimizer.extra:
        extra[OPTIMIZER_EXTRA_KEY] = dict(run.optimizer.extra)
    if len(pads) > 1:
        extra[PADS_KEY] = pads
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


class _NoWork:
    """Stands in for the exchange's work handle when no bytes move."""

    def wait(self) -> None:
        return None


# Tests only: send CPU pieces through the staging buffers and one pass after the exchange, as CUDA
# pieces go on a GPU machine (exercises that path on gloo).
_STAGE_ALL = False
# Writer commits in flight while device data is staged (each costs one more pinned buffer of a batch).
# bench_live_export on 2 H200s, 1 GiB TP2, 5 reps: export 1.12 s with 2 vs 1.23 s with 1.
_DEVICE_COMMITS = 2


def writer_batch_bytes(inflight_bytes: int) -> int:
    """Bytes per writer transaction (and per staging buffer) for an export budget.

    A quarter of the budget: the writer holds the batch being filled plus the two committing, and
    GPU staging four buffers of one batch each (the writer then references them, no slabs), so
    host memory stays near the budget.

    >>> writer_batch_bytes(256 << 20) >> 20
    64
    """
    return max(1, int(inflight_bytes) // 4)


def _plan(summaries: Sequence[RankSummary], run: LiveRun, world: int, target_chunk_bytes: int, compression: str | None,
          inner_chunk_bytes: int | str | None) -> _Planned:
    """The global plan and the store's write plan from every rank's summary (pure; identical on every rank)."""
    plan = build_plan(summaries, tree_name, target_chunk_bytes)
    if inner_chunk_bytes == "auto":
        inner_chunk_bytes = choose_inner_bytes(plan)
    elif inner_chunk_bytes is not None and not isinstance(inner_chunk_bytes, int):
        raise BridgeError(f"inner_chunk_bytes must be an int, None or 'auto', got {inner_chunk_bytes!r}")
    catalog = list(plan.catalog)
    ownership: dict[str, ArrayOwnership] = dict(plan.ownership)
    scalars = [ArraySpec(STEP_PATH, (), SCALAR_DTYPE)]
    if run.optimizer is not None:
        scalars.insert(0, ArraySpec(COUNT_PATH, (), SCALAR_DTYPE))
    for spec in scalars:
        ownership[spec.name] = ArrayOwnership((), (), np.array(0, dtype=np.int32))
    wplan = make_write_plan(catalog + scalars, world, ownership,
                            empty_paths=adamw_empty_paths() if run.optimizer is not None else (),
                            compression=compression, inner_chunk_bytes=inner_chunk_bytes)
    fused: dict = {}
    for s in summaries:
        fused.update(s.fused)
    pads = sorted({p for s in summaries for p in s.pads})
    return _Planned(plan, wplan, fused, pads, inner_chunk_bytes, plan.moved_bytes() > 0)


def _agree_plan(local: _Local | None, error: str | None, run: LiveRun, dst: str, device, clock: _Clock, *,
                target_chunk_bytes: int, compression: str | None,
                inner_chunk_bytes: int | str | None) -> tuple[_Planned, bool]:
    """The plan every rank computes alike, and whether it came from the cache (collective).

    Round 1 gathers errors and signature digests only; round 2 (full summaries) runs only when
    some rank lacks the plan. Any rank's error is raised on every rank, before anything is written.
    """
    group = run.group
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    with _collective("planning", rank, dst):
        keys = all_gather_json({"error": error, "key": local.key if local else None, "cached": _PLAN_CACHE.keys()},
                               group, device)
    bad = [(r, s["error"]) for r, s in enumerate(keys) if s["error"]]
    if bad:
        r, e = bad[0]
        raise BridgeError(e if r == rank else f"export aborted: rank {r} reported: {e}")
    gkey = plan_key([s["key"] for s in keys], world=world, chunk=target_chunk_bytes, compression=compression,
                    inner=inner_chunk_bytes, optim=run.optimizer is not None)
    planned = _PLAN_CACHE.get(gkey) if all(gkey in s["cached"] for s in keys) else None
    if planned is not None:
        clock.mark("gather")
        return planned, True
    with _collective("planning", rank, dst):
        summaries = [RankSummary.from_json(s) for s in all_gather_json(local.summary.to_json(), group, device)]
    clock.mark("gather")
    planned = _plan(summaries, run, world, target_chunk_bytes, compression, inner_chunk_bytes)
    _PLAN_CACHE.put(gkey, planned)
    return planned, False


@dataclass
class _Written:
    """What `_exchange_and_write` did on this rank (for the report)."""

    bytes_written: int
    bytes_sent: int
    calls: int             # CheckpointWriter.write calls
    peak: int              # staging buffer bytes used
    staged_bytes: int      # bytes copied device -> host
    d2h_wait_s: float      # blocked on device -> host copies
    commit_wait_s: float   # blocked on the writer's commits
    donated: bool          # staging buffers were donated to the writer


def _exchange_and_write(planned: _Planned, holdings: list[Holding], run: LiveRun, tmp: str, dst: str, device,
                        clock: _Clock, on_stage: Callable[[str], None] | None, *, inflight_bytes: int | None,
                        digest: bool) -> _Written:
    """Move every piece to its chunk owner and write the chunks this rank owns (steps pack..finish).

    The exchange is one all_to_all over flat byte buffers; on CPU this rank's own pieces are
    written while it runs. When this returns the writer has finished (its report is published).
    """
    plan, wplan, group = planned.plan, planned.wplan, run.group
    rank = dist.get_rank(group)
    send = _send_buffer(plan, holdings, rank, device)
    clock.mark("pack")
    with _collective("the exchange", rank, dst):
        if planned.moved:
            recv, work = start_all_to_all_bytes(send, plan.send_splits(rank), plan.recv_splits(rank), group)
        else:  # every owner holds all it writes (same on every rank): no collective
            recv, work = send, _NoWork()
    bytes_sent = send.numel()
    dtypes = {a.name: torch_dtype(a.dtype) for a in plan.catalog}
    local_items = [WriteItem(t.array, t.box, _piece_tensor(holdings[t.src.holding], t)) for t in plan.sends(rank, rank)]
    batch = writer_batch_bytes(inflight_bytes) if inflight_bytes else default_batch_bytes()
    # Device data goes through the donated staging pipeline (_DEVICE_COMMITS + 2 pinned buffers of
    # one batch, each refilled once its commit landed). Host data is donated as is: two in flight.
    # CPU holdings with a device exchange (NCCL) stage everything after the exchange, so that no
    # flush of the staging pipeline falls between a chunk's local and received pieces.
    on_host = not _STAGE_ALL and not recv.is_cuda and not any(it.data.is_cuda for it in local_items)
    staging = not on_host
    depth = _DEVICE_COMMITS if staging else 2
    writer = CheckpointWriter(tmp, wplan, rank, inflight_bytes=batch, compute_digest=digest, commit_depth=depth)
    calls = [0]

    def write_copy(n, b, a):
        calls[0] += 1
        writer.write(n, b, a)

    def write_donated(n, b, a):
        calls[0] += 1
        writer.write(n, b, a, donate=True)

    flush = (lambda: writer.flush(wait=False)) if staging else None
    staged: dict = {}
    order = {a.name: i for i, a in enumerate(plan.catalog)}
    total = plan.written_bytes(rank)
    peak = 0
    with progress(total, f"export rank {rank}") as bar:
        # CPU items (views of the holdings and of `recv`) stay alive until writer.finish() returns, so
        # the writer references them instead of copying (donate). CUDA items are staged through host
        # buffers, donated as well when the writer can commit in the background (see staging).
        def write_all(items: list[WriteItem]) -> None:
            nonlocal peak
            # A chunk's pieces together, chunk after chunk: the writer writes each chunk in one transaction.
            items = sorted(items, key=lambda it: (order[it.name], _first_chunk(wplan, it), it.box.start))
            peak = max(peak, stage_and_write(items, write_copy, (depth + 2) * batch, bar.update,
                                             write_cpu=write_donated, flush=flush, stage_cpu=_STAGE_ALL,
                                             stats=staged, commits_in_flight=depth, drain=writer.flush,
                                             cell_shape=lambda name: wplan.lookup(name).inner_chunk_shape,
                                             chunks=lambda name, box: _chunks_touching(wplan, name, box)))

        if on_host:
            write_all(local_items)  # overlaps the exchange (gloo runs it on its own thread)
        clock.mark("write_local")
        with _collective("the exchange", rank, dst):
            work.wait()
        del send
        clock.mark("exchange_wait")
        if on_stage:
            on_stage("exchanged")
        recv_items = _received_items(plan, recv, rank, dtypes)
        write_all(recv_items if on_host else local_items + recv_items)
        if rank == 0:
            write_copy(STEP_PATH, Box((), ()), np.asarray(run.step, dtype=SCALAR_DTYPE))
            if run.optimizer is not None:
                write_copy(COUNT_PATH, Box((), ()), np.asarray(run.step, dtype=SCALAR_DTYPE))
        clock.mark("write_recv")
        writer.finish()
    del recv, local_items, recv_items
    clock.mark("finish")
    if on_stage:
        on_stage("written")
    return _Written(bytes_written=writer.bytes_written, bytes_sent=bytes_sent, calls=calls[0], peak=peak,
                    staged_bytes=staged.get("staged_bytes", 0), d2h_wait_s=staged.get("d2h_wait_s", 0.0),
                    commit_wait_s=writer.commit_wait_s, donated=flush is not None)


def _first_chunk(wplan: WritePlan, item: WriteItem) -> tuple[int, ...]:
    """Grid index of the outer chunk holding the first element of `item`'s box."""
    own = wplan.lookup(item.name).ownership
    return tuple(s // max(1, c) for s, c in zip(item.box.start, own.chunk_shape))


def _chunks_touching(wplan: WritePlan, name: str, box: Box) -> list[tuple[str, tuple[int, ...]]]:
    """The outer chunks (array name, grid index) `box` of array `name` touches."""
    sl = wplan.lookup(name).ownership.chunks_touching(box)
    return [(name, idx) for idx in product(*(range(s.start, s.stop) for s in sl))]


def export_state(dst: str, run: LiveRun, params: Sequence[LocalParam], *, inflight_bytes: int | None = None,
                 target_chunk_bytes: int = 4 << 20, compression: str | None = None, timeout: float = 600.0,
                 digest: bool = True, inner_chunk_bytes: int | str | None = "auto",
                 on_stage: Callable[[str], None] | None = None) -> ExportReport:
    """Write this run's full training state to the logical checkpoint `dst` (collective call).

    Every rank of `run.group` calls it with the same `dst` and its own `params`. `inflight_bytes`
    bounds host memory: writer transactions of a quarter of it (host data: one filling, two
    committing) and, for CUDA tensors, four pinned staging buffers of one transaction each (one
    being copied into, one being written, two committing); the default is four of the store's
    `default_batch_bytes()` (256 MiB, 512 MiB with >= 16 CPUs).
    `inner_chunk_bytes` sizes the zarr3 inner (read) chunks: small enough that a reader at another
    TP / GTP split reads little beyond its boxes, large enough to write fast; "auto" takes the
    largest of 1 MiB / 512 KiB / 256 KiB whose estimated read amplification is <= 1.2
    (`bridge.live.plan.choose_inner_bytes`), None makes the inner chunk the whole outer chunk.
    `digest=False` skips the per-array integrity digests (faster; `gtp-bridge verify` can then
    only check structure). `on_stage(name)` is called after "planned", "exchanged", "written".
    The plan is cached: a later export whose ranks hold parameters of the same geometry, shapes,
    dtypes and optimizer ranges (values may differ) with the same options reuses it.
    Returns this rank's `ExportReport`; raises BridgeError on every rank if any rank's input is bad.
    """
    dst = location(dst, "export destination")  # a path, s3:// or gs://; an unknown scheme is refused
    group = run.group
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    if world != dist.get_world_size():
        # every rank of a subgroup sees this too: all of them raise, none waits in a collective
        raise BridgeError(f"export_state runs over the whole world ({dist.get_world_size()} ranks), got a group of "
                          f"{world}; pass LiveRun.group=None (the store's commit barrier spans all ranks)")
    device = collective_device(group)
    clock = _Clock()
    error = None
    holdings: list[Holding] = []
    local: _Local | None = None
    try:
        if rank != run.rank:
            raise BridgeError(f"LiveRun.rank is {run.rank} but this process is rank {rank} of the export group")
        if run.layout.world != world:
            raise BridgeError(f"layout world size {run.layout.world} != process group size {world}; "
                              "pass the group the layout describes")
        holdings, local = _local(params, run, rank)
    except BridgeError as e:
        error = str(e)
    clock.mark("holdings")
    planned, hit = _agree_plan(local, error, run, dst, device, clock, target_chunk_bytes=target_chunk_bytes,
                               compression=compression, inner_chunk_bytes=inner_chunk_bytes)
    plan, wplan = planned.plan, planned.wplan
    manifest = _manifest(run, planned.fused, planned.pads)
    clock.mark("plan")
    with _collective("the start", rank, dst):
        tmp = begin_checkpoint(dst)  # collective: rank 0 prepares, every rank gets the path or the error
    clock.mark("begin")
    if on_stage:
        on_stage("planned")
    written = _exchange_and_write(planned, holdings, run, tmp, dst, device, clock, on_stage,
                                  inflight_bytes=inflight_bytes, digest=digest)
    with _collective("the commit", rank, dst):
        dist.barrier(group)  # timed apart from the commit: how long the slowest rank kept this one waiting
        clock.mark("barrier")
        path = finalize(dst, wplan, rank, manifest, timeout=timeout)
    clock.mark("commit")
    st = clock.steps
    return ExportReport(path=path or absolute(dst), rank=rank, bytes_written=written.bytes_written,
                        bytes_sent=written.bytes_sent, bytes_received=sum(plan.recv_splits(rank)),
                        plan_s=clock.total("holdings", "gather", "plan", "begin"),
                        exchange_s=clock.total("pack", "exchange_wait"),
                        write_s=clock.total("write_local", "write_recv", "finish"),
                        commit_s=clock.total("barrier", "commit"), staging_peak_bytes=written.peak,
                        arrays=len(plan.catalog), sent_by_group=_sent_by_group(plan, run.layout, rank),
                        plan_cached=hit, timings={**st, "d2h_wait": written.d2h_wait_s,
                                                      "commit_wait": written.commit_wait_s},
                        write_calls=written.calls, staged_bytes=written.staged_bytes,
                        donated_staging=written.donated, inner_chunk_bytes=planned.inner_chunk_bytes)
