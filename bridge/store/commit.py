"""Commit: barrier, coverage check, OCDBT merge, Orbax metadata, fsync, atomic publish.

Protocol (W writers, any number of processes)::

    claim = begin_checkpoint(dst, sources=[src])      # claims dst (bridge.store.claim); once, before writers start
    ... each writer: CheckpointWriter(claim.tmp, plan, w).write(...); .finish()
    commit_checkpoint(claim, plan, manifest)          # one process; waits for all writer reports

`begin_checkpoint` returns the handle the commit needs (a `bridge.store.claim.Destination`), and
it is passed down to `commit_checkpoint`: nothing looks the claim up again by its location. A
committing process that did not begin (writers started as separate programs) passes DST instead,
and the claim is read from what it recorded (`Storage.claimed`).

`finalize(claim, plan, writer_id, manifest, coordinator=...)` wraps the last step for every writer:
with a `bridge.dist.TorchCoordinator` the writers of its group meet, rank 0 commits and every rank
returns dst or raises the same error naming the failing rank; with the default
`LocalCoordinator` (writers that do not talk) writer 0 waits (file barrier with a timeout) for the
other writers' reports and commits. The store never reads torch's global process-group state.

Every writer of a logical checkpoint (convert, the live export, the JAX save) ends with the one
commit, `publish_checkpoint`: seal `_METADATA`, copy its checksum into `_CHECKPOINT_METADATA`, and
let the claim (`bridge.store.claim.Destination`) make it visible, `_METADATA` last; on a local
file system one no-replace rename, so `dst` is either a complete checkpoint or absent.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from typing import Mapping, Sequence

import numpy as np

from bridge.dist import Coordinator, LocalCoordinator, wait_for_writers
from bridge.errors import BridgeError
from bridge.progress import progress
from bridge.store import digest as dg
from bridge.store import specs
from bridge.store.claim import ClaimInfo, Destination, claim_destination
from bridge.store.durable import json_bytes
from bridge.format.manifest import ArrayRecord, Manifest, custom_metadata
from bridge.format.seal import CHECKSUM_KEY, seal_metadata
from bridge.format.sharding_file import SHARDING_FILE, record_sharding, sharding_file
from bridge.store.plan import ArraySpec, WritePlan, make_write_plan
from bridge.format.tree import path_str, tree_metadata
from bridge.store.writer import MAX_COMMIT_DEPTH, REPORT_DIR, CheckpointWriter, report_key, report_path, slot_db_dir
from bridge.location import basename, is_remote
from bridge.store.storage import open_storage

ITEM_HANDLER = "orbax.checkpoint._src.handlers.standard_checkpoint_handler.StandardCheckpointHandler"
COMMIT_MARKER = "commit_success.txt"


def begin_checkpoint(dst: str | os.PathLike, sources: Sequence[str] = (), *,
                     coordinator: Coordinator | None = None) -> Destination:
    """Claim `dst` for this run (`Storage.claim`) and return the claim: writers write to its `tmp`,
    and `commit_checkpoint(claim, ...)` publishes it.

    Refuses an existing `dst`, a `dst` overlapping one of `sources`, and a temp directory that is
    not provably a stale one of ours. With a `TorchCoordinator` every rank of its group calls it:
    rank 0 claims, the other ranks get a handle on the same claim (its record travels as JSON; their
    `release()` removes nothing), or all raise the same error. Without one, call it once before
    starting the writer processes. The claim is released (its directory removed) when
    `commit_checkpoint` fails, on SIGTERM/SIGINT, or at exit.
    """
    coord = coordinator or LocalCoordinator()
    storage = open_storage(os.fspath(dst))
    mine: list[Destination] = []

    def claim() -> dict:
        mine.append(storage.claim(sources))
        return mine[0].info.record()

    sent = coord.broadcast("the start", claim)
    if mine:
        return mine[0]
    if sent is None:   # a LocalCoordinator of another rank: nobody tells it what rank 0 claimed
        raise BridgeError(f"begin_checkpoint({dst}) runs once, in the process that claims; writers of other "
                          f"processes write to its temporary directory and commit_checkpoint(dst) reads the claim")
    info = ClaimInfo.from_record(sent)
    if info is None:  # what travelled is checked as a claim file is (`bridge.torchrun.launch_claim` does the same)
        raise BridgeError(f"begin_checkpoint({dst}): what the claiming rank sent is not a gtp-bridge claim record")
    # rank 0's record names DST as rank 0 resolved it (absolute): every rank's writers write there
    return open_storage(info.dst).handle(info)


def checkpoint_metadata_json(init_ns: int, commit_ns: int | None = None, checksum: str | None = None) -> dict:
    """`_CHECKPOINT_METADATA` as Orbax's StandardCheckpointer writes it (`publish_checkpoint` adds
    `_METADATA`'s checksum to its custom_metadata)."""
    return {"item_handlers": ITEM_HANDLER, "metrics": {}, "performance_metrics": {},
            "init_timestamp_nsecs": init_ns, "commit_timestamp_nsecs": commit_ns,
            "custom_metadata": {CHECKSUM_KEY: checksum} if checksum else {}}


