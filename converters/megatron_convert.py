"""Megatron-Core `torch_dist` checkpoint -> logical checkpoint (the `convert` command's engine).

Steps: describe the source (`megatron_format.describe`), plan copies per parameter
(`megatron_plan`), give each parameter to one writer process (chunk ownership = whole arrays),
then every worker streams: read the stored chunks it needs (a bounded LRU cache), fill one
parameter's buffers (split into leading-axis blocks under the in-flight budget), cross-check
bf16 weights against bf16(fp32 master), write through `bridge.store.CheckpointWriter`. The parent
commits atomically; on any error the temporary directory is removed and nothing is left at DST.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import sys
import traceback
from dataclasses import dataclass
from typing import Any, Sequence

import ml_dtypes
import numpy as np

from bridge.errors import BridgeError, require
from bridge.location import local_path
from bridge.layout.boxes import Box
from bridge.layout.chunks import ArrayOwnership, regular_ownership
from bridge.layout.parallel import ParallelLayout
from bridge.lr_schedule import RECORD_VERSION
from bridge.progress import progress
from bridge.store.commit import begin_checkpoint, commit_checkpoint
from bridge.store.manifest import Manifest, OptimizerConfig, SourceLayout
from bridge.store.plan import ArraySpec, WritePlan, make_write_plan
from bridge.store.specs import numpy_dtype
from bridge.store.tree import adamw_empty_paths, megatron_key_to_path, path_str
from bridge.store.writer import CheckpointWriter
from bridge.torch_numpy import to_numpy
from converters.dcp_reader import DcpCheckpoint
from converters.megatron_cache import ArrayLRU
from converters.megatron_format import (Hints, SourceCheckpoint, _plain, describe, optimizer_groups,
                                        parse_groups_hyper, step_of)
from converters.megatron_plan import (ROLES, Copy, Unit, contributes, flat_copies, literal,
                                      local_instances, model_space_copies, parse_dtype_key,
                                      rebuild_bucket_layout, role_path)

MIN_BYTES_PER_WORKER = 1 << 30

TORCH_TO_NP = {"torch.bfloat16": "bfloat16", "torch.float32": "float32", "torch.float16": "float16",
               "torch.float64": "float64", "torch.int64": "int64", "torch.int32": "int32", "torch.uint8": "uint8"}


def np_dtype_name(torch_dtype: Any) -> str:
    """numpy dtype name of a torch dtype."""
    s = str(torch_dtype)
    if s not in TORCH_TO_NP:
        raise BridgeError(f"unsupported tensor dtype {s} in the checkpoint")
    return TORCH_TO_NP[s]



@dataclass
class ConvertOptions:
    """What `convert` was asked to do."""

    workers: int = 1
    budget: int = 1 << 30
    force: bool = False
    hints: Hints | None = None
    show_progress: bool | None = None
    min_worker_bytes: int = MIN_BYTES_PER_WORKER


@dataclass
class ConvertResult:
    """Summary for the command line / demo."""

    dst: str
    source_format: str
    layout: dict
    arrays: int
    bytes: int
    params: int
    step: int | None
    warnings: list[str]
    inferred: list[str]


# ---------------------------------------------------------------------------------------------
# Planning


def build_units(src: SourceCheckpoint, hints: Hints) -> list[Unit]:
    """One Unit per parameter, with every copy that fills its model / params / mu / nu arrays."""
    lay = src.layout
    units: dict[str, Unit] = {}
    for name, m in src.models.items():
        tp, gtp = lay.tp_gtp_sizes(m.geom.expert)
        arrays = m.geom.logical_arrays()
        dtypes = {"model": np_dtype_name(m.dtype), "params": "float32", "mu": "float32", "nu": "float32"}
        u = Unit(name, arrays, dtypes, {"model": model_space_copies(m.key, m.info, m.geom, m.npre, m.legacy_padded,
                                                                      tp, gtp)})
        if src.fmt == "fully_reshardable":
            for role in ("params", "mu", "nu"):
                key = src.opt_keys.get((role, name))
                if key is None:
                    continue
                info = src.ck.tensors[key]
                if info.shape != m.info.shape:
                    raise BridgeError(f"{key}: stored shape {info.shape} differs from the model entry's "
                                      f"{m.info.shape}; unknown format")
                u.dtypes[role] = np_dtype_name(info.dtype)
                u.copies[role] = model_space_copies(key, info, m.geom, m.npre, m.legacy_padded, tp, gtp)
        units[name] = u
    if src.fmt == "dp_reshardable":
        add_dp_copies(src, units, hints)
    return list(units.values())


def _per_bucket(obj: Any, gbuf: int, dtype_key: str, what: str) -> list[int] | None:
    """Bucket numels of buffer `gbuf` out of a saved per_bucket_numel object."""
    if obj is None:
        return None
    if isinstance(obj, list) and obj and isinstance(obj[0], list) and len(obj) == 1 and isinstance(obj[0][0], dict):
        obj = obj[0]  # ShardedObject payload wrapped in a list
    if not isinstance(obj, list) or gbuf >= len(obj) or not isinstance(obj[gbuf], dict):
        raise BridgeError(f"{what}: unexpected per_bucket_numel structure; unknown format")
    d = obj[gbuf]
    want = parse_dtype_key(dtype_key)
    for k, v in d.items():
        kk = tuple(str(x).replace("torch.", "") for x in (k if isinstance(k, tuple) else literal(str(k))))
        if kk == want:
            return [int(x) for x in v]
    if len(d) == 1:
        return [int(x) for x in next(iter(d.values()))]
    raise BridgeError(f"{what}: no bucket numels for dtype {dtype_key}; unknown format")


def add_dp_copies(src: SourceCheckpoint, units: dict[str, Unit], hints: Hints) -> None:
    """Rebuild every dp_reshardable buffer and add the copies of its buckets to the units."""
    lay = src.layout
    ck = src.ck
    chains = sorted({d.chain for d in src.dp_keys})
    geoms_all = [m.geom for m in src.models.values()]
    has_expert = any(g.expert for g in geoms_all)
    prefixed = any(d.key.startswith("chained_") for d in src.dp_keys)
    # At EP=1 routed experts share the dense buffer (one optimizer); otherwise the expert optimizer
    # is the last of the chain.
    split_expert = has_expert and len(chains) > 1
    by_bucket: dict[tuple[int, int, int, str, int], dict[str, str]] = {}
    for d in src.dp_keys:
        by_bucket.setdefault((d.chain, d.dp_group_idx, d.gbuf, d.dtype, d.bucket), {})[d.state] = d.key
    buffers = sorted({k[:4] for k in by_bucket})
    coords = _dp_group_coords(lay)
    for chain, k, j, dtype_key in buffers:
        expert = split_expert and chain == chains[-1]
        prefix = f"chained_{chain}." if prefixed else ""
        where = f"{prefix}optimizer.distributed.dp_group_idx_{k}.gbuf_idx_{j}"
        ck_coords = coords["expert" if expert else "dense"].get(k)
        if ck_coords is None:
            raise BridgeError(f"{where}: dp_group_idx {k} does not exist for layout {lay.to_json()}; "
                              f"pass --tp/--gtp/--ep matching the run")
        t, g, e = ck_coords
        pdt, _gdt = parse_dtype_key(dtype_key)
        geoms = [g_ for g_ in geoms_all if (g_.expert == expert or not split_expert)
                 and np_dtype_name(src.models[g_.name].dtype) == pdt]
        insts = local_instances(geoms, lay, e)
        gmap = {g_.name: g_ for g_ in geoms}
        sizes = {n: lay.tp_gtp_sizes(g_.expert) for n, g_ in gmap.items()}
        numels = {i: gmap[i.name].physical_numel(*sizes[i.name]) for i in insts}
        obj_pre = f"{prefix}optimizer.distributed.dp_group_idx_{k}."
        unp = _per_bucket(_maybe_object(ck, obj_pre + "per_bucket_numel_unpadded"), j, dtype_key, where)
        pad = _per_bucket(_maybe_object(ck, obj_pre + "per_bucket_numel"), j, dtype_key, where)
        dp_size = lay.edp if expert else lay.distopt_size
        blay = rebuild_bucket_layout(insts, numels, dp_size, unp, pad, hints.bucket_size, where)
        for b, (b0, _b1) in enumerate(blay.buckets):
            states = by_bucket.get((chain, k, j, dtype_key, b))
            if states is None:
                raise BridgeError(f"{where}: bucket {b} is missing from the checkpoint (missing shard?)")
            for state, key in states.items():
                role = {"param": "params", "exp_avg": "mu", "exp_avg_sq": "nu"}[state]
                info = ck.tensors[key]
                if info.shape != (blay.numel_unpadded[b],):
                    raise BridgeError(f"{key}: stored length {info.shape} differs from the rebuilt bucket "
                                      f"({blay.numel_unpadded[b]}); pass --bucket-size / --pad-for-alignment")
                for inst in insts:
                    p0, _p1, bid = blay.index[inst.label]
                    geom = gmap[inst.name]
                    tp, gtp = sizes[inst.name]
                    if bid != b or not contributes(geom, tp, gtp, t, g):
                        continue
                    u = units[inst.name]
                    u.dtypes[role] = np_dtype_name(info.dtype)
                    u.copies.setdefault(role, []).extend(
                        flat_copies(key, info.chunks, geom, tp, gtp, t, g, inst.index, p0 - b0))


def _maybe_object(ck: DcpCheckpoint, name: str):
    key = ck.object_key(name)
    return ck.read_object(key) if key is not None else None


def _dp_group_coords(lay: ParallelLayout) -> dict[str, dict[int, tuple[int, int, int]]]:
    """dp_group_idx -> (TP rank, GTP rank, EP rank) for the dense and the expert optimizer."""
    dense: dict[int, tuple[int, int, int]] = {}
    expert: dict[int, tuple[int, int, int]] = {}
    for r in range(lay.world):
        c = lay.coords(r)
        if c.d == 0 and c.c == 0:
            dense.setdefault(lay.dp_group_idx(r), (c.t, c.g, 0))
        if c.ed == 0:
            expert.setdefault(lay.expert_dp_group_idx(r), (c.et, c.eg, c.e))
    return {"dense": dense, "expert": expert}


def assign_writers(units: Sequence[Unit], workers: int) -> list[int]:
    """Writer of each unit: largest first onto the least-loaded writer (balanced bytes)."""
    load = [0] * workers
    owner = [0] * len(units)
    for i in sorted(range(len(units)), key=lambda i: -units[i].nbytes):
        w = min(range(workers), key=lambda w: load[w])
        owner[i] = w
        load[w] += units[i].nbytes
    return owner


def _whole(shape: Sequence[int], dtype: str, writer: int, max_chunk_bytes: int) -> ArrayOwnership:
    item = 2 if dtype in ("bfloat16", "float16", "int16", "uint16") else 4 if dtype in ("float32", "int32") else 8
    own = regular_ownership(shape, 1, item, max_chunk_bytes=max_chunk_bytes)
    return ArrayOwnership(own.shape, own.chunk_shape, np.full_like(own.owners, writer))


def make_plan(units: Sequence[Unit], owners: Sequence[int], workers: int, max_chunk_bytes: int = 1 << 30) -> WritePlan:
    """Catalog (all roles of every unit + count + step) and whole-array ownership per unit."""
    catalog, ownership = [], {}
    for u, w in zip(units, owners):
        for role in ROLES:
            if role not in u.copies:
                continue
            for arr, shape in u.arrays.items():
                p = role_path(role, arr)
                catalog.append(ArraySpec(p, shape, u.dtypes[role]))
                ownership[p] = _whole(shape, u.dtypes[role], w, max_chunk_bytes)
    for p in (("opt_state", "0", "count"), ("step",)):
        catalog.append(ArraySpec(p, (), "int32"))
        ownership[p] = ArrayOwnership((), (), np.array(0, dtype=np.int32))
    return make_write_plan(catalog, workers, ownership, empty_paths=adamw_empty_paths())


# ---------------------------------------------------------------------------------------------
# Execution


class ChunkCache:
    """Decoded stored chunks (numpy), least-recently-used out once over `max_bytes`."""

    def __init__(self, ck: DcpCheckpoint, max_bytes: int) -> None:
        self.ck = ck
        self._lru = ArrayLRU(max(1, max_bytes))
        self.bytes_read = 0

    def get(self, key: str, index: int) -> np.ndarray:
        a = self._lru.get((key, index))
        if a is None:
            info = self.ck.tensors[key]
            a = to_numpy(self.ck.read_chunk(key, info.chunks[index]))
            self.bytes_read += info.chunks[index].storage.length
            self._lru.put((key, index), a)
        return a


def _take(cache: ChunkCache, c: Copy) -> np.ndarray:
    a = cache.get(c.key, c.chunk)
    if c.flat:
        return a.reshape(-1)[c.flat_start:c.flat_start + c.dst.size].reshape(c.dst.shape)
    return a[tuple(slice(x, y) for x, y in c.src)].reshape(c.dst.shape)


def bits_equal(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Element-wise bit equality, NaN == NaN (NaN payloads may be canonicalised by a cast)."""
    ua = a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint32)
    ub = b.view(np.uint16 if b.dtype.itemsize == 2 else np.uint32)
    eq = ua == ub
    if not eq.all():
        eq |= np.isnan(a.astype(np.float32)) & np.isnan(b.astype(np.float32))
    return eq


