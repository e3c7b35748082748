"""Tensors inside a pickled DCP byte object, located in their file without reading their data.

dp_zero_gather_scatter stores each DistOpt group's whole optimizer state as ONE `torch.save`d object
(`optimizer.distributed.dp_group_idx_<k>.param_state`): at scale it is the full fp32 state of a
TP x PP rank, far larger than any worker's budget. torch.save writes every storage as a stored
(uncompressed) zip member, so each tensor's elements lie at a fixed byte offset of the `.distcp`
file: parsing only the pickle (`map_location="meta"`) and the zip directory gives a `RecordLayout`
per tensor, and the chunk cache then reads each copy's bytes (`ChunkCache._ranged`) or, for a small
tensor, the tensor alone — CRC-checked either way.
"""

from __future__ import annotations

import struct
import zipfile
from dataclasses import dataclass
from typing import Any

from bridge.errors import BridgeError
from converters.megatron.cache import RecordLayout, _Window

#: containers a param_state object is made of (walked to this depth at most: the file is untrusted)
MAX_DEPTH = 8


@dataclass(frozen=True)
class ObjectTensor:
    """A tensor of a pickled object: its dtype (torch), shape and where its elements are."""

    dtype: Any
    shape: tuple[int, ...]
    layout: RecordLayout

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


def object_tensors(ck, name: str) -> Any:
    """The object `name` of checkpoint `ck` (one stored blob, as Megatron's ShardedObjects are) with
    every tensor replaced by an `ObjectTensor`; no tensor data is read. Refuses a tensor that is not
    contiguous or not inside its own stored zip member. None when the blob is a pickled BytesIO
    holding the archive (DCP's default planner saves a BytesIO so; Megatron's torch_dist writer stores
    the archive itself): its bytes are re-encoded inside the pickle, so nothing can be located."""
    import torch

    from bridge.dtypes import numpy_dtype_of_torch
    from converters.megatron.dcp_reader import check_relative_path, open_range

    fqn = ck.object_key(name) or name
    if fqn not in ck.objects:
        raise BridgeError(f"{ck.root}: no object {name!r} in the checkpoint")
    items = ck.objects[fqn].items
    if len(items) != 1:
        raise BridgeError(f"{fqn}: {len(items)} stored blobs, one expected; unknown format")
    ref = items[0][1]
    what = f"{fqn} in {ref.relative_path}"
    path = check_relative_path(ck.root, ref.relative_path, str(ck.root))
    fd = open_range(path)
    try:
        try:
            every = zipfile.ZipFile(_Window(fd, ref.offset, ref.length)).infolist()
            pkl = [i for i in every if i.filename.split("/")[-1] == "data.pkl"]
            if pkl:
                head = fd.pread(30, ref.offset + pkl[0].header_offset)
                n, m = struct.unpack("<HH", head[26:30])
                if b"BytesIO" in fd.pread(64, ref.offset + pkl[0].header_offset + 30 + n + m):
                    return None
            obj = torch.load(_Window(fd, ref.offset, ref.length), map_location="meta", weights_only=True)
            infos = [i for i in every if i.filename.split("/")[-2:-1] == ["data"]]
        except Exception as e:  # noqa: BLE001 - any parse failure is a damaged record
            raise BridgeError(f"cannot read {what}: {type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''} (damaged object?)") from None
        members = {}   # data start in the record -> zip member
        for info in infos:
            head = fd.pread(30, ref.offset + info.header_offset)
            if len(head) < 30 or head[:4] != b"PK\x03\x04" or info.compress_type != zipfile.ZIP_STORED \
                    or info.compress_size != info.file_size:
                raise BridgeError(f"cannot read {what}: zip member {info.filename[:80]!r} is damaged or compressed")
            n, m = struct.unpack("<HH", head[26:30])
            start = info.header_offset + 30 + n + m
            if start + info.file_size > ref.length:
                raise BridgeError(f"cannot read {what}: zip member {info.filename[:80]!r} runs past its record; truncated")
            members[start] = info
    finally:
        fd.close()

    def locate(t, where: str) -> ObjectTensor:
        data = getattr(t.untyped_storage(), "_checkpoint_offset", None)
        info = members.get(data)
        item = t.element_size()
        if info is None or not t.is_contiguous() or info.file_size != t.untyped_storage().nbytes() \
                or (t.storage_offset() + t.numel()) * item > info.file_size:
            raise BridgeError(f"cannot read {what}: tensor {where} {t.dtype} {tuple(t.shape)} is not a contiguous "
                              f"run of its own stored zip member; damaged or unknown format")
        lay = RecordLayout(str(path), ref.offset + data + t.storage_offset() * item, item,
                           numpy_dtype_of_torch(t.dtype), ref.offset + data, info.file_size, info.CRC,
                           f"{what} {where}")
        return ObjectTensor(t.dtype, tuple(t.shape), lay)

    def walk(x: Any, where: str, depth: int) -> Any:
        if isinstance(x, torch.Tensor):
            return locate(x, where)
        if depth >= MAX_DEPTH:
            raise BridgeError(f"cannot read {what}: nested deeper than {MAX_DEPTH}; unknown format")
        if isinstance(x, dict):
            return {k: walk(v, f"{where}[{k!r}]", depth + 1) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return type(x)(walk(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(x))
        return x

    return walk(obj, "", 0)
