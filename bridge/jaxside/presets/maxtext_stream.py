"""The maxtext preset, streamed: logical checkpoint <-> MaxText train state, chunk by chunk within a budget.

    write_maxtext(src, root)      # logical -> MaxText CheckpointManager step <root>/<count - 1>/items
    read_maxtext(src, dst)        # MaxText root / step dir / items dir -> logical checkpoint

Both read blocks of the source with the store's reader and write every output chunk once, whole,
with the store's writer (one writer per chunk; `maxtext_plan` cuts the outputs on their chunk
grid so that each chunk is one box of one source array), in worker processes that share
`budget` bytes as `convert`'s do; the parent plans and makes the one commit. The tree written
is the tree `maxtext_ckpt.train_state` builds (params/params, optax.adamw's state with its empty
weight-decay node, step) in the store's Orbax layout; to-maxtext's step directory is made the way
Orbax's v1 `training.Checkpointer` makes it (`_CHECKPOINT_METADATA` naming the `items` PyTree
handler, `commit_success.txt`) plus the preset's sidecar. Local paths, s3:// and gs://.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from bridge.errors import BridgeError
from bridge.torchrun import launched_world
from bridge.worker_life import die_with_parent, testing_hold
from bridge.format import schema
from bridge.jaxside.presets.maxtext import (Dims, Hyper, Options, _value_forward, _value_inverse, block_for,
                                           check_llama, maxtext_moe_module, maxtext_overrides)
from bridge.jaxside.presets.maxtext_job import StreamOutput, StreamWriterJob, plan_job
from bridge.jaxside.presets.maxtext_moe import block_of_module, logical_topk
from bridge.jaxside.presets.maxtext_plan import (MT_ADAM, Move, arrange_block,
                                                moves_from_maxtext, moves_to_maxtext, source_box)
from bridge.format.manifest import Manifest
from bridge.jaxside.presets.maxtext_schedule import MaxTextRunSchedule, ScheduleOptions, plan_schedule, with_scheduler
from bridge.layout.boxes import Box
from bridge.location import absolute, basename, location
from bridge.budget import ShareSplit, per_worker, split_share
from bridge.machine import MIN_BYTES_PER_WORKER, default_budget, default_workers, mem_available, return_freed_memory
from bridge.jaxside.presets.maxtext_ckpt import ITEMS, SIDECAR
from bridge.progress import progress

Path = tuple[str, ...]
# What Orbax's v1 training.Checkpointer records for MaxText's `items` (tests/fixtures/maxtext/fresh_maxtext).
ITEMS_HANDLER = "orbax.checkpoint.experimental.v1._src.handlers.pytree_handler.PyTreeHandler"
MT_COUNT: Path = MT_ADAM + ("count",)  # foreign: maxtext / optax tree
MT_SCHEDULE_COUNT: Path = ("opt_state", "2", "count")   # foreign: maxtext / optax tree; optax ScaleByScheduleState.count (MaxText's lr schedule)
MT_STEP: Path = ("step",)  # foreign: maxtext / optax tree
MT_EMPTY: Path = ("opt_state", "1")                     # foreign: maxtext / optax tree; adamw's weight-decay state: empty


@dataclass(frozen=True)
class StreamOptions:
    """Resources of a streamed conversion, as `convert`'s: writer processes and the bytes they share."""

    workers: int | None = None          # None: default_workers()
    budget: int | None = None           # bytes for all processes together; None: default_budget()
    show_progress: bool | None = None
    announce: Callable[[str], None] | None = None
    min_worker_bytes: int = MIN_BYTES_PER_WORKER   # fewer workers than asked for a small state (convert's rule)


def _split(budget: int, workers: int) -> ShareSplit:
    """Each writer's share of the budget, split as `convert`'s (`bridge.budget.split_share`); one
    output chunk in hand is the block, cut no smaller than 4 KiB."""
    return split_share(per_worker(budget, workers), min_block=4 << 10)


# ------------------------------------------------------------------------------------ planning


