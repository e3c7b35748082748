"""Logical checkpoint -> Megatron-Core `torch_dist` checkpoint at a target layout (`to-megatron`).

Writes what `dist_checkpointing.save` writes (megatron-layout.md §5.3): `.distcp` files of
independent `torch.save` blobs, a `.metadata` pickle of DCP's `Metadata`, ShardedObjects
(`common_state`, `_extra_state`, dp_reshardable objects) as `torch.save([obj])` byte items,
and `metadata.json`. Chunks follow the target layout (one per stacked instance and TP shard, or
per (TP, GTP) shard of the 0.19.2 padded grid for GTP-sharded weights), so Megatron-Core
reads exactly its own rectangles. The output is Megatron-LM's run directory layout
(`<run>/iter_XXXXXXX/` + `latest_checkpointed_iteration.txt`, `converters.megatron_rundir`): the
iteration directory is written under a temporary name, renamed when complete, then the tracker set.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import signal
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from bridge.errors import BridgeError
from bridge.layout.boxes import Box
from bridge.layout.distopt import buffer_layout, BufferParam
from bridge.layout.fused import FusedSpec
from bridge.layout.parallel import ParallelLayout
from bridge.layout.params import ParamGeometry
from bridge.progress import progress
from bridge.store.manifest import Manifest
from bridge.store.reader import Checkpoint, open_checkpoint
from bridge.store.durable import fsync_path
from bridge.store.specs import numpy_dtype
from bridge.torch_numpy import from_numpy
from bridge.store.tree import megatron_key_to_path, path_str
from converters.dcp_reader import ChunkInfo, StorageRef
from converters.megatron_cache import ArrayLRU
from converters.megatron_rundir import plan_run_dir, write_tracker
from converters.megatron_format import (is_gtp_weight, is_routed_expert, num_prepend_axes, strip_wrappers,
                                        tp_kind_by_name)
from bridge.layout.legacy import legacy_box_map, legacy_shape
from converters.megatron_plan import (box_copies, is_scrambled_swiglu, local_instances, role_path,
                                      logical_row_runs)

FORMATS = ("fully_reshardable", "dp_reshardable")
STATE_NAMES = {"params": "param", "mu": "exp_avg", "nu": "exp_avg_sq"}


@dataclass
class Target:
    """The layout and format to write."""

    tp: int
    gtp: int = 1
    dp: int = 1
    ep: int = 1
    fmt: str = "fully_reshardable"
    pad_for_alignment: int | None = None
    bucket_size: int | None = None


@dataclass
class ParamInfo:
    """A parameter of the logical checkpoint as Megatron keys it."""

    name: str
    geom: ParamGeometry
    dtype: str
    optimized: bool


# ---------------------------------------------------------------------------------------------
# Reading the logical side


def manifest_of(ck: Checkpoint) -> Manifest:
    """The manifest the opened checkpoint carries (parsed by `open_checkpoint`); BridgeError when absent."""
    if ck.manifest is None:
        raise BridgeError(f"{ck.root}: no gtp_bridge manifest in _METADATA; to-megatron needs a checkpoint written "
                          f"by gtp-bridge (convert, live export or the JAX save)")
    return ck.manifest


def params_from_manifest(man: Manifest, arrays: dict, pad: int, gtp: int) -> list[ParamInfo]:
    """Parameters in registration order: the recorded Megatron list, else derived from the tree."""
    fused = {k: FusedSpec.from_json(v) for k, v in man.fused.items()}
    recorded = man.extra.get("megatron", {}).get("params") if isinstance(man.extra, dict) else None
    out: list[ParamInfo] = []
    if recorded:
        for p in recorded:
            name = strip_wrappers(p["name"])
            spec = fused.get(path_str(megatron_key_to_path(name)))
            geom = ParamGeometry(name, tuple(p["shape"]), p["tp_kind"], gtp=bool(p.get("gtp")) or is_gtp_weight(name),
                                 pad_for_alignment=pad, prepend=tuple(p["prepend"]), fused=spec,
                                 expert=bool(p["expert"]))
            out.append(ParamInfo(name, geom, p["dtype"], bool(p.get("optimized", True))))
        return out
    # Derived: every model/* (else params/*) array; fused sections regrouped by the manifest table.
    role = "model" if any(p[0] == "model" for p in arrays) else "params"
    seen: set[str] = set()
    for path, info in arrays.items():
        if path[0] != role:
            continue
        name = ".".join(path[1:])
        parent = ".".join(path[1:-1])
        spec = fused.get("/".join(path[1:-1]))
        if spec is not None and path[-1] in spec.names:
            if parent in seen:
                continue
            seen.add(parent)
            npre = num_prepend_axes(parent)
            first = arrays[(role,) + path[1:-1] + (spec.names[0],)]
            shape = (spec.rows,) + tuple(first.shape[npre + 1:])
            geom = ParamGeometry(parent, shape, "column", gtp=is_gtp_weight(parent), pad_for_alignment=pad,
                                 prepend=tuple(first.shape[:npre]), fused=spec, expert=is_routed_expert(parent))
            out.append(ParamInfo(parent, geom, "bfloat16", ("params",) + path[1:] in arrays))
            continue
        npre = num_prepend_axes(name)
        kind = tp_kind_by_name(name) if len(info.shape) > npre else "replicated"
        geom = ParamGeometry(name, tuple(info.shape[npre:]), kind, gtp=is_gtp_weight(name), pad_for_alignment=pad,
                             prepend=tuple(info.shape[:npre]), expert=is_routed_expert(name))
        out.append(ParamInfo(name, geom, "bfloat16" if role == "model" else "float32",
                             ("params",) + path[1:] in arrays))
    return out


# ---------------------------------------------------------------------------------------------
# Target chunk boxes (pure)


def stored_shape(geom: ParamGeometry, tp: int, gtp: int) -> tuple[int, ...]:
    """Per-instance stored global shape: logical, or the 0.19.2 padded grid for GTP weights.

    >>> stored_shape(ParamGeometry("w", (10, 6), "column", gtp=True, pad_for_alignment=4), 2, 2)
    (16, 6)
    """
    if not geom.gtp_active(gtp) or not geom.shape:
        return geom.shape
    return legacy_shape(geom, tp, gtp)[len(geom.prepend):]


def instance_boxes(geom: ParamGeometry, tp: int, gtp: int) -> list[Box]:
    """Chunk boxes of one stacked instance (no prepend axes) as a run at (tp, gtp) writes them.

    >>> [str(b) for b in instance_boxes(ParamGeometry("f", (12, 4), "column", fused=FusedSpec.swiglu(6)), 2, 1)]
    ['[0:3, 0:4]', '[6:9, 0:4]', '[3:6, 0:4]', '[9:12, 0:4]']
    """
    shape = stored_shape(geom, tp, gtp)
    if not shape:
        return [Box((), ())]
    rest0, rest = (0,) * (len(shape) - 1), tuple(shape[1:])
    if geom.gtp_active(gtp):
        s = geom.split(tp, gtp).shard_rows
        out = []
        for t in range(tp):
            for g in range(gtp):
                if geom.tp_kind in ("column", "vocab"):
                    out.append(Box.of(((t * gtp + g) * s,) + rest0, (s,) + rest))
                else:
                    k = shape[1] // tp
                    out.append(Box.of((g * s, t * k) + rest0[1:], (s, k) + rest[1:]))
        return out
    if tp == 1 or geom.tp_kind == "replicated":
        return [Box.full(shape)]
    if geom.tp_kind == "row":
        k = shape[1] // tp
        return [Box.of((0, t * k) + rest0[1:], (shape[0], k) + rest[1:]) for t in range(tp)]
    spec = geom.fused
    if spec is not None and spec.kind == "concat":
        out, starts, acc = [], [], 0
        for sec in spec.sections:
            starts.append(acc)
            acc += sec.rows
        for t in range(tp):
            for sec, st in zip(spec.sections, starts):
                n = sec.rows // tp
                out.append(Box.of((st + t * n,) + rest0, (n,) + rest))
        return out
    n = shape[0] // tp
    return [Box.of((t * n,) + rest0, (n,) + rest) for t in range(tp)]


def check_target(params: Sequence[ParamInfo], lay: ParallelLayout) -> None:
    """Refuse a target layout the parameters cannot take, naming the parameter."""
    for p in params:
        tp, gtp = lay.tp_gtp_sizes(p.geom.expert)
        p.geom.tp_local_shape(tp)  # divisibility (raises naming the param)
        if p.geom.gtp_active(gtp):
            if p.geom.fused is not None and p.geom.fused.kind == "concat" and not is_scrambled_swiglu(p.geom, gtp):
                raise BridgeError(f"{p.name}: GTP={gtp} with a fused {p.geom.fused.names} projection is not written "
                                  f"by megatron-core 0.19.2's padded grid; choose --gtp 1")
            p.geom.split(tp, gtp)
        if p.geom.expert and len(p.geom.prepend) >= 2 and p.geom.prepend[1] % lay.ep:
            raise BridgeError(f"{p.name}: {p.geom.prepend[1]} experts are not divisible by EP={lay.ep}; "
                              f"choose an --ep that divides the number of experts")


# ---------------------------------------------------------------------------------------------
# DCP file writing


class DcpWriter:
    """Appends independent `torch.save` blobs to one `.distcp` file and records DCP metadata."""

    def __init__(self, root: str, rel: str = "__0_0.distcp") -> None:
        import torch

        self.torch = torch
        self.root = root
        self.rel = rel
        self.f = open(os.path.join(root, rel), "wb")
        self.pos = 0
        self.tensors: dict[str, tuple[Any, tuple[int, ...], list[tuple[tuple[int, ...], tuple[int, ...]]]]] = OrderedDict()
        self.objects: list[str] = []
        self.storage: dict[tuple[str, tuple[int, ...] | None], tuple[int, int]] = {}
        self.bytes = 0

    def _blob(self, obj: Any) -> tuple[int, int]:
        buf = io.BytesIO()
        self.torch.save(obj, buf)
        data = buf.getbuffer()
        off = self.pos
        self.f.write(data)
        self.pos += len(data)
        self.bytes += len(data)
        return off, len(data)

    def declare(self, fqn: str, dtype: Any, shape: Sequence[int]) -> None:
        self.tensors[fqn] = (dtype, tuple(int(s) for s in shape), [])

    def tensor_chunk(self, fqn: str, offsets: Sequence[int], tensor: Any) -> None:
        offsets = tuple(int(o) for o in offsets)
        self.tensors[fqn][2].append((offsets, tuple(tensor.shape)))
        self.storage[(fqn, offsets)] = self._blob(tensor.contiguous())

    def obj(self, fqn: str, value: Any) -> None:
        self.objects.append(fqn)
        self.storage[(fqn, None)] = self._blob([value])

    def finish(self) -> None:
        from torch.distributed.checkpoint.filesystem import _StorageInfo
        from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                           MetadataIndex, StorageMeta, TensorProperties,
                                                           TensorStorageMetadata)

        torch = self.torch
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        sdm: dict[str, Any] = {}
        for fqn, (dtype, shape, chunks) in self.tensors.items():
            sdm[fqn] = TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(shape),
                                             [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in chunks])
        for fqn in self.objects:
            sdm[fqn] = BytesStorageMetadata()
        storage = {}
        for (fqn, off), (o, n) in self.storage.items():
            idx = MetadataIndex(fqn, torch.Size(off)) if off is not None else MetadataIndex(fqn)
            storage[idx] = _StorageInfo(self.rel, o, n)
        md = Metadata(state_dict_metadata=sdm, planner_data=None, storage_data=storage,
                      storage_meta=StorageMeta(checkpoint_id=None, save_id=str(uuid.uuid4())), version="1.0.0")
        import pickle

        with open(os.path.join(self.root, ".metadata"), "wb") as f:
            pickle.dump(md, f)
            f.flush()
            os.fsync(f.fileno())
        with open(os.path.join(self.root, "metadata.json"), "w") as f:
            json.dump({"sharded_backend": "torch_dist", "sharded_backend_version": 1}, f)


def _torch_dtype(name: str):
    import torch

    return {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}[name]


class ArrayCache:
    """Whole logical arrays read from the store, least-recently-used out over `max_bytes`."""

    def __init__(self, ck, max_bytes: int) -> None:
        self.ck = ck
        self.max_bytes = max_bytes
        self._lru = ArrayLRU(max_bytes)

    def read(self, path: tuple, box: Box) -> np.ndarray:
        a = self._lru.get(path)
        if a is None:
            if self.ck.info(path).nbytes > self.max_bytes:  # too big to keep: read just the box
                return self.ck.read(path, box)
            a = self.ck.read(path)
            self._lru.put(path, a)
        return a[box.slices]


# ---------------------------------------------------------------------------------------------
# Entry point


def to_megatron(src: str, dst: str, target: Target, *, budget: int = 1 << 30, show_progress: bool | None = None) -> dict:
    """Write step N of logical checkpoint `src` for `target` as Megatron-LM's run directory layout.

    DST is the run directory or its `iter_XXXXXXX` (see `megatron_rundir.plan_run_dir`); the
    iteration directory is written under a temporary name, renamed when complete, and only then
    is `latest_checkpointed_iteration.txt` set to N (atomically), so `--load RUN` finds it.
    """
    if target.fmt not in FORMATS:
        raise BridgeError(f"unknown --format {target.fmt!r}; use one of {list(FORMATS)}")
    ck = open_checkpoint(src)
    man = manifest_of(ck)
    arrays = ck.arrays()
    pad = target.pad_for_alignment if target.pad_for_alignment is not None else (man.source.pad_for_alignment or 16)
    params = params_from_manifest(man, arrays, pad, target.gtp)
    if target.fmt == "dp_reshardable" and not (man.extra.get("megatron") or {}).get("params"):
        raise BridgeError(f"{src}: dp_reshardable needs Megatron's parameter registration order, which this "
                          f"checkpoint's manifest does not record (not written by convert); use "
                          f"--format fully_reshardable")
    if not params:
        raise BridgeError(f"{src}: no model or params arrays; nothing to write")
    try:
        lay = ParallelLayout(tp=target.tp, gtp=target.gtp, dp=target.dp, ep=target.ep)
    except BridgeError as e:
        raise BridgeError(f"target layout: {e}") from None
    check_target(params, lay)
    for p in params:
        for arr, want in p.geom.logical_arrays().items():
            for role in ("model",) + (("params", "mu", "nu") if p.optimized else ()):
                path = role_path(role, arr)
                if path not in arrays:
                    raise BridgeError(f"{src}: array {path_str(path)} is missing; the checkpoint is incomplete")
                if tuple(arrays[path].shape) != tuple(want):
                    raise BridgeError(f"{path_str(path)}: shape {arrays[path].shape} differs from the recorded "
                                      f"parameter shape {want}; the manifest and the arrays disagree")
    step = int(ck.read(("step",))) if ("step",) in arrays else int(man.optimizer.step or 0)
    count = int(ck.read(("opt_state", "0", "count"))) if ("opt_state", "0", "count") in arrays else step
    if count != step:
        raise BridgeError(f"{src}: step {step} and opt_state/0/count {count} differ; the checkpoint is inconsistent")
    where = plan_run_dir(dst, step)
    created_run = not os.path.lexists(where.run_dir)
    tmp = f"{where.iter_dir}.tmp-{os.getpid()}"
    renamed = False
    with terminate_as_exit():
        try:
            os.makedirs(tmp)
            w = DcpWriter(tmp)
            cache = ArrayCache(ck, max(1, budget // 2))
            total = sum(a.nbytes for p, a in arrays.items() if p[0] in ("model", "params", "opt_state"))
            with progress(total, f"to-megatron {where.iter_dir}", enabled=show_progress) as bar:
                _write_model_space(w, cache, params, lay, target.fmt, bar)
                if target.fmt == "dp_reshardable":
                    _write_dp_buckets(w, cache, params, lay, target, man, step)
                _write_objects(w, man, params, lay, target, step)
            w.finish()
            if os.path.lexists(where.iter_dir):  # another run created it meanwhile: never replace it
                raise BridgeError(f"{where.iter_dir} appeared while writing; another run writes there")
            os.rename(tmp, where.iter_dir)
            renamed = True
            fsync_path(where.run_dir)
            write_tracker(where.run_dir, step)
        except BaseException:
            shutil.rmtree(where.iter_dir if renamed else tmp, ignore_errors=True)
            if created_run:
                _remove_if_empty(where.run_dir)
            raise
    return {"dst": where.iter_dir, "run_dir": where.run_dir, "tracker": where.tracker,
            "tracker_previous": where.previous, "layout": lay.to_json(), "format": target.fmt, "bytes": w.bytes,
            "params": len(params), "step": step}


def _remove_if_empty(path: str) -> None:
    try:
        os.rmdir(path)
    except OSError:
        pass


@contextlib.contextmanager
def terminate_as_exit():
    """SIGTERM raises SystemExit(143) in the main thread, so cleanup in `except BaseException` runs.

    (SIGINT already raises KeyboardInterrupt.) Outside the main thread signals cannot be caught;
    then nothing changes.
    """
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, _frame):
        raise SystemExit(128 + signum)

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def _write_model_space(w: DcpWriter, cache: ArrayCache, params: Sequence[ParamInfo], lay: ParallelLayout, fmt: str,
                       bar) -> None:
    """Model weights (and fully_reshardable optimizer state) as model-space chunks."""
    for p in params:
        g = p.geom
        tp, gtp = lay.tp_gtp_sizes(g.expert)
        npre = len(g.prepend)
        runs = logical_row_runs(g)
        legacy = g.gtp_active(gtp) and bool(g.shape)
        scrambled = is_scrambled_swiglu(g, gtp)
        shape = stored_shape(g, tp, gtp)
        boxes = instance_boxes(g, tp, gtp)
        roles = [("model", p.name, p.dtype)]
        if fmt == "fully_reshardable" and p.optimized:
            roles += [(r, f"optimizer.state.{STATE_NAMES[r]}.{p.name}", "float32") for r in ("params", "mu", "nu")]
        for role, fqn, dt in roles:
            w.declare(fqn, _torch_dtype(dt), g.prepend + shape)
            for index in np.ndindex(*g.prepend) if g.prepend else [()]:
                for box in boxes:
                    chunk_box = Box.of(tuple(index) + box.start, (1,) * npre + box.shape)
                    data = np.zeros(chunk_box.shape, dtype=numpy_dtype(dt))  # GTP pad rows stay zero
                    if legacy:  # the 0.19.2 padded grid (scrambled SwiGLU halves), via bridge.layout.legacy
                        for m in legacy_box_map(g, tp, gtp, chunk_box, scrambled_swiglu=scrambled):
                            data[m.src.slices] = cache.read(role_path(role, m.array), m.logical)
                    else:
                        ch = ChunkInfo(chunk_box.start, chunk_box.shape, StorageRef("", 0, 0))
                        for c in box_copies(fqn, 0, ch, runs, npre):
                            data[tuple(slice(a, b) for a, b in c.src)] = cache.read(role_path(role, c.array), c.dst)
                    w.tensor_chunk(fqn, chunk_box.start, from_numpy(data))
                    bar.update(data.nbytes)


def _dp_coords(lay: ParallelLayout, expert: bool) -> dict[int, tuple[int, int, int]]:
    out: dict[int, tuple[int, int, int]] = {}
    for r in range(lay.world):
        c = lay.coords(r)
        if expert and c.ed == 0:
            out.setdefault(lay.expert_dp_group_idx(r), (c.et, c.eg, c.e))
        if not expert and c.d == 0 and c.c == 0:
            out.setdefault(lay.dp_group_idx(r), (c.t, c.g, 0))
    return out


def _domains(params: Sequence[ParamInfo], lay: ParallelLayout) -> list[tuple[bool, list[ParamInfo]]]:
    """(expert?, params) per chained optimizer: dense first, experts last when EP > 1."""
    opt = [p for p in params if p.optimized]
    if lay.ep > 1 and any(p.geom.expert for p in opt):
        return [(False, [p for p in opt if not p.geom.expert]), (True, [p for p in opt if p.geom.expert])]
    return [(False, opt)]


def _write_dp_buckets(w: DcpWriter, cache: ArrayCache, params: Sequence[ParamInfo], lay: ParallelLayout,
                      target: Target, man: Manifest, step: int) -> None:
    """dp_reshardable bucket tensors and per-dp_group_idx objects (buffer layout from bridge.layout)."""
    import torch

    domains = _domains(params, lay)
    chained = len(domains) > 1
    groups = _param_groups(man, step)
    for ci, (expert, plist) in enumerate(domains):
        prefix = f"chained_{ci}." if chained else ""
        dp_size = lay.edp if expert else lay.distopt_size
        geoms = [p.geom for p in plist]
        gmap = {gm.name: gm for gm in geoms}
        sizes = {n: lay.tp_gtp_sizes(gm.expert) for n, gm in gmap.items()}
        for k, (t, g, e) in sorted(_dp_coords(lay, expert).items()):
            insts = local_instances(geoms, lay, e)
            bparams = [BufferParam(i.label, gmap[i.name].physical_numel(*sizes[i.name])) for i in insts]
            blay = buffer_layout(bparams, target.bucket_size, dp_size)
            key_dt = "(torch.bfloat16, torch.float32)"
            for b, (b0, _b1) in enumerate(blay.buckets):
                unp = blay.numel_unpadded[b]
                s = blay.shard_size(b)
                for role in ("params", "mu", "nu"):
                    world = np.zeros(unp, dtype=np.float32)
                    for inst in insts:
                        p0, _p1, bid = blay.index[inst.label]
                        if bid != b:
                            continue
                        geom = gmap[inst.name]
                        tp, gtp = sizes[inst.name]
                        for piece in geom.shard_pieces(tp, gtp, t, g, inst.index):
                            lo = p0 - b0 + piece.local_start
                            world[lo:lo + piece.logical.size] = cache.read(role_path(role, piece.array),
                                                                           piece.logical).reshape(-1)
                    fqn = (f"{prefix}optimizer.distributed.dp_group_idx_{k}.gbuf_idx_0.dtype_{key_dt}"
                           f".bucket_idx_{b}.{STATE_NAMES[role]}")
                    w.declare(fqn, torch.float32, (unp,))
                    for r in range(dp_size):
                        lo, hi = r * s, min((r + 1) * s, unp)
                        if hi > lo:
                            w.tensor_chunk(fqn, (lo,), torch.from_numpy(world[lo:hi].copy()))
            pre = f"{prefix}optimizer.distributed.dp_group_idx_{k}."
            dtk = (torch.bfloat16, torch.float32)
            w.obj(pre + "per_bucket_numel/shard_0_1", [{dtk: blay.per_bucket_numel()}])
            w.obj(pre + "per_bucket_numel_unpadded/shard_0_1", [{dtk: list(blay.numel_unpadded)}])
            w.obj(pre + "optimizer/shard_0_1", {"param_groups": _groups_for(groups, expert, chained)})


def _param_groups(man: Manifest, step: int) -> list[dict]:
    """Megatron param groups (identifier keys + hyper-parameters) with `step` set."""
    saved = man.extra.get("megatron", {}).get("param_groups") if isinstance(man.extra, dict) else None
    flat = [dict(g) for gs in (saved or []) for g in gs]
    if not flat:
        o = man.optimizer
        lr = o.lr if o.lr is not None else 0.0
        base = {"wd_mult": 1.0, "lr_mult": 1.0, "is_expert_parallel": False, "is_decoupled_lr": False,
                "default_config": True, "max_lr": lr, "min_lr": lr, "lr": lr, "betas": tuple(o.betas or (0.9, 0.999)),
                "eps": o.eps if o.eps is not None else 1e-8, "weight_decay": o.weight_decay or 0.0}
        flat = [base, dict(base, wd_mult=0.0, weight_decay=0.0 if o.no_decay else (o.weight_decay or 0.0))]
    out = []
    for g in flat:
        g = {k: (tuple(v) if k == "betas" and isinstance(v, list) else v) for k, v in g.items()
             if k not in ("params", "num_params", "optimizer")}
        # An int: TransformerEngine's FusedAdam passes the group step to its kernel, which refuses a
        # float (seen with TE 2.20 after loading a float step); torch Adam's load path takes either.
        g["step"] = int(step)
        out.append(g)
    return out


def _groups_for(groups: list[dict], expert: bool, chained: bool) -> list[dict]:
    """Groups of one chained optimizer (expert flag set), unique by Megatron's identifier keys."""
    out, seen = [], set()
    for g in groups:
        g = dict(g, is_expert_parallel=expert) if chained else dict(g)
        key = json.dumps({k: g.get(k) for k in sorted(g) if k not in ("step",)}, sort_keys=True, default=str)
        if key not in seen:
            seen.add(key)
            out.append(g)
    return out


