"""Safe reader for PyTorch DCP (`torch_dist`) checkpoint directories.

Checkpoints are untrusted input. Three things in a `torch_dist` directory are pickles:
`.metadata` (a plain pickle of `torch.distributed.checkpoint.metadata.Metadata`), and the byte
objects (`common_state`, `_extra_state`, optimizer param groups), each a `torch.save` zip of
`[obj]`. All of them go through `SafeUnpickler` (pure-Python pickle with every opcode that calls,
creates or mutates an object checked): an allow-list of torch / builtin / collections classes,
each callable's arguments validated, numpy only as plain numeric arrays and scalars (no object or
structured dtypes: a forged pointer cannot be built), inert stubs for `megatron.*`,
`transformer_engine.*`, `nvidia_resiliency_ext.*`, memory bounded by a constant times the input
size, and a one-line `BridgeError` naming the file for anything else, raised before it is built.

Integrity: DCP itself stores no checksum. Each `.distcp` record is a `torch.save` zip whose members
carry a CRC-32 (torch.load ignores it); every member of every record read is CRC-checked
(`zip_records`), so a flipped bit in any tensor or object record is refused naming the key and
file. `.metadata` and `metadata.json` carry no checksum: they are checked structurally (types,
ranges, chunks inside tensors, byte ranges inside files, paths inside the directory).
Tensor records are unpickled by the same reader (not `torch.load`), sharing the read buffer.

torch is never imported to read a checkpoint: torch's classes and rebuild functions are allow-listed
by name and build inert values (`converters.megatron.torch_archive`: a tensor is an `ArchiveTensor`
whose `.numpy()` views the record's bytes), so convert's processes stay hundreds of MiB smaller. The
functions named `*torch*` (`safe_torch_load_tensor`, `read_chunk`, `read_full`) convert to torch at
their edge, for callers that want tensors.
"""

from __future__ import annotations

import _compat_pickle
import argparse
import io
import os
import pickle
import re
import struct
import types
import zipfile
import zlib
from dataclasses import dataclass, field
from math import prod
from pathlib import Path
from typing import Any, Iterator

from bridge.errors import BridgeError
from bridge.store import open_storage
from bridge.store.ranged import RangeReader, open_range  # noqa: F401 - RangeReader: readers name it here
from bridge.store.sources import (FileSource, ObjectSource, check_relative_path,  # noqa: F401 - readers name them here
                                  source_of)
from bridge.store.sources import short_value as _short
from converters.megatron.inert import InertStub
from converters.megatron.unpickle_bounds import MAX_NESTING, Immutables, KeyGuard, check_graph, copy_keys
from converters.megatron.torch_archive import (DTYPE_NAMES, LAYOUT_NAMES, MEMORY_FORMAT_NAMES, STORAGE_DTYPES,
                                               ArchiveTensor, Storage, TorchDevice, TorchDtype, TorchLayout,
                                               TorchMemoryFormat, to_torch)

# ---------------------------------------------------------------------------------------------
# Restricted unpickling
# ---------------------------------------------------------------------------------------------

#: Module prefixes whose classes are replaced by inert stubs (they only carry data we may read).
STUB_PREFIXES = ("megatron.", "transformer_engine.", "nvidia_resiliency_ext.", "megatron_core.")

# DCP's own metadata classes are read as inert records (their pickled state is plain data): no torch
# code runs while unpickling, and torch.distributed.checkpoint (seconds to import) is not needed.
RECORD_CLASSES = {("torch.distributed.checkpoint.metadata", n) for n in (
    "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
    "TensorProperties", "StorageMeta", "MetadataIndex", "_MEM_FORMAT_ENCODING")}
RECORD_CLASSES |= {("torch.distributed.checkpoint.filesystem", n) for n in ("_StorageInfo", "_StoragePrefix")}
RECORD_CLASSES |= {("torch.distributed.checkpoint.planner", n) for n in (
    "SavePlan", "WriteItem", "WriteItemType", "TensorWriteData", "LoadItemType")}

#: Limits that keep a hostile pickle from costing more than a constant times its size.
MAX_DIMS = 64             # dimensions of a torch.Size / array shape
ALLOC_PER_INPUT_BYTE = 16  # objects/bytes a pickle may copy through allowed callables, per input byte
ALLOC_SLACK = 1 << 20

_STUB_CACHE: dict[str, type] = {}


def make_stub(module: str, name: str) -> type:
    """An InertStub subclass standing in for `module.name` (cached, so identity is stable)."""
    full = f"{module}.{name}"
    if full not in _STUB_CACHE:
        _STUB_CACHE[full] = type(name, (InertStub,), {"stub_name": full, "__module__": "converters.megatron.dcp_reader"})
    return _STUB_CACHE[full]


def _is_stub_class(obj: Any) -> bool:
    return isinstance(obj, type) and issubclass(obj, InertStub)


@dataclass(frozen=True)
class _StorageKind:
    """What a `torch.<X>Storage` global means inside a torch.save pickle: the element dtype."""

    dtype: TorchDtype


@dataclass(frozen=True)
class TorchGlobal:
    """An allow-listed torch class or function, by name: what the pickle calls is checked and built
    by its rule in `_call_rules` (torch itself is not imported)."""

    module: str
    name: str


#: torch globals a torch.save pickle may name, and the markers standing for them
_TORCH_GLOBALS = {(m, n): TorchGlobal(m, n) for m, n in (
    ("torch", "Size"), ("torch", "device"), ("torch", "Tensor"), ("torch.serialization", "_get_layout"),
    ("torch._utils", "_rebuild_tensor"), ("torch._utils", "_rebuild_tensor_v2"),
    ("torch._utils", "_rebuild_parameter"), ("torch._tensor", "_rebuild_from_type_v2"),
    ("torch.nn.parameter", "Parameter"))}
_TORCH_NAMES: dict[str, Any] = {**{n: TorchDtype(n) for n in DTYPE_NAMES}, **{n: TorchLayout(n) for n in LAYOUT_NAMES},
                                **{n: TorchMemoryFormat(n) for n in MEMORY_FORMAT_NAMES}}
_STORAGE_KINDS = {n: _StorageKind(_TORCH_NAMES[d]) for n, d in STORAGE_DTYPES.items()}


_GLOBALS: dict[tuple[str, str], Any] | None = None
_CALLS: dict[Any, Any] = {}       # allowed global -> checker(unpickler, args, kwargs) building the object
_EMPTY_NEW: set[Any] = set()      # classes NEWOBJ may create empty (their state comes from later opcodes)


