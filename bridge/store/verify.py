"""Full integrity check of a checkpoint: metadata checksum, shapes/dtypes, every byte's digest."""

from __future__ import annotations

from dataclasses import dataclass, field
from math import prod

from bridge.errors import BridgeError
from bridge.layout.boxes import Box
from bridge.progress import progress
from bridge.store import digest as dg
from bridge.store.commit import metadata_checksum
from bridge.store.manifest import MANIFEST_KEY
from bridge.store.reader import Checkpoint, open_checkpoint
from bridge.store.tree import path_str

READ_BLOCK_BYTES = 64 << 20


@dataclass
class VerifyResult:
    """Damaged arrays (path string -> reason), metadata problems, and how many arrays were checked."""

    damaged: dict[str, str] = field(default_factory=dict)
    metadata_problems: list[str] = field(default_factory=list)
    checked: int = 0
    has_manifest: bool = False

    @property
    def ok(self) -> bool:
        return not self.damaged and not self.metadata_problems


def row_blocks(shape: tuple[int, ...], itemsize: int, block_bytes: int = READ_BLOCK_BYTES) -> list[Box]:
    """Cover an array with leading-axis blocks of at most ~block_bytes (one box for 0-d).

    >>> row_blocks((5, 2), 4, 16)
    [Box(start=(0, 0), stop=(2, 2)), Box(start=(2, 0), stop=(4, 2)), Box(start=(4, 0), stop=(5, 2))]
    """
    if not shape:
        return [Box((), ())]
    row = max(1, prod(shape[1:]) * itemsize)
    rows = max(1, block_bytes // row)
    return [Box((r,) + (0,) * (len(shape) - 1), (min(shape[0], r + rows),) + tuple(shape[1:]))
            for r in range(0, shape[0], rows)]


def verify_checkpoint(path: str) -> VerifyResult:
    """Re-read every array; compare with the manifest (shape, dtype, digest) when there is one."""
    ck = open_checkpoint(path)
    res = VerifyResult(has_manifest=ck.manifest is not None)
    records = ck.manifest.arrays if ck.manifest else {}
    if ck.manifest is not None:
        custom = ck.metadata.get("custom_metadata") or {}
        if ck.metadata_checksum != metadata_checksum(ck.metadata.get("tree_metadata"), custom.get(MANIFEST_KEY)):
            res.metadata_problems.append("_METADATA was modified after commit (checksum mismatch)")
        stored = {".".join(p) for p in ck.paths()}
        for name in sorted(set(records) - stored):
            res.damaged[path_str(name.split("."))] = "listed in the manifest but missing from the tree"
    total = sum(_nbytes_or_zero(ck, p) for p in ck.paths())
    with progress(total, "verify") as bar:
        for p in ck.paths():
            res.checked += 1
            problem = _check_array(ck, p, records.get(".".join(p)), ck.manifest is not None, bar)
            if problem:
                res.damaged[path_str(p)] = problem
    return res


def _nbytes_or_zero(ck: Checkpoint, p) -> int:
    try:
        return ck.info(p).nbytes
    except BridgeError:
        return 0


def _check_array(ck: Checkpoint, p, record, expect_record: bool, bar) -> str | None:
    try:
        info = ck.info(p)
    except BridgeError as e:
        return str(e)
    if expect_record and record is None:
        return "not listed in the manifest"
    if record is not None:
        if tuple(record.shape) != info.shape:
            return f"stored shape {info.shape} != manifest shape {tuple(record.shape)}"
        if record.dtype != info.dtype:
            return f"stored dtype {info.dtype} != manifest dtype {record.dtype}"
    itemsize = max(1, info.nbytes // max(1, prod(info.shape)))
    t = ck.open(p)
    total = 0
    try:
        for box in row_blocks(info.shape, itemsize):
            data = t[box.slices].read().result() if box.ndim else t.read().result()
            total = dg.combine([total, dg.digest_box(info.shape, box, data)])
            bar.update(data.nbytes)
    except Exception as e:
        return f"read failed: {' '.join(str(e).split())[:300]}"
    if record is not None and record.digest is not None and ck.manifest.digest_algorithm == dg.ALGORITHM:
        if dg.to_hex(total) != record.digest:
            return f"content digest {dg.to_hex(total)} != recorded {record.digest}"
    return None