def megatron_args(meg: dict, params: Sequence[ParamInfo], lay: ParallelLayout, fmt: str, step: int) -> dict:
    """`common_state["args"]` for the target: the source's args, model dims the geometry shows when
    the source saved none, and everything Megatron-LM 0.19.2 reads back about the layout set to it.

    `load_checkpoint` compares num_layers / hidden_size / num_attention_heads (no default: they must
    be present), uses tensor/pipeline sizes, world_size and data_parallel_size to decide whether RNG
    and rerun state are loaded, and `load_args_from_checkpoint` may take the parallel sizes from here.
    """
    args = dict(meg.get("args") or {})
    for p in params:  # model dims the fused section tables know (a library-style source saved no args)
        spec = p.geom.fused
        if spec is None:
            continue
        if spec.info.get("name") == "qkv":
            args.setdefault("num_attention_heads", spec.info["num_heads"])
            args.setdefault("num_query_groups", spec.info["num_query_groups"])
            args.setdefault("kv_channels", spec.info["head_dim"])
            args.setdefault("group_query_attention", spec.info["num_query_groups"] != spec.info["num_heads"])
        elif spec.info.get("name") == "swiglu" and not p.geom.expert:
            args.setdefault("swiglu", True)
            args.setdefault("ffn_hidden_size", spec.info["ffn_hidden"])
    by_name = {p.name: p.geom for p in params}
    layers = [g.prepend[0] for n, g in by_name.items() if n.startswith("decoder.layers.") and g.prepend]
    if layers:
        args.setdefault("num_layers", max(layers))
    emb = by_name.get("embedding.word_embeddings.weight")
    if emb is not None and len(emb.shape) == 2:
        args.setdefault("padded_vocab_size", emb.shape[0])
        args.setdefault("hidden_size", emb.shape[1])
    experts = [g.prepend[1] for g in by_name.values() if g.expert and len(g.prepend) >= 2]
    if experts:
        args.setdefault("num_experts", max(experts))
    recorded_iteration = meg.get("iteration")
    gbs = args.get("global_batch_size")
    if recorded_iteration != step and isinstance(gbs, int) and not args.get("rampup_batch_size"):
        # Trained elsewhere since the source save: the data position follows the step.
        args["consumed_train_samples"] = step * gbs
    args.update(tensor_model_parallel_size=lay.tp, pipeline_model_parallel_size=1,
                virtual_pipeline_model_parallel_size=None, num_layers_per_virtual_pipeline_stage=None,
                context_parallel_size=1, gtp_weight_remat_size=lay.gtp,
                tensor_parallel_num_weight_shards=lay.tp * lay.gtp, expert_model_parallel_size=lay.ep,
                expert_tensor_parallel_size=lay.etp, expert_gtp_weight_remat_size=lay.egtp,
                expert_tensor_parallel_num_weight_shards=lay.etp * lay.egtp, data_parallel_size=lay.dp,
                world_size=lay.world, iteration=step, ckpt_format="torch_dist", use_dist_ckpt=True,
                dist_ckpt_optim_fully_reshardable=fmt == "fully_reshardable", use_distributed_optimizer=True,
                no_save_optim=False,
                # No RNG state is written (a logical checkpoint has none). With no_save_rng set,
                # load_checkpoint skips the RNG load at an unchanged TP/PP instead of failing on it.
                no_save_rng=True)
    return args