def _globals() -> dict[tuple[str, str], Any]:
    """The allow-list: (module, name) -> object; built once, on first use (imports numpy, not torch)."""
    global _GLOBALS
    if _GLOBALS is not None:
        return _GLOBALS
    import argparse
    import collections
    import codecs
    import copyreg
    import datetime
    import pathlib
    import types

    import numpy as np

    try:
        from numpy._core import multiarray as np_ma
    except ImportError:  # numpy 1
        from numpy.core import multiarray as np_ma
    b = __import__("builtins")
    g: dict[tuple[str, str], Any] = {("builtins", n): getattr(b, n) for n in (
        "dict", "list", "tuple", "set", "frozenset", "bytearray", "bytes", "str", "int", "float", "complex",
        "bool", "slice", "object")}
    g[("builtins", "NoneType")] = type(None)
    g.update({
        ("collections", "OrderedDict"): collections.OrderedDict, ("collections", "defaultdict"): collections.defaultdict,
        ("collections", "deque"): collections.deque, ("collections", "Counter"): collections.Counter,
        ("argparse", "Namespace"): argparse.Namespace, ("types", "SimpleNamespace"): types.SimpleNamespace,
        ("_codecs", "encode"): codecs.encode, ("copyreg", "_reconstructor"): copyreg._reconstructor,
        ("_io", "BytesIO"): io.BytesIO, ("pathlib", "PosixPath"): pathlib.PosixPath,
        ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
        ("datetime", "datetime"): datetime.datetime, ("datetime", "date"): datetime.date,
        ("datetime", "timedelta"): datetime.timedelta,
        **_TORCH_GLOBALS,
        ("numpy", "ndarray"): np.ndarray, ("numpy", "dtype"): np.dtype,
    })
    for mod in ("numpy.core.multiarray", "numpy._core.multiarray"):
        g[(mod, "_reconstruct")] = np_ma._reconstruct
        g[(mod, "scalar")] = np_ma.scalar
    for cls in (dict, list, set, bytearray, collections.OrderedDict, collections.Counter, collections.deque,
                argparse.Namespace, types.SimpleNamespace, io.BytesIO, object):
        _EMPTY_NEW.add(cls)
    _CALLS.update(_call_rules(g))
    _GLOBALS = g
    return g


def _sized(x: Any) -> bool:
    """A concrete, already-built container (no lazy range/iterator that a copy would expand)."""
    return type(x) in (list, tuple, dict, set, frozenset, str, bytes, bytearray) or isinstance(x, dict)


def _plain_numeric_dtype(d: Any) -> bool:
    """A numpy dtype whose raw bytes cannot encode pointers: bool/int/uint/float/complex, no fields.

    >>> import numpy as np
    >>> _plain_numeric_dtype(np.dtype("f4")), _plain_numeric_dtype(np.dtype("O")), _plain_numeric_dtype(np.dtype([("a", "O")]))
    (True, False, False)
    """
    import numpy as np

    return (isinstance(d, np.dtype) and d.kind in "biufc" and d.fields is None and d.subdtype is None
            and not d.hasobject and d.flags == np.dtype(d.str).flags)


def _int_tuple(x: Any, what: str, max_len: int = MAX_DIMS) -> tuple[int, ...]:
    ok = isinstance(x, (tuple, list)) and len(x) <= max_len
    if ok:
        for v in x:  # a plain loop: this runs for every chunk offset of a large .metadata
            if type(v) is not int or not 0 <= v < 1 << 63:   # torch sizes are int64
                ok = False
                break
    if not ok:
        raise BridgeError(f"{what}: expected at most {max_len} integers in [0, 2**63), found {_short(x)}")
    return tuple(x)


