"""Live export: every rank of a torch.distributed group writes the full training state in parallel.

    export_state(dst, run, params)                        # called by every rank of run.group, same dst
    exporter = Exporter(); exporter.export(dst, run, params, options)   # the same, reusing plans

1. each rank cuts what it holds into logical pieces (`holdings`, layout engine);
2. one small JSON all-gather shares the summaries; every rank computes the same plan
   (`plan`: catalog, replica election, tiling check, chunk owners, transfers);
3. one `all_to_all_single` over flat byte buffers moves every piece to its chunk owner (NCCL on
   GPU, gloo on CPU); pieces of a logical section that spans GTP shards meet at the owner of each
   of its chunks, so no rank ever gathers a whole tensor;
4. each rank writes the chunks it owns (`StagedWriter`: device -> host through pinned buffers
   under a budget) into its own OCDBT database; the ranks meet once and rank 0 merges and commits
   atomically.

The ranks talk through a `bridge.dist.TorchCoordinator` on `run.group` (a subgroup works): any
rank's bad input or failure is raised on every rank (one line naming the rank and the stage), bad
input before anything is written; a rank that dies mid-export leaves only the
`*.orbax-checkpoint-tmp` directory, and the others fail in the next collective.
"""

from __future__ import annotations

import dataclasses
import hashlib
import queue
import time
from collections import deque
from dataclasses import InitVar, dataclass
from typing import Callable, Mapping, Sequence

import numpy as np
import torch
import torch.distributed as dist

from bridge import _testing
from bridge.dist import TorchCoordinator
from bridge.dtypes import torch_dtype
from bridge.errors import BridgeError
from bridge.location import location
from bridge.layout.boxes import Box
from bridge.layout.chunks import ArrayOwnership
from bridge.live.api import LiveRun, LocalParam
from bridge.live.exchange import pack, start_all_to_all_bytes
from bridge.live.holdings import (Holding, RankSummary, holdings_signature, rank_holdings, refresh_holdings,
                                  tree_name)
from bridge.live.plan import ExportPlan, PlanCache, Transfer, build_plan, choose_inner_bytes, plan_key
from bridge.live.background import ExportHandle, background_group
from bridge.live.shared_slots import SharedSlots
from bridge.live.writer_process import WriterProcess, write_in_process
from bridge.live.snapshot import Recipe, SlotRing, Snapshot, SnapshotStats, StagedBatch, slot_size
from bridge.live.staging import HostBuffers, StagedWriter, StagingStats, WriteItem
from bridge.dtypes import to_numpy
from bridge.progress import progress
from bridge.budget import export_split, staged_split
from bridge.renamed import renamed
from bridge.format.manifest import (GROUP_PARAMS, OPTIMIZER_EXTRA_KEY, PADS_KEY, Manifest, OptimizerConfig,
                                    SourceLayout)
from bridge.format.schema import COUNT_PATH, SCALAR_DTYPE, STEP_PATH, adamw_empty_paths
from bridge.format.tree import megatron_key_to_path, path_str
from bridge.store import (ArraySpec, CheckpointWriter, WritePlan, begin_checkpoint, commit_checkpoint, default_batch_bytes,
                          make_write_plan, open_storage)


@dataclass(frozen=True)
class ExportOptions:
    """How an export writes; every rank passes the same (they are part of the plan's cache key)."""

    # Host memory: writer transactions of a quarter of it (host data: one filling, two committing)
    # and, for CUDA tensors, four pinned staging buffers of one transaction each; None: four of the
    # store's `default_batch_bytes()` (larger on object storage, where a transaction's data files are
    # the PUTs in flight).
    budget: int | None = None
    target_chunk_bytes: int = 4 << 20   # outer (write) chunk size
    compression: str | None = None
    timeout: float = 600.0              # seconds rank 0's commit waits for every writer's report
    digest: bool = True                 # per-array integrity digests (False: `verify` checks structure only)
    # zarr3 inner (read) chunks: "auto" takes the largest of 1 MiB / 512 KiB / 256 KiB whose estimated
    # read amplification is <= 1.2 (`bridge.live.plan.choose_inner_bytes`), None the whole outer chunk.
    inner_chunk_bytes: int | str | None = "auto"
    # Writer commits in flight while device data is staged (each costs one more pinned buffer of a batch).
    commit_depth: int = 2
    # Asynchronous export (`Exporter.export_async`): bytes of host staging slots at most (None: as many
    # as this rank's share of the checkpoint, so the call returns right after its device -> host
    # copies; less: the call also waits while the writer frees slots: less memory, longer blocked).
    staging_bytes: int | None = None
    # (Tests and benchmarks vary the writer and the staging path through `bridge._testing`, not here.)
    # Former names, accepted with a DeprecationWarning (not fields: no part of the plan's cache key).
    inflight_bytes: InitVar[int | None] = None
    device_commits: InitVar[int | None] = None

    def __post_init__(self, inflight_bytes: int | None, device_commits: int | None) -> None:
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        for old, new, value in (("inflight_bytes", "budget", inflight_bytes),
                                ("device_commits", "commit_depth", device_commits)):
            if value is not None:
                given = getattr(self, new)
                mine = None if given == defaults[new] else given
                object.__setattr__(self, new, renamed("ExportOptions", old, new, value, mine, stacklevel=4))