# -- barrier -------------------------------------------------------------------------------------
def wait_for_reports(tmp_dir: str, plan: WritePlan, timeout: float = 600.0, poll: float = 0.05) -> list[dict]:
    """File barrier: wait until every writer published its report; BridgeError naming the missing ones."""
    if is_remote(tmp_dir):
        return _remote_reports(tmp_dir, plan, timeout)
    # start at 1 ms: writers usually finish together, so most waits are short
    wait_for_writers(lambda left: [w for w in left if not os.path.exists(report_path(tmp_dir, w))],
                     range(plan.num_writers), timeout, "writers", 0.001, poll)
    reports = []
    for w in range(plan.num_writers):
        with open(report_path(tmp_dir, w)) as f:
            reports.append(json.load(f))
    return _checked_reports(plan, reports)


def _remote_reports(root: str, plan: WritePlan, timeout: float) -> list[dict]:
    """`wait_for_reports` on object storage: poll for the report objects, then read them."""
    from bridge.store import kvstore
    from bridge.store.remote import wait_for_objects

    keys = [report_key(w) for w in range(plan.num_writers)]
    reports = kvstore.read_json_many(root, keys)  # usually all there: no listing, one GET each
    if any(r is None for r in reports):
        wait_for_objects(root, keys, timeout, "writers")
        reports = kvstore.read_json_many(root, keys)
    return _checked_reports(plan, reports)


def _checked_reports(plan: WritePlan, raw: Sequence[dict]) -> list[dict]:
    reports = []
    for w, r in enumerate(raw):
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


def expected_databases(plan: WritePlan) -> list[int]:
    """Writers that must have an OCDBT database: owners of chunks and creators of array metadata."""
    ws = set()
    for ap in plan.arrays.values():
        ws.add(ap.meta_writer)
        if ap.ownership.num_chunks:
            ws.update(int(w) for w in np.unique(ap.ownership.owners))
    return sorted(ws)


def metadata_json(plan: WritePlan, manifest: Manifest) -> dict:
    """`_METADATA` in Orbax's schema, the manifest in custom_metadata (`publish_checkpoint` seals it)."""
    tree = tree_metadata([(ap.spec.path, ap.ownership.chunk_shape) for ap in plan.arrays.values()], plan.empty_paths)
    meta = {"tree_metadata": tree, "use_ocdbt": True, "use_zarr3": True,
            "store_array_data_equal_to_fill_value": True,
            "custom_metadata": custom_metadata(manifest)}
    return meta


