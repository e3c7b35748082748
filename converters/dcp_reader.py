"""Safe reader for PyTorch DCP (`torch_dist`) checkpoint directories.

Checkpoints are untrusted input. Three things in a `torch_dist` directory are pickles:
`.metadata` (a plain pickle of `torch.distributed.checkpoint.metadata.Metadata`), and the byte
objects (`common_state`, `_extra_state`, optimizer param groups), each a `torch.save` zip of
`[obj]`. All of them go through `SafeUnpickler`: an allow-list of torch / builtin / collections
classes, inert stubs for `megatron.*`, `transformer_engine.*`, `nvidia_resiliency_ext.*`, and a
`BridgeError` for anything else, raised before the name is resolved, so nothing runs.
Tensor chunks are `torch.save` blobs read with `torch.load(weights_only=True)` from the byte range
`.metadata` names. Relative paths are checked not to escape the directory, files are checked to
exist and to be long enough before any data is read.
"""

from __future__ import annotations

import io
import os
import pickle
import zipfile
from dataclasses import dataclass, field
from math import prod
from pathlib import Path
from typing import Any, Iterator

from bridge.errors import BridgeError

# ---------------------------------------------------------------------------------------------
# Restricted unpickling
# ---------------------------------------------------------------------------------------------

#: Module prefixes whose classes are replaced by inert stubs (they only carry data we may read).
STUB_PREFIXES = ("megatron.", "transformer_engine.", "nvidia_resiliency_ext.", "megatron_core.")

#: (module, name) pairs that are plain data containers or torch/numpy rebuild helpers.
_ALLOWED: set[tuple[str, str]] = {
    ("builtins", n)
    for n in ("dict", "list", "tuple", "set", "frozenset", "bytearray", "bytes", "str", "int", "float",
              "complex", "bool", "slice", "range", "object", "NoneType")
} | {
    ("collections", "OrderedDict"), ("collections", "defaultdict"), ("collections", "deque"),
    ("collections", "Counter"), ("argparse", "Namespace"), ("types", "SimpleNamespace"),
    ("_codecs", "encode"), ("copyreg", "_reconstructor"), ("_io", "BytesIO"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
    ("datetime", "datetime"), ("datetime", "date"), ("datetime", "timedelta"),
    ("torch", "Size"), ("torch", "device"), ("torch", "Tensor"), ("torch.serialization", "_get_layout"),
    ("torch._utils", "_rebuild_tensor"), ("torch._utils", "_rebuild_tensor_v2"),
    ("torch._utils", "_rebuild_parameter"), ("torch._tensor", "_rebuild_from_type_v2"),
    ("torch.nn.parameter", "Parameter"),
    ("numpy", "ndarray"), ("numpy", "dtype"),
    ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"),
}
# DCP's own metadata classes are read as inert records (their pickled state is plain data): no torch
# code runs while unpickling, and torch.distributed.checkpoint (seconds to import) is not needed.
RECORD_CLASSES = {("torch.distributed.checkpoint.metadata", n) for n in (
    "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
    "TensorProperties", "StorageMeta", "MetadataIndex", "_MEM_FORMAT_ENCODING")}
RECORD_CLASSES |= {("torch.distributed.checkpoint.filesystem", n) for n in ("_StorageInfo", "_StoragePrefix")}
RECORD_CLASSES |= {("torch.distributed.checkpoint.planner", n) for n in (
    "SavePlan", "WriteItem", "WriteItemType", "TensorWriteData", "LoadItemType")}


class InertStub:
    """Stand-in for a class from an untrusted module: records what it was built from, runs nothing.

    >>> s = make_stub("megatron.core.enums", "ModelType")(1)
    >>> s.stub_name, s.stub_args
    ('megatron.core.enums.ModelType', (1,))
    """

    stub_name = "?"

    def __new__(cls, *args: Any, **kwargs: Any) -> "InertStub":
        obj = object.__new__(cls)
        obj.__dict__["stub_args"] = args
        obj.__dict__["stub_kwargs"] = kwargs
        obj.__dict__["stub_state"] = None
        obj.__dict__["stub_items"] = {}
        obj.__dict__["stub_list"] = []
        return obj

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # accept anything, do nothing
        pass

    def __setstate__(self, state: Any) -> None:
        self.__dict__["stub_state"] = state

    def __setitem__(self, key: Any, value: Any) -> None:
        self.__dict__["stub_items"][key] = value

    def append(self, value: Any) -> None:
        self.__dict__["stub_list"].append(value)

    def extend(self, values: Any) -> None:
        self.__dict__["stub_list"].extend(values)

    def get(self, name: str, default: Any = None) -> Any:
        """Attribute `name` from the pickled state (dict state or (dict, slots) state)."""
        st = self.stub_state
        if isinstance(st, tuple) and len(st) == 2 and isinstance(st[1], dict):
            merged = dict(st[0] or {})
            merged.update(st[1])
            st = merged
        if isinstance(st, dict):
            return st.get(name, default)
        return default

    def __repr__(self) -> str:
        return f"<stub {self.stub_name}{self.stub_args!r}>"


_STUB_CACHE: dict[str, type] = {}


def make_stub(module: str, name: str) -> type:
    """An InertStub subclass standing in for `module.name` (cached, so identity is stable)."""
    full = f"{module}.{name}"
    if full not in _STUB_CACHE:
        _STUB_CACHE[full] = type(name, (InertStub,), {"stub_name": full, "__module__": "converters.dcp_reader"})
    return _STUB_CACHE[full]


def _resolve_allowed(module: str, name: str) -> Any:
    """Resolve an allow-listed global (imports only modules that are already allow-listed)."""
    import importlib

    if (module, name) in _ALLOWED:
        if module == "builtins" and name == "NoneType":
            return type(None)
        try:
            return getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            if module.startswith("numpy.core"):  # numpy 2 renamed numpy.core -> numpy._core
                return getattr(importlib.import_module(module.replace("numpy.core", "numpy._core")), name)
            raise
    if module == "torch":
        import torch

        obj = getattr(torch, name, None)
        if isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)):
            return obj
    return None