@dataclass(frozen=True)
class ExportReport:
    """What this rank did (figures for benchmarks and logs)."""

    path: str
    rank: int
    bytes_written: int
    bytes_sent: int            # exchange bytes this rank sent
    sent_by_group: dict        # payload bytes to GTP peers / DistOpt (DP) peers / others
    plan_cached: bool          # the plan of an earlier export with the same layout was reused
    inner_chunk_bytes: int | None   # inner (read) chunk size used ("auto" resolved)
    timings: dict              # seconds per step (TIMING_STEPS, then "d2h_wait", "commit_wait"), this rank
    staging: StagingStats      # the staged writer's counters (write calls, buffer bytes, bytes staged)


# Steps of `ExportReport.timings`, in order (grouped into phases by PHASES). write_local overlaps the
# exchange on CPU; barrier is where the ranks meet (and errors travel). Not steps but parts of
# write_local / write_recv / finish: `timings["d2h_wait"]` = time blocked on device -> host copies,
# `timings["commit_wait"]` = time blocked on the store writer's commits.
TIMING_STEPS = ("holdings", "gather", "plan", "begin", "pack", "write_local", "exchange_wait", "write_recv",
                "finish", "barrier", "commit")
PHASES = {"plan": ("holdings", "gather", "plan", "begin"), "exchange": ("pack", "exchange_wait"),
          "write": ("write_local", "write_recv", "finish"), "commit": ("barrier", "commit")}


def phase_seconds(timings: Mapping[str, float]) -> dict[str, float]:
    """Seconds per phase of an export from its `ExportReport.timings`.

    >>> phase_seconds({**dict.fromkeys(TIMING_STEPS, 0.5), "d2h_wait": 9.0})
    {'plan': 2.0, 'exchange': 1.0, 'write': 1.5, 'commit': 1.0}
    """
    return {phase: sum(timings.get(k, 0.0) for k in steps) for phase, steps in PHASES.items()}


class _Clock:
    """Seconds spent per named step (consecutive marks)."""

    def __init__(self) -> None:
        self.t = time.perf_counter()
        self.steps = dict.fromkeys(TIMING_STEPS, 0.0)

    def mark(self, step: str) -> None:
        now = time.perf_counter()
        self.steps[step] = self.steps.get(step, 0.0) + now - self.t
        self.t = now


@dataclass
class _Planned:
    """Everything an export derives from the ranks' summaries alone (cached across exports)."""

    plan: ExportPlan
    wplan: WritePlan
    fused: dict
    pads: list
    inner_chunk_bytes: int | None = None  # what "auto" chose (or what was passed)
    moved: bool = True  # some rank sends bytes to another (else the exchange is skipped)
    recipes: dict = dataclasses.field(default_factory=dict)  # batch bytes -> this rank's snapshot `Recipe`


@dataclass
class _Local:
    """This rank's holdings template (pieces, no data) and summary for one holdings signature."""

    holdings: list[Holding]
    summary: RankSummary
    key: str  # digest of the signature, exchanged instead of the summary when every rank has a plan


def _summary(params: Sequence[LocalParam], run: LiveRun, rank: int) -> tuple[list[Holding], RankSummary]:
    holdings, catalog = rank_holdings(params, run.layout, rank, with_optim=run.optimizer is not None)
    fused = {path_str(megatron_key_to_path(p.geometry.name)): p.geometry.fused.to_json()
             for p in params if p.geometry.fused is not None}
    pads = sorted({p.geometry.pad_for_alignment for p in params if p.geometry.gtp})
    return holdings, RankSummary(catalog, tuple(h.describe() for h in holdings), fused, tuple(pads))


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
    opt.check("LiveRun.optimizer")
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


def _sent_by_group(plan: ExportPlan, layout, rank: int) -> dict:
    """Payload bytes this rank sent, by the group the peer shares with it (dense grid)."""
    gtp, dp = set(layout.gtp_group(rank)), set(layout.distopt_group(rank))
    out = {"gtp": 0, "distopt": 0, "other": 0}
    for dst in range(plan.world):
        if dst != rank:
            out["gtp" if dst in gtp else "distopt" if dst in dp else "other"] += plan.payload_bytes(rank, dst)
    return out


