"""Full integrity check of a checkpoint: metadata checksum, shapes/dtypes, every byte's digest.

Each stored byte is read once: an array is read in blocks aligned to its stored chunks (whole
inner chunks, never a block that cuts one). TensorStore reads blocks of all arrays in parallel into
a fixed set of reused buffers (bounded memory; a fresh array per block would be page-faulted in and
unmapped again every time), and a thread pool digests each block as its read completes. The GIL is
the shared resource to spare: TensorStore's workers never need it (see `_Block`), and the digest
takes it a few dozen times per block (`DIGEST_STEP`) on at most one thread per core. A damaged array
is reported by name and never hides the others.
"""

from __future__ import annotations

import os
import queue
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from math import prod
from typing import Sequence

import numpy as np

from bridge.dist import Coordinator, LocalCoordinator
from bridge.errors import IntegrityError
from bridge.layout.shares import contiguous_parts
from bridge.layout.boxes import Box
from bridge.progress import progress
from bridge.store import digest as dg
from bridge.store.reader import ArrayInfo, Checkpoint, open_checkpoint, record_problem
from bridge.dtypes import numpy_dtype
from bridge.format.tree import path_str

READ_BLOCK_BYTES = 16 << 20
# Elements per digest step (see digest.digest_box): 4 MiB of float32, so a 16 MiB block takes a
# few dozen numpy calls, not hundreds, each a GIL round trip among all the digesting threads.
DIGEST_STEP = 1 << 20


@dataclass
class VerifyResult:
    """Damaged arrays (path string -> reason), metadata problems, and how many arrays were checked."""

    damaged: dict[str, str] = field(default_factory=dict)
    metadata_problems: list[str] = field(default_factory=list)
    checked: int = 0
    has_manifest: bool = False
    bytes_read: int = 0     # array bytes read (decoded)

    @property
    def ok(self) -> bool:
        return not self.damaged and not self.metadata_problems


