"""DCP's `.metadata` as plain data: where each tensor chunk and byte object lies (`StorageRef`,
`ChunkInfo`, `TensorInfo`, `ObjectInfo`), read from the unpickled `Metadata` with every field
type-checked, and file names kept inside the checkpoint directory (`check_relative_path`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from math import prod
from pathlib import Path
from typing import Any

from bridge.errors import BridgeError
from bridge.store import check_relative_path, short_value
from converters.megatron.read.inert import InertStub
from converters.megatron.read.torch_archive import TorchDtype
from converters.megatron.read.unpickle_bounds import Immutables, KeyGuard
from converters.megatron.read.unpickle_rules import int_tuple

# ---------------------------------------------------------------------------------------------
# Checkpoint directory model
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StorageRef:
    """Where one item's bytes live: `length` bytes at `offset` of `relative_path`."""

    relative_path: str
    offset: int
    length: int


@dataclass(frozen=True)
class ChunkInfo:
    """One stored chunk of a tensor: global offsets, sizes, and where its bytes are."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    storage: StorageRef

    @property
    def numel(self) -> int:
        return prod(self.sizes)


@dataclass
class TensorInfo:
    """A DCP tensor entry: dtype (`TorchDtype`: prints as `torch.bfloat16`, `.numpy()` for numpy's,
    `.torch()` for torch's), global shape and its chunks."""

    fqn: str
    dtype: Any
    shape: tuple[int, ...]
    chunks: list[ChunkInfo] = field(default_factory=list)


@dataclass
class ObjectInfo:
    """A DCP byte entry (ShardedObject / common_state): one or more stored blobs."""

    fqn: str
    items: list[tuple[tuple[int, ...], StorageRef]] = field(default_factory=list)


def _get(obj: Any, name: str, default: Any = None) -> Any:
    """Attribute of a real object or of an InertStub's pickled state.

    `TensorProperties` pickles its state as a tuple `(dtype, layout, requires_grad, ...)`.
    """
    if isinstance(obj, InertStub):
        st = obj.stub_state
        if obj.stub_name.endswith(".TensorProperties") and isinstance(st, tuple) and st and name == "dtype":
            return st[0]
        return obj.get(name, default)
    return getattr(obj, name, default)


#: megatron-core 0.15 / 0.16 pickle `.metadata` as this subclass of DCP's Metadata
MCORE_METADATA = "megatron.core.dist_checkpointing.strategies.torch.MCoreMetadata"


def _record(obj: Any, kind: str, what: str) -> InertStub:
    """`obj` must be the DCP record class `kind` (read as an InertStub)."""
    if not isinstance(obj, InertStub) or obj.stub_name.rsplit(".", 1)[-1] != kind:
        raise BridgeError(f"{what}: expected a DCP {kind}, found {short_value(obj)}; the file is damaged "
                          f"or not a torch_dist checkpoint")
    return obj


def _refuse(what: str, why: str) -> None:
    raise BridgeError(f"{what}: {why}; the file is damaged or hostile")


def _index_tuple(x: Any, what: str) -> tuple[int, ...]:
    """A chunk offset / size / shape: a torch.Size or tuple of non-negative ints."""
    return int_tuple(x, what)


def interpret_metadata(md: Any, root: Path, what: str) -> tuple[dict[str, "TensorInfo"], dict[str, "ObjectInfo"]]:
    """Tensors and byte objects of an unpickled DCP `Metadata`, every field type- and range-checked.

    Chunks must lie inside their tensor and each have a storage entry; every storage entry must
    name a file inside `root` and a non-negative byte range.
    """
    if isinstance(md, InertStub) and md.stub_name == MCORE_METADATA:
        pass  # megatron-core 0.15-0.16: DCP Metadata plus an `mcore_data` dict, same fields
    else:
        md = _record(md, "Metadata", what)
    sdm, storage = md.get("state_dict_metadata"), md.get("storage_data")
    if type(sdm) is not dict or type(storage) is not dict:
        raise BridgeError(f"{what}: not a DCP Metadata object (unknown format); is this a torch_dist checkpoint?")
    by_key: dict[tuple[str, tuple[int, ...]], StorageRef] = {}
    keys = KeyGuard(lambda why: _refuse(what, why), lambda n: None, Immutables())   # offsets chosen to collide
    by_fqn: dict[str, list[tuple[tuple[int, ...], StorageRef]]] = {}
    for idx, info in storage.items():
        idx = _record(idx, "MetadataIndex", f"{what}: storage_data key")
        fqn = idx.get("fqn")
        if type(fqn) is not str:
            raise BridgeError(f"{what}: a storage entry without a string fqn ({short_value(fqn)})")
        off = idx.get("offset")
        off = () if off is None else _index_tuple(off, f"{what}: storage entry {fqn} offset")
        info = _record(info, "_StorageInfo", f"{what}: storage entry {fqn}")
        rel, o, n = info.get("relative_path"), info.get("offset"), info.get("length")
        if info.get("transform_descriptors"):
            raise BridgeError(f"{what}: entry {fqn} uses storage transforms (compression?), which are not supported")
        if type(o) is not int or type(n) is not int or not (0 <= o < 1 << 63 and 0 <= n < 1 << 63):
            raise BridgeError(f"{what}: entry {fqn} has an invalid byte range ({short_value(o)}, {short_value(n)})")
        check_relative_path(root, rel, what)
        keys.admit((fqn, off))
        if (fqn, off) in by_key:
            raise BridgeError(f"{what}: entry {fqn} at {off} is stored twice; the file is damaged")
        ref = by_key[(fqn, off)] = StorageRef(rel, o, n)
        by_fqn.setdefault(fqn, []).append((off, ref))
    tensors: dict[str, TensorInfo] = {}
    objects: dict[str, ObjectInfo] = {}
    for fqn, entry in sdm.items():
        if type(fqn) is not str:
            raise BridgeError(f"{what}: an entry name that is not a string ({short_value(fqn)})")
        if isinstance(entry, InertStub) and entry.stub_name.endswith(".BytesStorageMetadata"):
            items = by_fqn.get(fqn, [])
            if not items:
                raise BridgeError(f"{what}: object {fqn} has no stored bytes (incomplete checkpoint)")
            objects[fqn] = ObjectInfo(fqn, list(items))
            continue
        entry = _record(entry, "TensorStorageMetadata", f"{what}: entry {fqn}")
        props = entry.get("properties")
        dtype = _get(props, "dtype") if isinstance(props, InertStub) else None
        if not isinstance(dtype, TorchDtype):
            raise BridgeError(f"{what}: tensor {fqn} has no valid dtype")
        shape = _index_tuple(entry.get("size"), f"{what}: tensor {fqn} size")
        chunks = entry.get("chunks")
        if type(chunks) is not list:
            raise BridgeError(f"{what}: tensor {fqn} has no chunk list (found {short_value(chunks)})")
        ti = TensorInfo(fqn, dtype, shape)
        for ch in chunks:
            ch = _record(ch, "ChunkStorageMetadata", f"{what}: tensor {fqn} chunk")
            offs = _index_tuple(ch.get("offsets"), f"{what}: tensor {fqn} chunk offsets")
            sizes = _index_tuple(ch.get("sizes"), f"{what}: tensor {fqn} chunk sizes")
            if len(offs) != len(shape) or len(sizes) != len(shape) or \
                    any(o + n > s for o, n, s in zip(offs, sizes, shape)):
                raise BridgeError(f"{what}: tensor {fqn} of shape {shape} has a chunk at {offs} of size {sizes} "
                                  f"outside it; the file is damaged")
            ref = by_key.get((fqn, offs))
            if ref is None:
                raise BridgeError(f"{what}: tensor {fqn} chunk at {offs} has no storage entry "
                                  f"(incomplete checkpoint)")
            ti.chunks.append(ChunkInfo(offs, sizes, ref))
        tensors[fqn] = ti
    return tensors, objects