def _call_rules(g: dict[tuple[str, str], Any]) -> dict[Any, Any]:
    """Per allowed callable, a checker that validates the arguments and then builds the object.

    Every rule charges what it copies to the unpickler's allocation budget; callables that could
    expand a small argument (bytearray(3e9), list(range(5e7)), torch.Tensor(1e5, 1e5)) do not exist here.
    """
    import argparse
    import collections
    import copyreg
    import datetime
    import pathlib
    import types

    import numpy as np

    np_reconstruct = g[("numpy._core.multiarray", "_reconstruct")]
    np_scalar = g[("numpy._core.multiarray", "scalar")]

    def container(cls):
        def rule(u, args, kw):
            if kw or len(args) > 1 or (args and not _sized(args[0])):
                raise BridgeError(f"{u.what}: {cls.__name__}() with arguments {[_short(a) for a in args]}; "
                                  f"only a copy of an already-built container is allowed")
            if args:
                u.charge(len(args[0]))
                u.keys.admit_all(copy_keys(cls, args[0]))
            out = cls(*args)
            if cls in (tuple, frozenset):
                u.note_immutable(out, out)
            return out
        return rule

    def scalar_of(cls, max_len: int = 4300):
        def rule(u, args, kw):
            if kw or len(args) > 2 or not all(isinstance(a, (int, float, str, bytes, complex)) for a in args) \
                    or any(isinstance(a, (str, bytes)) and len(a) > max_len for a in args):
                raise BridgeError(f"{u.what}: {cls.__name__}() with arguments {[_short(a) for a in args]}")
            return cls(*args)
        return rule

    def bytes_like(cls):
        def rule(u, args, kw):
            if kw or len(args) > 3 or (args and isinstance(args[0], int)) or (args and not _sized(args[0])) \
                    or not all(isinstance(a, str) for a in args[1:]):
                raise BridgeError(f"{u.what}: {cls.__name__}() with arguments {[_short(a) for a in args]}; "
                                  f"only bytes given in the file are allowed")
            if args:
                u.charge(len(args[0]) * (4 if isinstance(args[0], str) else 1))
            return cls(*args)
        return rule

    def str_rule(u, args, kw):
        if kw or len(args) > 3 or (args and not isinstance(args[0], (str, bytes, bytearray, int, float))):
            raise BridgeError(f"{u.what}: str() with arguments {[_short(a) for a in args]}")
        if args and isinstance(args[0], (str, bytes, bytearray)):
            u.charge(len(args[0]) * 4)
        return str(*args)

    def encode(u, args, kw):
        if kw or len(args) != 2 or not isinstance(args[0], str) or args[1] not in ("latin1", "latin-1"):
            raise BridgeError(f"{u.what}: _codecs.encode only decodes latin1 text (protocol-2 bytes)")
        u.charge(len(args[0]))
        return args[0].encode("latin1")

    def namespace(cls):
        def rule(u, args, kw):
            if args or not all(isinstance(k, str) for k in kw):
                raise BridgeError(f"{u.what}: {cls.__name__}() with positional arguments")
            u.charge(len(kw))
            return cls(**kw)
        return rule

    def reconstructor(u, args, kw):
        if kw or len(args) != 3 or args[1] is not object or args[2] is not None or \
                not (_is_stub_class(args[0]) or args[0] in (argparse.Namespace, types.SimpleNamespace)):
            raise BridgeError(f"{u.what}: copyreg._reconstructor may only create a Megatron record or a Namespace")
        return args[0]() if _is_stub_class(args[0]) else object.__new__(args[0])

    def bytesio(u, args, kw):
        if kw or len(args) > 1 or (args and type(args[0]) not in (bytes, bytearray)):
            raise BridgeError(f"{u.what}: BytesIO() with arguments {[_short(a) for a in args]}")
        u.charge(len(args[0]) if args else 0)
        return io.BytesIO(*args)

    def path(cls):
        def rule(u, args, kw):
            if kw or len(args) > 64 or not all(isinstance(a, str) and len(a) < 4096 for a in args):
                raise BridgeError(f"{u.what}: {cls.__name__}() with arguments that are not short strings")
            return cls(*args)
        return rule

    def plain_args(cls, n: int):
        def rule(u, args, kw):
            ok = (type(None), int, float, bool, str, bytes)
            if kw or len(args) > n or not all(isinstance(a, ok) and (not isinstance(a, (str, bytes)) or len(a) < 64)
                                              for a in args):
                raise BridgeError(f"{u.what}: {cls.__name__}() with arguments {[_short(a) for a in args]}")
            return cls(*args)
        return rule

    def size(u, args, kw):
        if kw or len(args) != 1:
            raise BridgeError(f"{u.what}: torch.Size() needs one tuple of integers")
        return _int_tuple(args[0], f"{u.what}: torch.Size")  # a tuple: torch.Size is one

    def device(u, args, kw):
        m = re.fullmatch(r"([a-z_]{1,24})(?::(\d{1,4}))?", args[0]) if args and isinstance(args[0], str) else None
        if kw or not 1 <= len(args) <= 2 or m is None or \
                (len(args) == 2 and (type(args[1]) is not int or not 0 <= args[1] < 1 << 16 or m.group(2))):
            raise BridgeError(f"{u.what}: torch.device() with arguments {[_short(a) for a in args]}")
        index = args[1] if len(args) == 2 else int(m.group(2)) if m.group(2) else None
        return TorchDevice(m.group(1), index)

    def layout(u, args, kw):
        if kw or len(args) != 1 or not isinstance(args[0], str):
            raise BridgeError(f"{u.what}: _get_layout() needs a layout name")
        v = _TORCH_NAMES.get(args[0][len("torch."):]) if args[0].startswith("torch.") else None
        if not isinstance(v, TorchLayout):
            raise BridgeError(f"{u.what}: unknown tensor layout {_short(args[0])}")
        return v

    def rebuild_tensor(u, args, kw):
        if kw or not 4 <= len(args) <= 7:
            raise BridgeError(f"{u.what}: tensor rebuild with {len(args)} arguments")
        storage, offset, shape, stride = args[:4]
        hooks = args[5] if len(args) > 5 else None
        meta = args[6] if len(args) > 6 else None
        if not isinstance(storage, Storage):
            raise BridgeError(f"{u.what}: a tensor without a stored record (a tensor rebuild outside a torch.save archive)")
        shape = _int_tuple(shape, f"{u.what}: tensor shape")
        stride = _int_tuple(stride, f"{u.what}: tensor stride")
        if type(offset) is not int or offset < 0 or len(stride) != len(shape) \
                or (len(args) > 4 and not isinstance(args[4], bool)) or hooks or meta:
            raise BridgeError(f"{u.what}: invalid tensor rebuild arguments (offset {_short(offset)}, "
                              f"shape {shape}, stride {stride})")
        item = storage.dtype.itemsize
        end = offset + (sum((n - 1) * s for n, s in zip(shape, stride)) + 1 if all(shape) else 0)
        if end * item > storage.nbytes:
            raise BridgeError(f"{u.what}: tensor of shape {shape} (stride {stride}, offset {offset}) needs "
                              f"{end * item} bytes of a {storage.nbytes}-byte record")
        return ArchiveTensor(storage, offset, shape, stride, requires_grad=len(args) > 4 and args[4])

    def rebuild_parameter(u, args, kw):
        if kw or len(args) != 3 or not isinstance(args[0], ArchiveTensor) or not isinstance(args[1], bool) or args[2]:
            raise BridgeError(f"{u.what}: invalid Parameter rebuild")
        return args[0].as_parameter(args[1])

    def rebuild_from_type(u, args, kw):
        if kw or len(args) != 4 or args[0] not in (g[("torch._utils", "_rebuild_tensor_v2")],
                                                    g[("torch._utils", "_rebuild_tensor")]) \
                or args[1] not in (g[("torch", "Tensor")], g[("torch.nn.parameter", "Parameter")]) \
                or type(args[2]) is not tuple or not (args[3] is None or (type(args[3]) is dict and not args[3])):
            raise BridgeError(f"{u.what}: invalid tensor rebuild (only plain tensors and Parameters)")
        t = rebuild_tensor(u, args[2], {})
        return t if args[1] is g[("torch", "Tensor")] else t.as_parameter(t.requires_grad)

    def parameter(u, args, kw):
        if kw or not 1 <= len(args) <= 2 or not isinstance(args[0], ArchiveTensor) or \
                (len(args) == 2 and not isinstance(args[1], bool)):
            raise BridgeError(f"{u.what}: Parameter() needs a tensor")
        return args[0].as_parameter(args[1] if len(args) == 2 else True)

    def dtype(u, args, kw):
        # numpy pickles a dtype as dtype("f8", False, True) + a BUILD with byte order; only the plain
        # numeric codes are accepted, as a private copy that one BUILD may still adjust
        if kw or not 1 <= len(args) <= 3 or not isinstance(args[0], str) or \
                re.fullmatch(r"[<>|=]?(?:[biufc]\d{1,2}|\?)", args[0]) is None or \
                not all(isinstance(a, bool) for a in args[1:]):
            raise BridgeError(f"{u.what}: numpy dtype {_short(args[0] if args else None)} refused: only "
                              f"bool/integer/float/complex arrays may be stored in a checkpoint")
        d = np.dtype(args[0], False, True)  # a private copy: BUILD must never change numpy's shared dtypes
        if not _plain_numeric_dtype(d):
            raise BridgeError(f"{u.what}: numpy dtype {args[0]!r} refused (not a plain numeric type)")
        u.open_dtype(d)
        return d

    def reconstruct(u, args, kw):
        if kw or len(args) != 3 or args[0] is not np.ndarray or type(args[1]) is not tuple or args[1] != (0,) \
                or type(args[2]) not in (bytes, str) or args[2] not in (b"b", "b"):
            raise BridgeError(f"{u.what}: numpy array reconstruction with arguments "
                              f"{[_short(a) for a in args]} refused (only plain ndarrays)")
        arr = np_reconstruct(np.ndarray, (0,), b"b")  # an empty int8 array until its BUILD
        u.open_array(arr)
        return arr

    def scalar(u, args, kw):
        if kw or len(args) != 2 or not _plain_numeric_dtype(args[0]) or type(args[1]) is not bytes \
                or len(args[1]) != args[0].itemsize:
            raise BridgeError(f"{u.what}: numpy scalar refused: only bool/integer/float/complex scalars "
                              f"given as exactly their bytes")
        u.close_dtype(args[0])
        return np_scalar(args[0], args[1])

    rules: dict[Any, Any] = {
        dict: container(dict), list: container(list), tuple: container(tuple), set: container(set),
        frozenset: container(frozenset), collections.OrderedDict: container(collections.OrderedDict),
        collections.Counter: container(collections.Counter), collections.deque: container(collections.deque),
        bytes: bytes_like(bytes), bytearray: bytes_like(bytearray), str: str_rule,
        int: scalar_of(int), float: scalar_of(float), complex: scalar_of(complex), bool: scalar_of(bool),
        slice: plain_args(slice, 3), object: plain_args(object, 0), type(None): plain_args(type(None), 0),
        argparse.Namespace: namespace(argparse.Namespace), types.SimpleNamespace: namespace(types.SimpleNamespace),
        g[("_codecs", "encode")]: encode, copyreg._reconstructor: reconstructor, io.BytesIO: bytesio,
        pathlib.PosixPath: path(pathlib.PosixPath), pathlib.PurePosixPath: path(pathlib.PurePosixPath),
        datetime.datetime: plain_args(datetime.datetime, 8), datetime.date: plain_args(datetime.date, 3),
        datetime.timedelta: plain_args(datetime.timedelta, 3),
        g[("torch", "Size")]: size, g[("torch", "device")]: device, g[("torch.serialization", "_get_layout")]: layout,
        g[("torch._utils", "_rebuild_tensor")]: rebuild_tensor,
        g[("torch._utils", "_rebuild_tensor_v2")]: rebuild_tensor,
        g[("torch._utils", "_rebuild_parameter")]: rebuild_parameter,
        g[("torch._tensor", "_rebuild_from_type_v2")]: rebuild_from_type,
        g[("torch.nn.parameter", "Parameter")]: parameter, np.dtype: dtype, np_reconstruct: reconstruct, np_scalar: scalar,
    }

    def defaultdict_rule(u, args, kw):
        if kw or len(args) > 1 or (args and args[0] not in (None, list, dict, int, float, set, str)):
            raise BridgeError(f"{u.what}: defaultdict() with a factory that is not a plain type")
        return collections.defaultdict(*args)

    rules[collections.defaultdict] = defaultdict_rule
    return rules