def block_shape(chunk: Sequence[int], inner: Sequence[int], itemsize: int, block_bytes: int) -> tuple[int, ...]:
    """The largest block of whole inner chunks inside one outer chunk of at most ~block_bytes:
    full extent on trailing axes first, then whole multiples of the inner chunk on the next axis.
    A single inner chunk larger than block_bytes is one block (it is stored as one unit).

    >>> block_shape((16, 128, 128), (16, 128, 128), 4, 1 << 20)    # an inner chunk over all layers: whole
    (16, 128, 128)
    >>> block_shape((16, 512, 512), (1, 512, 512), 4, 2 << 20)      # two layers' inner chunks per block
    (2, 512, 512)
    >>> block_shape((8, 8), (2, 2), 1, 16)
    (2, 8)
    """
    b = list(inner)
    for d in range(len(b) - 1, -1, -1):
        rest = prod(b[:d]) * prod(b[d + 1:]) * itemsize
        m = max(1, block_bytes // max(1, rest * inner[d]))
        b[d] = min(chunk[d], m * inner[d])
        if b[d] < chunk[d]:
            break
    return tuple(b)


def read_blocks(shape: Sequence[int], chunk: Sequence[int], inner: Sequence[int], itemsize: int,
                block_bytes: int = READ_BLOCK_BYTES) -> list[Box]:
    """Cover an array with blocks aligned to its stored chunks (see `block_shape`); 0-d: one box.

    >>> [str(b) for b in read_blocks((5, 4), (4, 4), (2, 4), 4, 32)]
    ['[0:2, 0:4]', '[2:4, 0:4]', '[4:5, 0:4]']
    """
    shape = tuple(int(s) for s in shape)
    if not shape:
        return [Box((), ())]
    if not all(shape):
        return []
    chunk = tuple(min(max(1, int(c)), s) for c, s in zip(chunk, shape))
    inner = tuple(min(max(1, int(i)), c) for i, c in zip(inner, chunk))
    b = block_shape(chunk, inner, itemsize, block_bytes)
    out = []
    for cidx in _grid(shape, chunk):
        c0 = tuple(i * c for i, c in zip(cidx, chunk))
        c1 = tuple(min(s, x + c) for s, x, c in zip(shape, c0, chunk))
        for bidx in _grid(tuple(e - s for s, e in zip(c0, c1)), b):
            start = tuple(x + i * n for x, i, n in zip(c0, bidx, b))
            out.append(Box(start, tuple(min(e, s + n) for e, s, n in zip(c1, start, b))))
    return out


def _grid(shape: Sequence[int], step: Sequence[int]):
    counts = [-(-s // n) for s, n in zip(shape, step)]
    idx = [0] * len(counts)
    while True:
        yield tuple(idx)
        for d in range(len(idx) - 1, -1, -1):
            idx[d] += 1
            if idx[d] < counts[d]:
                break
            idx[d] = 0
        else:
            return


def default_threads() -> int:
    return max(4, min(32, 2 * (os.cpu_count() or 2)))


def digest_threads(reads: int) -> int:
    """Threads that digest blocks: one per core at most (more only queue for the GIL), <= reads."""
    return max(1, min(reads, os.cpu_count() or 1))


def verify_checkpoint(path: str, *, threads: int | None = None, block_bytes: int = READ_BLOCK_BYTES,
                      show_progress: bool | None = None, digests: bool = True,
                      coordinator: Coordinator | None = None) -> VerifyResult:
    """Re-read every array once, in parallel; compare with the manifest (shape, dtype, digest).

    With a `coordinator` of several ranks (`verify` under torchrun) each rank reads a contiguous
    share of the blocks and every rank returns the same result: the digests are sums, so the
    ranks' partial digests of an array add up to the one a single reader computes.

    `threads`: blocks read at once (default `default_threads()`); as many reused buffers.
    `digests=False` reads every byte but computes no digest: it checks structure and readability only
    (a diagnostic of the reads' own rate, `scripts/gpu/scale/offline.py verify --reads-only`).
    Never raises for damage: problems are in the result (`damaged` by array, `metadata_problems`).
    Raises BridgeError only when `path` is not a checkpoint directory at all.
    """
    try:
        ck = open_checkpoint(path, allow_edited_metadata=True)
    except IntegrityError as e:
        return VerifyResult(metadata_problems=[str(e)])
    res = VerifyResult(has_manifest=ck.manifest is not None, metadata_problems=list(ck.metadata_problems))
    records = ck.manifest.arrays if ck.manifest else {}
    if ck.manifest is not None:
        stored = {".".join(p) for p in ck.paths()}
        for name in sorted(set(records) - stored):
            res.damaged[path_str(name.split("."))] = "listed in the manifest but missing from the tree"
    expect = ck.manifest is not None
    try:
        ck.open_many(ck.paths())  # all opens at once; an array that fails is named by _check_info below
    except IntegrityError:
        pass
    infos: dict = {}
    for p in ck.paths():
        res.checked += 1
        problem = _check_info(ck, p, records.get(".".join(p)), expect, infos)
        if problem:
            res.damaged[path_str(p)] = problem
    coord = coordinator or LocalCoordinator()

    def read() -> tuple[dict, dict, int]:
        return _read_all(ck, infos, threads or default_threads(), block_bytes,
                         show_progress if coord.rank == 0 else False, digests, part=(coord.rank, coord.world))

    if coord.world > 1:  # a rank's error reaches every rank (the coordinator), read failures travel as results
        partial, failed, res.bytes_read = _merge_parts(coord.all_gather("verify", lambda: _part_json(*read())), infos)
    else:
        partial, failed, res.bytes_read = read()
    for p, why in failed.items():
        res.damaged[path_str(p)] = why
    for p, info in infos.items():
        if p in failed:
            continue
        record = records.get(".".join(p))
        if digests and record is not None and record.digest is not None and ck.manifest.digest_algorithm == dg.ALGORITHM:
            got = dg.to_hex(dg.combine(partial[p]))
            if got != record.digest:
                res.damaged[path_str(p)] = f"content digest {got} != recorded {record.digest}"
    return res


@dataclass
class _Block:
    """One block in flight: the TensorStore read into `data` (a view of `buf`) and the TensorStore
    array wrapping `data`, kept referenced here until the read is done and digested: were the read the
    last holder of that wrapper, a TensorStore worker would take the GIL to release the numpy array
    and stall behind the digesting threads."""

    path: tuple
    box: Box
    buf: np.ndarray
    data: np.ndarray
    target: object = None
    read: object = None


def _read_all(ck: Checkpoint, infos: dict, threads: int, block_bytes: int,
              show_progress: bool | None, digests: bool = True, part: tuple[int, int] = (0, 1)) -> tuple[dict, dict, int]:
    """Read and digest every array's blocks: `threads` blocks read at once by TensorStore into reused
    buffers of block_bytes (memory ~threads x block_bytes, no block allocated and page-faulted anew);
    `digest_threads` workers digest blocks as their reads land, in large steps (few GIL round trips).
    `part` = (rank, ranks): only this rank's contiguous share of the blocks (`contiguous_parts`).
    Returns (path -> partial digests, path -> first failure, bytes read)."""
    import tensorstore as ts

    jobs = [(p, box) for p, info in infos.items()
            for box in read_blocks(info.shape, info.chunk_shape, info.inner_chunk_shape, _itemsize(info), block_bytes)]
    if part[1] > 1:
        owner = contiguous_parts([_nbytes(infos, p, box) for p, box in jobs], part[1])
        jobs = [j for j, o in zip(jobs, owner) if o == part[0]]
    partial: dict = {p: [] for p in infos}
    failed: dict = {}
    free: queue.SimpleQueue = queue.SimpleQueue()
    made = 0  # buffers allocated so far (on demand, at most `threads`)

    def digest_one(blk: _Block) -> int:
        try:
            blk.read.result()
        except BaseException:
            # TensorStore may still hold this buffer after a failed read: it is never handed out again
            blk.target = None
            if blk.buf.nbytes == block_bytes:
                free.put(np.empty(block_bytes, np.uint8))
            raise
        try:
            if digests:
                partial[blk.path].append(dg.digest_box(infos[blk.path].shape, blk.box, blk.data, step=DIGEST_STEP))
            return blk.data.nbytes
        finally:
            blk.target = None
            if blk.buf.nbytes == block_bytes:
                free.put(blk.buf)

    nread = 0
    pending: dict = {}

    def collect(block: bool) -> None:
        nonlocal nread
        done, _ = wait(pending, timeout=None if block else 0, return_when=FIRST_COMPLETED)
        for f in done:
            p, box = pending.pop(f)
            try:
                n = f.result()
            except Exception as e:
                failed.setdefault(p, f"read of {box} failed: {' '.join(str(e).split())[:300]}")
                n = 0
            nread += n
            bar.update(n)

    with progress(sum(_nbytes(infos, p, box) for p, box in jobs), "verify", enabled=show_progress) as bar, \
            ThreadPoolExecutor(digest_threads(threads), thread_name_prefix="verify") as pool:
        for p, box in jobs:
            if pending:
                collect(block=False)
            if p in failed:
                continue  # this array is already known damaged: spend no more reads on it
            info = infos[p]
            nb = _nbytes(infos, p, box)
            if nb > block_bytes:  # one inner chunk larger than a block: it goes alone, in its own buffer
                while pending:
                    collect(block=True)
                buf = np.empty(nb, np.uint8)
            elif made < threads and free.empty():
                buf, made = np.empty(block_bytes, np.uint8), made + 1
            else:
                buf = free.get()
            data = buf[:nb].view(numpy_dtype(info.dtype)).reshape(box.shape)
            blk = _Block(p, box, buf, data, ts.array(data, copy=False, write=True))
            t = ck.open(p)
            blk.read = blk.target.write(t[box.slices] if box.ndim else t)
            pending[pool.submit(digest_one, blk)] = (p, box)
        while pending:
            collect(block=True)
    return partial, failed, nread


def _part_json(partial: dict, failed: dict, nread: int) -> dict:
    """One rank's share of `_read_all` as JSON: its digest sum per array, failures, bytes read."""
    return {"digests": [[list(p), dg.to_hex(dg.combine(d))] for p, d in partial.items()],
            "failed": [[list(p), why] for p, why in failed.items()], "read": nread}


def _merge_parts(parts: list, infos: dict) -> tuple[dict, dict, int]:
    """Every rank's `_part_json` back into `_read_all`'s result (a failure: the lowest rank's reason)."""
    partial: dict = {p: [] for p in infos}
    failed: dict = {}
    for part in parts:
        for p, d in part["digests"]:
            partial[tuple(p)].append(int(d, 16))
        for p, why in part["failed"]:
            failed.setdefault(tuple(p), why)
    return partial, failed, sum(part["read"] for part in parts)


def _nbytes(infos: dict, p, box: Box) -> int:
    return box.size * _itemsize(infos[p])


def _itemsize(info: ArrayInfo) -> int:
    n = prod(info.shape)
    return max(1, info.nbytes // n) if n else 1


def _check_info(ck: Checkpoint, p, record, expect_record: bool, infos: dict) -> str | None:
    """Open one array and compare its metadata with the manifest; on success it joins `infos`."""
    try:
        info = ck.info(p)
        ck.check_chunk_bytes(p)  # one read decodes a whole chunk: never one the stored bytes cannot hold
    except Exception as e:  # IntegrityError from the reader; anything else from a damaged zarr.json
        return " ".join(str(e).split())[:300]
    if expect_record and record is None:
        return "not listed in the manifest"
    problem = record_problem(info, record) if record is not None else None
    if problem:
        return problem
    infos[p] = info
    return None