def _write_objects(w: DcpWriter, man: Manifest, params: Sequence[ParamInfo], lay: ParallelLayout, target: Target,
                   step: int) -> None:
    """_extra_state objects (None, or TE's empty uint8 tensors, as the source saved them) and common_state."""
    meg = man.extra.get("megatron", {}) if isinstance(man.extra, dict) else {}
    extra_keys = list(meg.get("extra_state_keys") or [])
    if not extra_keys:  # synthesise the keys a run would save for its linears (per stacked instance)
        seen = set()
        for p in params:
            mod = p.name.rsplit(".", 1)[0]
            if p.name.endswith(".weight") and p.geom.tp_kind in ("column", "row") and mod not in seen:
                seen.add(mod)
                for index in np.ndindex(*p.geom.prepend) if p.geom.prepend else [()]:
                    off = ".".join(str(i) for i in index) if index else "0"
                    shp = ".".join(str(n) for n in p.geom.prepend) if index else "1"
                    extra_keys.append(f"{mod}._extra_state/shard_{off}_{shp}")
    empty = meg.get("extra_state_payload") == "empty_uint8_tensor"
    for k in extra_keys:
        w.obj(k, w.torch.empty(0, dtype=w.torch.uint8) if empty else None)
    domains = _domains(params, lay)
    chained = len(domains) > 1
    groups = _param_groups(man, step)
    args = megatron_args(meg, params, lay, target.fmt, step)
    content = {"distrib_optim_sharding_type": target.fmt, "singleton_local_shards": False,
               "chained_optim_avoid_prefix": True}
    if target.fmt == "fully_reshardable":
        per = [{"optimizer": {"param_groups": _groups_for(groups, ex, chained)},
                "param_state_sharding_type": target.fmt} for ex, _ in domains]
        optimizer: Any = per[0] if not chained else {i: s for i, s in enumerate(per)}
    else:
        optimizer = ({"param_state_sharding_type": target.fmt} if not chained else
                     {i: {"param_state_sharding_type": target.fmt} for i in range(len(domains))})
    common = {"args": argparse.Namespace(**args), "checkpoint_version": 3.0, "iteration": step,
              "optimizer": optimizer, "content_metadata": content}
    if meg.get("scheduler"):  # Megatron resumes its lr / wd schedule from this (else it restarts warmup)
        from bridge.lr_schedule import scheduler_state_dict

        common["opt_param_scheduler"] = scheduler_state_dict(meg["scheduler"], step)
    w.obj("common_state/shard_0_1", common)
