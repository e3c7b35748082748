"""Commit: barrier, coverage check, OCDBT merge, Orbax metadata, fsync, atomic rename.

Protocol (W writers, any number of processes)::

    tmp = begin_checkpoint(dst)                       # once, before writers start (rank 0 + barrier)
    ... each writer: CheckpointWriter(tmp, plan, w).write(...); .finish()
    commit_checkpoint(dst, plan, manifest)            # one process; waits for all writer reports

`finalize(dst, plan, writer_id, manifest)` wraps the last step for every writer: with
torch.distributed initialised it barriers, rank 0 commits and the outcome is broadcast; without
it, writer 0 waits (file barrier with a timeout) for the other writers' reports and commits.
A directory is only ever renamed to `dst` after every check passed, so `dst` is either a complete
checkpoint or absent.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import sys
import time
from typing import Mapping, Sequence

import numpy as np

from bridge.errors import BridgeError
from bridge.progress import progress
from bridge.store import digest as dg
from bridge.store import specs
from bridge.store.durable import fsync_path, fsync_tree, write_json_atomic
from bridge.store.manifest import MANIFEST_KEY, ArrayRecord, Manifest
from bridge.store.plan import ArraySpec, WritePlan, make_write_plan
from bridge.store.tree import path_str, tree_metadata
from bridge.store.writer import REPORT_DIR, CheckpointWriter, report_path

TMP_SUFFIX = ".orbax-checkpoint-tmp"
CHECKSUM_KEY = "gtp_bridge_checksum"
ITEM_HANDLER = "orbax.checkpoint._src.handlers.standard_checkpoint_handler.StandardCheckpointHandler"


def tmp_dir_for(dst: str) -> str:
    """Orbax's temporary directory name for a checkpoint being written to `dst`."""
    return os.path.abspath(dst).rstrip("/") + TMP_SUFFIX


def begin_checkpoint(dst: str) -> str:
    """Create a fresh `<dst>.orbax-checkpoint-tmp` (removing a stale one); refuse an existing `dst`.

    Under torch.distributed every rank calls it: rank 0 prepares the directory, the outcome is
    broadcast and all ranks return the tmp path (or raise the same error). Without it, call it
    once before starting the writer processes.
    """
    if not dist_initialized():
        return _begin_local(dst)
    import torch.distributed as dist

    err = [None]
    if dist.get_rank() == 0:
        try:
            _begin_local(dst)
        except BridgeError as e:
            err = [str(e)]
    dist.broadcast_object_list(err, src=0)
    if err[0] is not None:
        raise BridgeError(err[0])
    return tmp_dir_for(dst)


def _begin_local(dst: str) -> str:
    dst = os.path.abspath(dst)
    if os.path.lexists(dst):
        raise BridgeError(f"destination {dst} already exists; choose a new directory or remove it")
    tmp = tmp_dir_for(dst)
    if os.path.lexists(tmp):
        # Left by a crashed save (never a committed checkpoint: those carry no tmp suffix).
        shutil.rmtree(tmp)
    os.makedirs(tmp)
    return tmp


def checkpoint_metadata_json(init_ns: int, commit_ns: int | None = None) -> dict:
    """`_CHECKPOINT_METADATA` as Orbax's StandardCheckpointer writes it."""
    return {"item_handlers": ITEM_HANDLER, "metrics": {}, "performance_metrics": {},
            "init_timestamp_nsecs": init_ns, "commit_timestamp_nsecs": commit_ns, "custom_metadata": {}}


# -- barrier -------------------------------------------------------------------------------------
def dist_initialized() -> bool:
    """True when torch.distributed has a process group (never imports torch: that costs seconds)."""
    dist = sys.modules.get("torch.distributed")
    return dist is not None and dist.is_available() and dist.is_initialized()


