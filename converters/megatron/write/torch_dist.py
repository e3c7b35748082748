"""Logical checkpoint -> Megatron-Core `torch_dist` checkpoint at a target layout (`to-megatron`):
the plan (`plan_megatron`) and one process's writing; the entry is `write.to_megatron`.

Writes what `dist_checkpointing.save` writes (megatron-layout.md §5.3): `.distcp` files of
independent `torch.save` blobs, a `.metadata` pickle of DCP's `Metadata`, ShardedObjects
(`common_state`, `_extra_state`, dp_reshardable objects) as `torch.save([obj])` byte items,
and `metadata.json`. Chunks follow the target layout (one per stacked instance and TP shard, or
per (TP, GTP) shard of the 0.19.2 padded grid for GTP-sharded weights; split into row slabs when one
would not fit the budget), so Megatron-Core reads its own rectangles. The output is Megatron-LM's
run directory layout (`<run>/iter_<step, 7 digits>/` + `latest_checkpointed_iteration.txt`,
`converters.megatron.read.rundir`): the iteration directory is written under a temporary name, renamed
when complete, then the tracker set.

Streaming: `megatron_write_plan` groups the work so each logical array's boxes are read once and a
group fits its share of `--budget`; `workers` threads each own one `.distcp` file (TensorStore
reads, numpy copies and file writes release the GIL). Every bf16 weight is checked against
bf16(its fp32 master) on the way; without `model` arrays the weights are derived that way.
"""

from __future__ import annotations

import dataclasses
import contextlib
import io
import json
import os
import queue
import threading
import uuid
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence

import ml_dtypes
import numpy as np

from bridge.cast_check import cast_mismatch
from bridge.errors import BridgeError, require, write_failure
from bridge.location import location
from bridge.budget import per_worker
from bridge.machine import default_workers, mem_available, return_freed_memory
from bridge.layout.boxes import Box
from bridge.layout.distopt import buffer_layout, BufferParam
from bridge.layout.fused import FusedSpec
from bridge.layout.parallel import ParallelLayout
from bridge.layout.params import ParamGeometry
from bridge.store import Checkpoint, Storage, open_checkpoint, open_storage
from bridge.torchrun import host_ranks
from bridge.format.manifest import Manifest, MegatronRecord
from bridge.format import schema
from bridge.format.schema import COUNT_PATH, MODEL, OPTIMIZER_ROLES, PARAMS, STEP_PATH, has_role, split_role
from bridge.dtypes import numpy_dtype, torch_dtype
from bridge.format.tree import megatron_key_to_path, path_str
from bridge.dtypes import from_numpy
from converters.megatron.plan.naming import (check_one_convention, is_gtp_weight, is_routed_expert,
                                             key_prefix, num_prepend_axes, strip_wrappers, tp_kind_by_name)
from converters.megatron.plan.convert_plan import (PipelineSplit, dp_group_places, is_scrambled_swiglu, is_tied,
                                                   local_instances, role_path)
from converters.megatron.read.rundir import plan_run_dir
from converters.megatron.write.objects import common_objects, groups_for, optimizer_domains, param_groups
from converters.megatron.plan.write_plan import (STATE_NAMES, DpJob, ChunkGroup, ParamSpec, layout_limits, plan_groups,
                                                 shard_ranges)

FORMATS = ("fully_reshardable", "dp_reshardable")
#: target megatron-core release -> the optimizer formats it loads that to-megatron writes. Up to 0.16
#: the common state is read from `common.pt` beside the .distcp files (0.19 reads a DCP object);
#: 0.14 loads only fully_sharded_model_space / dp_zero_gather_scatter / fully_sharded_bucket_space.
RELEASES = {"0.14": (), "0.15": FORMATS, "0.16": FORMATS, "0.19": FORMATS}
LEGACY_COMMON = ("0.14", "0.15", "0.16")
ParamInfo = ParamSpec  # a parameter of the logical checkpoint as Megatron keys it