class SafeUnpickler(pickle.Unpickler):
    """`pickle.Unpickler` that resolves only allow-listed globals; stubs Megatron/TE classes.

    `what` names the file or object in error messages.
    """

    what = "pickle"

    def find_class(self, module: str, name: str) -> Any:  # noqa: D102 - pickle API
        module, name = str(module), str(name)
        if any(module == p.rstrip(".") or module.startswith(p) for p in STUB_PREFIXES) or (module, name) in RECORD_CLASSES:
            return make_stub(module, name)
        obj = _resolve_allowed(module, name)
        if obj is None:
            raise BridgeError(
                f"refusing to unpickle {module}.{name} in {self.what}: not an allowed class "
                f"(the checkpoint may be malicious or from an unsupported writer)")
        return obj


def _named_unpickler(what: str) -> type:
    return type("SafeUnpickler", (SafeUnpickler,), {"what": what})


def safe_loads(data: bytes, what: str) -> Any:
    """Unpickle plain pickle bytes with the allow-list.

    >>> safe_loads(pickle.dumps({"a": [1, 2]}), "test")
    {'a': [1, 2]}
    """
    try:
        return _named_unpickler(what)(io.BytesIO(data)).load()
    except BridgeError:
        raise
    except Exception as e:  # corrupt pickle bytes
        raise BridgeError(f"cannot read {what}: damaged pickle ({type(e).__name__}: {e}); "
                          f"the file is truncated or not a torch_dist checkpoint") from None


class _SafePickleModule:
    """A module-like object for `torch.load(pickle_module=...)` using SafeUnpickler."""

    def __init__(self, what: str) -> None:
        self.__name__ = "bridge_safe_pickle"
        self.Unpickler = _named_unpickler(what)

    def load(self, f: Any, **kw: Any) -> Any:  # only used by torch's legacy (non-zip) path
        return self.Unpickler(f, **kw).load()