def check_sources(moves: Sequence[Move], shapes: Mapping[Path, Sequence[int]], where: str) -> None:
    """Every source array has the shape its layout needs (else a block would read a wrong region)."""
    from bridge.jaxside.presets.maxtext import pattern_shape

    for m in moves:
        want = pattern_shape(m.src_pattern, m.sizes)     # (a stacked source whole, when a layer is taken)
        for src in m.sources:
            got = tuple(int(x) for x in shapes[src])
            if got != want:
                raise BridgeError(f"{where}: array {'/'.join(src)} has shape {got}, the {m.src_pattern!r} layout "
                                  f"of this model needs {want}")


# ------------------------------------------------------------------------------------ execution


def transform(move: Move, block: np.ndarray, dims: Dims, opts: Options, forward: bool) -> np.ndarray:
    """The preset's value transform of one block (elementwise or along D, which blocks hold whole)."""
    f = _value_forward if forward else _value_inverse
    return np.ascontiguousarray(f(block, move.leaf, move.kind, dims, opts), dtype=move.dtype)


def write_blocks(wj: StreamWriterJob, tmp: str, writer_id: int, on_progress=None) -> dict:
    """Writer `writer_id`'s blocks of `wj` into the claimed temporary directory `tmp`: read each
    source box, rearrange, transform, write; its report."""
    from bridge.store import open_checkpoint, CheckpointWriter

    return_freed_memory()
    job = wj.job
    ck = open_checkpoint(wj.src)
    writer = CheckpointWriter(tmp, job.plan, writer_id, batch_bytes=wj.share.batch)
    for (i, box), w in zip(job.blocks, job.owners):
        if w != writer_id:
            continue
        m = job.moves[i]
        path, sbox = source_box(m, box)
        y = transform(m, arrange_block(m, box, ck.read(path, sbox)), wj.dims, wj.opts, wj.forward)
        writer.write(m.dst, box, y, donate=True)
        if on_progress:
            on_progress(y.nbytes)
        del y
        testing_hold(writer_id)
    if writer_id == 0:
        for p, a in wj.scalars.items():
            writer.write(p, Box((), ()), np.asarray(a))
    return writer.finish(publish=False)


def _worker_main(q, wj: StreamWriterJob, tmp: str, w: int) -> None:  # pragma: no cover - subprocess
    die_with_parent()   # a SIGKILLed command leaves no writer behind
    try:
        rep = write_blocks(wj, tmp, w, on_progress=lambda n: q.put(("p", w, n)))
        q.put(("ok", w, rep))
        q.close()
        q.join_thread()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)   # skip the interpreter's teardown (TensorStore's objects): the parent waits for it
    except BridgeError as e:
        q.put(("err", w, f"writer {w}: {e}"))
    except BaseException as e:  # noqa: BLE001 - any crash as one line
        q.put(("err", w, f"writer {w} crashed: {type(e).__name__}: {e}".splitlines()[0]))
        traceback.print_exc(file=sys.stderr)


def run_job(wj: StreamWriterJob, out: StreamOutput, ranks=None) -> str:
    """Claim `out.dst`, run the writers of `wj` (in process for one), commit once; returns dst. Under
    torchrun (`ranks`, a `bridge.torchrun.Ranks`, or a launch this call joins) this rank's share of
    the writers."""
    from bridge.store import claim_destination, commit_checkpoint
    from bridge.torchrun import command_ranks

    job = wj.job

    def write_share(tmp: str, ids, bar) -> list[dict]:
        if len(ids) == 1:   # one writer here: in this process
            return [write_blocks(wj, tmp, ids[0], bar.update)]
        return _run_parallel(wj, tmp, ids, bar) if ids else []

    def commit(claim, reports: list[dict]) -> str:
        return commit_checkpoint(claim, job.plan, out.manifest, timeout=60.0, reports=reports)

    if ranks is not None or launched_world() > 1:   # a rank of a torchrun launch: its share of the writers
        from bridge.jaxside.presets.maxtext_ranks import run_job_ranks

        if ranks is not None:
            return run_job_ranks(ranks, wj, out, write_share, commit)
        with command_ranks(f"{out.label.split()[0]} to {out.dst}") as joined:
            return run_job_ranks(joined, wj, out, write_share, commit)
    with claim_destination(out.dst, sources=[wj.src]) as claim:
        with progress(job.nbytes, out.label, enabled=out.show_progress) as bar:
            reports = write_share(claim.tmp, list(range(job.workers)), bar)
        return commit(claim, reports)


