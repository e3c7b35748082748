"""Tensors inside a pickled DCP byte object, located in their file without reading their data.

dp_zero_gather_scatter stores each DistOpt group's whole optimizer state as ONE `torch.save`d object
(`optimizer.distributed.dp_group_idx_<k>.param_state`): at scale it is the full fp32 state of a
TP x PP rank, far larger than any worker's budget. torch.save writes every storage as a stored
(uncompressed) zip member, so each tensor's elements lie at a fixed byte offset of the `.distcp`
file: parsing only the pickle (storages by size) and the zip directory gives a `RecordLayout`
per tensor, and the chunk cache then reads each copy's bytes (`ChunkCache._ranged`) or, for a small
tensor, the tensor alone — CRC-checked either way.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Any

from bridge.errors import BridgeError
from converters.megatron.read.records import RecordLayout, Window

#: containers a param_state object is made of (walked to this depth at most: the file is untrusted)
MAX_DEPTH = 8


@dataclass(frozen=True)
class ObjectTensor:
    """A tensor of a pickled object: its dtype (`torch_archive.TorchDtype`), shape and where its elements are."""

    dtype: Any
    shape: tuple[int, ...]
    layout: RecordLayout

    @property
    def numel(self) -> int:
        return prod(self.shape)


#: a param_state object's pickle holds dicts, dtypes and storage references: kilobytes
MAX_OBJECT_PICKLE = 64 << 20


def object_tensors(ck, name: str) -> Any:
    """The object `name` of checkpoint `ck` (one stored blob, as Megatron's ShardedObjects are) with
    every tensor replaced by an `ObjectTensor`; no tensor data is read, torch is not imported (the
    restricted unpickler of `read.dcp`, storages by size only). Refuses a tensor that is not
    contiguous. None when the blob is a pickled BytesIO holding the archive (DCP's default planner
    saves a BytesIO so; Megatron's torch_dist writer stores the archive itself): its bytes are
    re-encoded inside the pickle, so nothing can be located."""
    from bridge.store import check_relative_path, open_range
    from converters.megatron.read.dcp import archive_members, read_small_members, safe_loads
    from converters.megatron.read.torch_archive import ArchiveTensor

    fqn = ck.object_key(name) or name
    if fqn not in ck.objects:
        raise BridgeError(f"{ck.root}: no object {name!r} in the checkpoint")
    items = ck.objects[fqn].items
    if len(items) != 1:
        raise BridgeError(f"{fqn}: {len(items)} stored blobs, one expected; unknown format")
    ref = items[0][1]
    what = f"{fqn} in {ref.relative_path}"
    path = check_relative_path(ck.root, ref.relative_path, str(ck.root))
    with open_range(path) as fd:
        f = Window(fd, ref.offset, ref.length)
        members = archive_members(f, ref.length, what)
        if "data.pkl" not in members:
            raise BridgeError(f"cannot read {what}: the zip archive has no data.pkl (not a torch.save archive)")
        f.seek(members["data.pkl"][0])
        if b"BytesIO" in f.read(64):
            return None
        small = read_small_members(f, members, what, MAX_OBJECT_PICKLE, "; more than an optimizer object holds")
    obj = safe_loads(small["data.pkl"], what, {k: m[1] for k, m in members.items() if k.startswith("data/")})

    def locate(t: ArchiveTensor, where: str) -> ObjectTensor:
        if not t.is_contiguous() or t.dtype.itemsize is None:
            raise BridgeError(f"cannot read {what}: tensor {where} {t.dtype} {t.shape} (strides {t.stride}) is not "
                              f"one contiguous run of a supported dtype; unknown format")
        start, n, crc, _mname = members[f"data/{t.storage.key}"]
        item = t.dtype.itemsize
        lay = RecordLayout(str(path), ref.offset + start + t.offset * item, item, t.dtype.numpy(), ref.offset + start,
                           n, crc, f"{what} {where}")
        return ObjectTensor(t.dtype, tuple(t.shape), lay)

    def walk(x: Any, where: str, depth: int) -> Any:
        if isinstance(x, ArchiveTensor):
            return locate(x, where)
        if depth >= MAX_DEPTH:
            raise BridgeError(f"cannot read {what}: nested deeper than {MAX_DEPTH}; unknown format")
        if isinstance(x, dict):
            return {k: walk(v, f"{where}[{k!r}]", depth + 1) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return type(x)(walk(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(x))
        return x

    return walk(obj, "", 0)