def _start_exchange(planned, holdings: Sequence[Holding], coord, attempt, on_stage, clock) -> tuple:
    """Pack this rank's pieces and start the one all_to_all of flat byte buffers: (recv, work, bytes sent).

    A failure here does not skip the collective: the failing rank joins the exchange with a zero buffer
    of the sizes the plan gives, and reports its failure when the ranks meet."""
    plan, rank, device = planned.plan, coord.rank, coord.device
    if on_stage:
        attempt(lambda: on_stage("planned"))
    send = attempt(lambda: _send_buffer(plan, holdings, rank, device))
    if send is None:  # this rank failed: still take part in the exchange, with the sizes the plan gives
        send = torch.zeros(sum(plan.send_splits(rank)), dtype=torch.uint8, device=device)
    clock.mark("pack")
    with coord.guard("the exchange"):
        if planned.moved:
            recv, work = start_all_to_all_bytes(send, plan.send_splits(rank), plan.recv_splits(rank), coord.group)
        else:  # every owner holds all it writes (same on every rank): no collective
            recv, work = send, _NoWork()
    return recv, work, send.numel()


class _NoWork:
    """Stands in for the exchange's work handle when no bytes move."""

    def wait(self) -> None:
        return None


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


@dataclass(frozen=True)
class _Written:
    """What `_exchange_and_write` did on this rank (for the report)."""

    bytes_written: int
    bytes_sent: int
    commit_wait_s: float   # blocked on the writer's commits
    staging: StagingStats