def _run_parallel(wj: StreamWriterJob, tmp: str, ids: Sequence[int], bar) -> list[dict]:
    """One spawned process per writer id of `ids`, each sent `wj` once; their reports in id order."""
    ctx = mp.get_context("spawn")   # TensorStore aborts in a forked child once the parent used it
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker_main, args=(q, wj, tmp, w), daemon=True) for w in ids]
    done: dict[int, dict] = {}
    errors: list[str] = []
    try:
        for p in procs:
            p.start()
        while len(done) < len(procs) and not errors:
            try:
                kind, w, payload = q.get(timeout=1.0)
            except Exception:  # queue.Empty: is a writer gone without a word?
                # by writer id (a torchrun rank's ids do not start at 0), as `done` is keyed
                dead = [(w, p.exitcode) for w, p in zip(ids, procs) if w not in done and p.exitcode not in (0, None)]
                if dead and q.empty():
                    errors.append(f"writer {dead[0][0]} died with exit code {dead[0][1]}")
                continue
            if kind == "p":
                bar.update(payload)
            elif kind == "ok":
                done[w] = payload
            else:
                errors.append(payload)
    finally:
        if len(done) < len(procs):   # an error, Ctrl-C or SIGTERM: stop every writer before tmp goes
            for p in procs:
                if p.pid is not None and p.is_alive():
                    p.kill()
        for p in procs:
            if p.pid is not None:
                p.join()
    if errors:
        raise BridgeError(errors[0])
    return [done[w] for w in sorted(done)]