class SafeUnpickler(pickle._Unpickler):
    """A pickle reader that can only build what DCP metadata and Megatron objects hold.

    The pure-Python unpickler with every opcode that creates, calls or mutates an object checked:
    only allow-listed globals (Megatron/TE classes become `InertStub`s), each callable's arguments
    validated (`_call_rules`), numpy arrays only of plain numeric dtypes with exactly their bytes
    (checked BEFORE `ndarray.__setstate__`), memo indices no larger than the file, copies charged
    to a budget proportional to the input, nesting bounded, no cycles. Its memo is a dict, so a
    huge memo index costs nothing (the C unpickler allocates an array up to the index).
    Anything else raises `BridgeError` naming `what`.
    """

    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, file: io.BytesIO, what: str, size: int,
                 records: dict[str, memoryview | int] | None = None) -> None:
        super().__init__(file)
        self._file = file
        self.what = what
        self.size = size
        self.budget = ALLOC_PER_INPUT_BYTE * size + ALLOC_SLACK
        self.records = records
        self.storages: dict[str, Storage] = {}
        self._open_arrays: dict[int, Any] = {}   # id -> array from _reconstruct awaiting its one BUILD
        self._open_dtypes: dict[int, Any] = {}   # id -> dtype copy that one BUILD may still adjust
        self.immutables = Immutables()   # nesting and unfolded size of tuples / frozensets (hash costs)
        self.keys = KeyGuard(self.refuse, self.charge, self.immutables)   # hash flooding refused

    def load(self) -> Any:  # noqa: D102 - pickle API
        # The input is one in-memory buffer, so frames need no unframer: reading opcodes straight from
        # the BytesIO (C calls) saves a Python-level call per opcode through pickle._Unframer.
        f = self._file
        self.read, self.readline, self.readinto = f.read, f.readline, f.readinto
        self.metastack = []
        self.stack = []
        self.append = self.stack.append
        self.proto = 0
        read, dispatch = f.read, self.dispatch
        try:
            while True:
                key = read(1)
                if not key:
                    raise EOFError
                dispatch[key[0]](self)
        except pickle._Stop as stop:
            return stop.value

    def load_frame(self) -> None:
        self.read(8)  # a frame only announces how many of the following bytes belong together

    def load_bytearray8(self) -> None:
        n = int.from_bytes(self.read(8), "little")
        if n > self.size:  # pickle._Unpickler would allocate n bytes before reading them
            self.refuse(f"a {n}-byte bytearray in a {self.size}-byte file")
        data = self.read(n)
        if len(data) != n:
            raise EOFError
        self.append(bytearray(data))

    # -- bookkeeping ----------------------------------------------------------------------------

    def refuse(self, why: str) -> None:
        raise BridgeError(f"{self.what}: {why}; the file is damaged or hostile (refused before building it)")

    def charge(self, n: int) -> None:
        self.budget -= n
        if self.budget < 0:
            self.refuse(f"it would build more than {ALLOC_PER_INPUT_BYTE} objects per byte of its "
                        f"{self.size} bytes")

    def open_array(self, arr: Any) -> None:
        self._open_arrays[id(arr)] = arr

    def open_dtype(self, d: Any) -> None:
        self._open_dtypes[id(d)] = d

    def close_dtype(self, d: Any) -> None:
        # once a dtype describes data, a later BUILD must not change what that data means
        self._open_dtypes.pop(id(d), None)

    def note_immutable(self, obj: Any, items: Any) -> None:
        """Record a tuple/frozenset's nesting and size; deep ones are refused (hashing them recurses in C)."""
        if self.immutables.note(obj, items) > MAX_NESTING:
            self.refuse(f"tuples nested more than {MAX_NESTING} deep")

    # -- globals ----------------------------------------------------------------------------------

    def find_class(self, module: str, name: str) -> Any:  # noqa: D102 - pickle API
        module, name = str(module), str(name)
        if self.proto < 3:  # Python 2 names in protocol 0-2 pickles (as pickle.Unpickler's fix_imports)
            module, name = _compat_pickle.NAME_MAPPING.get((module, name), (module, name))
            module = _compat_pickle.IMPORT_MAPPING.get(module, module)
        if any(module == p.rstrip(".") or module.startswith(p) for p in STUB_PREFIXES) or (module, name) in RECORD_CLASSES:
            return make_stub(module, name)
        g = _globals()
        if (module, name) in g:
            return g[(module, name)]
        if module == "torch":
            if self.records is not None and name in _STORAGE_KINDS:
                return _STORAGE_KINDS[name]
            if name in _TORCH_NAMES:  # a dtype, layout or memory format
                return _TORCH_NAMES[name]
        raise BridgeError(f"refusing to unpickle {module}.{name} in {self.what}: not an allowed class "
                          f"(the checkpoint may be malicious or from an unsupported writer)")

    def persistent_load(self, pid: Any) -> Any:  # noqa: D102 - pickle API
        if self.records is None:
            self.refuse("a persistent reference outside a torch.save archive")
        if not (type(pid) is tuple and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], _StorageKind)
                and type(pid[2]) is str and type(pid[4]) is int and pid[4] >= 0):
            self.refuse(f"an invalid tensor storage reference {_short(pid)}")
        _, kind, key, _loc, numel = pid
        if key in self.storages:
            return self.storages[key]
        rec = self.records.get(f"data/{key}")
        if rec is None:
            self.refuse(f"tensor storage {key!r} has no data/{key} record")
        nbytes = numel * kind.dtype.itemsize
        size = rec if type(rec) is int else len(rec)  # an int: only the archive's layout is read
        if size != nbytes:
            self.refuse(f"tensor storage {key!r}: record has {size} bytes, the pickle says {nbytes}")
        st = Storage(key, kind.dtype, nbytes, None if type(rec) is int else rec)
        self.storages[key] = st
        return st

    # -- opcodes that call, create or mutate ------------------------------------------------------

    def call(self, func: Any, args: Any, kw: dict | None = None) -> Any:
        if type(args) is not tuple or (kw is not None and type(kw) is not dict):
            self.refuse("a call with arguments that are not a tuple")
        if type(func) in (tuple, frozenset):   # looking it up would hash it: 2**48 steps for a shared one
            self.refuse(f"calling a {type(func).__name__}")
        if _is_stub_class(func):
            return func(*args, **(kw or {}))
        try:
            rule = _CALLS.get(func)
        except TypeError:
            rule = None
        if rule is None:
            self.refuse(f"calling {_short(func) if not hasattr(func, '__name__') else func.__name__} is not allowed")
        return rule(self, args, kw or {})

    def new(self, cls: Any, args: Any, kw: dict | None = None) -> Any:
        if _is_stub_class(cls) or type(cls) in (tuple, frozenset):
            return self.call(cls, args, kw)
        try:
            empty = cls in _EMPTY_NEW
        except TypeError:
            empty = False
        if empty:  # __new__ ignores the arguments of these; their content comes from BUILD/SETITEMS
            if cls is object and (args or kw):
                self.refuse("object() with arguments")
            return cls.__new__(cls)
        return self.call(cls, args, kw)

    def load_reduce(self) -> None:
        args = self.stack.pop()
        self.stack[-1] = self.call(self.stack[-1], args)

    def load_newobj(self) -> None:
        args = self.stack.pop()
        cls = self.stack.pop()
        self.append(self.new(cls, args))

    def load_newobj_ex(self) -> None:
        kwargs = self.stack.pop()
        args = self.stack.pop()
        cls = self.stack.pop()
        self.append(self.new(cls, args, kwargs))

    def _instantiate(self, klass: Any, args: list) -> None:
        self.append(self.call(klass, tuple(args)))

    def load_obj(self) -> None:
        args = self.pop_mark()
        cls = args.pop(0)
        self._instantiate(cls, args)

    def load_build(self) -> None:
        import numpy as np

        state = self.stack.pop()
        inst = self.stack[-1]
        if isinstance(inst, InertStub):
            inst.__setstate__(state)
        elif type(inst) is np.ndarray:
            self._build_array(inst, state)
        elif type(inst) is np.dtype or isinstance(inst, np.dtype):
            self._build_dtype(inst, state)
        elif type(inst) in (argparse.Namespace, types.SimpleNamespace):
            if isinstance(state, tuple) and len(state) == 2 and state[1] is None:
                state = state[0]
            if type(state) is not dict or not all(type(k) is str for k in state):
                self.refuse(f"{type(inst).__name__} state that is not a dict of names")
            self.charge(len(state))
            inst.__dict__.update(state)
        elif type(inst) is io.BytesIO:
            if not (type(state) is tuple and len(state) == 3 and type(state[0]) in (bytes, bytearray)
                    and type(state[1]) is int and 0 <= state[1] <= len(state[0]) and state[2] in (None, {})):
                self.refuse("a BytesIO with an invalid state")
            self.charge(len(state[0]))
            inst.__setstate__(state)
        elif state is None or (type(state) is dict and not state):
            pass
        else:
            self.refuse(f"setting the state of a {type(inst).__name__}")

    def _build_array(self, arr: Any, state: Any) -> None:
        import numpy as np

        if self._open_arrays.pop(id(arr), None) is not arr:
            self.refuse("setting the state of a numpy array twice or one not made by _reconstruct")
        if type(state) is not tuple or len(state) != 5 or state[0] != 1 or type(state[0]) is not int:
            self.refuse("a numpy array state that is not (1, shape, dtype, fortran, bytes)")
        _, shape, dtype, fortran, raw = state
        shape = _int_tuple(shape, f"{self.what}: numpy array shape", 32)
        if not _plain_numeric_dtype(dtype):
            self.refuse(f"a numpy array of dtype {_short(str(dtype)) if isinstance(dtype, np.dtype) else _short(dtype)}: "
                        f"only bool/integer/float/complex arrays (no object or structured dtypes)")
        if type(fortran) is not bool or type(raw) not in (bytes, bytearray):
            self.refuse("a numpy array whose data is not raw bytes")
        n = prod(shape) * dtype.itemsize
        if len(raw) != n:
            self.refuse(f"a numpy array of shape {shape} {dtype} with {len(raw)} data bytes (needs {n})")
        self.close_dtype(dtype)
        self.charge(n)
        arr.__setstate__(state)

    def _build_dtype(self, d: Any, state: Any) -> None:
        if self._open_dtypes.pop(id(d), None) is not d:
            self.refuse("changing a numpy dtype that is already in use or was not made by dtype()")
        if not (type(state) is tuple and len(state) in (8, 9) and state[0] in (3, 4) and state[1] in ("<", ">", "|", "=")
                and state[2] is None and state[3] is None and state[4] is None
                and state[5] in (-1, d.itemsize) and state[6] in (-1, d.alignment) and state[7] == d.flags
                and (len(state) == 8 or state[8] is None)):
            self.refuse("a numpy dtype state with fields, sub-arrays or flags (only a byte order may be set)")
        d.__setstate__(state)
        if not _plain_numeric_dtype(d):
            self.refuse("a numpy dtype that is not plain numeric after its state was set")

    def load_setitem(self) -> None:
        value = self.stack.pop()
        key = self.stack.pop()
        self._setitems(self.stack[-1], [(key, value)])

    def load_setitems(self) -> None:
        items = self.pop_mark()
        self._setitems(self.stack[-1], zip(items[::2], items[1::2]))

    def _setitems(self, target: Any, pairs: Any) -> None:
        pairs = self.keys.pairs(pairs)
        if type(target) is dict:
            target.update(pairs)
        elif isinstance(target, (dict, InertStub)):  # OrderedDict, Counter...: their own __setitem__
            for k, v in pairs:
                target[k] = v
        else:
            self.refuse(f"setting items of a {type(target).__name__}")

    def load_append(self) -> None:
        value = self.stack.pop()
        self._appends(self.stack[-1], [value])

    def load_appends(self) -> None:
        items = self.pop_mark()
        self._appends(self.stack[-1], items)

    def _appends(self, target: Any, items: list) -> None:
        import collections

        if type(target) is list or type(target) is collections.deque or isinstance(target, InertStub):
            target.extend(items)
        else:
            self.refuse(f"appending to a {type(target).__name__}")

    def load_additems(self) -> None:
        items = self.pop_mark()
        target = self.stack[-1]
        if type(target) is not set:
            self.refuse(f"adding items to a {type(target).__name__}")
        self.keys.admit_all(items)
        target.update(items)

    def load_frozenset(self) -> None:
        items = self.pop_mark()
        self.keys.admit_all(items)
        out = frozenset(items)
        self.note_immutable(out, items)
        self.append(out)

    def load_tuple(self) -> None:
        items = self.pop_mark()
        out = tuple(items)
        self.note_immutable(out, items)
        self.append(out)

    def load_tuple1(self) -> None:
        self.stack[-1] = t = (self.stack[-1],)
        self.note_immutable(t, t)

    def load_tuple2(self) -> None:
        t = (self.stack[-2], self.stack[-1])
        self.stack[-2:] = [t]
        self.note_immutable(t, t)

    def load_tuple3(self) -> None:
        t = (self.stack[-3], self.stack[-2], self.stack[-1])
        self.stack[-3:] = [t]
        self.note_immutable(t, t)

    def load_dict(self) -> None:
        items = self.pop_mark()
        self.append(dict(self.keys.pairs(zip(items[::2], items[1::2]))))

    def load_next_buffer(self) -> None:
        self.refuse("an out-of-band buffer (pickle protocol 5 buffers are not used by checkpoints)")

    def load_ext(self) -> None:
        self.refuse("a copyreg extension code")

    # memo: indices are dict keys here, but no real file numbers them beyond its own length
    def _memo_put(self, i: int) -> None:
        if i < 0 or i > self.size:
            self.refuse(f"memo index {i} beyond the file's {self.size} bytes")
        if not self.stack:
            self.refuse("a memo store with an empty stack")
        self.memo[i] = self.stack[-1]

    def load_put(self) -> None:
        line = self.readline()[:-1]
        if len(line) > 20 or not line.isdigit():
            self.refuse("an invalid memo index")
        self._memo_put(int(line))

    def load_binput(self) -> None:
        self._memo_put(self.read(1)[0])

    def load_long_binput(self) -> None:
        self._memo_put(int.from_bytes(self.read(4), "little"))


