"""CheckpointWriter: one writer process writing its owned chunks into its own OCDBT database.

Usage (every writer w of W, after `begin_checkpoint(dst)` claimed DST and created the tmp dir)::

    w = CheckpointWriter(claim.tmp, plan, writer_id)               # claim: what begin_checkpoint returned
    w.write(("params", "w"), Box.of((0, 0), block.shape), block)   # only boxes inside owned chunks
    w.finish()                                                      # flush + report for the commit

Writes are batched into TensorStore transactions of about `batch_bytes`, each committed as
one OCDBT version while the next batch is staged, so host memory is bounded by that budget, not by
the model size.

Two invariants the writer enforces itself:
- Every outer chunk is written within ONE transaction (any number of partial writes there). A
  write to a chunk written in an earlier transaction is refused: OCDBT would keep every version
  of the chunk, and TensorStore would carry the earlier transaction's inner chunks forward by
  reference into the rewrite. The automatic flush waits until the chunks it would split are
  complete, so a transaction may exceed `batch_bytes` by the chunks still open.
- A buffer TensorStore references (staging slabs, donated data) is leased (`staging.Lease`) and
  refilled or handed back to the caller only once TensorStore dropped its references to it, not
  merely once the commit that wrote it landed.

Costs per byte that are kept down (bench_store_write): inner chunks not contiguous in the caller's
data are copied once, on local disks into reused staging slabs (bridge/store/staging.py; on object
storage TensorStore copies them, see `staging`); digests run on side threads; the page cache of committed data files is dropped (drop-behind), so later batches write
into recycled pages.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from itertools import product
from typing import Sequence

import numpy as np

from bridge.errors import BridgeError
from bridge.layout.boxes import Box
from bridge.location import is_remote
from bridge.store import digest as dg
from bridge.store import specs
from bridge.store.durable import write_json_atomic
from bridge.store.plan import ArrayPlan, ArraySpec, WritePlan, make_write_plan  # noqa: F401 (re-export)
from bridge.store.staging import Lease, SlabPool, cells_are_row_runs, grid_cells, num_grid_cells
from bridge.format.tree import path_str

REPORT_DIR = "_gtp_bridge_writers"
# Donated boxes at least this large are digested on a side thread (small ones: thread hand-off costs more).
_ASYNC_DIGEST_BYTES = 256 << 10
# Boxes whose inner-chunk cells average less than this are left to TensorStore to copy: per cell,
# staging costs one TensorStore write call, a fixed cost that only pays off for cells of this size.
_MIN_STAGED_CELL_BYTES = 128 << 10
# Boxes to be copied that are at most this large are copied here and referenced: waiting for
# TensorStore's own copy is a hand-off to its threads and back, which costs more than the copy.
_COPY_HERE_BYTES = 256 << 10


def default_batch_bytes(remote: bool = False) -> int:
    """Bytes per writer transaction when the caller does not say: 64 MiB, 128 MiB with >= 16 CPUs;
    four times that on object storage (`remote`).

    Larger batches let OCDBT write more data files at once, which a many-core host with a deep disk
    queue turns into throughput; on a small host the staging memory they touch costs more than they
    bring (bench_store_write; figures in the README's performance section). On object storage each
    data file is one PUT whose latency, not the host, bounds it, and a writer has one commit in flight
    (a second one would start its PUTs early, but makes OCDBT store some data twice, see
    `CheckpointWriter`): the PUTs in flight are the data files of one transaction, so a transaction
    must hold about as many files as an object store wants requests in flight (bench_remote).

    >>> default_batch_bytes(remote=True) // default_batch_bytes()
    4
    """
    local = (128 << 20) if (os.cpu_count() or 1) >= 16 else (64 << 20)
    return 4 * local if remote else local


def _digest_cells(shape: Sequence[int], cells: Sequence[tuple[Box, np.ndarray]]) -> int:
    """Digest of staged cells (each a box of the array and its data)."""
    return dg.combine([dg.digest_box(shape, cell, buf) for cell, buf in cells])


MAX_COMMIT_DEPTH = 64   # commits in flight, hence databases per writer


def slot_db_dir(root: str, writer: int, slot: int) -> str:
    """The OCDBT database of writer `writer`'s commit slot `slot` (see `CheckpointWriter`): slot 0
    is the writer's own database (Orbax's name), slot s > 0 a sibling the commit merges alike (the
    writer's report says how many it wrote: `databases`).

    >>> slot_db_dir("/c", 1, 0), slot_db_dir("/c", 1, 2)
    ('/c/ocdbt.process_1/', '/c/ocdbt.process_1.2/')
    """
    return specs.writer_db_dir(root, writer) if slot == 0 else f"{root.rstrip('/')}/ocdbt.process_{writer}.{slot}/"


def report_key(writer: int) -> str:
    return f"{REPORT_DIR}/writer_{writer}.json"


def report_path(tmp_dir: str, writer: int) -> str:
    return os.path.join(tmp_dir, report_key(writer))


class _BoxList:
    """Boxes as rows of int64 starts / stops: amortized appends, one vectorized overlap test.

    >>> bl = _BoxList(2); bl.append(Box((0, 0), (2, 2))); bl.append(Box((2, 0), (4, 2)))
    >>> str(bl.first_overlap(Box((1, 1), (3, 2)))), bl.first_overlap(Box((0, 2), (4, 3)))
    ('[0:2, 0:2]', None)
    """

    def __init__(self, ndim: int) -> None:
        self.n = 0
        self.lo = np.empty((4, ndim), dtype=np.int64)
        self.hi = np.empty((4, ndim), dtype=np.int64)

    def append(self, box: Box) -> None:
        if self.n == len(self.lo):
            self.lo = np.concatenate([self.lo, np.empty_like(self.lo)])
            self.hi = np.concatenate([self.hi, np.empty_like(self.hi)])
        self.lo[self.n] = box.start
        self.hi[self.n] = box.stop
        self.n += 1

    def first_overlap(self, box: Box) -> Box | None:
        """The first listed box sharing an element with non-empty `box` (0-d boxes always do)."""
        hit = (np.minimum(self.hi[:self.n], box.stop) > np.maximum(self.lo[:self.n], box.start)).all(axis=1)
        if not hit.any():
            return None
        k = int(hit.argmax())
        return Box(tuple(int(x) for x in self.lo[k]), tuple(int(x) for x in self.hi[k]))


class _ArrayState:
    """What one writer has written of one array: boxes (for overlap checks), coverage, digest."""

    def __init__(self, plan: ArrayPlan) -> None:
        self.plan = plan
        # Boxes written, listed under every chunk they touch: a new box is checked against those of
        # its own chunks only, not against every box of the array.
        self.boxes: dict[tuple[int, ...], _BoxList] = {}
        self.covered = np.zeros(plan.ownership.grid_shape, dtype=np.int64)
        self.txn = np.full(plan.ownership.grid_shape, -1, dtype=np.int64)   # transaction that wrote each chunk
        self.digest = 0
        self._sizes: np.ndarray | None = None

    @property
    def chunk_sizes(self) -> np.ndarray:
        """Elements of each chunk (edge chunks are clipped to the array)."""
        if self._sizes is None:
            own = self.plan.ownership
            sizes = np.ones((), dtype=np.int64)
            for n, c, g in zip(own.shape, own.chunk_shape, own.grid_shape):
                starts = np.arange(g, dtype=np.int64) * c
                sizes = np.multiply.outer(sizes, np.minimum(starts + c, n) - starts)
            self._sizes = sizes
        return self._sizes

    def claim(self, box: Box, txn: int, where: str) -> list[tuple[int, ...]]:
        """Mark the chunks `box` touches as written in transaction `txn` (returns their indices);
        BridgeError if one was written in an earlier transaction.

        >>> from bridge.layout.chunks import ArrayOwnership
        >>> own = ArrayOwnership((4, 4), (2, 4), np.zeros((2, 1), dtype=np.int32))
        >>> st = _ArrayState(ArrayPlan(ArraySpec("a", (4, 4), "float32"), own, (2, 4)))
        >>> st.claim(Box((0, 0), (1, 4)), 0, "w0: a"), st.claim(Box((1, 0), (3, 4)), 0, "w0: a")
        ([(0, 0)], [(0, 0), (1, 0)])
        >>> st.claim(Box((3, 0), (4, 4)), 1, "w0: a")
        Traceback (most recent call last):
        ...
        bridge.errors.BridgeError: w0: a: box [3:4, 0:4] touches chunk [2:4, 0:4], written in transaction 0, which is already committed; write each chunk whole within one transaction (a chunk rewritten in a later transaction makes OCDBT keep every version of it)
        """
        own = self.plan.ownership
        sl = own.chunks_touching(box)
        seen = self.txn[sl]
        bad = (seen >= 0) & (seen != txn)
        if bad.any():
            rel = tuple(int(i) for i in np.argwhere(bad)[0])
            idx = tuple(s.start + r for s, r in zip(sl, rel))
            raise BridgeError(f"{where}: box {box} touches chunk {own.chunk_box(idx)}, written in transaction "
                              f"{int(seen[rel])}, which is already committed; write each chunk whole within one "
                              "transaction (a chunk rewritten in a later transaction makes OCDBT keep every "
                              "version of it)")
        self.txn[sl] = txn
        return list(product(*(range(s.start, s.stop) for s in sl)))

    def record(self, box: Box) -> None:
        """Add `box` to the coverage; BridgeError if it overlaps a box written before.

        >>> from bridge.layout.chunks import ArrayOwnership
        >>> own = ArrayOwnership((4, 4), (2, 4), np.zeros((2, 1), dtype=np.int32))
        >>> st = _ArrayState(ArrayPlan(ArraySpec("a", (4, 4), "float32"), own, (2, 4)))
        >>> st.record(Box((0, 0), (3, 2))); st.record(Box((0, 2), (4, 4))); st.covered.ravel().tolist()
        [8, 6]
        >>> st.record(Box((2, 1), (4, 2)))
        Traceback (most recent call last):
        ...
        bridge.errors.BridgeError: a: box [2:4, 1:2] overlaps box [0:3, 0:2] written before; every element must be written exactly once
        """
        own = self.plan.ownership
        sl = own.chunks_touching(box)
        keys = list(product(*(range(s.start, s.stop) for s in sl)))
        for key in keys:
            prev = self.boxes[key].first_overlap(box) if key in self.boxes else None
            if prev is not None:
                raise BridgeError(f"{path_str(self.plan.spec.path)}: box {box} overlaps box {prev} written "
                                  "before; every element must be written exactly once")
        for key in keys:
            lst = self.boxes.get(key)
            if lst is None:
                lst = self.boxes[key] = _BoxList(box.ndim)
            lst.append(box)
        if len(keys) == 1:  # the common case: a box inside one chunk
            self.covered[keys[0]] += box.size
            return
        # Elements of `box` inside each touched chunk = product over dims of per-dim overlap lengths.
        counts = np.ones((), dtype=np.int64)
        for d, s in enumerate(sl):
            idx = np.arange(s.start, s.stop, dtype=np.int64)
            c = own.chunk_shape[d]
            lengths = np.minimum(box.stop[d], (idx + 1) * c) - np.maximum(box.start[d], idx * c)
            counts = np.multiply.outer(counts, lengths)
        self.covered[sl] += counts


class CheckpointWriter:
    """Writes the chunks `writer_id` owns into ``<tmp_dir>/ocdbt.process_<writer_id>/``.

    `commit_depth` = commits in flight while the next batch is staged. Transaction i commits into
    the database of slot i mod `commit_depth` (`slot_db_dir`; the commit merges them all), so
    commits in flight never share a database: two TensorStore transactions committing into one
    OCDBT database race for its manifest, and the loser retries its whole commit, writing every
    value of the transaction again into new data files (the first copy stays, unreferenced: 1.1 to
    1.4 times the logical bytes stored, on disk and on object storage). `target_data_file_size`: OCDBT data file
    size (None: `specs.TARGET_DATA_FILE_SIZE`; benchmarks vary it). `staging` (None: on local
    disks, not on object storage): copy non-contiguous inner chunks into reused slabs (see
    bridge/store/staging.py) rather than let TensorStore copy them. On object storage the slabs of
    the first `commit_depth` + 1 batches (about a whole checkpoint there: batches are large) are
    fresh memory, whose page faults cost more client CPU than TensorStore's own copies (bench_remote).
    """

    def __init__(self, tmp_dir: str, plan: WritePlan, writer_id: int, *, batch_bytes: int | None = None,
                 compute_digest: bool = True, threads: int | None = None, staging: bool | None = None,
                 drop_behind: bool = True, commit_depth: int = 1, btree_cache_bytes: int | None = None,
                 target_data_file_size: int | None = None, digest_step: int | None = None) -> None:
        if not isinstance(writer_id, int) or not 0 <= writer_id < plan.num_writers:
            raise BridgeError(f"writer id {writer_id!r} is not in 0..{plan.num_writers - 1}")
        self.remote = is_remote(tmp_dir)
        if staging is None:
            staging = not self.remote
        if self.remote:
            drop_behind = False  # no local files, no page cache to drop
        elif not os.path.isdir(tmp_dir):
            raise BridgeError(f"checkpoint tmp dir {tmp_dir} does not exist; call begin_checkpoint(dst) first")
        import tensorstore as ts

        self._ts = ts
        self.tmp_dir = tmp_dir
        self.plan = plan
        self.writer_id = writer_id
        self.batch_bytes = max(1, int(batch_bytes or default_batch_bytes(self.remote)))
        self.compute_digest = compute_digest
        # elements per vectorised digest step of donated boxes (None: digest_box's default); larger
        # steps take and release the GIL less often (a writer in a training process shares it)
        self.digest_step = digest_step
        self.target_data_file_size = target_data_file_size
        ctx = specs.context_spec()
        if btree_cache_bytes is not None:  # a bounded-memory caller (convert) caps the OCDBT B-tree node cache
            ctx["cache_pool#ocdbt"] = {"total_bytes_limit": int(btree_cache_bytes)}
        self.context = ts.Context(ctx)
        self._state: dict[str, _ArrayState] = {}
        self._created: set[str] = set()
        self._base: dict[tuple[int, str], object] = {}  # (slot, array) opened once, not bound to a transaction
        self._open: dict[str, object] = {}   # the arrays bound to the current transaction
        self._txn = None
        self._digester: ThreadPoolExecutor | None = None
        # Threads for digests and for staging copies (each); TensorStore has its own pool.
        self.threads = max(1, int(threads if threads is not None else min(4, (os.cpu_count() or 2) // 4)))
        self._copier: ThreadPoolExecutor | None = None
        self.staging = staging
        self.commit_depth = max(1, int(commit_depth))
        if self.commit_depth > MAX_COMMIT_DEPTH:
            raise BridgeError(f"commit_depth {commit_depth} is more than {MAX_COMMIT_DEPTH} commits in flight; use fewer")
        self.drop_behind = drop_behind and hasattr(os, "posix_fadvise")
        self._dropped: set[str] = set()     # data files complete and dropped: never touched again
        self._seen: dict[str, int] = {}      # data file -> commits issued when first listed
        self._issued = 0                     # commits issued so far
        # Staging holds the batch being filled plus the `commit_depth` committing (see flush).
        self._slabs = SlabPool(keep_bytes=(self.commit_depth + 1) * self.batch_bytes)
        self._futures: list = []
        self._commits: list = []   # (commit future, staging slab leases, donated leases, its digests)
        self._donated: list[Lease] = []  # data of the batch being staged that TensorStore references
        self._open_chunks: set[tuple[str, tuple[int, ...]]] = set()  # chunks of this transaction not yet complete
        self._digests: list = []   # (array state, digest future) of the batch being staged
        self._pending = 0
        self._finished = False
        self.bytes_written = 0
        self.bytes_staged = 0      # of bytes_written, how many went through the staging slabs
        self.commit_wait_s = 0.0   # seconds the caller was blocked waiting for commits to land

    # -- public -------------------------------------------------------------------------------
    def write(self, path: Sequence[str] | str, box: Box, data: np.ndarray, *, donate: bool = False) -> None:
        """Write `data` at `box` of array `path`; the box must lie in chunks this writer owns.

        By default data is copied, so the caller may reuse its buffer once `write` returns. With
        ``donate=True`` the writer keeps a reference instead (no copy: faster, less memory) and the
        caller must not modify `data` until the next `flush()` / `finish()`.
        """
        if self._finished:
            raise BridgeError(f"writer {self.writer_id}: write after finish()")
        ap = self.plan.lookup(path)
        spec = ap.spec
        where = f"writer {self.writer_id}: {path_str(spec.path)}"
        data = np.asarray(data)
        if data.dtype.name != spec.dtype:
            raise BridgeError(f"{where}: data dtype {data.dtype.name} does not match catalog dtype {spec.dtype}; "
                              "cast before writing")
        if not isinstance(box, Box) or box.ndim != len(spec.shape):
            raise BridgeError(f"{where}: box {box} does not match the rank of shape {spec.shape}")
        if tuple(data.shape) != box.shape:
            raise BridgeError(f"{where}: data shape {tuple(data.shape)} does not match box {box} (shape {box.shape})")
        if not Box.full(spec.shape).contains(box):
            raise BridgeError(f"{where}: box {box} lies outside the array shape {spec.shape}")
        if box.empty:
            return
        self._check_owner(ap, box, where)
        state = self._state.get(spec.name) or self._state.setdefault(spec.name, _ArrayState(ap))
        keys = state.claim(box, self._issued, where)  # self._issued = the transaction being staged
        state.record(box)
        sizes = state.chunk_sizes
        for key in keys:
            if state.covered[key] < sizes[key]:
                self._open_chunks.add((spec.name, key))
            else:
                self._open_chunks.discard((spec.name, key))
        store = self._store(ap)
        try:
            staged, copying = self._issue(store, ap, box, data, donate)
        except Exception as e:  # TensorStore raises ValueError etc.; name the array
            raise BridgeError(f"{where}: writing box {box} failed: {' '.join(str(e).split())}") from e
        # The digest runs after the write is issued, so it overlaps TensorStore's encoding and I/O.
        # Staged copies and donated data stay untouched while their batch commits: digest them on
        # the digest threads, folded in when the batch lands; copied boxes are digested now (the
        # caller may change them once this returns), while TensorStore copies them.
        if self.compute_digest:
            if staged:
                self._digests.append((state, self._digest_pool().submit(_digest_cells, spec.shape, staged)))
            elif donate and data.nbytes >= _ASYNC_DIGEST_BYTES:
                step = {"step": self.digest_step} if self.digest_step else {}  # foreign: digest_box keyword
                self._digests.append((state, self._digest_pool().submit(dg.digest_box, spec.shape, box, data, **step)))
            else:
                state.digest = dg.combine([state.digest, self._digest_now(spec.shape, box, data)])
        if copying is not None:
            try:
                copying.result()
            except Exception as e:
                raise BridgeError(f"{where}: writing box {box} failed: {' '.join(str(e).split())}") from e
        self._pending += data.nbytes
        self.bytes_written += data.nbytes
        if self._pending >= self.batch_bytes and not self._open_chunks:
            self.flush(wait=False)

    @property
    def open_chunk_count(self) -> int:
        """Chunks written in the current transaction but not complete (a flush now would split them)."""
        return len(self._open_chunks)

    def flush(self, wait: bool = True) -> None:
        """Commit the staged writes as one OCDBT version.

        With ``wait=False`` (used when the in-flight budget fills) the commit and the batch's
        digests run in the background while the next batch is staged; at most `commit_depth`
        commits are outstanding, so host memory stays below about (commit_depth + 1) x
        `batch_bytes`. When it returns, the donated buffers of every commit that landed are free
        again (TensorStore dropped them): with ``wait=True`` all of them. Chunks left incomplete
        can not be written any more (see `open_chunk_count`).
        """
        try:
            for f in self._futures:
                f.result()
            self._futures.clear()
            self._await_commits(keep=self.commit_depth - 1)  # bound the batches in flight
            if self._txn is not None:  # every write (hence every digest) opened the transaction
                self._commits.append((self._txn.commit_async(), self._slabs.seal(), self._donated, self._digests))
                self._issued += 1
            self._digests = []
            self._donated = []
            self._open_chunks.clear()
            self._txn = None
            self._open.clear()
            self._pending = 0
            if wait:
                self._await_commits()
        except BridgeError:
            raise
        except Exception as e:
            raise BridgeError(f"writer {self.writer_id}: committing writes to {self.tmp_dir} failed: "
                              f"{' '.join(str(e).split())}") from e

    def finish(self, publish: bool = True) -> dict:
        """Create metadata of arrays this writer is responsible for, flush, and publish its report
        (for the committer's barrier); returns the report. `publish=False`: only return it, for a
        committer in this process that is handed the reports (`commit_checkpoint(reports=...)`)."""
        if self._finished:
            raise BridgeError(f"writer {self.writer_id}: finish() called twice")
        for ap in self.plan.arrays.values():
            if ap.meta_writer == self.writer_id and ap.spec.name not in self._created:
                self._store(ap)
        self.flush()
        for pool in (self._digester, self._copier):
            if pool is not None:
                pool.shutdown()
        self._digester = self._copier = None
        self._slabs = SlabPool(keep_bytes=0)   # the writer is done: let its staging memory go
        report = {
            "writer": self.writer_id,
            "plan": self.plan.fingerprint(),
            "digest_algorithm": dg.ALGORITHM if self.compute_digest else "",
            "databases": self.databases,
            "arrays": {},
        }
        for name, st in self._state.items():
            own = st.plan.ownership
            mine = own.owners == self.writer_id
            report["arrays"][name] = {"covered": st.covered[mine].tolist(), "digest": dg.to_hex(st.digest)}
        if not publish:
            pass
        elif self.remote:
            from bridge.store import kvstore

            kvstore.write_json(self.tmp_dir, report_key(self.writer_id), report)
        else:
            os.makedirs(os.path.join(self.tmp_dir, REPORT_DIR), exist_ok=True)
            write_json_atomic(report_path(self.tmp_dir, self.writer_id), report)
        self._finished = True
        return report

    # -- internals ------------------------------------------------------------------------------
    def _issue(self, store, ap: ArrayPlan, box: Box, data: np.ndarray, donate: bool) -> tuple[list | None, object]:
        """Issue TensorStore writes for one box; returns the staged [(cell box, buffer)] or None,
        and the future of TensorStore's copy of `data` that the caller must wait for (or None).

        Donated data is referenced where TensorStore can (inner chunks contiguous in it), else
        TensorStore copies it; non-donated data is copied, here or by TensorStore. With `staging`,
        a box spanning inner chunks of useful size is instead copied cell by cell into reused
        slabs that TensorStore references (see bridge/store/staging.py).
        """
        inner = ap.inner_chunk_shape
        ncell = num_grid_cells(box, inner)
        contiguous = data.flags.c_contiguous and cells_are_row_runs(box, inner)
        if (donate and contiguous) or not self.staging or data.nbytes < ncell * _MIN_STAGED_CELL_BYTES:
            if not donate and data.nbytes <= _COPY_HERE_BYTES:
                # our copy, referenced: no wait below, and nobody else holds it
                fut = store[box.slices].write(np.array(data, order="C"), can_reference_source_data_indefinitely=True)
            elif donate:
                # TensorStore holds a view only the lease knows: the caller gets the buffer back
                # (flush) only once TensorStore dropped it
                lease = Lease(data.view())
                fut = store[box.slices].write(lease.arr, can_reference_source_data_indefinitely=True)
                self._donated.append(lease)
            else:  # TensorStore copies the source asynchronously; the caller may reuse it once copied
                fut = store[box.slices].write(data, can_reference_source_data_indefinitely=False)
                self._futures.append(fut)
                return None, fut.copy
            self._futures.append(fut)
            return None, None
        staged = [(cell, self._slabs.take(cell.shape, data.dtype)) for cell in grid_cells(box, inner)]

        def copy_and_write(part: Sequence[tuple[Box, np.ndarray]]) -> list:
            out = []
            for cell, buf in part:
                np.copyto(buf, data[cell.relative_to(box).slices])   # releases the GIL
                out.append(store[cell.slices].write(buf, can_reference_source_data_indefinitely=True))
            return out

        n = min(self.threads, len(staged))
        if n <= 1:
            self._futures.extend(copy_and_write(staged))
        else:  # copies in parallel, all done before write() returns (the caller may then reuse data)
            parts = [staged[i::n] for i in range(n)]
            for f in [self._pool().submit(copy_and_write, part) for part in parts]:
                self._futures.extend(f.result())
        self.bytes_staged += data.nbytes
        return staged, None

    def _digest_now(self, shape: Sequence[int], box: Box, data: np.ndarray) -> int:
        """Digest of `data` at `box`, before returning; a large box is split by rows over the copy
        threads (idle while `write` runs; the digest threads may be busy with earlier batches)."""
        n = min(self.threads, box.shape[0] if box.ndim else 1, data.nbytes // _ASYNC_DIGEST_BYTES)
        if n <= 1:
            return dg.digest_box(shape, box, data)
        edges = [box.start[0] + (box.shape[0] * i) // n for i in range(n + 1)]
        parts = [(Box((a,) + box.start[1:], (b,) + box.stop[1:]), data[a - box.start[0]:b - box.start[0]])
                 for a, b in zip(edges[:-1], edges[1:])]
        futs = [self._pool().submit(dg.digest_box, shape, part, d) for part, d in parts]
        return dg.combine([f.result() for f in futs])

    def _digest_pool(self) -> ThreadPoolExecutor:
        if self._digester is None:
            self._digester = ThreadPoolExecutor(self.threads, thread_name_prefix=f"digest-w{self.writer_id}")
        return self._digester

    def _pool(self) -> ThreadPoolExecutor:
        """Threads for staging copies (separate from the digests, which may queue up behind them)."""
        if self._copier is None:
            self._copier = ThreadPoolExecutor(self.threads, thread_name_prefix=f"stage-w{self.writer_id}")
        return self._copier

    def _await_commits(self, keep: int = 0) -> None:
        """Wait until at most `keep` commits are outstanding and TensorStore let go of their donated
        buffers; their staging slabs are released (reused once TensorStore let go of them too)."""
        if len(self._commits) <= keep:
            return
        t0 = time.perf_counter()
        while len(self._commits) > keep:
            fut, slabs, donated, digests = self._commits.pop(0)
            fut.result()
            for st, d in digests:
                st.digest = dg.combine([st.digest, d.result()])
            self._slabs.release(slabs)
            self._await_released(donated)
        self.commit_wait_s += time.perf_counter() - t0
        if self.drop_behind:
            self._drop_written_pages()

    def _await_released(self, leases: Sequence[Lease], timeout: float = 10.0) -> None:
        """Wait until TensorStore dropped the donated buffers of a landed commit (it releases them
        as the transaction is destroyed, just after its future is ready); BridgeError if it does not:
        the caller would then reuse a buffer a write still reads."""
        deadline = None
        wait = 1e-5
        for lease in leases:
            while lease.busy:
                now = time.monotonic()
                deadline = deadline or now + timeout
                if now > deadline:
                    raise BridgeError(f"writer {self.writer_id}: TensorStore still references a donated buffer "
                                      f"{timeout:.0f} s after its commit landed; it is not safe to reuse it")
                time.sleep(wait)
                wait = min(wait * 2, 1e-3)

    def _drop_written_pages(self) -> None:
        """Drop the page cache of data files whose commit landed (TensorStore fsync'd them).

        The checkpoint is not read back by this process, so its pages only crowd out other cached
        data; freeing them lets the next batch's writes reuse those pages, which on VMs that return
        freed guest memory to the host is several times cheaper than touching fresh memory.
        A file listed may belong to a commit still in flight, but at most to the last one issued
        when it was first listed: once that commit landed the file is complete, is dropped one last
        time and then skipped (else every batch would re-drop every file written so far).
        """
        names = []
        for slot in range(min(self.commit_depth, self._issued)):
            d = os.path.join(slot_db_dir(self.tmp_dir, self.writer_id, slot), "d")
            try:
                names += [os.path.join(d, n) for n in os.listdir(d)]
            except FileNotFoundError:
                pass
        landed = self._issued - len(self._commits)
        for name in names:
            if name in self._dropped:
                continue
            if landed >= self._seen.setdefault(name, self._issued):
                self._dropped.add(name)
                del self._seen[name]
            try:
                fd = os.open(name, os.O_RDONLY)
            except OSError:
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)

    def _check_owner(self, ap: ArrayPlan, box: Box, where: str) -> None:
        own = ap.ownership
        sl = own.chunks_touching(box)
        owners = own.owners[sl]
        bad = owners != self.writer_id
        if bad.any():
            rel = tuple(int(i) for i in np.argwhere(bad)[0])
            idx = tuple(s.start + r for s, r in zip(sl, rel))
            raise BridgeError(f"{where}: box {box} touches chunk {own.chunk_box(idx)} owned by writer "
                              f"{int(owners[rel])}; send that data to its owner")

    def _store(self, ap: ArrayPlan):
        """The array bound to the current transaction (opening the transaction if none is)."""
        st = self._open.get(ap.spec.name)
        if st is None:
            if self._txn is None:
                self._begin_transaction()
            st = self._open.get(ap.spec.name) or self._bind([ap])[0]
        return st

    def _begin_transaction(self) -> None:
        """Start the next transaction; the first one also binds every array this writer touches.

        Opening (or creating) an array waits on TensorStore's threads: once a batch is encoding
        and writing, each open queues behind that work (a large share of a small export's time on a
        small host), so all opens happen before any data is in flight.
        """
        self._txn = self._ts.Transaction(atomic=True)
        if self._issued < self.commit_depth:  # the first transaction of its slot (database)
            self._bind([ap for ap in self.plan.arrays.values()
                        if ap.meta_writer == self.writer_id or (ap.ownership.owners == self.writer_id).any()])

    def _bind(self, aps: Sequence[ArrayPlan]) -> list:
        """Open arrays `aps` in the current transaction (creating those whose metadata this writer owns).

        The opens run concurrently: each mostly waits on TensorStore's threads, so waiting for all
        at once costs little more than one. Each array is opened once per writer; later
        transactions rebind that handle, which is cheap. Arrays are created in slot 0's database
        (see `slot_db_dir`): on local disks in a transaction of their own, committed before any
        data; on object storage, where that costs several sequential requests, inside the current
        transaction when it is slot 0's (no other commit in flight shares that database).
        """
        ts = self._ts
        slot = self._slot
        create = [ap for ap in aps if ap.meta_writer == self.writer_id and ap.spec.name not in self._created]
        if create:
            fold = self.remote and self._txn is not None and slot == 0
            meta = self._txn if fold else ts.Transaction(atomic=True)
            # metadata only ever in slot 0's database: every key is in one database for the merge
            futs = [ts.open(self._spec(ap, 0), create=True, context=self.context, transaction=meta) for ap in create]
            made = [self._opened(ap, fut) for ap, fut in zip(create, futs)]
            try:
                if not fold:
                    meta.commit_async().result()
            except Exception as e:
                raise BridgeError(f"writer {self.writer_id}: creating {len(create)} arrays in {self.tmp_dir} failed: "
                                  f"{' '.join(str(e).split())}") from e
            if not fold:  # (folded: opened below with the plan's metadata, like arrays made elsewhere)
                for ap, st in zip(create, made):
                    self._base[0, ap.spec.name] = st.with_transaction(None)
            self._created.update(ap.spec.name for ap in create)
        # assume_metadata: no I/O, the plan fixes the metadata
        futs = [(ap, None if (slot, ap.spec.name) in self._base else
                 ts.open(self._spec(ap, slot), open=True, assume_metadata=True, context=self.context)) for ap in aps]
        out = []
        for ap, fut in futs:
            name = ap.spec.name
            if fut is not None:
                self._base[slot, name] = self._opened(ap, fut)
            st = self._base[slot, name].with_transaction(self._txn)
            self._open[name] = st
            out.append(st)
        return out

    def _opened(self, ap: ArrayPlan, fut):
        try:
            return fut.result()
        except Exception as e:
            raise BridgeError(f"writer {self.writer_id}: {path_str(ap.spec.path)}: opening for write failed: "
                              f"{' '.join(str(e).split())}") from e

    @property
    def databases(self) -> int:
        """Databases this writer wrote (slots 0 .. n-1, see `slot_db_dir`)."""
        return max(1, min(self._issued, self.commit_depth))

    @property
    def _slot(self) -> int:
        """The commit slot (database) of the transaction being staged."""
        return self._issued % self.commit_depth

    def _spec(self, ap: ArrayPlan, slot: int) -> dict:
        spec = specs.array_write_spec(self.tmp_dir, self.writer_id, ap.spec.name, ap.spec.shape, ap.spec.dtype,
                                      ap.ownership.chunk_shape, ap.inner_chunk_shape, self.plan.compression,
                                      checksum=self.plan.checksum,
                                      target_data_file_size=self.target_data_file_size)
        if slot:
            spec["kvstore"] = specs.ocdbt_kvstore(slot_db_dir(self.tmp_dir, self.writer_id, slot), ap.spec.name,
                                                  write=True, target_data_file_size=self.target_data_file_size)
        return spec