class Exporter:
    """Exports a run's state, as often as the run likes; owns what one export leaves for the next.

    A run exports every N steps with the same layout: the exporter plans once and reuses the plan
    while nothing but values changed (keys: every rank's holdings signature, compared exactly, and
    the options), and keeps its host staging buffers (pinning host memory is slow). Nothing is
    cached per process: an exporter's caches go with it.
    """

    def __init__(self, cache_size: int = 2) -> None:
        self._local = PlanCache(size=cache_size)   # holdings signature -> this rank's `_Local`
        self._plans = PlanCache(size=cache_size)   # global plan key -> `_Planned`
        self.buffers = HostBuffers()
        self.slots = SharedSlots()                 # the asynchronous export's staging slots (shared memory)
        self.writer = WriterProcess()              # the asynchronous export's writer, started by the first one
        self._inflight: ExportHandle | None = None  # the asynchronous export still running, if any
        self._bg_groups: dict = {}                 # export group ranks -> its background gloo group

    def clear_cache(self) -> None:
        """Forget every cached plan (the next export plans from scratch)."""
        self._local.clear()
        self._plans.clear()

    def export(self, dst: str, run: LiveRun, params: Sequence[LocalParam], options: ExportOptions | None = None, *,
               on_stage: Callable[[str], None] | None = None) -> ExportReport:
        """`export_state` with this exporter's caches (collective over `run.group`)."""
        self.settle()
        opts = options or ExportOptions()
        dst = location(dst, "export destination")  # a path, s3:// or gs://; an unknown scheme is refused
        coord = TorchCoordinator(run.group if run.group is not None else dist.group.WORLD, job=f"export to {dst}")
        clock = _Clock()
        holdings, planned, hit = self._agree_plan(params, run, coord, opts, clock)
        manifest = _manifest(run, planned.fused, planned.pads)
        clock.mark("plan")
        claim = begin_checkpoint(dst, coordinator=coord)  # rank 0 claims, every rank gets a handle or the error
        clock.mark("begin")
        try:
            written = _exchange_and_write(planned, holdings, run, claim.tmp, coord, clock, on_stage, opts,
                                          self.buffers, _testing.current())
            clock.mark("barrier")
        except BaseException:
            claim.release()  # rank 0's removes what this run wrote; the other ranks' handles remove nothing
            raise
        path = coord.broadcast("the commit", lambda: commit_checkpoint(claim, planned.wplan, manifest,
                                                                      timeout=opts.timeout))
        clock.mark("commit")
        return ExportReport(path=path, rank=coord.rank, bytes_written=written.bytes_written,
                            bytes_sent=written.bytes_sent,
                            sent_by_group=_sent_by_group(planned.plan, run.layout, coord.rank), plan_cached=hit,
                            inner_chunk_bytes=planned.inner_chunk_bytes,
                            timings={**clock.steps, "d2h_wait": written.staging.d2h_wait_s,
                                     "commit_wait": written.commit_wait_s},
                            staging=written.staging)

    def settle(self) -> None:
        """Wait for the asynchronous export still in flight, if any; raise its failure (every rank
        raises the same one). Every export calls it first: one staging set, one export at a time."""
        handle, self._inflight = self._inflight, None
        if handle is not None:
            handle.wait()

    def export_async(self, dst: str, run: LiveRun, params: Sequence[LocalParam], options: ExportOptions | None = None,
                     *, on_stage: Callable[[str], None] | None = None,
                     on_commit: Callable[[str], None] | None = None) -> ExportHandle:
        """`export` that returns once this rank's bytes are in host memory (collective over `run.group`).

        In the call: the export in flight, if any, is waited for (its failure raised); planning and the
        claim as `export`; the exchange between ranks, if the plan moves bytes; every byte this rank
        writes copied into the staging slots (`SharedSlots`: shared memory, pinned for CUDA data, kept
        for the next export). Then the tensors may change: the checkpoint holds the state at the call,
        bit for bit. In the background: writes and digests in the exporter's writer process (started by
        the first asynchronous export, reused: `bridge.live.writer_process`), the ranks' meeting and
        rank 0's commit on a thread (over a gloo group of their own, `background_group`). Returns an `ExportHandle` (`wait()`, `done()`); a failure
        is raised by its `wait()` and by this exporter's next export, on every rank, naming the rank.
        `options.staging_bytes` bounds the slots (the call then also waits for the writer to free
        slots). `on_stage` is called as in `export`, plus "staged" (the call's copies are done) and,
        in the background thread, "writing" (the first batch went to the writer). `on_commit(path)`
        runs on rank 0 in the background right after the commit, as part of it (its failure is the
        commit's, raised on every rank; e.g. a run directory's tracker file).
        """
        self.settle()
        t_call = time.perf_counter()
        opts = options or ExportOptions()
        seams = _testing.current()  # read on the caller's thread: the background writer uses them too
        dst = location(dst, "export destination")
        group = run.group if run.group is not None else dist.group.WORLD
        coord = TorchCoordinator(group, job=f"export to {dst}")
        ranks = tuple(dist.get_process_group_ranks(group))
        if ranks not in self._bg_groups:  # a collective: the first asynchronous export creates it
            self._bg_groups[ranks] = background_group(group, timeout=opts.timeout)
        bg = TorchCoordinator(self._bg_groups[ranks], job=f"export to {dst}")
        clock = _Clock()
        holdings, planned, hit = self._agree_plan(params, run, coord, opts, clock)
        manifest = _manifest(run, planned.fused, planned.pads)
        clock.mark("plan")
        claim = begin_checkpoint(dst, coordinator=coord)
        tmp = claim.tmp
        clock.mark("begin")
        try:
            job = self._stage(planned, holdings, run, coord, clock, on_stage, opts)
        except BaseException:
            claim.release()  # rank 0's removes what this run wrote; the other ranks' handles remove nothing
            raise

        if seams.writer_class is None:
            # Started (or restarted) here, on the caller's thread, not on the background one: the
            # writer dies with the thread that started it (bridge.worker_life.die_with_parent).
            self.writer.ensure()

        def background() -> ExportReport:
            if seams.writer_class is None:
                written = _write_in_process(job, planned, run, tmp, bg.rank, opts, on_stage, seams, self.writer,
                                            self.slots.shared)
            else:  # a test's writer class lives in this process: the thread writer runs it
                written = _write_staged(job, planned, run, tmp, bg.rank, opts, on_stage, seams)
            clock.mark("finish")
            try:
                bg.all_gather("writing", written.outcome)  # every writer finished, or every rank raises
                clock.mark("barrier")

                def commit() -> str:
                    path = commit_checkpoint(claim, planned.wplan, manifest, timeout=opts.timeout)
                    if on_commit is not None:
                        on_commit(path)
                    return path

                path = bg.broadcast("the commit", commit)
            except BaseException:
                claim.release()  # rank 0's: nothing of this run stays
                raise
            finally:
                written.failed.clear()
            clock.mark("commit")
            return ExportReport(path=path, rank=coord.rank, bytes_written=written.bytes_written,
                                bytes_sent=job.bytes_sent, sent_by_group=_sent_by_group(planned.plan, run.layout,
                                                                                        coord.rank),
                                plan_cached=hit, inner_chunk_bytes=planned.inner_chunk_bytes,
                                timings={**clock.steps, "d2h_wait": job.d2h_wait_s, "commit_wait": written.commit_wait_s,
                                         "blocked": job.staged_at - t_call, "slot_wait": job.ring.wait_s},
                                staging=StagingStats(written.calls, job.stats.held_bytes, job.staged_bytes,
                                                     job.d2h_wait_s, True))

        handle = ExportHandle(dst, background, staging=job.stats)
        job.start_writer = handle.start
        self._inflight = handle
        job.run_foreground()
        handle.blocked_s = job.staged_at - t_call
        return handle

    def _stage(self, planned: _Planned, holdings: list[Holding], run: LiveRun, coord: TorchCoordinator, clock: _Clock,
               on_stage: Callable[[str], None] | None, opts: ExportOptions) -> "_StageJob":
        """The exchange (in the foreground, on the export group) and the batches to copy into the slots.

        All exchange happens here, before the call returns, on the caller's thread: the ranks call the
        export at the same point of their loops, so this collective never interleaves with the
        training's own (the background thread issues none on the training's groups).
        """
        plan, rank = planned.plan, coord.rank
        failed: list[BaseException] = []
        attempt = _attempter(failed)
        recv, work, bytes_sent = _start_exchange(planned, holdings, coord, attempt, on_stage, clock)
        with coord.guard("the exchange"):
            work.wait()
        del work   # the send buffer goes with its collective
        clock.mark("exchange_wait")
        if on_stage:
            attempt(lambda: on_stage("exchanged"))
        dtypes = {a.name: torch_dtype(a.dtype) for a in plan.catalog}
        items = attempt(lambda: [WriteItem(t.array, t.box, _piece_tensor(holdings[t.src.holding], t))
                                 for t in plan.sends(rank, rank)] + _received_items(plan, recv, rank, dtypes)) or []
        order = {name: i for i, name in enumerate(planned.wplan.arrays)}
        items.sort(key=lambda it: (order[it.name], _first_chunk(planned.wplan, it), it.box.start))
        batch = export_split(opts.budget, opts.commit_depth).batch if opts.budget else default_batch_bytes(False)
        recipe = planned.recipes.get(batch)
        if recipe is None and not failed:
            recipe = attempt(lambda: Recipe.of(items, planned.wplan, batch))
            if recipe is not None:
                planned.recipes[batch] = recipe
        nbatch = len(recipe.runs) if recipe is not None and not failed else 0
        size = recipe.slot_bytes if recipe is not None else slot_size(batch, 0)
        count = max(1, nbatch)
        if opts.staging_bytes is not None:
            bound = int(opts.staging_bytes) // size
            if bound < 2:  # reported at the ranks' meeting (another rank's batches may fit)
                failed.append(BridgeError(f"rank {rank}: staging_bytes={opts.staging_bytes} holds fewer than two "
                                          f"staging slots of {size} bytes (a batch of whole chunks); raise it to at "
                                          f"least {2 * size}"))
                nbatch = 0
            count = max(1, min(count, bound))
        cuda = any(it.data.is_cuda for it in items)
        slots, alloc_s = self.slots.get(count, size, pinned=cuda and torch.cuda.is_available())
        stats = SnapshotStats(size, count, self.slots.held_bytes(), self.slots.pinned, self.slots.allocations, alloc_s,
                              sum(map(len, recipe.runs[:nbatch])) if recipe else 0,
                              sum(map(len, recipe.pieces[:nbatch])) if recipe else 0)
        # The writer keeps `depth` commits in flight; a slot comes back once its commit landed, so
        # with `count` slots at most count - 1 may be in flight for the copier to make progress.
        return _StageJob(Snapshot(SlotRing(slots), cuda, recipe, items), nbatch, stats, failed, bytes_sent, recv,
                         on_stage, clock,
                         depth=max(1, min(opts.commit_depth, count - 1)))

    def _holdings(self, params: Sequence[LocalParam], run: LiveRun, rank: int) -> tuple[list[Holding], _Local]:
        """This rank's holdings (current tensors) and its summary, reusing the pieces of an equal signature."""
        sig = holdings_signature(params, run.layout, rank, run.optimizer is not None)
        cached = self._local.get(sig)
        if cached is not None:
            return refresh_holdings(cached.holdings, params), cached
        holdings, summary = _summary(params, run, rank)
        template = [Holding(h.root, h.param, torch.empty(0, dtype=h.data.dtype), h.pieces, h.main_replica, h.slot)
                    for h in holdings]  # no reference to the tensors: the cache must not keep them alive
        entry = _Local(template, summary, hashlib.sha256(repr(sig).encode()).hexdigest())
        self._local.put(sig, entry)
        return holdings, entry

    def _agree_plan(self, params: Sequence[LocalParam], run: LiveRun, coord: TorchCoordinator, opts: ExportOptions,
                    clock: _Clock) -> tuple[list[Holding], _Planned, bool]:
        """This rank's holdings, the plan every rank computes alike, and whether it came from the cache.

        Round 1 gathers signature digests only (any rank's bad input is raised on every rank here,
        before anything is written); round 2 (full summaries) runs only when some rank lacks the plan.
        """
        rank, world = coord.rank, coord.world
        mine: dict = {}

        def holdings() -> dict:
            if rank != run.rank:
                raise BridgeError(f"LiveRun.rank is {run.rank} but this process is rank {rank} of the export group")
            if run.layout.world != world:
                raise BridgeError(f"layout world size {run.layout.world} != process group size {world}; "
                                  "pass the group the layout describes")
            mine["holdings"], mine["local"] = self._holdings(params, run, rank)
            clock.mark("holdings")
            return {"key": mine["local"].key, "cached": self._plans.keys()}

        keys = coord.all_gather("planning", holdings)
        local: _Local = mine["local"]
        gkey = plan_key([k["key"] for k in keys], world=world, chunk=opts.target_chunk_bytes,
                        compression=opts.compression, inner=opts.inner_chunk_bytes, optim=run.optimizer is not None)
        planned = self._plans.get(gkey) if all(gkey in k["cached"] for k in keys) else None
        if planned is not None:
            clock.mark("gather")
            return mine["holdings"], planned, True
        summaries = [RankSummary.from_json(s) for s in coord.all_gather("planning", lambda: local.summary.to_json())]
        clock.mark("gather")
        planned = _plan(summaries, run, world, opts.target_chunk_bytes, opts.compression, opts.inner_chunk_bytes)
        self._plans.put(gkey, planned)
        return mine["holdings"], planned, False