for _op, _fn in ((pickle.REDUCE, SafeUnpickler.load_reduce), (pickle.NEWOBJ, SafeUnpickler.load_newobj),
                 (pickle.NEWOBJ_EX, SafeUnpickler.load_newobj_ex), (pickle.OBJ, SafeUnpickler.load_obj),
                 (pickle.BUILD, SafeUnpickler.load_build), (pickle.SETITEM, SafeUnpickler.load_setitem),
                 (pickle.SETITEMS, SafeUnpickler.load_setitems), (pickle.APPEND, SafeUnpickler.load_append),
                 (pickle.APPENDS, SafeUnpickler.load_appends), (pickle.ADDITEMS, SafeUnpickler.load_additems),
                 (pickle.FROZENSET, SafeUnpickler.load_frozenset), (pickle.TUPLE, SafeUnpickler.load_tuple),
                 (pickle.TUPLE1, SafeUnpickler.load_tuple1), (pickle.TUPLE2, SafeUnpickler.load_tuple2),
                 (pickle.TUPLE3, SafeUnpickler.load_tuple3), (pickle.DICT, SafeUnpickler.load_dict),
                 (pickle.NEXT_BUFFER, SafeUnpickler.load_next_buffer), (pickle.EXT1, SafeUnpickler.load_ext),
                 (pickle.EXT2, SafeUnpickler.load_ext), (pickle.EXT4, SafeUnpickler.load_ext),
                 (pickle.FRAME, SafeUnpickler.load_frame), (pickle.BYTEARRAY8, SafeUnpickler.load_bytearray8),
                 (pickle.PUT, SafeUnpickler.load_put), (pickle.BINPUT, SafeUnpickler.load_binput),
                 (pickle.LONG_BINPUT, SafeUnpickler.load_long_binput)):
    SafeUnpickler.dispatch[_op[0]] = _fn