def check_master(unit_name: str, array: str, master: np.ndarray, model: np.ndarray, force: bool,
                 fmt: str, warnings: list[str]) -> None:
    """bf16 weight must equal bf16(fp32 master); else refuse (0.19.2 defect / wrong layout)."""
    if model.dtype != ml_dtypes.bfloat16 and model.dtype != np.float16:
        if model.dtype == np.float32 and not bits_equal(master, model).all():
            warnings.append(f"{array}: fp32 weight differs from its master; the master is kept")
        return
    ok = bits_equal(master.astype(model.dtype), model)
    if ok.all():
        return
    bad = int(ok.size - ok.sum())
    first = tuple(int(i) for i in np.argwhere(~ok)[0])
    if fmt == "dp_reshardable":
        msg = (f"{array}: fp32 masters disagree with the bf16 weights at {bad} of {ok.size} elements (first at {first}); "
               f"the rebuilt DistOpt layout is wrong — pass --bucket-size, --pad-for-alignment or --tp/--gtp/--dp")
    else:
        msg = (f"{array}: fp32 masters disagree with the bf16 weights at {bad} of {ok.size} elements (first at {first}); "
               f"this is megatron-core 0.19.2's multi-bucket fully_reshardable defect (corrupt optimizer state) — "
               f"re-save with dp_reshardable, or pass --force to convert it anyway")
    if not force:
        raise BridgeError(msg)
    warnings.append("FORCED: " + msg)