def export_state(dst: str, run: LiveRun, params: Sequence[LocalParam], options: ExportOptions | None = None, *,
                 exporter: Exporter | None = None, on_stage: Callable[[str], None] | None = None,
                 **fields) -> ExportReport:
    """Write this run's full training state to the logical checkpoint `dst` (collective call).

    Every rank of `run.group` (None: the default world group; any subgroup works) calls it with the
    same `dst` and options and its own `params`. `options` (`ExportOptions`; keyword arguments
    named like its fields override them, e.g. `target_chunk_bytes=64`) say how to write.
    `exporter` (an `Exporter`) keeps the plan and the staging buffers for the next export: a later
    export whose ranks hold parameters of the same geometry, shapes, dtypes and optimizer ranges
    (values may differ) with the same options reuses the plan; without one, nothing is kept.
    `on_stage(name)` is called after "planned", "exchanged", "written"; an error it raises is a
    failure of this rank. Returns this rank's `ExportReport`; raises BridgeError on every rank if
    any rank's input is bad or any rank fails.
    """
    return (exporter or Exporter()).export(dst, run, params, _options(options, fields), on_stage=on_stage)


def export_state_async(dst: str, run: LiveRun, params: Sequence[LocalParam], options: ExportOptions | None = None, *,
                       exporter: Exporter | None = None, on_stage: Callable[[str], None] | None = None,
                       on_commit: Callable[[str], None] | None = None, **fields) -> ExportHandle:
    """`export_state` that returns once this rank's bytes are in host memory (collective call).

    The rest (writes, digests, the commit) runs in the background; returns an `ExportHandle`
    (`wait()`, `done()`; see `Exporter.export_async`). Pass the same `exporter` every time: it keeps
    the staging slots (pinned memory is slow to allocate) and waits for the export in flight before
    the next one. Options and keywords as `export_state`'s (`staging_bytes` bounds the slots).
    """
    return (exporter or Exporter()).export_async(dst, run, params, _options(options, fields), on_stage=on_stage,
                                                 on_commit=on_commit)