# INST reads "module\nname\n" then calls _instantiate (checked above); READONLY_BUFFER/BYTEARRAY8 etc. are inert.


def safe_loads(data: bytes | memoryview, what: str, records: dict[str, memoryview | int] | None = None,
               check: bool = True) -> Any:
    """Unpickle untrusted bytes with the allow-list and limits of `SafeUnpickler`.

    `records`: a torch.save archive's `data/<key>` members (their bytes, or only their sizes when
    just the archive's layout is wanted), which tensor storages refer to.

    >>> safe_loads(pickle.dumps({"a": [1, 2]}), "test")
    {'a': [1, 2]}
    """
    try:
        obj = SafeUnpickler(io.BytesIO(data), what, len(data), records).load()
        if check:
            check_graph(obj, what, max_size=ALLOC_PER_INPUT_BYTE * len(data) + ALLOC_SLACK)
        return obj
    except BridgeError:
        raise
    except RecursionError:
        raise BridgeError(f"cannot read {what}: nested too deep; the file is damaged or hostile") from None
    except MemoryError:
        raise BridgeError(f"cannot read {what}: out of memory while unpickling; the file is damaged or hostile") from None
    except Exception as e:  # corrupt pickle bytes
        raise BridgeError(f"cannot read {what}: damaged pickle ({type(e).__name__}: {str(e)[:200]}); "
                          f"the file is truncated or not a torch_dist checkpoint") from None


# ---------------------------------------------------------------------------------------------
# torch.save archives (DCP records and byte objects), read without torch.load
# ---------------------------------------------------------------------------------------------


class _MemFile(io.RawIOBase):
    """A read-only file over a buffer, without copying it (zipfile reads only headers from it)."""

    def __init__(self, buf: memoryview) -> None:
        self.buf, self.pos = buf, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, off: int, whence: int = 0) -> int:
        self.pos = max(0, off if whence == 0 else self.pos + off if whence == 1 else len(self.buf) + off)
        return self.pos

    def tell(self) -> int:
        return self.pos

    def read(self, n: int = -1) -> bytes:
        end = len(self.buf) if n is None or n < 0 else min(len(self.buf), self.pos + n)
        out = bytes(self.buf[self.pos:end])
        self.pos = max(self.pos, end)
        return out

    def readinto(self, b: Any) -> int:
        data = self.read(len(b))
        b[:len(data)] = data
        return len(data)


def _zip_members(f: Any, size: int, tail: bytes, what: str) -> dict[str, tuple[int, int, int, str]]:
    """The members of the torch.save archive in file `f` (seekable, `size` bytes; `tail`: its last
    bytes, up to 64 KiB + 22) as key -> (data offset, size, recorded CRC-32, name), every structural check
    done (one disk, stored members, local headers matching the directory, inside the file) and no
    data read. Keys drop the archive's top folder (`data.pkl`, `data/0`, `byteorder`, ...)."""
    try:
        zf = zipfile.ZipFile(f)
        infos = zf.infolist()
    except Exception as e:  # zipfile raises BadZipFile, NotImplementedError, ValueError, struct.error...
        raise BridgeError(f"cannot read {what}: not a valid torch.save zip archive ({type(e).__name__}: {str(e)[:120]}); "
                          f"the file is damaged") from None
    e = tail.rfind(b"PK\x05\x06")
    if e < 0 or len(tail) < e + 22 or struct.unpack("<HHHH", tail[e + 4:e + 12]) not in \
            ((0, 0, len(infos), len(infos)), (0, 0, 0xFFFF, 0xFFFF)):
        raise BridgeError(f"cannot read {what}: the zip archive claims several disks or a different member count "
                          f"(torch.save writes one); the file is damaged")
    out: dict[str, tuple[int, int, int, str]] = {}
    for info in infos:
        h = info.header_offset
        f.seek(h)
        head = f.read(30)
        if len(head) < 30 or head[:4] != b"PK\x03\x04":
            raise BridgeError(f"cannot read {what}: zip member {info.filename[:80]!r} has no local header; damaged")
        n, m = struct.unpack("<HH", head[26:30])
        start = h + 30 + n + m
        name = f.read(n)
        if name != info.orig_filename.encode("utf-8", "surrogateescape") and name.decode("cp437") != info.orig_filename:
            raise BridgeError(f"cannot read {what}: zip member {info.filename[:80]!r} names differ; damaged")
        if info.compress_type != zipfile.ZIP_STORED or info.flag_bits & 1 or info.compress_size != info.file_size:
            raise BridgeError(f"cannot read {what}: zip member {info.filename[:80]!r} is compressed or encrypted "
                              f"(torch.save stores members); damaged or not written by torch")
        if start + info.file_size > size:
            raise BridgeError(f"cannot read {what}: zip member {info.filename[:80]!r} runs past the end; truncated")
        key = info.filename.split("/", 1)[1] if "/" in info.filename else info.filename
        if key in out:
            raise BridgeError(f"cannot read {what}: two zip members named {key[:80]!r}; damaged")
        out[key] = (start, info.file_size, info.CRC, info.filename)
    return out


def _check_crc(data: Any, crc: int, name: str, what: str) -> None:
    if zlib.crc32(data) != crc:
        raise BridgeError(f"{what}: CRC-32 mismatch in zip member {name[:80]!r} "
                          f"(stored {crc:08x}, computed {zlib.crc32(data):08x}): the bytes are damaged")


def zip_records(buf: bytes | bytearray | memoryview, what: str) -> dict[str, memoryview]:
    """The members of a torch.save archive, each CRC-32-checked, as views into `buf` (no copies).

    torch.save writes every member stored (uncompressed) with its CRC-32 in the zip directory;
    torch.load does not check it, so a flipped bit would pass silently. (A save made with
    `torch.serialization.set_crc32_options(False)` has 0 for every member and cannot be checked.)
    Keys drop the archive's top folder (`data.pkl`, `data/0`, `byteorder`, ...).
    """
    mv = memoryview(buf).cast("B")
    members = _zip_members(_MemFile(mv), len(mv), bytes(mv[-(1 << 16) - 22:]), what)
    # torch.serialization.set_crc32_options(False) writes 0 for every member: nothing to check then
    crc_recorded = any(m[2] for m in members.values())
    out: dict[str, memoryview] = {}
    for key, (start, n, crc, name) in members.items():
        out[key] = mv[start:start + n]
        if crc_recorded:
            _check_crc(out[key], crc, name, what)
    return out