@dataclass
class MegatronTarget:
    """The layout and format to write."""

    tp: int
    gtp: int = 1
    dp: int = 1
    ep: int = 1
    fmt: str = "fully_reshardable"
    pad_for_alignment: int | None = None
    bucket_size: int | None = None
    release: str = "0.19"   # the megatron-core release that will load the output (major.minor)
    pp: int = 1             # pipeline stages (no virtual chunks)
    pp_first: int | None = None   # decoder_first_pipeline_num_layers (None: as the even split)
    pp_last: int | None = None    # decoder_last_pipeline_num_layers
    embedding_in_split: bool = False   # account_for_embedding_in_pipeline_split
    loss_in_split: bool = False        # account_for_loss_in_pipeline_split
    vpp: int = 1                       # virtual pipeline chunks per stage (dp_reshardable: a buffer each)
    key_convention: str = "unwrapped"  # naming.KEY_CONVENTIONS: Megatron-LM's load_checkpoint, or "wrapped" (module.)
    # Megatron-LM's scheduler arguments of the loading run (bridge.format.scheduler_args.SCHEDULER_ARGS names)
    scheduler_args: Mapping[str, Any] | None = None
    # refuse when SRC records no scheduler and no scheduler_args are given (the CLI's default: Megatron-LM's
    # --load needs one); else none is written then (a library's dist_checkpointing.load needs none)
    require_scheduler: bool = False

    def split(self, params: Sequence["ParamInfo"], meg: MegatronRecord | None) -> PipelineSplit:
        """The target's pipeline split; the output layer is tied when the model has none (or the
        source's args say so)."""
        untie = (meg.args or {}).get("untie_embeddings_and_output_weights") if meg else None
        return PipelineSplit(pp=self.pp, first=self.pp_first, last=self.pp_last,
                             embedding_in_split=self.embedding_in_split, loss_in_split=self.loss_in_split,
                             tied=is_tied([p.name for p in params], untie), vpp=self.vpp)