def safe_torch_load_object(data: bytes, what: str, _depth: int = 0) -> Any:
    """Load a `torch.save` zip holding arbitrary objects (a DCP byte item) with the allow-list.

    DCP's planner `torch.save`s every byte item, and Megatron hands it a BytesIO that already holds
    a `torch.save` of the object, so real items are nested: a BytesIO is unwrapped (bounded depth).
    """
    import torch

    if not zipfile.is_zipfile(io.BytesIO(data)):
        raise BridgeError(f"cannot read {what}: not a torch.save zip archive (damaged or unsupported writer)")
    try:
        obj = torch.load(io.BytesIO(data), map_location="cpu", weights_only=False,
                         pickle_module=_SafePickleModule(what))
    except BridgeError:
        raise
    except Exception as e:
        raise BridgeError(f"cannot read {what}: {type(e).__name__}: {e}".splitlines()[0]) from None
    if isinstance(obj, io.BytesIO) and _depth < 3:
        inner = obj.getvalue()
        if zipfile.is_zipfile(io.BytesIO(inner)):
            return safe_torch_load_object(inner, what, _depth + 1)
    return obj


def safe_torch_load_tensor(data: bytes, what: str) -> "Any":
    """Load a tensor blob (`torch.save(tensor)`) with torch's weights-only unpickler."""
    import torch

    try:
        t = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:
        raise BridgeError(f"cannot read {what}: {type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''} (damaged chunk?)") from None
    if not isinstance(t, torch.Tensor):
        raise BridgeError(f"cannot read {what}: expected a tensor, found {type(t).__name__}")
    return t


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
    """A DCP tensor entry: dtype (a torch dtype), global shape and its chunks."""

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


def check_relative_path(root: Path, rel: str, what: str) -> Path:
    """Resolve `rel` inside `root`, refusing absolute paths, `..` and symlink escapes.

    >>> check_relative_path(Path("/ck"), "__0_0.distcp", "x").name
    '__0_0.distcp'
    """
    if not isinstance(rel, str) or not rel or "\x00" in rel:
        raise BridgeError(f"{what}: invalid file name {rel!r} in .metadata")
    p = Path(rel)
    if p.is_absolute() or ".." in p.parts or rel.startswith(("/", "\\")):
        raise BridgeError(f"{what}: file name {rel!r} escapes the checkpoint directory; refusing")
    full = root / p
    try:
        real_root = os.path.realpath(root)
        real = os.path.realpath(full)
    except OSError:
        return full
    if os.path.commonpath([real_root, real]) != real_root:
        raise BridgeError(f"{what}: file {rel!r} resolves outside the checkpoint directory; refusing")
    return full


def resolve_checkpoint_dir(path: str | os.PathLike) -> Path:
    """The directory holding `.metadata`: SRC itself, or SRC's latest `iter_*` (Megatron save dir)."""
    root = Path(path)
    if not root.exists():
        raise BridgeError(f"{root}: no such directory; give the torch_dist checkpoint directory (iter_<N>)")
    if not root.is_dir():
        raise BridgeError(f"{root}: not a directory; give the torch_dist checkpoint directory (iter_<N>)")
    if (root / ".metadata").is_file():
        return root
    tracker = root / "latest_checkpointed_iteration.txt"
    if tracker.is_file():
        text = tracker.read_text(errors="replace").strip()
        if text.isdigit():
            cand = root / f"iter_{int(text):07d}"
            if (cand / ".metadata").is_file():
                return cand
        elif text == "release" and (root / "release" / ".metadata").is_file():
            return root / "release"
    if (root / "common.pt").exists() or list(root.glob("mp_rank_*")):
        raise BridgeError(f"{root}: this is a legacy 'torch' format checkpoint (mp_rank_*/common.pt), "
                          f"not torch_dist; re-save it with --ckpt-format torch_dist")
    raise BridgeError(f"{root}: not a torch_dist checkpoint (no .metadata file); point SRC at the "
                      f"iter_<N> directory that Megatron-Core wrote")