def _check_byteorder(order: Any, what: str) -> None:
    if order is not None and bytes(order) != b"little":
        raise BridgeError(f"cannot read {what}: byte order {bytes(order[:16])!r}; only little-endian saves are supported")


def load_torch_archive(buf: bytes | bytearray | memoryview, what: str) -> Any:
    """Unpickle a torch.save archive with SafeUnpickler; tensors (`ArchiveTensor`) share `buf`'s memory."""
    if isinstance(buf, bytes):  # tensors stay writable views (DcpCheckpoint reads bytearrays)
        buf = bytearray(buf)
    recs = zip_records(buf, what)
    if "data.pkl" not in recs:
        raise BridgeError(f"cannot read {what}: the zip archive has no data.pkl (not a torch.save archive)")
    _check_byteorder(recs.get("byteorder"), what)
    return safe_loads(recs["data.pkl"], what, recs)


@dataclass(frozen=True)
class TensorMember:
    """Where a `torch.save(tensor)` archive keeps its one tensor's bytes, without reading them:
    element i (row-major) is at archive byte `data_offset + i * dtype.itemsize`; the data member is
    `member_size` bytes at `member_offset` with CRC-32 `crc` (checked by whoever reads them)."""

    dtype: TorchDtype
    shape: tuple[int, ...]
    data_offset: int
    member_offset: int
    member_size: int
    crc: int


#: a tensor record's pickle is a few hundred bytes; more is not a tensor record
MAX_TENSOR_PICKLE = 1 << 20


def archive_members(f: Any, size: int, what: str) -> dict[str, tuple[int, int, int, str]]:
    """The zip members of a `torch.save` archive of `size` bytes in the seekable file `f`, read from
    its directory alone: member name -> (data start, size, CRC-32 or 0, stored name)."""
    f.seek(max(0, size - (1 << 16) - 22))
    return _zip_members(f, size, f.read((1 << 16) + 22), what)


def read_small_members(f: Any, members: dict[str, tuple[int, int, int, str]], what: str, limit: int,
                       too_big: str) -> dict[str, bytes]:
    """`data.pkl` and `byteorder` of an archive (`archive_members`), each at most `limit` bytes
    (else BridgeError ending in `too_big`), CRC-checked where the archive records CRCs, byte order checked."""
    crc_recorded = any(m[2] for m in members.values())  # as zip_records
    small = {}
    for key in ("data.pkl", "byteorder"):
        if key in members:
            start, n, crc, name = members[key]
            if n > limit:
                raise BridgeError(f"cannot read {what}: a {n}-byte {key}{too_big}")
            f.seek(start)
            small[key] = f.read(n)
            if len(small[key]) != n:
                raise BridgeError(f"cannot read {what}: zip member {name[:80]!r} runs past the end; truncated")
            if crc_recorded:
                _check_crc(small[key], crc, name, what)
    _check_byteorder(small.get("byteorder"), what)
    return small


def tensor_member(f: Any, size: int, what: str) -> TensorMember:
    """Parse a tensor record (`torch.save(tensor)`, `size` bytes in the seekable file `f`) reading
    only its zip directory, headers and pickle (CRC-checked): the tensor must be contiguous, of a
    numpy dtype, and lie inside its one data member."""
    members = archive_members(f, size, what)
    small = read_small_members(f, members, what, MAX_TENSOR_PICKLE, " (a tensor record's is small); damaged")
    if "data.pkl" not in small:
        raise BridgeError(f"cannot read {what}: the zip archive has no data.pkl (not a torch.save archive)")
    data = {k: m[1] for k, m in members.items() if k.startswith("data/")}
    t = safe_loads(small["data.pkl"], what, data)
    if not isinstance(t, ArchiveTensor) or len(data) != 1:
        raise BridgeError(f"cannot read {what}: expected one tensor in the record, found {_short(t)} and "
                          f"{len(data)} data members; damaged checkpoint")
    if not t.is_contiguous() or t.dtype.itemsize is None:
        raise BridgeError(f"cannot read {what}: a {t.dtype} tensor of shape {t.shape} with strides {t.stride} "
                          f"(a torch_dist record is one contiguous tensor of a supported dtype); damaged")
    start, n, crc, _name = members[f"data/{t.storage.key}"]
    return TensorMember(t.dtype, t.shape, start + t.offset * t.dtype.itemsize, start, n, crc)


#: `common.pt` holds args, param groups and scheduler state: kilobytes, never gigabytes
MAX_COMMON_BYTES = 1 << 30


def safe_torch_load_object(data: bytes | bytearray, what: str, _depth: int = 0) -> Any:
    """Load a `torch.save` zip holding arbitrary objects (a DCP byte item) with the allow-list.

    DCP's planner `torch.save`s every byte item, and Megatron hands it a BytesIO that already holds
    a `torch.save` of the object, so real items are nested: a BytesIO is unwrapped (bounded depth).
    """
    obj = load_torch_archive(data, what)
    if isinstance(obj, io.BytesIO) and _depth < 3:
        inner = obj.getvalue()
        if inner[:4] == b"PK\x03\x04":
            return safe_torch_load_object(inner, what, _depth + 1)
    return obj


def load_tensor_record(data: bytes | bytearray, what: str) -> ArchiveTensor:
    """A tensor record (`torch.save(tensor)`), CRC-checked, with the allow-list, without torch: an
    `ArchiveTensor` sharing `data` (`.numpy()` views it)."""
    t = load_torch_archive(data, what)
    if not isinstance(t, ArchiveTensor):
        raise BridgeError(f"cannot read {what}: expected a tensor, found {type(t).__name__}")
    return t


def safe_torch_load_tensor(data: bytes | bytearray, what: str) -> "Any":
    """`load_tensor_record` as a torch tensor sharing `data` (imports torch)."""
    return to_torch(load_tensor_record(data, what))


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
        raise BridgeError(f"{what}: expected a DCP {kind}, found {_short(obj)}; the file is damaged "
                          f"or not a torch_dist checkpoint")
    return obj


def _refuse(what: str, why: str) -> None:
    raise BridgeError(f"{what}: {why}; the file is damaged or hostile")


def _index_tuple(x: Any, what: str) -> tuple[int, ...]:
    """A chunk offset / size / shape: a torch.Size or tuple of non-negative ints."""
    return _int_tuple(x, what)


def _interpret_metadata(md: Any, root: Path, what: str) -> tuple[dict[str, "TensorInfo"], dict[str, "ObjectInfo"]]:
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
            raise BridgeError(f"{what}: a storage entry without a string fqn ({_short(fqn)})")
        off = idx.get("offset")
        off = () if off is None else _index_tuple(off, f"{what}: storage entry {fqn} offset")
        info = _record(info, "_StorageInfo", f"{what}: storage entry {fqn}")
        rel, o, n = info.get("relative_path"), info.get("offset"), info.get("length")
        if info.get("transform_descriptors"):
            raise BridgeError(f"{what}: entry {fqn} uses storage transforms (compression?), which are not supported")
        if type(o) is not int or type(n) is not int or not (0 <= o < 1 << 63 and 0 <= n < 1 << 63):
            raise BridgeError(f"{what}: entry {fqn} has an invalid byte range ({_short(o)}, {_short(n)})")
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
            raise BridgeError(f"{what}: an entry name that is not a string ({_short(fqn)})")
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
            raise BridgeError(f"{what}: tensor {fqn} has no chunk list (found {_short(chunks)})")
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