_FORMER_NAMES = {"inflight_bytes", "device_commits"}  # still accepted as keyword overrides (with a DeprecationWarning)


def _options(options: ExportOptions | None, fields: dict) -> ExportOptions | None:
    """`options` with keyword overrides named like `ExportOptions` fields (unknown names refused)."""
    if not fields:
        return options
    names = {f.name for f in dataclasses.fields(ExportOptions)} | _FORMER_NAMES
    bad = sorted(set(fields) - names)
    if bad:
        raise BridgeError(f"export_state: unknown option {bad[0]!r}; the options are {', '.join(sorted(names))}")
    return dataclasses.replace(options or ExportOptions(), **fields)


def _exchange_and_write(planned: _Planned, holdings: list[Holding], run: LiveRun, tmp: str, coord: TorchCoordinator,
                        clock: _Clock, on_stage: Callable[[str], None] | None, opts: ExportOptions,
                        buffers: HostBuffers, seams: _testing.Seams) -> "_Written":
    """Move every piece to its chunk owner and write the chunks this rank owns (steps pack..barrier).

    The exchange is one all_to_all over flat byte buffers; on CPU this rank's own pieces are
    written while it runs. A failure here does not skip a collective: this rank still joins the
    exchange, then reports the failure when the ranks meet ("writing"), where every rank raises it.
    When this returns every rank's writer has finished (its report is published).
    """
    plan, wplan = planned.plan, planned.wplan
    rank = coord.rank
    failed: list[BaseException] = []
    attempt = _attempter(failed)
    recv, work, bytes_sent = _start_exchange(planned, holdings, coord, attempt, on_stage, clock)
    dtypes = {a.name: torch_dtype(a.dtype) for a in plan.catalog}
    local_items = attempt(lambda: [WriteItem(t.array, t.box, _piece_tensor(holdings[t.src.holding], t))
                                   for t in plan.sends(rank, rank)]) or []
    # Device data goes through the donated staging pipeline (commit_depth + 2 pinned buffers of one
    # batch, each refilled once its commit landed). Host data is donated as is: two in flight.
    # CPU holdings with a device exchange (NCCL) stage everything after the exchange, so that no
    # flush of the staging pipeline falls between a chunk's local and received pieces.
    on_host = not seams.stage_all and not recv.is_cuda and not any(it.data.is_cuda for it in local_items)
    depth = 2 if on_host else opts.commit_depth
    mem = (export_split(opts.budget, depth) if opts.budget
           else staged_split(open_storage(tmp).default_batch_bytes(), depth))  # bridge.budget: the one split
    order = {name: i for i, name in enumerate(wplan.arrays)}
    with progress(plan.written_bytes(rank), f"export rank {rank}") as bar:
        # CPU items (views of the holdings and of `recv`) stay alive until the writer has finished, so
        # it references them instead of copying (donate); so does every staged buffer.
        writer = attempt(lambda: StagedWriter(
            _store_writer(seams, tmp, wplan, rank, batch_bytes=mem.batch, digest=opts.digest, depth=depth),
            mem.staging, stage_all=seams.stage_all, buffers=buffers,
            on_bytes=bar.update))

        def write_all(items: list[WriteItem]) -> None:
            # A chunk's pieces together, chunk after chunk: the writer writes each chunk in one transaction.
            writer.write_items(sorted(items, key=lambda it: (order[it.name], _first_chunk(wplan, it), it.box.start)))

        if on_host:
            attempt(lambda: write_all(local_items))  # overlaps the exchange (gloo runs it on its own thread)
        clock.mark("write_local")
        with coord.guard("the exchange"):
            work.wait()
        del work   # the send buffer goes with its collective
        clock.mark("exchange_wait")
        if on_stage:
            attempt(lambda: on_stage("exchanged"))

        def write_rest() -> None:
            recv_items = _received_items(plan, recv, rank, dtypes)
            write_all(recv_items if on_host else local_items + recv_items)
            if rank == 0:
                writer.write(STEP_PATH, Box((), ()), np.asarray(run.step, dtype=SCALAR_DTYPE))
                if run.optimizer is not None:
                    writer.write(COUNT_PATH, Box((), ()), np.asarray(run.step, dtype=SCALAR_DTYPE))
            clock.mark("write_recv")
            writer.finish()

        attempt(write_rest)
    recv = local_items = None  # the writer has finished with them
    clock.mark("finish")
    if on_stage:
        attempt(lambda: on_stage("written"))

    def outcome() -> None:
        if failed:
            raise failed[0]

    try:
        coord.all_gather("writing", outcome)  # the one barrier: every writer finished, or every rank raises
    finally:
        failed.clear()  # the kept error's traceback runs through `attempt`, which holds this list: no cycle
    return _Written(writer.writer.bytes_written, bytes_sent, writer.writer.commit_wait_s, writer.stats())