class DcpCheckpoint:
    """A read-only view of a `torch_dist` directory: entries, chunks, safe reads.

    Opening validates everything the metadata references (paths stay inside, files exist and are
    long enough), so later reads fail only on damaged bytes, with the file named.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.root = resolve_checkpoint_dir(path)
        meta_path = self.root / ".metadata"
        self.metadata = safe_loads(meta_path.read_bytes(), f"{meta_path}")
        self.backend = self._read_backend()
        sdm = _get(self.metadata, "state_dict_metadata")
        storage = _get(self.metadata, "storage_data")
        if not isinstance(sdm, dict) or not isinstance(storage, dict):
            raise BridgeError(f"{meta_path}: not a DCP Metadata object (unknown format); "
                              f"is this a torch_dist checkpoint?")
        by_key: dict[tuple[str, tuple[int, ...]], StorageRef] = {}
        for idx, info in storage.items():
            fqn, off = _get(idx, "fqn"), _get(idx, "offset")
            rel, o, n = _get(info, "relative_path"), _get(info, "offset"), _get(info, "length")
            if _get(info, "transform_descriptors"):
                raise BridgeError(f"{meta_path}: entry {fqn} uses storage transforms "
                                  f"{_get(info, 'transform_descriptors')} (compression?), which are not supported")
            if not isinstance(o, int) or not isinstance(n, int) or o < 0 or n < 0:
                raise BridgeError(f"{meta_path}: entry {fqn} has an invalid byte range")
            check_relative_path(self.root, rel, str(meta_path))
            by_key[(str(fqn), tuple(int(x) for x in off) if off is not None else ())] = StorageRef(rel, o, n)
        self.tensors: dict[str, TensorInfo] = {}
        self.objects: dict[str, ObjectInfo] = {}
        import torch

        for fqn, md in sdm.items():
            chunks = _get(md, "chunks")
            if chunks is None:  # BytesStorageMetadata
                obj = ObjectInfo(fqn)
                for (f, off), ref in by_key.items():
                    if f == fqn:
                        obj.items.append((off, ref))
                if not obj.items:
                    raise BridgeError(f"{meta_path}: object {fqn} has no stored bytes (incomplete checkpoint)")
                self.objects[fqn] = obj
                continue
            props = _get(md, "properties")
            dtype = _get(props, "dtype")
            if not isinstance(dtype, torch.dtype):
                raise BridgeError(f"{meta_path}: tensor {fqn} has no valid dtype")
            ti = TensorInfo(fqn, dtype, tuple(int(s) for s in _get(md, "size")))
            for ch in chunks:
                offs = tuple(int(x) for x in _get(ch, "offsets"))
                sizes = tuple(int(x) for x in _get(ch, "sizes"))
                ref = by_key.get((fqn, offs))
                if ref is None:
                    raise BridgeError(f"{meta_path}: tensor {fqn} chunk at {offs} has no storage entry "
                                      f"(incomplete checkpoint)")
                ti.chunks.append(ChunkInfo(offs, sizes, ref))
            self.tensors[fqn] = ti
        self._check_files()

    # -- validation ----------------------------------------------------------------------------

    def _read_backend(self) -> str:
        mj = self.root / "metadata.json"
        if not mj.is_file():
            return "torch_dist"  # dcp.save without megatron writes no metadata.json
        import json

        try:
            backend = json.loads(mj.read_text()).get("sharded_backend", "torch_dist")
        except (ValueError, AttributeError):
            raise BridgeError(f"{mj}: not valid JSON; the checkpoint is damaged") from None
        if backend != "torch_dist":
            raise BridgeError(f"{self.root}: sharded_backend is {backend!r}; only torch_dist checkpoints "
                              f"can be converted (re-save with --ckpt-format torch_dist)")
        return backend

    def _check_files(self) -> None:
        need: dict[str, int] = {}
        for ref in self.all_refs():
            need[ref.relative_path] = max(need.get(ref.relative_path, 0), ref.offset + ref.length)
        for rel, end in sorted(need.items()):
            p = self.root / rel
            if not p.is_file():
                raise BridgeError(f"missing shard file {p} (named in .metadata); copy the complete checkpoint")
            size = p.stat().st_size
            if size < end:
                raise BridgeError(f"truncated shard file {p}: {size} bytes, .metadata needs {end}; "
                                  f"copy the complete checkpoint")
        self.files = sorted(need)

    def all_refs(self) -> Iterator[StorageRef]:
        for t in self.tensors.values():
            for c in t.chunks:
                yield c.storage
        for o in self.objects.values():
            for _, ref in o.items:
                yield ref

    # -- reads ---------------------------------------------------------------------------------

    def read_bytes(self, ref: StorageRef) -> bytes:
        """The raw bytes of one stored item."""
        p = check_relative_path(self.root, ref.relative_path, str(self.root))
        try:
            with open(p, "rb") as f:
                data = os.pread(f.fileno(), ref.length, ref.offset)
        except FileNotFoundError:
            raise BridgeError(f"missing shard file {p}; copy the complete checkpoint") from None
        if len(data) != ref.length:
            raise BridgeError(f"truncated shard file {p}: item at byte {ref.offset} needs {ref.length} bytes, "
                              f"got {len(data)}")
        return data

    def read_chunk(self, fqn: str, chunk: ChunkInfo) -> "Any":
        """One stored chunk as a torch tensor of shape `chunk.sizes` (dtype checked)."""
        what = f"{fqn} chunk {chunk.offsets} in {chunk.storage.relative_path}"
        t = safe_torch_load_tensor(self.read_bytes(chunk.storage), what)
        ti = self.tensors[fqn]
        if t.dtype != ti.dtype:
            raise BridgeError(f"{what}: stored dtype {t.dtype} differs from .metadata's {ti.dtype}; damaged checkpoint")
        if t.numel() != chunk.numel:
            raise BridgeError(f"{what}: {t.numel()} elements, .metadata says {chunk.numel}; damaged checkpoint")
        return t.reshape(chunk.sizes)

    def object_key(self, name: str) -> str | None:
        """The stored fqn of object `name`: itself, or Megatron's `name/shard_<offset>_<shape>` form."""
        if name in self.objects:
            return name
        for k in self.objects:
            if k.split("/", 1)[0] == name:
                return k
        return None

    def object_names(self) -> list[str]:
        """Object names without Megatron's `/shard_...` suffix."""
        return [k.split("/", 1)[0] for k in self.objects]

    def read_object(self, fqn: str) -> Any:
        """A byte entry unpickled with the allow-list (first blob; MCore wraps objects in a list)."""
        fqn = self.object_key(fqn) or fqn
        if fqn not in self.objects:
            raise BridgeError(f"{self.root}: no object {fqn!r} in the checkpoint")
        out = []
        for off, ref in self.objects[fqn].items:
            out.append(safe_torch_load_object(self.read_bytes(ref), f"{fqn} in {ref.relative_path}"))
        obj = out[0]
        return obj

    def read_full(self, fqn: str) -> "Any":
        """A whole tensor entry assembled from its chunks (small tensors / tests)."""
        import torch

        ti = self.tensors[fqn]
        out = torch.empty(ti.shape, dtype=ti.dtype)
        for c in ti.chunks:
            out[tuple(slice(o, o + s) for o, s in zip(c.offsets, c.sizes))] = self.read_chunk(fqn, c)
        return out

    def common_state(self) -> dict:
        """Megatron's `common_state` object (args, iteration, optimizer groups...), or {} when absent."""
        for name in ("common_state",):
            fqn = self.object_key(name)
            if fqn is not None:
                obj = self.read_object(fqn)
                if isinstance(obj, list) and obj:
                    obj = obj[0]
                if not isinstance(obj, dict):
                    raise BridgeError(f"{self.root}: common_state is a {type(obj).__name__}, expected a dict")
                return obj
        return {}

    def writer_ranks(self) -> list[int]:
        """Ranks that wrote `.distcp` files (`__<rank>_<i>.distcp`), ascending."""
        ranks = set()
        for rel in self.files:
            name = Path(rel).name
            if name.startswith("__") and name.endswith(".distcp"):
                try:
                    ranks.add(int(name[2:].split("_")[0]))
                except ValueError:
                    pass
        return sorted(ranks)

    @property
    def total_bytes(self) -> int:
        return sum(r.length for r in self.all_refs())