# -- I/O -------------------------------------------------------------------------------------------
def publish_checkpoint(claim: Destination, metadata: dict, checkpoint_metadata: dict | None, *,
                       payload: str | None = None, marker: bool = False) -> str:
    """The one atomic commit of every writer: seal `metadata` (`_METADATA`; its checksum also goes
    into `checkpoint_metadata`'s custom_metadata, so a removed manifest is told apart from a plain
    Orbax checkpoint), then `claim.publish` the payload (default: the claim's temp directory) with
    `_CHECKPOINT_METADATA`, the commit marker when asked, and `_METADATA` last. Returns DST; on any
    failure the claim is released (nothing of this run stays).

    `_sharding` (what Orbax's default restore places arrays with, `bridge.format.sharding_file`):
    written here for the store's own payload; a payload Orbax wrote keeps Orbax's. Either way its
    digest goes into `_METADATA` before sealing, so the checksum covers it."""
    try:
        files = []
        if payload is None:
            sharding = sharding_file(metadata.get("tree_metadata") or {})
            files.append((SHARDING_FILE, sharding))
        else:
            sharding = _payload_file(payload, SHARDING_FILE)
        if sharding is not None:
            record_sharding(metadata, sharding)
        checksum = seal_metadata(metadata)
        if checkpoint_metadata is not None:
            checkpoint_metadata["custom_metadata"] = {**(checkpoint_metadata.get("custom_metadata") or {}),
                                                      CHECKSUM_KEY: checksum}
            files.append(("_CHECKPOINT_METADATA", json_bytes(checkpoint_metadata)))
        if marker:
            files.append((COMMIT_MARKER, f"Checkpoint commit was successful to {claim.dst}".encode()))
        files.append(("_METADATA", json_bytes(metadata)))
        return claim.publish(payload, files=files)
    except BaseException:
        claim.release()
        raise