def default_budget() -> int:
    """A quarter of the memory available now, between 256 MiB and 4 GiB."""
    avail = mem_available()
    if avail is None:
        avail = 4 << 30
    return int(min(4 << 30, max(256 << 20, avail // 4)))


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
    meg = man.megatron or MegatronRecord()
    recorded = meg.params
    out: list[ParamInfo] = []
    if recorded:
        for p in recorded:
            name = strip_wrappers(p.name)
            spec = fused.get(path_str(megatron_key_to_path(name)))
            geom = ParamGeometry(name, tuple(p.shape), p.tp_kind, gtp=bool(p.gtp) or is_gtp_weight(name),
                                 pad_for_alignment=pad, prepend=tuple(p.prepend), fused=spec, expert=bool(p.expert))
            out.append(ParamInfo(name, geom, p.dtype, bool(p.optimized)))
        return out
    # Derived: every model/* (else params/*) array; fused sections regrouped by the manifest table.
    role = MODEL if has_role(arrays, MODEL) else PARAMS
    # Megatron's weights are bf16 (fp16 runs say so in their args); derived from masters when absent.
    weight_dtype = "float16" if (meg.args or {}).get("fp16") else "bfloat16"
    seen: set[str] = set()
    for full, info in arrays.items():
        found = split_role(full)
        if found is None or found[0] != role:
            continue
        param = found[1]
        name = ".".join(param)
        parent = ".".join(param[:-1])
        spec = fused.get("/".join(param[:-1]))
        if spec is not None and param[-1] in spec.names:
            if parent in seen:
                continue
            seen.add(parent)
            npre = num_prepend_axes(parent)
            first = arrays[schema.role_path(role, param[:-1] + (spec.names[0],))]
            shape = (spec.rows,) + tuple(first.shape[npre + 1:])
            geom = ParamGeometry(parent, shape, "column", gtp=is_gtp_weight(parent), pad_for_alignment=pad,
                                 prepend=tuple(first.shape[:npre]), fused=spec, expert=is_routed_expert(parent))
            out.append(ParamInfo(parent, geom, weight_dtype, schema.role_path(PARAMS, param) in arrays))
            continue
        npre = num_prepend_axes(name)
        kind = tp_kind_by_name(name) if len(info.shape) > npre else "replicated"
        geom = ParamGeometry(name, tuple(info.shape[npre:]), kind, gtp=is_gtp_weight(name), pad_for_alignment=pad,
                             prepend=tuple(info.shape[:npre]), expert=is_routed_expert(name))
        out.append(ParamInfo(name, geom, weight_dtype, schema.role_path(PARAMS, param) in arrays))
    return out


# ---------------------------------------------------------------------------------------------
# MegatronTarget checks


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
# DCP files


@dataclass
class Written:
    """Where one blob went: (fqn, chunk offsets or None for an object, chunk sizes) -> file range."""

    fqn: str
    offsets: tuple[int, ...] | None
    sizes: tuple[int, ...] | None
    rel: str
    offset: int
    length: int


def _sync_file_range() -> Callable[[int, int, int], Any] | None:
    """libc's sync_file_range (Linux), or None where there is none."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint)
    fn.restype = ctypes.c_int
    return fn


_SYNC_FILE_RANGE = _sync_file_range() if os.name == "posix" else None
SYNC_FILE_RANGE_WRITE = 2  # <linux/fs.h>: start writeback of the range's dirty pages, do not wait
WRITEBACK_BYTES = 64 << 20  # start the disk writing once this much of a file is dirty


@contextlib.contextmanager
def writing(path: str) -> Iterator[None]:
    """A failed write of `path` as one line naming it: "disk full" for ENOSPC, or for torch's short-write
    RuntimeError on a full file system (`bridge.errors.write_failure`)."""
    try:
        yield
    except (OSError, RuntimeError) as e:
        raise write_failure(path, e) from e


class DcpFile:
    """`.distcp` file number `index` (`__<index>_0.distcp`) in directory `root`: independent
    `torch.save` blobs; used by one thread at a time.

    The disk starts writing each blob's pages as soon as there are `writeback_bytes` of them
    (sync_file_range, not waiting): on a host whose dirty-page limits exceed the output, the
    kernel would otherwise hold every byte until `close`'s fsync, which then writes the whole file
    after all reading is done instead of while the next blobs are read."""

    def __init__(self, root: str, index: int, *, writeback_bytes: int = WRITEBACK_BYTES,
                 sync_range: Callable[[int, int, int, int], Any] | None = _SYNC_FILE_RANGE) -> None:
        import torch

        self.torch = torch
        self.writeback_bytes, self.sync_range = writeback_bytes, sync_range
        self.rel = f"__{index}_0.distcp"
        self.f = open(os.path.join(root, self.rel), "wb")
        self.bytes = 0
        self.flushed = 0  # the file's bytes before this offset have had writeback started

    def tensor(self, fqn: str, offsets: Sequence[int], tensor: Any) -> Written:
        # Straight into the file, as DCP's own _write_item does (no in-memory copy of the blob).
        off = self.f.tell()
        with writing(self.f.name):
            self.torch.save(tensor, self.f)
        n = self.f.tell() - off
        self.bytes += n
        self._writeback(off + n)
        return Written(fqn, tuple(int(o) for o in offsets), tuple(int(s) for s in tensor.shape), self.rel, off, n)

    def _writeback(self, end: int) -> None:
        if self.sync_range is None or end - self.flushed < self.writeback_bytes:
            return
        self.f.flush()
        # A hint only: a failure here (an fs without it) leaves the work to close()'s fsync.
        self.sync_range(self.f.fileno(), self.flushed, end - self.flushed, SYNC_FILE_RANGE_WRITE)
        self.flushed = end

    def obj(self, fqn: str, value: Any) -> Written:
        buf = io.BytesIO()
        self.torch.save([value], buf)
        off = self.f.tell()
        with writing(self.f.name):
            self.f.write(buf.getbuffer())
        self.bytes += buf.tell()
        return Written(fqn, None, None, self.rel, off, buf.tell())

    def close(self) -> None:
        if not self.f.closed:
            with writing(self.f.name):
                try:
                    self.f.flush()
                    os.fsync(self.f.fileno())
                finally:
                    self.f.close()   # flushes what is left again: a full disk raises here too


class RemoteDcpFile:
    """`DcpFile` for storage that puts each object whole (s3:// / gs://): blobs collect in memory and
    go out as whole objects of about `part_bytes` (`__<i>_<j>.distcp`, j = 0, 1, ...; DCP's metadata
    names each blob's object), so memory stays bounded however much one worker writes."""

    def __init__(self, root: str, index: int, part_bytes: int) -> None:
        import torch

        self.torch = torch
        self.storage = open_storage(root)
        self.root, self.index, self.part_bytes = root, index, max(1, part_bytes)
        self.part = 0
        self.rel = f"__{index}_0.distcp"
        self.f = io.BytesIO()
        self.bytes = 0

    def _roll(self) -> None:
        if self.f.tell() >= self.part_bytes:
            self._put()
            self.part += 1
            self.rel = f"__{self.index}_{self.part}.distcp"

    def _put(self) -> None:
        if self.f.tell():
            self.storage.replace_bytes(self.rel, self.f.getbuffer().tobytes())
        self.f = io.BytesIO()

    def tensor(self, fqn: str, offsets: Sequence[int], tensor: Any) -> Written:
        off = self.f.tell()
        self.torch.save(tensor, self.f)
        n = self.f.tell() - off
        self.bytes += n
        w = Written(fqn, tuple(int(o) for o in offsets), tuple(int(s) for s in tensor.shape), self.rel, off, n)
        self._roll()
        return w

    def obj(self, fqn: str, value: Any) -> Written:
        off = self.f.tell()
        self.torch.save([value], self.f)
        n = self.f.tell() - off
        self.bytes += n
        w = Written(fqn, None, None, self.rel, off, n)
        self._roll()
        return w

    def close(self) -> None:
        if self.f is not None:
            self._put()
            self.f = None


#: Opens file `index` of the output in the temporary directory (or object prefix) `root`; the
#: writer's one seam, as torch DCP takes a StorageWriter: `to_megatron(open_file=...)`.
OpenFile = Callable[[str, int], "DcpFile | RemoteDcpFile"]


def default_open_file(storage: Storage, limit: int) -> OpenFile:
    """`DcpFile`, or where files are put whole (s3:// / gs://) a `RemoteDcpFile` putting objects of
    about `limit` (1..256 MiB)."""
    if not storage.appends:
        part = max(1 << 20, min(limit, 256 << 20))
        return lambda root, index: RemoteDcpFile(root, index, part)
    return DcpFile


class DcpIndex:
    """The DCP `Metadata` being collected (main thread only)."""

    def __init__(self) -> None:
        self.tensors: dict[str, tuple[str, tuple[int, ...]]] = {}
        self.written: list[Written] = []

    def declare(self, fqn: str, dtype: str, shape: Sequence[int]) -> None:
        self.tensors.setdefault(fqn, (dtype, tuple(int(s) for s in shape)))

    def encode(self) -> tuple[bytes, bytes]:
        """(`.metadata`, `metadata.json`) as bytes."""
        import pickle

        import torch
        from torch.distributed.checkpoint.filesystem import _StorageInfo
        from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                           MetadataIndex, StorageMeta, TensorProperties,
                                                           TensorStorageMetadata)

        chunks: dict[str, list[Written]] = {fqn: [] for fqn in self.tensors}
        sdm: dict[str, Any] = {}
        storage = {}
        for w in self.written:
            if w.offsets is None:
                sdm[w.fqn] = BytesStorageMetadata()
                storage[MetadataIndex(w.fqn)] = _StorageInfo(w.rel, w.offset, w.length)
            else:
                chunks[w.fqn].append(w)
                storage[MetadataIndex(w.fqn, torch.Size(w.offsets))] = _StorageInfo(w.rel, w.offset, w.length)
        for fqn, (dtype, shape) in self.tensors.items():
            cs = sorted(chunks[fqn], key=lambda w: w.offsets)
            sdm[fqn] = TensorStorageMetadata(TensorProperties(dtype=torch_dtype(dtype)), torch.Size(shape),
                                             [ChunkStorageMetadata(torch.Size(w.offsets), torch.Size(w.sizes))
                                              for w in cs])
        md = Metadata(state_dict_metadata=sdm, planner_data=None, storage_data=storage,
                      storage_meta=StorageMeta(checkpoint_id=None, save_id=str(uuid.uuid4())), version="1.0.0")
        return pickle.dumps(md), json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1}).encode()


def _write_common_pt(root: str, common: dict) -> None:
    """megatron-core <= 0.16's common state file: `torch.save` of the dict, beside the .distcp files."""
    import torch

    path = os.path.join(root, "common.pt")
    with writing(path), open(path, "wb") as f:
        torch.save(common, f)
        f.flush()
        os.fsync(f.fileno())


# ---------------------------------------------------------------------------------------------
# Entry point


@dataclass
class Stats:
    """Elements read from the store vs the elements the output needed (a read-once check)."""

    read: int = 0
    needed: int = 0
    read_bytes: int = 0

    def add(self, other: "Stats") -> None:
        self.read += other.read
        self.needed += other.needed
        self.read_bytes += other.read_bytes


@dataclass
class MegatronPlan:
    """What `to_megatron` writes, planned before anything is (the same on every rank under torchrun)."""

    src: str
    ck: Checkpoint
    man: Manifest
    params: list
    lay: ParallelLayout
    target: MegatronTarget
    step: int
    where: Any              # converters.megatron.read.rundir.RunDirPlan
    groups: list[ChunkGroup]
    dp_jobs: list[DpJob]
    dp_objects: list
    derive: bool
    budget: int
    workers: int
    limit: int
    sched: dict | None      # common_state["opt_param_scheduler"], or None (none written)
    objects: list           # (key, value) of the common state and other objects, in the target's convention

    @property
    def storage(self) -> Storage:
        """Where the iteration is written (decided once, from DST, by `plan_run_dir`)."""
        return open_storage(self.where.iter_dir)

    @property
    def total_bytes(self) -> int:
        return sum(c.nbytes for g in self.groups for c in g.chunks) + sum(j.nbytes for j in self.dp_jobs)

    def jobs(self) -> list[tuple[Callable, Any, int]]:
        """(function, job, bytes) of every chunk group and DistOpt bucket job, in plan order."""
        return [(_run_group, g, sum(c.nbytes for c in g.chunks)) for g in self.groups] + \
               [(_run_dp_job, j, j.nbytes) for j in self.dp_jobs]

    def index(self) -> DcpIndex:
        """The DCP index with every tensor declared (the blobs are added as they are written)."""
        index = DcpIndex()
        for g in self.groups:
            for c in g.chunks:
                index.declare(c.fqn, c.dtype, c.global_shape)
        for j in self.dp_jobs:
            index.declare(j.fqn, "float32", (j.numel,))
        return index

    def claim(self):
        """Exclusive temp dir beside the iteration dir, renamed when complete (bridge.store.claim); on
        object storage the iteration prefix itself, `.metadata` written last (bridge.store.remote)."""
        return self.storage.claim(sources=[self.src], marker=".metadata")

    def result(self, nbytes: int, stats: "Stats") -> dict:
        where = self.where
        return {"dst": where.iter_dir, "run_dir": where.run_dir, "tracker": where.tracker,
                "tracker_previous": where.previous, "layout": self.lay.to_json(), "format": self.target.fmt,
                "bytes": nbytes, "params": len(self.params), "step": self.step,  # foreign: report keys (commands/to_megatron.py)
                "weights_derived": self.derive, "budget": self.budget, "workers": self.workers,
                "scheduler": ("built" if self.target.scheduler_args else "carried") if self.sched else None,
                "elements_read": stats.read, "elements_needed": stats.needed, "bytes_read": stats.read_bytes}


def plan_megatron(src: str, dst: str, target: MegatronTarget, budget: int | None, workers: int | None,
                  weights_from_masters: bool) -> MegatronPlan:
    """Check the request and the checkpoint, and plan every file's work (no output written)."""
    src, dst = location(src, "source"), location(dst, "destination")
    require("to-megatron", "torch")
    on_host = host_ranks()  # under torchrun the host's memory and cores are shared by its ranks
    budget = int(budget or default_budget() // on_host)
    workers = int(workers or default_workers((os.cpu_count() or 1) // on_host))
    if target.fmt not in FORMATS:
        raise BridgeError(f"unknown --format {target.fmt!r}; use one of {list(FORMATS)}")
    if target.release not in RELEASES:
        raise BridgeError(f"unknown --megatron-core {target.release!r}; use one of {list(RELEASES)}")
    if target.fmt not in RELEASES[target.release]:
        raise BridgeError(f"megatron-core {target.release} does not load --format {target.fmt} (it loads "
                          f"fully_sharded_model_space / dp_zero_gather_scatter, which to-megatron does not write "
                          f"yet); target 0.15 or later")
    if workers < 1 or budget < 1:
        raise BridgeError(f"--workers {workers} / --budget {budget}: both must be positive")
    ck = open_checkpoint(src)
    man = manifest_of(ck)
    man.optimizer.check(src)  # out-of-range hyper-parameters are never written into a run
    arrays = ck.arrays()
    has_model = has_role(arrays, MODEL)
    derive = weights_from_masters or not has_model
    pad = target.pad_for_alignment if target.pad_for_alignment is not None else (man.source.pad_for_alignment or 16)
    params = params_from_manifest(man, arrays, pad, target.gtp)
    if target.fmt == "dp_reshardable" and not (man.megatron and man.megatron.params):
        raise BridgeError(f"{src}: dp_reshardable needs Megatron's parameter registration order, which this "
                          f"checkpoint's manifest does not record (not written by convert); use "
                          f"--format fully_reshardable")
    if not params:
        raise BridgeError(f"{src}: no model or params arrays; nothing to write")
    layout_limits(params, target.tp, target.gtp, target.dp, target.ep)
    try:
        lay = ParallelLayout(tp=target.tp, gtp=target.gtp, dp=target.dp, ep=target.ep, pp=target.pp)
    except BridgeError as e:
        raise BridgeError(f"target layout: {e}") from None
    check_target(params, lay)
    split = target.split(params, man.megatron)
    for p in params:
        if p.name.startswith("decoder.layers.") and p.geom.prepend:
            split.counts(p.geom.prepend[0])  # a split Megatron accepts (raises naming the sizes)
    _check_arrays(src, params, arrays, derive)
    step = int(ck.read(STEP_PATH)) if STEP_PATH in arrays else int(man.optimizer.step or 0)
    count = int(ck.read(COUNT_PATH)) if COUNT_PATH in arrays else step
    if count != step:
        raise BridgeError(f"{src}: step {step} and {path_str(COUNT_PATH)} {count} differ; the checkpoint is inconsistent")
    sched = scheduler_state(src, man, step, target)
    where = plan_run_dir(dst, step)
    workers = min(workers, len(params) * lay.world)   # a file each: more than the chunks to write leaves some empty
    limit = per_worker(budget, workers)  # bridge.budget: the one split of a budget
    prefix = key_prefix(target.key_convention)
    groups = plan_groups(params, lay, target.fmt, derive=derive, limit=limit, key_prefix=prefix)
    dp_jobs, dp_objects = (_plan_dp(params, lay, target, man, step, limit, split, sched) if target.fmt == "dp_reshardable"
                           else ([], []))
    objects = common_objects(man, params, lay, target, step, sched)
    # one convention for every entry, checked before anything is written
    check_one_convention([c.fqn for g in groups for c in g.chunks] + [j.fqn for j in dp_jobs] +
                         [k for k, _ in dp_objects + objects], target.key_convention,
                         {p.name.split(".", 1)[0] for p in params})
    return MegatronPlan(src, ck, man, params, lay, target, step, where, groups, dp_jobs, dp_objects, derive, budget,
                        workers, limit, sched, objects)


def write_files(mp: MegatronPlan, tmp: str, open_file: OpenFile | None, first: int, jobs: list, objects: bool,
                bar) -> tuple[list[Written], "Stats", int]:
    """Run `jobs` on `mp.workers` threads, each with its own `.distcp` file (numbered from `first`),
    then, with `objects`, the plan's objects (common state, DistOpt objects) into the first file.
    Returns (every blob written, read statistics, bytes written)."""
    return_freed_memory()
    opener = open_file or default_open_file(mp.storage, mp.limit)
    files = [opener(tmp, first + i) for i in range(mp.workers)]
    written: list[Written] = []
    stats = Stats()
    try:
        for w, st in _run_pool(jobs, mp.ck, files, bar):
            written += w
            stats.add(st)
        if objects:
            for fqn, value in mp.dp_objects:
                written.append(files[0].obj(fqn, value))
            for fqn, value in mp.objects:
                if fqn.startswith("common_state/") and mp.target.release in LEGACY_COMMON:
                    _write_common_pt(tmp, value)
                    continue
                written.append(files[0].obj(fqn, value))
        nbytes = sum(f.bytes for f in files)
    finally:
        for f in files:
            f.close()
    return written, stats, nbytes


def publish_iteration(claim: Any, index: DcpIndex) -> None:
    """Write the DCP metadata and make the iteration directory visible: the claim's publish writes the
    files into its temporary directory and renames it, or on object storage puts `.metadata` last."""
    md, mj = index.encode()
    with writing(os.path.join(claim.tmp, ".metadata")):   # a full disk: one line naming it
        claim.publish(files=[("metadata.json", mj), (".metadata", md)])


def take_back(mp: MegatronPlan, published: bool, created_run: bool) -> None:
    """After a failure: remove a published iteration (its tracker was not set), and an emptied new run dir."""
    if published:  # only what this run wrote there
        mp.storage.remove_published(".metadata")
    if created_run:
        _remove_if_empty(mp.where.run_dir)


def scheduler_state(src: str, man: Manifest, step: int, target: MegatronTarget) -> dict | None:
    """`common_state["opt_param_scheduler"]` for step `step`: built from the loading run's arguments
    when given (num_steps: the samples the source recorded, else step x global batch size), else the
    source's recorded state carried; else None, or refused naming the flags when `require_scheduler`."""
    from bridge.format.scheduler_args import NEEDED, record_from_args
    from bridge.lr_schedule import samples_at, scheduler_state_dict

    recorded = man.megatron.scheduler if man.megatron else None
    if target.scheduler_args:
        rec = record_from_args(target.scheduler_args, step)
        if recorded:
            rec = dataclasses.replace(rec, num_steps=samples_at(recorded, step))
        return scheduler_state_dict(rec, step)
    if recorded:
        return scheduler_state_dict(recorded, step)
    if not target.require_scheduler:
        return None
    raise BridgeError(f"{src} records no Megatron LR-scheduler state, and Megatron-LM's --load restores the "
                      f"optimizer only with one (KeyError 'opt_param_scheduler'); pass the loading run's scheduler "
                      f"arguments ({NEEDED} [--min-lr X] [--lr-decay-style S] [--lr-warmup-iters N] "
                      f"[--lr-decay-iters N] [--weight-decay X] ..., or --megatron-args FILE), or --no-scheduler")


def _check_arrays(src: str, params: Sequence[ParamInfo], arrays: dict, derive: bool) -> None:
    """Every array the output takes exists with the recorded shape."""
    for p in params:
        for arr, want in p.geom.logical_arrays().items():
            roles = OPTIMIZER_ROLES if p.optimized else ()
            if not (derive and p.optimized):
                roles = (MODEL,) + roles
            for role in roles:
                path = role_path(role, arr)
                if path not in arrays:
                    how = " (and no fp32 master to derive it from)" if role == MODEL else ""
                    raise BridgeError(f"{src}: array {path_str(path)} is missing{how}; the checkpoint is incomplete")
                if tuple(arrays[path].shape) != tuple(want):
                    raise BridgeError(f"{path_str(path)}: shape {arrays[path].shape} differs from the recorded "
                                      f"parameter shape {want}; the manifest and the arrays disagree")


def _run_pool(jobs: list, ck: Checkpoint, files: list[DcpFile], bar):
    """Run (fn, job, nbytes) on len(files) threads, each job with a file no other thread holds;
    yield results in completion order. On an error (or a signal in the main thread) no new job
    starts, running ones finish, and the error propagates."""
    free: queue.Queue = queue.Queue()
    for f in files:
        free.put(f)
    stop = threading.Event()

    def call(fn, job):
        if stop.is_set():
            return [], Stats()
        f = free.get()
        try:
            return fn(job, ck, f, stop)
        finally:
            free.put(f)

    pool = ThreadPoolExecutor(max_workers=len(files), thread_name_prefix="to-megatron")
    try:
        pending = {pool.submit(call, fn, job): n for fn, job, n in jobs}
        while pending:
            done, _ = wait(pending, return_when=FIRST_EXCEPTION, timeout=0.5)
            for fut in done:
                n = pending.pop(fut)
                result = fut.result()  # raises the job's error
                bar.update(n)
                yield result
    finally:
        stop.set()
        pool.shutdown(wait=True, cancel_futures=True)


def _read_boxes(ck: Checkpoint, reads: dict) -> dict:
    """Read every (array, box) at once (TensorStore futures) -> array -> (box, numpy data)."""
    from bridge.errors import IntegrityError

    stores = ck.open_many(list(reads))
    futs = {a: (box, t[box.slices].read()) for (a, box), t in zip(reads.items(), stores)}
    out = {}
    for a, (box, fut) in futs.items():
        try:
            out[a] = (box, np.asarray(fut.result()))
        except Exception as e:
            raise IntegrityError(f"array {path_str(a)}: read of {box} failed: {' '.join(str(e).split())[:300]}") from e
    return out


def _run_group(g: ChunkGroup, ck: Checkpoint, f: DcpFile, stop: threading.Event) -> tuple[list[Written], Stats]:
    """Read the group's boxes once, check weights against masters, assemble and write its chunks."""
    reads = g.reads()
    blocks = _read_boxes(ck, reads)
    st = Stats(read=sum(b.size for b in reads.values()), needed=sum(g.needed().values()),
               read_bytes=sum(d.nbytes for _, d in blocks.values()))
    for weights, masters in g.checks:
        check_weights(weights, blocks[weights], blocks[masters])
    out = []
    for c in g.chunks:
        if stop.is_set():  # the run is being abandoned: stop writing into the temp dir now
            break
        covered = sum(t.dst.size for t in c.takes) == int(np.prod(c.shape, dtype=np.int64))
        # GTP pad rows (not covered by any take) stay zero; a fully covered chunk skips the memset
        data = (np.empty if covered else np.zeros)(c.shape, dtype=numpy_dtype(c.dtype))
        for t in c.takes:
            box, a = blocks[t.array]
            part = a[t.logical.relative_to(box).slices]
            # Derived weights: fp32 -> bf16 rounds to nearest even (ml_dtypes), as Megatron's copy_ does.
            data[t.dst.slices] = part.astype(data.dtype) if c.cast else part
        out.append(f.tensor(c.fqn, c.start, from_numpy(data)))
    return out, st


def check_weights(path: tuple, weights: tuple[Box, np.ndarray], masters: tuple[Box, np.ndarray]) -> None:
    """bf16 weights must be bf16(fp32 masters) (what Megatron's optimizer step leaves), element by element."""
    (wbox, w), (mbox, m) = weights, masters
    if wbox != mbox:
        raise BridgeError(f"{path_str(path)}: internal plan error: weights box {wbox} != masters box {mbox}")
    mm = cast_mismatch(m, w, wbox)
    if mm is None:
        return
    name = "bf16" if w.dtype == ml_dtypes.bfloat16 else str(w.dtype)
    first = mm.local
    raise BridgeError(f"{path_str(path)}: {name} weights differ from {name}(params) at {mm.count} of {mm.size} elements "
                      f"read, first at index {mm.index} (weight {float(w[first])!r}, {name}(master) "
                      f"{float(mm.cast[first])!r}): "
                      f"the weights were not updated after the optimizer step; re-save with model=None to derive them "
                      f"from the masters, or pass --weights-from-masters")


def _run_dp_job(j: DpJob, ck: Checkpoint, f: DcpFile, stop: threading.Event) -> tuple[list[Written], Stats]:
    """One bucket role: each chunk range filled from the segments it overlaps; a segment running into
    the next range is kept, so every segment is read once."""
    import bisect

    starts = [s[0] for s in j.segments]
    held: dict[int, np.ndarray] = {}
    st = Stats()
    out = []
    for lo, hi in j.ranges:
        if stop.is_set():
            break
        data = np.zeros(hi - lo, dtype=np.float32)
        i = max(0, bisect.bisect_right(starts, lo) - 1)
        keep: dict[int, np.ndarray] = {}
        while i < len(j.segments) and j.segments[i][0] < hi:
            s0, arr, box = j.segments[i]
            s1 = s0 + box.size
            if s1 > lo:
                flat = held.get(i)
                if flat is None:
                    flat = _read_boxes(ck, {arr: box})[arr][1].reshape(-1)
                    st.read += flat.size
                    st.read_bytes += flat.nbytes
                a, b = max(lo, s0), min(hi, s1)
                data[a - lo:b - lo] = flat[a - s0:b - s0]
                st.needed += b - a
                if s1 > hi:
                    keep[i] = flat
            i += 1
        held = keep
        out.append(f.tensor(j.fqn, (lo,), from_numpy(data)))
    return out, st


def _remove_if_empty(path: str) -> None:
    try:
        os.rmdir(path)
    except OSError:
        pass


def _plan_dp(params: Sequence[ParamInfo], lay: ParallelLayout, target: MegatronTarget, man: Manifest, step: int,
             limit: int, split: PipelineSplit, sched: dict | None = None) -> tuple[list[DpJob], list[tuple[str, Any]]]:
    """dp_reshardable bucket jobs and per-dp_group_idx objects (buffer layout from bridge.layout). Tied
    at PP > 1, the last stage's buffer holds a copy of the embedding's state (`Instance.tied_copy`)."""
    import torch

    jobs: list[DpJob] = []
    objects: list[tuple[str, Any]] = []
    domains = optimizer_domains(params, lay)
    chained = len(domains) > 1
    groups = param_groups(man, step, sched)
    key_dt = "(torch.bfloat16, torch.float32)"
    for ci, (expert, plist) in enumerate(domains):
        prefix = f"chained_{ci}." if chained else ""
        dp_size = lay.edp if expert else lay.distopt_size
        geoms = [p.geom for p in plist]
        gmap = {gm.name: gm for gm in geoms}
        sizes = {n: lay.tp_gtp_sizes(gm.expert) for n, gm in gmap.items()}
        for k, (t, g, e, stage) in sorted(dp_group_places(lay, expert).items()):
            padded, unpadded = [], []
            for v in range(split.vpp):   # one DDP buffer per virtual pipeline chunk: gbuf_idx = chunk
                insts = local_instances(geoms, lay, e, stage, split, v)
                bparams = [BufferParam(i.label, gmap[i.name].physical_numel(*sizes[i.name]), i.shared) for i in insts]
                # Megatron-LM's training loop buckets only the first model chunk of the first stage
                # (training.py: `None if (disable or pp_rank > 0)`); it loads only that layout
                blay = buffer_layout(bparams, target.bucket_size if stage == 0 and v == 0 else None, dp_size)
                jobs += _bucket_jobs(blay, insts, gmap, sizes, t, g, dp_size, limit,
                                     f"{prefix}optimizer.distributed.dp_group_idx_{k}.gbuf_idx_{v}.dtype_{key_dt}")
                padded.append(blay.per_bucket_numel())
                unpadded.append(list(blay.numel_unpadded))
            pre = f"{prefix}optimizer.distributed.dp_group_idx_{k}."
            dtk = (torch.bfloat16, torch.float32)
            objects.append((pre + "per_bucket_numel/shard_0_1", [{dtk: n} for n in padded]))
            objects.append((pre + "per_bucket_numel_unpadded/shard_0_1", [{dtk: n} for n in unpadded]))
            objects.append((pre + "optimizer/shard_0_1", {"param_groups": groups_for(groups, expert, chained)}))
    return jobs, objects


def _bucket_jobs(blay: Any, insts: Sequence[Any], gmap: dict, sizes: dict, t: int, g: int, dp_size: int, limit: int,
                 prefix: str) -> list[DpJob]:
    """The bucket tensors of one DDP buffer (`prefix` names it up to `.bucket_idx_`), in every optimizer role."""
    segs: dict[int, list[tuple[int, str, Box]]] = {b: [] for b in range(len(blay.buckets))}
    for inst in insts:
        p0, _p1, bid = blay.index[inst.label]
        geom = gmap[inst.name]
        for piece in geom.shard_pieces(*sizes[inst.name], t, g, inst.index):
            segs[bid].append((p0 - blay.buckets[bid][0] + piece.local_start, piece.array, piece.logical))
    jobs = []
    for b in range(len(blay.buckets)):
        unp = blay.numel_unpadded[b]
        # a range's fp32 chunk plus the segments read into it (TensorStore's 2x while reading)
        ranges = shard_ranges(unp, blay.shard_size(b), dp_size, max(1, limit // 12))
        ordered = sorted(segs[b], key=lambda s: s[0])
        for role in OPTIMIZER_ROLES:
            fqn = f"{prefix}.bucket_idx_{b}.{STATE_NAMES[role]}"
            jobs.append(DpJob(fqn, unp, ranges, [(o, role_path(role, a), box) for o, a, box in ordered]))
    return jobs