def wait_for_reports(tmp_dir: str, plan: WritePlan, timeout: float = 600.0, poll: float = 0.05) -> list[dict]:
    """File barrier: wait until every writer published its report; BridgeError naming the missing ones."""
    deadline = time.monotonic() + timeout
    missing = list(range(plan.num_writers))
    wait = 0.001
    while True:
        missing = [w for w in missing if not os.path.exists(report_path(tmp_dir, w))]
        if not missing:
            break
        if time.monotonic() > deadline:
            raise BridgeError(f"writers {missing} did not finish within {timeout:.0f} s (crashed or still writing); "
                              f"nothing was committed, rerun the save")
        time.sleep(wait)
        wait = min(poll, wait * 2)  # start at 1 ms: writers usually finish together, so most waits are short
    reports = []
    for w in range(plan.num_writers):
        with open(report_path(tmp_dir, w)) as f:
            r = json.load(f)
        if r.get("plan") != plan.fingerprint():
            raise BridgeError(f"writer {w} wrote with a different plan than the committer holds; "
                              "all writers must use the same WritePlan")
        reports.append(r)
    return reports


# -- checks (pure) -------------------------------------------------------------------------------
def check_coverage(plan: WritePlan, reports: Sequence[dict]) -> dict[str, int]:
    """Every chunk of every array written completely by its owner; returns name -> combined digest.

    Raises BridgeError naming the array and the first unwritten region.
    """
    digests: dict[str, int] = {}
    for name, ap in plan.arrays.items():
        own = ap.ownership
        partial = []
        for w in own.writers() if own.num_chunks else []:
            idx = own.chunks_owned_by(w)
            entry = reports[w]["arrays"].get(name)
            covered = entry["covered"] if entry else [0] * len(idx)
            if len(covered) != len(idx):
                raise BridgeError(f"{path_str(ap.spec.path)}: writer {w} reported {len(covered)} chunks, owns {len(idx)}")
            for i, c in zip(idx, covered):
                box = own.chunk_box(i)
                if c != box.size:
                    raise BridgeError(f"{path_str(ap.spec.path)}: region {box} was not fully written by its owner, "
                                      f"writer {w} ({c} of {box.size} elements); nothing was committed")
            if entry:
                partial.append(int(entry["digest"], 16))
        digests[name] = dg.combine(partial)
    return digests