def run_units(src_root: str, units: Sequence[Unit], plan: WritePlan, tmp: str, writer_id: int, budget: int,
              force: bool, fmt: str, step: int, on_progress=None) -> tuple[list[str], int]:
    """One writer's work: fill, check and write its units. Returns (warnings, source bytes read)."""
    ck = DcpCheckpoint(src_root)
    cache = ChunkCache(ck, budget // 2)
    writer = CheckpointWriter(tmp, plan, writer_id, inflight_bytes=max(1, budget // 4))
    warnings: list[str] = []
    for unit in units:
        for lo, hi, sub in unit.split_lead(max(1, budget // 4)):
            bufs: dict[tuple[str, str], np.ndarray] = {}
            filled: dict[tuple[str, str], int] = {}
            for role, copies in sub.copies.items():
                for arr, shape in unit.arrays.items():
                    bshape = ((hi - lo),) + tuple(shape[1:]) if shape else ()
                    bufs[(role, arr)] = np.empty(bshape, dtype=numpy_dtype(unit.dtypes[role]))
                    filled[(role, arr)] = 0
                for c in copies:
                    data = _take(cache, c)
                    dst = c.dst if not c.dst.ndim else c.dst.shift((-lo,) + (0,) * (c.dst.ndim - 1))
                    buf = bufs[(role, c.array)]
                    if data.dtype != buf.dtype:
                        raise BridgeError(f"{c.key}: stored dtype {data.dtype} differs from {buf.dtype} of "
                                          f"{c.array}; unknown format")
                    buf[dst.slices] = data
                    filled[(role, c.array)] += c.dst.size
            for (role, arr), n in filled.items():
                if n != bufs[(role, arr)].size:
                    raise BridgeError(
                        f"{path_str(role_path(role, arr))}: the checkpoint fills {n} of {bufs[(role, arr)].size} "
                        f"elements (rows {lo}..{hi}); a shard is missing or the layout could not be rebuilt — "
                        f"check --tp/--gtp/--dp/--ep/--bucket-size")
            if "params" in sub.copies and "model" in sub.copies:
                for arr in unit.arrays:
                    check_master(unit.name, arr, bufs[("params", arr)], bufs[("model", arr)], force, fmt, warnings)
            for (role, arr), buf in bufs.items():
                shape = unit.arrays[arr]
                box = Box.of((lo,) + (0,) * (len(shape) - 1), buf.shape) if shape else Box((), ())
                writer.write(role_path(role, arr), box, buf)
                if on_progress:
                    on_progress(buf.nbytes)
    if writer_id == 0:
        for p in (("opt_state", "0", "count"), ("step",)):
            writer.write(p, Box((), ()), np.asarray(step, dtype=np.int32))
    writer.finish()
    return warnings, cache.bytes_read


def _worker_main(q, src_root, units, plan, tmp, w, budget, force, fmt, step) -> None:  # pragma: no cover - subprocess
    try:
        warns, nread = run_units(src_root, units, plan, tmp, w, budget, force, fmt, step,
                                 on_progress=lambda n: q.put(("p", w, n)))
        q.put(("ok", w, (warns, nread)))
    except BridgeError as e:
        q.put(("err", w, f"writer {w}: {e}"))
    except BaseException as e:  # noqa: BLE001 - report any crash as one line
        q.put(("err", w, f"writer {w} crashed: {type(e).__name__}: {e}".splitlines()[0]))
        traceback.print_exc(file=sys.stderr)


# ---------------------------------------------------------------------------------------------
# Manifest


def build_manifest(src: SourceCheckpoint, units: Sequence[Unit], step: int | None, groups: list[list[dict]]) -> Manifest:
    """Provenance, hyper-parameters, fused section tables and what to-megatron needs."""
    lay = src.layout
    source = SourceLayout(framework="megatron", tp=lay.tp, gtp=lay.gtp, dp=lay.dp, ep=lay.ep, etp=lay.etp,
                          egtp=lay.egtp, pp=lay.pp, cp=lay.cp, pad_for_alignment=src.pad_for_alignment,
                          optimizer_format=src.format_label, world_size=lay.world)
    hyper = parse_groups_hyper(groups)
    # Megatron puts biases and 1-D params in the wd_mult=0 group (its default no_weight_decay_cond);
    # they are "no decay" when that group's effective weight_decay (what the inner optimizer used) is 0.
    wd_mult_zero = []
    for m in src.models.values():
        if m.name.endswith(".bias") or len(m.geom.shape) == 1:
            wd_mult_zero += [path_str(megatron_key_to_path(a)) for a in m.geom.logical_arrays()]
    zero_groups = [g for g in hyper.get("groups", []) if g.get("wd_mult") == 0.0]
    no_decay = wd_mult_zero if zero_groups and all(float(g.get("weight_decay") or 0.0) == 0.0 for g in zero_groups) else []
    opt = OptimizerConfig(name="adamw", lr=hyper.get("lr"), betas=hyper.get("betas"), eps=hyper.get("eps"),
                          weight_decay=hyper.get("weight_decay"), step=step, groups=hyper.get("groups", []),
                          no_decay=no_decay, clip_grad=_clip_grad(src.args))
    fused = {path_str(megatron_key_to_path(m.name)): m.geom.fused.to_json()
             for m in src.models.values() if m.geom.fused is not None}
    params = []
    for m in src.models.values():
        params.append({"name": m.name, "key": m.key, "shape": list(m.geom.shape), "prepend": list(m.geom.prepend),
                       "tp_kind": m.geom.tp_kind, "gtp": m.geom.gtp, "expert": m.geom.expert,
                       "dtype": np_dtype_name(m.dtype), "optimized": any(r != "model" for r in
                                                                         next(u for u in units if u.name == m.name).copies)})
    extra_keys = sorted(k for k in src.ck.objects if k.split("/", 1)[0].endswith("._extra_state"))
    payload = "none"
    if extra_keys:  # TE saves empty uint8 tensors, Megatron-local layers None: written back the same way
        first = src.ck.read_object(extra_keys[0])
        first = first[0] if isinstance(first, list) and first else first
        if hasattr(first, "numel") and first.numel() == 0:
            payload = "empty_uint8_tensor"
    keep_args = {k: _plain(v) for k, v in src.args.items() if isinstance(_plain(v), (int, float, str, bool, type(None)))}
    extra = {"megatron": {
        "source_dir": str(src.ck.root),
        "params": params,
        "param_groups": [[{k: _plain(v) for k, v in g.items() if k != "params"} for g in gs] for gs in groups],
        "extra_state_keys": extra_keys,
        "extra_state_payload": payload,
        "args": keep_args,
        "inferred": list(src.inferred),
        "wd_mult_zero_params": wd_mult_zero,
        "iteration": _plain(src.common.get("iteration")),
        "checkpoint_version": _plain(src.common.get("checkpoint_version")),
    }}
    sched = scheduler_record(src.common, src.args, step or 0)
    if sched is not None:
        extra["megatron"]["scheduler"] = sched
    return Manifest(source=source, optimizer=opt, fused=fused, extra=extra)


def _first(d: dict, *names: str) -> Any:
    """The first of `names` present in `d` (Megatron renamed scheduler keys over versions)."""
    return next((_plain(d[n]) for n in names if n in d), None)


def _clip_grad(args: dict) -> float | None:
    """Megatron's `clip_grad` from the saved args (None when the save carries no args)."""
    v = _plain(args.get("clip_grad")) if args else None
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def scheduler_record(common: dict, args: dict, at_count: int) -> dict | None:
    """Megatron's `OptimizerParamScheduler` state (+ the args it needs) as JSON, or None when absent.

    Fields are `bridge.lr_schedule.SchedulerRecord`'s; old key names are read the way
    `OptimizerParamScheduler.load_state_dict` reads them. Step quantities are in samples;
    `increment` (samples per iteration) is `global_batch_size`; `at_count` is the Adam count written
    to `opt_state/0/count`.
    """
    sd = common.get("opt_param_scheduler", common.get("lr_scheduler"))
    if not isinstance(sd, dict):
        return None
    a = lambda name, default=None: _plain(args.get(name, default))  # noqa: E731
    gbs = a("global_batch_size")
    if a("train_iters"):
        wsd = a("lr_wsd_decay_iters") * gbs if a("lr_wsd_decay_iters") is not None and gbs else None
    else:
        wsd = a("lr_wsd_decay_samples")
    ramp = a("rampup_batch_size")
    return {"version": RECORD_VERSION, "max_lr": _first(sd, "start_lr", "max_lr"), "min_lr": _first(sd, "min_lr"),
            "lr_warmup_steps": _first(sd, "warmup_iter", "warmup_steps", "lr_warmup_steps"),
            "lr_decay_steps": _first(sd, "end_iter", "decay_steps", "lr_decay_steps"),
            "lr_decay_style": _first(sd, "decay_style", "lr_decay_style"),
            "num_steps": _first(sd, "num_iters", "num_steps"),
            "start_wd": _first(sd, "start_wd"), "end_wd": _first(sd, "end_wd"),
            "wd_incr_steps": _first(sd, "wd_incr_steps"), "wd_incr_style": _first(sd, "wd_incr_style"),
            "init_lr": float(a("lr_warmup_init", 0.0) or 0.0), "wsd_decay_steps": wsd,
            "lr_wsd_decay_style": a("lr_wsd_decay_style"), "increment": int(gbs) if gbs else None,
            "rampup_samples": int(ramp[2]) if isinstance(ramp, list) and len(ramp) == 3 else None,
            "at_count": int(at_count)}


# ---------------------------------------------------------------------------------------------
# Entry point


def convert(src_dir: str, dst: str, opts: ConvertOptions | None = None) -> ConvertResult:
    """Convert a torch_dist checkpoint at `src_dir` into a logical checkpoint at `dst`."""
    src_dir, dst = local_path(src_dir, "source"), local_path(dst, "destination"); require("convert", "torch")
    opts = opts or ConvertOptions()
    hints = opts.hints or Hints()
    dst = os.path.abspath(dst)
    if os.path.lexists(dst):
        raise BridgeError(f"destination {dst} already exists; choose a new directory or remove it")
    if opts.workers < 1:
        raise BridgeError(f"--workers must be >= 1, got {opts.workers}")
    if opts.budget < (64 << 10):
        raise BridgeError(f"--budget must be at least 64k, got {opts.budget} bytes")
    ck = DcpCheckpoint(src_dir)
    src = describe(ck, hints)
    groups = optimizer_groups(src)
    step = step_of(src, groups)
    units = build_units(src, hints)
    if src.fmt != "model_only" and not any("params" in u.copies for u in units):
        raise BridgeError(f"{ck.root}: optimizer entries match no model parameter; unknown format")
    # A worker process costs seconds to start (torch + TensorStore imports): give each at least
    # MIN_BYTES_PER_WORKER of work, so small checkpoints convert in-process.
    total_bytes = sum(u.nbytes for u in units)
    workers = max(1, min(opts.workers, len(units), -(-total_bytes // max(1, opts.min_worker_bytes))))
    owners = assign_writers(units, workers)
    plan = make_plan(units, owners, workers)
    manifest = build_manifest(src, units, step, groups)
    tmp = begin_checkpoint(dst)
    warnings: list[str] = []
    try:
        with progress(total_bytes, f"convert {os.path.basename(dst)}", enabled=opts.show_progress) as bar:
            per = [[u for u, w in zip(units, owners) if w == i] for i in range(workers)]
            if workers == 1:
                warns, _ = run_units(str(ck.root), per[0], plan, tmp, 0, opts.budget, opts.force, src.fmt,
                                     step or 0, on_progress=bar.update)
                warnings += warns
            else:
                warnings += _run_parallel(str(ck.root), per, plan, tmp, opts, src.fmt, step or 0, bar)
        commit_checkpoint(dst, plan, manifest, timeout=60.0)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for w in warnings:
        print(f"gtp-bridge: warning: {w}", file=sys.stderr)
    return ConvertResult(dst, src.format_label, src.layout.to_json(), len(plan.arrays), plan.total_bytes,
                         len(units), step, warnings, src.inferred)


def _run_parallel(root: str, per: list[list[Unit]], plan: WritePlan, tmp: str, opts: ConvertOptions, fmt: str,
                  step: int, bar) -> list[str]:
    # spawn: TensorStore aborts in a forked child once the parent has used it
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    budget = max(1 << 20, opts.budget // len(per))
    procs = [ctx.Process(target=_worker_main, args=(q, root, per[w], plan, tmp, w, budget, opts.force, fmt, step),
                         daemon=True) for w in range(len(per))]
    for p in procs:
        p.start()
    done: dict[int, Any] = {}
    errors: list[str] = []
    try:
        while len(done) + len(errors) < len(procs):
            try:
                kind, w, payload = q.get(timeout=1.0)
            except Exception:  # queue.Empty
                dead = [i for i, p in enumerate(procs) if not p.is_alive() and i not in done and p.exitcode not in (0, None)]
                if dead and q.empty():
                    errors.append(f"writer {dead[0]} died with exit code {procs[dead[0]].exitcode}")
                    break
                continue
            if kind == "p":
                bar.update(payload)
            elif kind == "ok":
                done[w] = payload
            else:
                errors.append(payload)
                break
    finally:
        if errors:
            for p in procs:
                if p.is_alive():
                    p.terminate()
        for p in procs:
            p.join()
    if errors:
        raise BridgeError(errors[0])
    return [x for w in sorted(done) for x in done[w][0]]