def _payload_file(payload: str, name: str) -> bytes | None:
    """A file of a local payload directory, None when absent."""
    try:
        with open(os.path.join(payload, name), "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None


def check_writer_databases(tmp_dir: str, plan: WritePlan) -> list[int]:
    """Every expected writer's database exists (a missing one is an error, never skipped)."""
    writers = expected_databases(plan)
    if is_remote(tmp_dir):
        from bridge.store import kvstore

        have = set(kvstore.list_keys(tmp_dir, "ocdbt.process_"))
        missing = [w for w in writers if f"ocdbt.process_{w}/manifest.ocdbt" not in have]
    else:
        missing = [w for w in writers
                   if not os.path.isfile(os.path.join(specs.writer_db_dir(tmp_dir, w), "manifest.ocdbt"))]
    if missing:
        raise BridgeError(f"the databases of writers {missing} are missing from {tmp_dir} although their reports "
                          f"are there (removed by another process?); nothing was committed, rerun")
    return writers


def merge_writer_databases(tmp_dir: str, writers: Sequence[int], databases: Mapping[int, int] | None = None) -> None:
    """Copy every writer DB's B-tree entries into the root DB (one shared Context, one transaction);
    `databases`: writer -> how many commit-slot databases it wrote (`slot_db_dir`; default 1).

    Every writer listed must have its databases (BridgeError naming the missing ones)."""
    import tensorstore as ts

    dbs = [slot_db_dir(tmp_dir, w, s) for w in writers for s in range((databases or {}).get(w, 1))]
    missing = [] if is_remote(tmp_dir) else [os.path.basename(d.rstrip("/")) for d in dbs if not os.path.isdir(d)]
    if missing:
        raise BridgeError(f"writer databases {missing} are missing from {tmp_dir}; nothing was committed, rerun")
    ctx = ts.Context(specs.context_spec())
    parent = ts.KvStore.open(specs.ocdbt_kvstore(tmp_dir, write=True), context=ctx).result()
    txn = ts.Transaction(atomic=True)
    futures = []
    for db in dbs:
        # Same base-kvstore spec as the parent: CopyRange only works within one file kvstore.
        child = ts.KvStore.open(specs.ocdbt_kvstore(db, write=True), context=ctx).result()
        futures.append(child.experimental_copy_range_to(parent.with_transaction(txn)))
    for f in futures:
        f.result()
    txn.commit_async().result()


def report_databases(reports: Sequence[dict]) -> dict[int, int]:
    """Writer -> databases it wrote, from the writers' reports (a report without the field: one).

    >>> report_databases([{"writer": 0, "databases": 2}, {"writer": 1}])
    {0: 2, 1: 1}
    """
    out = {}
    for r in reports:
        n = r.get("databases", 1)
        if not isinstance(n, int) or not 1 <= n <= MAX_COMMIT_DEPTH:
            raise BridgeError(f"writer {r.get('writer')}'s report names {n!r} databases; the reports are damaged, "
                              f"rerun")
        out[int(r["writer"])] = n
    return out


def stored_chunk_counts(keys: Sequence[bytes]) -> dict[str, int]:
    """Array name -> number of chunk keys (`<name>/c...`) in a listing of the merged database.

    >>> stored_chunk_counts([b"a.w/zarr.json", b"a.w/c/0/0", b"a.w/c/1/0", b"step/c", b"step/zarr.json"])
    {'a.w': 2, 'step': 1}
    """
    counts: dict[str, int] = {}
    for k in keys:
        name, sep, rest = k.decode().partition("/")
        if sep and (rest == "c" or rest.startswith("c/")):
            counts[name] = counts.get(name, 0) + 1
    return counts


def check_stored_chunks(tmp_dir: str, plan: WritePlan) -> None:
    """After the merge: every array's metadata and every one of its chunks is in the root database."""
    import tensorstore as ts

    kv = ts.KvStore.open(specs.ocdbt_kvstore(tmp_dir), context=ts.Context(specs.context_spec())).result()
    keys = kv.list().result()
    have = {k.decode().partition("/")[0] for k in keys if k.endswith(b"/zarr.json")}
    counts = stored_chunk_counts(keys)
    for name, ap in plan.arrays.items():
        want = ap.ownership.num_chunks if all(ap.spec.shape) else 0
        if name not in have:
            raise BridgeError(f"{path_str(ap.spec.path)}: its zarr metadata is missing after the merge; nothing was "
                              f"committed, rerun")
        if counts.get(name, 0) != want:
            raise BridgeError(f"{path_str(ap.spec.path)}: {counts.get(name, 0)} of its {want} chunks are stored after "
                              f"the merge; nothing was committed, rerun")


def _destination(claim: Destination | str | os.PathLike) -> Destination:
    """The claim handed down (`begin_checkpoint`'s), or for a location the claim another process of
    the run made there, read from its record (`Storage.claimed`)."""
    if isinstance(claim, (str, os.PathLike)):
        return open_storage(os.fspath(claim)).claimed()
    return claim


def commit_checkpoint(claim: Destination | str | os.PathLike, plan: WritePlan, manifest: Manifest | None = None, *,
                      timeout: float = 600.0, reports: Sequence[dict] | None = None) -> str:
    """Wait for all writers, check coverage and every writer's database, merge, check every chunk is
    stored, write sealed metadata, fsync, rename tmp -> dst (never over an existing dst). Returns DST.

    `claim`: what `begin_checkpoint` (or `Storage.claim`) returned; a process that did not begin
    (writers started apart, the file barrier) passes DST, whose recorded claim is read.
    `reports`: every writer's report (`CheckpointWriter.finish(publish=False)`), when the writers ran
    in this process: no barrier, and no report files or objects written, read and removed.

    On any failure the run's temp directory is removed (by the process holding the claim)."""
    claim = _destination(claim)
    tmp = claim.tmp
    init_ns = time.time_ns()
    try:
        claim.check_owned()
        handed = reports is not None
        reports = _checked_reports(plan, reports) if handed else wait_for_reports(tmp, plan, timeout)
        if len(reports) != plan.num_writers:
            raise BridgeError(f"{len(reports)} writer reports for {plan.num_writers} writers; pass every writer's")
        digests = check_coverage(plan, reports)
        algos = {r["digest_algorithm"] for r in reports}
        algo = algos.pop() if len(algos) == 1 else ""
        manifest = manifest if manifest is not None else Manifest()
        records = {name: ArrayRecord(ap.spec.shape, ap.spec.dtype, dg.to_hex(digests[name]) if algo else None)
                   for name, ap in plan.arrays.items()}
        manifest = manifest.with_arrays(records, algo)
        merge_writer_databases(tmp, check_writer_databases(tmp, plan), report_databases(reports))
        check_stored_chunks(tmp, plan)
        if not handed:  # (handed: nothing is removed before the publish, which checks it itself)
            claim.check_owned()  # nobody replaced the directory while we merged
        meta = metadata_json(plan, manifest)
        if handed:
            pass
        elif is_remote(tmp):
            from bridge.store import kvstore

            kvstore.delete_keys(tmp, [report_key(w) for w in range(plan.num_writers)])
        else:
            shutil.rmtree(os.path.join(tmp, REPORT_DIR))
    except BaseException:
        claim.release()
        raise
    return publish_checkpoint(claim, meta, checkpoint_metadata_json(init_ns, time.time_ns()),
                              marker=True)  # releases the claim itself if it fails


def finalize(claim: Destination | str | os.PathLike, plan: WritePlan, writer_id: int,
             manifest: Manifest | None = None, *, timeout: float = 600.0,
             coordinator: Coordinator | None = None) -> str | None:
    """Called by every writer after `finish()`: the writers meet, then writer 0 commits `claim`
    (`begin_checkpoint`'s handle, or DST in a process that did not begin: `commit_checkpoint`).

    With a `TorchCoordinator` (its rank = `writer_id`) all ranks return dst or raise the same
    error naming the failing rank; with the default `LocalCoordinator` writers other than 0
    return None at once (writer 0 waits for their reports: the file barrier).
    """
    coord = coordinator or LocalCoordinator(writer_id, plan.num_writers)
    if coord.rank != writer_id:
        raise BridgeError(f"writer {writer_id} finalizes as rank {coord.rank} of its coordinator; they must agree")
    coord.all_gather("writing", lambda: None)  # the one barrier: every writer's report is published
    return coord.broadcast("the commit", lambda: commit_checkpoint(claim, plan, manifest, timeout=timeout))


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

    Keys are path tuples or "/"-joined paths. Validates everything before creating any file. The
    arrays are read in place, not copied (donated to the writer until it finishes, before this
    returns): uploads start as soon as the writes are issued, the digests run beside them, and
    no second copy of the state is held. Do not modify them from another thread meanwhile.

    >>> import tempfile; d = tempfile.mkdtemp()
    >>> save_checkpoint(d + "/ck", {("params", "w"): np.ones((4, 2), np.float32)}).endswith("ck")
    True
    """
    catalog = catalog_of(arrays)
    plan = make_write_plan(catalog, num_writers, empty_paths=empty_paths, compression=compression,
                           max_chunk_bytes=specs.max_chunk_bytes(dst))
    data = {spec.name: np.asarray(a) for spec, a in zip(catalog, arrays.values())}
    with claim_destination(dst) as claim:
        with progress(plan.total_bytes, f"save {basename(dst)}") as bar:
            reports = []
            for w in range(num_writers):
                writer = CheckpointWriter(claim.tmp, plan, w)
                for name, ap in plan.arrays.items():
                    for box in ap.ownership.boxes_owned_by(w):
                        block = data[name][box.slices]
                        writer.write(name, box, block, donate=True)
                        bar.update(block.nbytes)
                reports.append(writer.finish(publish=False))
        return commit_checkpoint(claim, plan, manifest, timeout=10.0, reports=reports)