def resolve_checkpoint_dir(path: str | os.PathLike) -> Path | str:
    """The directory holding `.metadata`: SRC itself, or SRC's latest `iter_*` (Megatron save dir).
    For an s3:// / gs:// SRC, the prefix (a URL string) found the same way."""
    storage = open_storage(path, "source")
    if not storage.file_system:
        return _resolve_remote_dir(storage.root)
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


def _resolve_remote_dir(url: str) -> str:
    from bridge.store.kvstore import ObjectPath

    url = ObjectPath(url)  # a str with the Path methods readers use on a checkpoint directory
    src = ObjectSource(url)
    if src.read_whole(".metadata") is not None:
        return url
    text = (src.read_whole("latest_checkpointed_iteration.txt") or b"").decode(errors="replace").strip()
    cand = f"{url}/iter_{int(text):07d}" if text.isdigit() else f"{url}/release" if text == "release" else None
    if cand is not None and ObjectSource(cand).read_whole(".metadata") is not None:
        return ObjectPath(cand)
    from bridge.store.remote import CLAIM_KEY

    if src.read_whole(CLAIM_KEY) is not None:
        raise BridgeError(f"{url} is a partial checkpoint (its writer never committed: no .metadata); "
                          f"rerun the write, which removes it")
    raise BridgeError(f"{url}: not a torch_dist checkpoint (no .metadata object); point SRC at the "
                      f"iter_<N> prefix that Megatron-Core wrote")


class DcpCheckpoint:
    """A read-only view of a `torch_dist` directory: entries, chunks, safe reads.

    Opening validates everything the metadata references (paths stay inside, files exist and are
    long enough), so later reads fail only on damaged bytes, with the file named.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.root = resolve_checkpoint_dir(open_storage(path, "source").root)
        self.source = source_of(self.root)
        meta_path = f"{self.root}/.metadata"
        raw = self.source.read_whole(".metadata")
        if raw is None:
            raise BridgeError(f"{meta_path} is missing; the checkpoint is incomplete")
        # the walk for cycles/deep nesting is skipped: every field used below is type-checked instead
        self.metadata = safe_loads(raw, f"{meta_path}", check=False)
        self.backend = self._read_backend()
        try:
            self.tensors, self.objects = _interpret_metadata(self.metadata, self.root, str(meta_path))
        except BridgeError:
            raise
        except (TypeError, ValueError, AttributeError, KeyError, IndexError, OverflowError, RecursionError) as e:
            # a structure the checks above did not foresee: still one line naming the file
            raise BridgeError(f"{meta_path}: malformed DCP metadata ({type(e).__name__}: {str(e)[:160]}); "
                              f"the file is damaged or not written by torch.distributed.checkpoint") from None
        self._check_files()

    # -- validation ----------------------------------------------------------------------------

    def _read_backend(self) -> str:
        mj = f"{self.root}/metadata.json"
        text = self.source.read_whole("metadata.json")
        if text is None:
            return "torch_dist"  # dcp.save without megatron writes no metadata.json
        import json

        try:
            backend = json.loads(text).get("sharded_backend", "torch_dist")
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
            self.source.check_length(rel, end)
        self.files = sorted(need)

    def has_file(self, rel: str) -> bool:
        """True when the checkpoint holds file `rel` (e.g. Megatron's metadata.json)."""
        return self.source.read_whole(rel) is not None

    def all_refs(self) -> Iterator[StorageRef]:
        for t in self.tensors.values():
            for c in t.chunks:
                yield c.storage
        for o in self.objects.values():
            for _, ref in o.items:
                yield ref

    # -- reads ---------------------------------------------------------------------------------

    def read_bytes(self, ref: StorageRef) -> bytearray:
        """The raw bytes of one stored item."""
        p = self.source.location(ref.relative_path)
        data = bytearray(ref.length)  # writable, so tensors can share it without a copy
        try:
            with open_range(p) as f:
                got = f.readinto(data, ref.offset) if ref.length else 0
        except FileNotFoundError:
            raise BridgeError(f"missing shard file {p}; copy the complete checkpoint") from None
        if got != ref.length:
            raise BridgeError(f"truncated shard file {p}: item at byte {ref.offset} needs {ref.length} bytes, "
                              f"got {got}")
        return data

    def read_array(self, fqn: str, chunk: ChunkInfo) -> "Any":
        """One stored chunk as a numpy array of shape `chunk.sizes` (dtype and size checked against
        .metadata), a view of the bytes read (no torch)."""
        what = f"{fqn} chunk {chunk.offsets} in {chunk.storage.relative_path}"
        t = load_tensor_record(self.read_bytes(chunk.storage), what)
        ti = self.tensors[fqn]
        if t.dtype != ti.dtype:
            raise BridgeError(f"{what}: stored dtype {t.dtype} differs from .metadata's {ti.dtype}; damaged checkpoint")
        if t.numel() != chunk.numel:
            raise BridgeError(f"{what}: {t.numel()} elements, .metadata says {chunk.numel}; damaged checkpoint")
        try:
            return t.numpy().reshape(chunk.sizes)
        except BridgeError as e:
            raise BridgeError(f"cannot read {what}: {e}") from None

    def read_chunk(self, fqn: str, chunk: ChunkInfo) -> "Any":
        """`read_array` as a torch tensor (imports torch)."""
        from bridge.dtypes import from_numpy

        return from_numpy(self.read_array(fqn, chunk))

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
        """A byte entry unpickled with the allow-list (first blob; MCore wraps objects in a list);
        torch values are `converters.megatron.torch_archive` stand-ins (`to_torch` converts)."""
        fqn = self.object_key(fqn) or fqn
        if fqn not in self.objects:
            raise BridgeError(f"{self.root}: no object {fqn!r} in the checkpoint")
        out = []
        for off, ref in self.objects[fqn].items:
            out.append(safe_torch_load_object(self.read_bytes(ref), f"{fqn} in {ref.relative_path}"))
        obj = out[0]
        return obj

    def read_full(self, fqn: str) -> "Any":
        """A whole tensor entry assembled from its chunks, as a torch tensor (small tensors / tests)."""
        import numpy as np

        from bridge.dtypes import from_numpy

        ti = self.tensors[fqn]
        out = np.empty(ti.shape, dtype=ti.dtype.numpy())
        for c in ti.chunks:
            out[tuple(slice(o, o + s) for o, s in zip(c.offsets, c.sizes))] = self.read_array(fqn, c)
        return from_numpy(out)

    def common_state(self) -> dict:
        """Megatron's `common_state` object (args, iteration, optimizer groups...), or {} when absent.

        megatron-core 0.19 stores it as a DCP object; releases up to 0.16 `torch.save` it to `common.pt`
        next to the `.distcp` files.
        """
        obj: Any = None
        fqn = self.object_key("common_state")
        if fqn is not None:
            obj = self.read_object(fqn)
        else:
            path = self.root / "common.pt"
            if not path.is_file():
                return {}
            if path.stat().st_size > MAX_COMMON_BYTES:
                raise BridgeError(f"{path}: {path.stat().st_size} bytes, more than a common state holds; "
                                  f"the checkpoint is damaged")
            obj = safe_torch_load_object(path.read_bytes(), str(path))
        if isinstance(obj, list) and obj:
            obj = obj[0]
        if not isinstance(obj, dict):
            raise BridgeError(f"{self.root}: common_state is a {type(obj).__name__}, expected a dict")
        return obj

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