def _first_chunk(wplan: WritePlan, item: WriteItem) -> tuple[int, ...]:
    """Grid index of the outer chunk holding the first element of `item`'s box."""
    own = wplan.lookup(item.name).ownership
    return tuple(s // max(1, c) for s, c in zip(item.box.start, own.chunk_shape))




def _attempter(failed: list[BaseException]) -> Callable[[Callable[[], object]], object]:
    """`attempt(fn)`: run `fn` unless an earlier step failed here; keep the first failure in `failed`
    (reported where the ranks meet, so a failing rank still joins every collective) and return None."""

    def attempt(fn: Callable[[], object]) -> object:
        if failed:
            return None
        try:
            return fn()
        except Exception as e:
            failed.append(e)
            return None

    return attempt


class _StageJob:
    """One asynchronous export's staging on this rank: the caller's thread copies the batches into
    ring slots (`run_foreground`) and queues them; the background writer (`_write_staged`) takes them
    from the queue and gives each slot back once the store let go of it."""

    def __init__(self, snapshot: Snapshot, nbatch: int, stats: SnapshotStats, failed: list[BaseException],
                 bytes_sent: int, recv: torch.Tensor, on_stage: Callable[[str], None] | None, clock: _Clock,
                 depth: int) -> None:
        self.nbatch = nbatch
        self.ring = snapshot.ring
        self.snapshot = snapshot
        self.stats = stats
        self.failed = failed
        self.bytes_sent = bytes_sent
        self._recv = recv          # the exchange's receive buffer: items are views of it until copied
        self.on_stage = on_stage
        self.clock = clock
        self.depth = depth
        self.queue: "queue.Queue[StagedBatch | None]" = queue.Queue()
        self.start_writer: Callable[[], object] = lambda: None
        self.d2h_wait_s = 0.0
        self.staged_bytes = 0
        self.staged_at = 0.0   # time.perf_counter() when the copies were done (the call returns)

    def run_foreground(self) -> None:
        """Copy every batch (waiting for free slots when they are bounded), then wait for the copies."""
        # With a slot for every batch the writer starts once the copies are launched: a writer thread
        # running meanwhile takes the GIL from the thread launching them (measured on the H200: 8.5 s
        # instead of the copies' fraction of a second). With bounded slots it must free slots meanwhile.
        bounded = len(self.ring.slots) < self.nbatch
        if bounded:
            self.start_writer()
        try:
            for k in range(self.nbatch):
                if self.failed:
                    break
                try:
                    self.queue.put(self.snapshot.stage(k))
                except Exception as e:
                    self.failed.append(e)
        finally:
            self.d2h_wait_s = self.snapshot.sync()  # from here on the caller may change its tensors
            self.staged_bytes = self.snapshot.staged_bytes
            self._recv = None
            self.nbatch = 0
            self.clock.mark("staged")
            self.staged_at = time.perf_counter()
            if self.on_stage:
                _attempter(self.failed)(lambda: self.on_stage("staged"))
            self.queue.put(None)  # after every foreground failure is recorded: the writer reports them
            if not bounded:
                self.start_writer()


@dataclass
class _StagedWritten:
    """What the background writer did on this rank; `outcome()` raises its first failure (for the meeting)."""

    failed: list[BaseException]
    bytes_written: int
    calls: int
    commit_wait_s: float

    def outcome(self) -> None:
        if self.failed:
            raise self.failed[0]


# Elements per digest step of the live export's writers: they share the GIL with the training loop
# (and the writer's own thread), and each step takes it a few times (16x fewer steps than
# `digest_box`'s default; the digest does not depend on the step).
LIVE_DIGEST_STEP = 1 << 20


def _store_writer(seams: _testing.Seams, tmp: str, wplan: WritePlan, rank: int, *, batch_bytes: int,
                  digest: bool, depth: int) -> CheckpointWriter:
    """This rank's store writer (the class, staging and data file size as the testing seams say)."""
    return (seams.writer_class or CheckpointWriter)(
        tmp, wplan, rank, batch_bytes=batch_bytes, compute_digest=digest, commit_depth=depth,
        staging=seams.writer_staging, target_data_file_size=seams.target_data_file_size,
        digest_step=LIVE_DIGEST_STEP)


def _write_in_process(job: _StageJob, planned: _Planned, run: LiveRun, tmp: str, rank: int, opts: ExportOptions,
                      on_stage: Callable[[str], None] | None, seams: _testing.Seams, proc: WriterProcess,
                      slots: Sequence) -> _StagedWritten:
    """The background part on this rank by the exporter's writer process (out of the training's GIL:
    bridge/live/writer_process.py): the same store writer, batches and slot releases as
    `_write_staged`. Failures are kept, not raised."""
    begin = {"tmp": tmp, "plan": planned.wplan, "rank": rank, "batch_bytes": 2 * job.stats.slot_bytes,
             "compute_digest": opts.digest, "depth": job.depth, "staging": seams.writer_staging,
             "target_data_file_size": seams.target_data_file_size, "digest_step": LIVE_DIGEST_STEP}
    scalar = np.dtype(SCALAR_DTYPE).name
    scalars = [] if rank != 0 else [(STEP_PATH, int(run.step), scalar)] + (
        [(COUNT_PATH, int(run.step), scalar)] if run.optimizer is not None else [])
    on_first = (lambda: on_stage("writing")) if on_stage else None
    nbytes, calls, wait_s = write_in_process(proc, job, slots, begin, scalars, on_first)
    if on_stage:
        _attempter(job.failed)(lambda: on_stage("written"))
    return _StagedWritten(job.failed, nbytes, calls, wait_s)


def _write_staged(job: _StageJob, planned: _Planned, run: LiveRun, tmp: str, rank: int, opts: ExportOptions,
                  on_stage: Callable[[str], None] | None, seams: _testing.Seams) -> _StagedWritten:
    """The background writer: each staged batch donated to the store writer as one transaction,
    `job.depth` commits in flight; a batch's slot is released once its commit landed (after the
    flush of the batch `depth` later: see `CheckpointWriter.flush`). Failures are kept, not raised."""
    failed = job.failed
    attempt = _attempter(failed)
    writer = attempt(lambda: _store_writer(seams, tmp, planned.wplan, rank, batch_bytes=2 * job.stats.slot_bytes,
                                           digest=opts.digest, depth=job.depth))
    inflight: deque[int] = deque()
    calls = 0
    while (staged := job.queue.get()) is not None:
        if not failed:
            try:
                staged.wait()
                pieces = staged.items()
                for it in pieces:
                    writer.write(it.name, it.box, to_numpy(it.data), donate=True)
                writer.flush(wait=False)
                calls += len(pieces)
                del pieces
                if on_stage and calls == len(staged.pieces):
                    on_stage("writing")
            except Exception as e:
                failed.append(e)
                job.ring.close(e)  # a copier waiting for a slot stops too
        inflight.append(staged.slot)
        while len(inflight) > (0 if failed else job.depth):
            job.ring.release(inflight.popleft())

    def finish() -> None:
        if rank == 0:
            writer.write(STEP_PATH, Box((), ()), np.asarray(run.step, dtype=SCALAR_DTYPE))
            if run.optimizer is not None:
                writer.write(COUNT_PATH, Box((), ()), np.asarray(run.step, dtype=SCALAR_DTYPE))
        writer.finish()

    attempt(finish)  # every commit landed: no slot is referenced any more
    while inflight:
        job.ring.release(inflight.popleft())
    if on_stage:
        attempt(lambda: on_stage("written"))
    return _StagedWritten(failed, writer.bytes_written if writer is not None else 0, calls,
                          writer.commit_wait_s if writer is not None else 0.0)