def resources(opts: StreamOptions, total_bytes: int) -> tuple[int, int]:
    """(workers, budget) as `convert` picks them (under torchrun the defaults take this rank's part
    of the host: `bridge.torchrun.host_ranks`); the announce line is printed by the caller."""
    from bridge.torchrun import host_ranks

    on_host = host_ranks()
    workers = default_workers((os.cpu_count() or 1) // on_host) if opts.workers is None else opts.workers
    if workers < 1:
        raise BridgeError(f"--workers must be >= 1, got {workers}")
    free = mem_available()
    budget = default_budget(workers, free and free // on_host) if opts.budget is None else opts.budget
    if budget < (64 << 10):
        raise BridgeError(f"--budget must be at least 64k, got {budget} bytes")
    return max(1, min(workers, -(-total_bytes // max(1, opts.min_worker_bytes)))), budget


def budget_line(cmd: str, workers: int, budget: int) -> str:
    """What the run will use, printed before it starts (as `convert` prints it).

    >>> budget_line("to-maxtext", 2, 1 << 30)
    'to-maxtext: 2 workers, budget 1.0 GiB (512.0 MiB each)'
    """
    from bridge.units import human_bytes

    each = "" if workers == 1 else f" ({human_bytes(budget // workers)} each)"
    return f"{cmd}: {workers} worker{'s' if workers != 1 else ''}, budget {human_bytes(budget)}{each}"


# ------------------------------------------------------------------------------------ to MaxText


def write_maxtext(src: str, dst_root: str, *, decoder_block: str | None = None, scan_layers: bool = True,
                  max_target_length: int | None = None, stream: StreamOptions | None = None,
                  num_experts_per_tok: int = 0, schedule: ScheduleOptions | None = None):
    """Write the logical checkpoint `src` as a step of MaxText checkpoint root `dst_root`.

    MaxText names a step directory by the index of the last step taken (`count - 1`) and stores
    `step = count` (the step it continues from), so Megatron's iteration n (n updates) becomes
    `<dst_root>/<n - 1>/` with `step = n`. Streamed chunk by chunk, never holding more than the budget
    of its data (`StreamOptions`: workers, budget, progress); local paths, s3:// or gs://.
    `decoder_block` None: qwen2 for a dense model, qwen3_moe for a mixture of experts (both exact);
    `num_experts_per_tok`: an MoE model's top-k when its manifest records no Megatron args.
    MaxText's lr schedule follows the Megatron run's recorded scheduler, or the one `schedule` gives
    (`maxtext_schedule.plan_schedule`); refused in one line where MaxText cannot express it.
    Returns a `maxtext_ckpt.Written`.
    """
    from bridge.jaxside.presets import maxtext_ckpt as mc
    from bridge.jaxside.manifest_view import scheduler_of
    from bridge.store import check_step_free, write_step, open_checkpoint

    stream = stream or StreamOptions()
    src, dst_root = absolute(location(src, "source")), absolute(location(dst_root, "destination"))
    ck = open_checkpoint(src)
    man = ck.manifest
    infos = ck.arrays()
    trees: dict[str, dict[Path, Any]] = {r: {} for r in mc.ROLES}
    for p, info in infos.items():
        sp = schema.split_role(p)
        if sp and sp[0] in trees:
            trees[sp[0]][sp[1]] = info
    count = mc._scalar(ck, schema.COUNT_PATH, "Adam count") if schema.COUNT_PATH in infos else None
    if not all(trees.values()) or count is None:
        raise BridgeError(f"{src} has no full Adam state (masters, both moments and the count); the maxtext preset "
                          f"writes the weights and the optimizer state together")
    args = mc._megatron_args(man)
    mc._check_megatron_args(args)
    shapes = {p: tuple(i.shape) for p, i in trees[schema.PARAMS].items()}
    dims = Dims.from_logical(shapes, mc._head_dim(man, args), topk=logical_topk(shapes, args, num_experts_per_tok))
    opts = Options(decoder_block=block_for(dims, decoder_block), scan_layers=scan_layers,
                   rotary_interleaved=bool(args.get("rotary_interleaved", False)))
    for role, tree in trees.items():
        check_llama(tree, dims)
        if role != schema.PARAMS and set(tree) != set(shapes):
            odd = sorted(set(tree) ^ set(shapes))[0]
            raise BridgeError(f"logical checkpoint's {role} and masters differ at {'/'.join(odd)}")
    hyper = mc.hyper_of(man, shapes)
    # untrusted: each array's stored metadata as the manifest records it, and what will be read against
    # the bytes stored, before any read
    role_paths = [p for p in infos if (schema.split_role(p) or ("",))[0] in trees]
    ck.check_read_bytes(sum(ck.checked_info(p).nbytes for p in role_paths), "the masters and moments")
    dtypes = {np.dtype(i.dtype).name for i in trees[schema.PARAMS].values()}
    dtype = dtypes.pop() if len(dtypes) == 1 else "float32"
    overrides = maxtext_overrides(dims, opts, hyper, max_target_length=max_target_length or args.get("seq_length"),
                                  norm_epsilon=float(args.get("norm_epsilon", args.get("layernorm_epsilon", 1e-5))),
                                  rotary_base=float(args.get("rotary_base", 10000)))
    planned = plan_schedule(scheduler_of(man), args, count, schedule or ScheduleOptions(), src)
    overrides.update(planned.settings)
    dir_step = max(count - 1, 0)
    check_step_free(dst_root, dir_step, ITEMS)   # MaxText checkpoints are never overwritten
    moves = moves_to_maxtext(trees[schema.PARAMS], dims, opts, dtype)
    check_sources(moves, {p: i.shape for p, i in infos.items()}, src)
    c32 = np.asarray(count, np.int32)   # optax's counts and MaxText's TrainState.step are int32
    scalars = {MT_COUNT: c32, MT_SCHEDULE_COUNT: c32, MT_STEP: c32}
    total = sum(m.nbytes for m in moves)
    workers, budget = resources(stream, total)
    share = _split(budget, workers)
    job = plan_job(moves, scalars, workers * launched_world(), share, empty_paths=[MT_EMPTY], stacked_outputs=False)
    if stream.announce:
        stream.announce(budget_line("to-maxtext", job.workers, budget))
    sidecar = {"format": 1, "options": asdict(opts), "dims": asdict(dims), "hyper": asdict(hyper),
               "overrides": overrides, "adam_count": count,
               "base_manifest": with_scheduler(man.to_json(), planned.record) if man is not None else None}
    now = time.time_ns()
    step_meta = {"item_handlers": {ITEMS: ITEMS_HANDLER}, "metrics": {}, "performance_metrics": {},
                 "init_timestamp_nsecs": now, "commit_timestamp_nsecs": now,
                 "custom_metadata": {"scan_layers": scan_layers}}
    from bridge.store import json_bytes

    writers = StreamWriterJob(src, job, share, dims, opts, forward=True, scalars=scalars)

    def write(item: str, ranks=None) -> int:
        run_job(writers, StreamOutput(item, None, f"to-maxtext {basename(dst_root)}", stream.show_progress),
                ranks=ranks)
        return dir_step

    files = {SIDECAR: json_bytes(sidecar)}
    def make_step(write_item) -> str:
        return write_step(dst_root, write_item, lambda s: s, step=dir_step, item=ITEMS, step_metadata=step_meta,
                          files=lambda _r: files, commit_marker=True)[1]

    if launched_world() > 1:   # torchrun: rank 0 makes the step, every rank writes a share of its item
        from bridge.jaxside.presets.maxtext_ranks import write_step_ranks

        step_dir = write_step_ranks(f"to-maxtext to {dst_root}", write, make_step)
    else:
        step_dir = make_step(write)
    return mc.Written(step_dir=step_dir, step=count, overrides=overrides, dims=dims, options=opts,
                      notes=planned.notes)


# ------------------------------------------------------------------------------------ from MaxText


def read_maxtext(src: str, dst: str, *, hyper: Hyper | None = None, options: Options | None = None,
                 rotary_base: float | None = None, norm_epsilon: float | None = None,
                 stream: StreamOptions | None = None, topk: int = 0,
                 schedule: MaxTextRunSchedule | None = None) -> dict:
    """Write a MaxText checkpoint (root / step dir / items dir) as the logical checkpoint `dst`.

    A checkpoint `write_maxtext` made carries its sidecar (preset options, hyper-parameters, the base
    manifest: Megatron's records come back). Any other MaxText checkpoint needs `hyper` (its AdamW
    settings; the no-decay set defaults to the norms, Megatron's rule), for the llama2 block
    `options=Options(decoder_block="llama2")` (the query scale is unfolded) and, for an MoE tree,
    `topk` (MaxText's num_experts_per_tok; the block is told by the tree). Streamed chunk by chunk
    within a budget (`StreamOptions`); local paths, s3:// or gs://. `schedule` (the MaxText run's lr
    schedule) is recorded as the Megatron scheduler to-megatron writes (else a sidecar's comes back).
    """
    from bridge.jaxside.presets import maxtext_ckpt as mc
    from bridge.jaxside.presets.maxtext import active_table
    from bridge.store import open_checkpoint

    stream = stream or StreamOptions()
    src, dst = absolute(location(src, "source")), absolute(location(dst, "destination"))
    items = mc.find_items(src)
    side = mc.read_sidecar(items)
    ck = open_checkpoint(items)
    infos = ck.arrays()
    # untrusted: every leaf's metadata checked (shapes from the model's sizes, floating dtypes, the
    # bytes to read against the bytes stored) before any read; count and step range-checked
    moment_roots = {MT_ADAM + (m, mc.MT_MOMENT_ROOT): m for m in schema.MOMENTS}
    roles = {p: ((schema.PARAMS, p[2:]) if p[:2] == mc.MT_PARAMS else (moment_roots[p[:4]], p[4:]))
             for p in infos if p[:2] == mc.MT_PARAMS or p[:4] in moment_roots}
    mc._check_tree(ck, items, {p: ck.checked_info(p) for p in roles}, roles, side, topk)
    params = {p[2:]: tuple(i.shape) for p, i in infos.items() if p[:2] == mc.MT_PARAMS}
    count = mc._scalar(ck, MT_COUNT, "Adam count") if MT_COUNT in infos else None
    if count is None or not any(p[:3] == MT_ADAM + (schema.MU,) for p in infos):
        raise BridgeError(f"{items} holds no Adam state (moments and count); the maxtext preset needs MaxText's "
                          f"adamw state (opt_type=adamw)")
    step = mc._scalar(ck, MT_STEP, "step") if MT_STEP in infos else count  # foreign: the name in messages
    dims, scanned = Dims.from_maxtext(params, topk=side.dims.topk if side is not None else topk)
    if side is not None:
        opts = side.options
        hyper = hyper or side.hyper
        rotary_base = rotary_base or side.overrides.get("rope_max_timescale", 10000.0)
        norm_epsilon = norm_epsilon or side.overrides.get("normalization_layer_epsilon", 1e-5)
    else:
        module = maxtext_moe_module(params)
        # an MoE tree names its block by its module; a dense tree cannot tell llama2 from qwen2
        opts = options or Options(decoder_block=block_of_module(module) if module else "qwen2")
        block_for(dims, opts.decoder_block)
        if module and opts.decoder_block != block_of_module(module):
            raise BridgeError(f"{items} holds MaxText's {block_of_module(module)} experts ({module}); "
                              f"--decoder-block {opts.decoder_block} does not match")
        if hyper is None:
            raise BridgeError(f"{items} was not written by gtp-bridge (no {SIDECAR}); give its AdamW settings "
                              f"(--lr, --betas, --eps, --weight-decay) so the logical checkpoint records them")
    if opts.scan_layers != scanned:
        opts = Options(decoder_block=opts.decoder_block, scan_layers=scanned, rotary_interleaved=opts.rotary_interleaved)
    if not hyper.no_decay:
        norms = [leaf.logical[0] for leaf in active_table(dims) if leaf.no_decay]
        hyper = Hyper(**{**asdict(hyper), "no_decay": tuple(tuple(n.split("/")) for n in norms)})
    moves = moves_from_maxtext(dims, opts)
    have = set(infos)
    wanted = {s for m in moves for s in m.sources}
    for role_root in [mc.MT_PARAMS] + [MT_ADAM + (r, mc.MT_MOMENT_ROOT) for r in schema.MOMENTS]:
        extra = sorted(p for p in have - wanted if p[:len(role_root)] == role_root)
        if extra:
            raise BridgeError(f"MaxText leaf {'/'.join(extra[0][len(role_root):])} has no logical counterpart in "
                              f"the maxtext preset (llama-family, no biases; MoE: routed experts and router only)")
    missing = sorted(wanted - have)
    if missing:
        raise BridgeError(f"MaxText checkpoint lacks {'/'.join(missing[0])}")
    check_sources(moves, {p: i.shape for p, i in infos.items()}, items)
    man = mc._manifest_for(dims, hyper, count, side.base_manifest if side else None, opts,
                           float(rotary_base or 10000.0), float(norm_epsilon or 1e-5))
    if schedule is not None:
        man = Manifest.from_json(with_scheduler(man.to_json(), schedule.record_at(count, hyper.weight_decay)))
    scalars = {schema.COUNT_PATH: np.asarray(count, schema.SCALAR_DTYPE),
               schema.STEP_PATH: np.asarray(step, schema.SCALAR_DTYPE)}
    total = sum(m.nbytes for m in moves)
    workers, budget = resources(stream, total)
    share = _split(budget, workers)
    # under torchrun every rank runs `workers` writers of its own with its own budget (bridge.torchrun)
    job = plan_job(moves, scalars, workers * launched_world(), share, empty_paths=schema.adamw_empty_paths())
    if stream.announce:
        stream.announce(budget_line("from-maxtext", job.workers, budget))
    run_job(StreamWriterJob(items, job, share, dims, opts, forward=False, scalars=scalars),
            StreamOutput(dst, man, f"from-maxtext {basename(dst)}", stream.show_progress))
    return {"dst": dst, "items": items, "trained_steps": step, "adam_count": count, "dims": asdict(dims),
            "options": asdict(opts), "sidecar": side is not None}