def metadata_checksum(tree: Mapping, manifest_json: Mapping) -> str:
    """sha256 over the tree and the manifest: any edit of `_METADATA` is detected by `verify`."""
    blob = json.dumps({"tree_metadata": tree, MANIFEST_KEY: manifest_json}, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()


def metadata_json(plan: WritePlan, manifest: Manifest) -> dict:
    """`_METADATA` in Orbax's schema, the manifest in custom_metadata."""
    tree = tree_metadata([(ap.spec.path, ap.ownership.chunk_shape) for ap in plan.arrays.values()], plan.empty_paths)
    mj = manifest.to_json()
    return {"tree_metadata": tree, "use_ocdbt": True, "use_zarr3": True,
            "store_array_data_equal_to_fill_value": True,
            "custom_metadata": {MANIFEST_KEY: mj, CHECKSUM_KEY: metadata_checksum(tree, mj)}}


# -- I/O -------------------------------------------------------------------------------------------
def merge_writer_databases(tmp_dir: str, writers: Sequence[int]) -> None:
    """Copy every writer DB's B-tree entries into the root DB (one shared Context, one transaction)."""
    import tensorstore as ts

    ctx = ts.Context(specs.context_spec())
    parent = ts.KvStore.open(specs.ocdbt_kvstore(tmp_dir, write=True), context=ctx).result()
    txn = ts.Transaction(atomic=True)
    futures = []
    for w in writers:
        db = specs.writer_db_dir(tmp_dir, w)
        if not os.path.isdir(db):
            continue
        # Same base-kvstore spec as the parent: CopyRange only works within one file kvstore.
        child = ts.KvStore.open(specs.ocdbt_kvstore(db, write=True), context=ctx).result()
        futures.append(child.experimental_copy_range_to(parent.with_transaction(txn)))
    for f in futures:
        f.result()
    txn.commit_async().result()


def commit_checkpoint(dst: str, plan: WritePlan, manifest: Manifest | None = None, *, timeout: float = 600.0) -> str:
    """Wait for all writers, check coverage, merge, write metadata, fsync, rename tmp -> dst."""
    dst = os.path.abspath(dst)
    tmp = tmp_dir_for(dst)
    init_ns = time.time_ns()
    if not os.path.isdir(tmp):
        raise BridgeError(f"no checkpoint in progress at {tmp}; call begin_checkpoint(dst) and run the writers first")
    reports = wait_for_reports(tmp, plan, timeout)
    digests = check_coverage(plan, reports)
    algos = {r["digest_algorithm"] for r in reports}
    algo = algos.pop() if len(algos) == 1 else ""
    manifest = manifest if manifest is not None else Manifest()
    records = {name: ArrayRecord(ap.spec.shape, ap.spec.dtype, dg.to_hex(digests[name]) if algo else None)
               for name, ap in plan.arrays.items()}
    manifest = dataclasses.replace(manifest, arrays=records, digest_algorithm=algo)
    merge_writer_databases(tmp, range(plan.num_writers))
    shutil.rmtree(os.path.join(tmp, REPORT_DIR))
    write_json_atomic(os.path.join(tmp, "_METADATA"), metadata_json(plan, manifest))
    write_json_atomic(os.path.join(tmp, "_CHECKPOINT_METADATA"), checkpoint_metadata_json(init_ns, time.time_ns()))
    with open(os.path.join(tmp, "commit_success.txt"), "w") as f:
        f.write(f"Checkpoint commit was successful to {dst}")
    fsync_tree(tmp)
    if os.path.lexists(dst):
        raise BridgeError(f"destination {dst} appeared while saving; the new checkpoint is left in {tmp}")
    os.rename(tmp, dst)
    fsync_path(os.path.dirname(dst))
    return dst


def finalize(dst: str, plan: WritePlan, writer_id: int, manifest: Manifest | None = None, *,
             timeout: float = 600.0) -> str | None:
    """Called by every writer after `finish()`: barrier, then writer 0 commits.

    With torch.distributed initialised all ranks return dst or raise the same error; otherwise
    writers other than 0 return None at once (writer 0 waits for their reports).
    """
    if dist_initialized():
        import torch.distributed as dist

        dist.barrier()
        err = [None]
        if writer_id == 0:
            try:
                commit_checkpoint(dst, plan, manifest, timeout=timeout)
            except BridgeError as e:
                err = [str(e)]
        dist.broadcast_object_list(err, src=0)
        if err[0] is not None:
            raise BridgeError(err[0])
        return os.path.abspath(dst)
    if writer_id == 0:
        return commit_checkpoint(dst, plan, manifest, timeout=timeout)
    return None


def catalog_of(arrays: Mapping[Sequence[str] | str, np.ndarray]) -> list[ArraySpec]:
    """ArraySpecs for in-memory arrays (paths as tuples or "/"-joined strings)."""
    out = []
    for key, a in arrays.items():
        path = tuple(key.split("/")) if isinstance(key, str) else tuple(key)
        a = np.asarray(a)
        out.append(ArraySpec(path, a.shape, a.dtype.name))
    return out


def save_checkpoint(dst: str, arrays: Mapping[Sequence[str] | str, np.ndarray], manifest: Manifest | None = None,
                    num_writers: int = 1, *, empty_paths: Sequence[Sequence[str]] = (),
                    compression: str | None = None) -> str:
    """Single-process save of whole in-memory arrays (W writers run one after another).

    Keys are path tuples or "/"-joined paths. Validates everything before creating any file.

    >>> import tempfile; d = tempfile.mkdtemp()
    >>> save_checkpoint(d + "/ck", {("params", "w"): np.ones((4, 2), np.float32)}).endswith("ck")
    True
    """
    catalog = catalog_of(arrays)
    plan = make_write_plan(catalog, num_writers, empty_paths=empty_paths, compression=compression)
    if os.path.lexists(dst):
        raise BridgeError(f"destination {os.path.abspath(dst)} already exists; choose a new directory or remove it")
    data = {spec.name: np.asarray(a) for spec, a in zip(catalog, arrays.values())}
    tmp = begin_checkpoint(dst)
    with progress(plan.total_bytes, f"save {os.path.basename(dst)}") as bar:
        for w in range(num_writers):
            writer = CheckpointWriter(tmp, plan, w)
            for name, ap in plan.arrays.items():
                for box in ap.ownership.boxes_owned_by(w):
                    block = data[name][box.slices]
                    writer.write(name, box, block)
                    bar.update(block.nbytes)
            writer.finish()
    return commit_checkpoint(dst, plan, manifest, timeout=10.0)
