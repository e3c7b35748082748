"""What an untrusted pickle may build: the allow-list of the restricted unpickler (`read.dcp.SafeUnpickler`).

Globals a pickle may name (torch's classes and rebuild functions as inert markers, a few builtins and
collections, numpy's plain numeric arrays, DCP's metadata records), the inert stubs standing for
`megatron.*` / `transformer_engine.*` classes, and each allowed callable's argument checks (`_call_rules`):
every rule validates its arguments and builds the value itself, so nothing a pickle names runs.
"""

from __future__ import annotations

import io
import re
from dataclasses import dataclass
from typing import Any

from bridge.errors import BridgeError
from bridge.store import short_value
from converters.megatron.read.inert import InertStub
from converters.megatron.read.unpickle_bounds import copy_keys
from converters.megatron.read.torch_archive import (DTYPE_NAMES, LAYOUT_NAMES, MEMORY_FORMAT_NAMES, STORAGE_DTYPES,
                                                    ArchiveTensor, Storage, TorchDevice, TorchDtype, TorchLayout,
                                                    TorchMemoryFormat)

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
        _STUB_CACHE[full] = type(name, (InertStub,), {"stub_name": full, "__module__": __name__})
    return _STUB_CACHE[full]


def is_stub_class(obj: Any) -> bool:
    return isinstance(obj, type) and issubclass(obj, InertStub)


@dataclass(frozen=True)
class StorageKind:
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
TORCH_NAMES: dict[str, Any] = {**{n: TorchDtype(n) for n in DTYPE_NAMES}, **{n: TorchLayout(n) for n in LAYOUT_NAMES},
                                **{n: TorchMemoryFormat(n) for n in MEMORY_FORMAT_NAMES}}
STORAGE_KINDS = {n: StorageKind(TORCH_NAMES[d]) for n, d in STORAGE_DTYPES.items()}


_GLOBALS: dict[tuple[str, str], Any] | None = None
CALL_RULES: dict[Any, Any] = {}       # allowed global -> checker(unpickler, args, kwargs) building the object
EMPTY_NEW: set[Any] = set()      # classes NEWOBJ may create empty (their state comes from later opcodes)


def allowed_globals() -> dict[tuple[str, str], Any]:
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
        EMPTY_NEW.add(cls)
    CALL_RULES.update(_call_rules(g))
    _GLOBALS = g
    return g


def _sized(x: Any) -> bool:
    """A concrete, already-built container (no lazy range/iterator that a copy would expand)."""
    return type(x) in (list, tuple, dict, set, frozenset, str, bytes, bytearray) or isinstance(x, dict)


def plain_numeric_dtype(d: Any) -> bool:
    """A numpy dtype whose raw bytes cannot encode pointers: bool/int/uint/float/complex, no fields.

    >>> import numpy as np
    >>> plain_numeric_dtype(np.dtype("f4")), plain_numeric_dtype(np.dtype("O")), plain_numeric_dtype(np.dtype([("a", "O")]))
    (True, False, False)
    """
    import numpy as np

    return (isinstance(d, np.dtype) and d.kind in "biufc" and d.fields is None and d.subdtype is None
            and not d.hasobject and d.flags == np.dtype(d.str).flags)


def int_tuple(x: Any, what: str, max_len: int = MAX_DIMS) -> tuple[int, ...]:
    ok = isinstance(x, (tuple, list)) and len(x) <= max_len
    if ok:
        for v in x:  # a plain loop: this runs for every chunk offset of a large .metadata
            if type(v) is not int or not 0 <= v < 1 << 63:   # torch sizes are int64
                ok = False
                break
    if not ok:
        raise BridgeError(f"{what}: expected at most {max_len} integers in [0, 2**63), found {short_value(x)}")
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
                raise BridgeError(f"{u.what}: {cls.__name__}() with arguments {[short_value(a) for a in args]}; "
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
                raise BridgeError(f"{u.what}: {cls.__name__}() with arguments {[short_value(a) for a in args]}")
            return cls(*args)
        return rule

    def bytes_like(cls):
        def rule(u, args, kw):
            if kw or len(args) > 3 or (args and isinstance(args[0], int)) or (args and not _sized(args[0])) \
                    or not all(isinstance(a, str) for a in args[1:]):
                raise BridgeError(f"{u.what}: {cls.__name__}() with arguments {[short_value(a) for a in args]}; "
                                  f"only bytes given in the file are allowed")
            if args:
                u.charge(len(args[0]) * (4 if isinstance(args[0], str) else 1))
            return cls(*args)
        return rule

    def str_rule(u, args, kw):
        if kw or len(args) > 3 or (args and not isinstance(args[0], (str, bytes, bytearray, int, float))):
            raise BridgeError(f"{u.what}: str() with arguments {[short_value(a) for a in args]}")
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
                not (is_stub_class(args[0]) or args[0] in (argparse.Namespace, types.SimpleNamespace)):
            raise BridgeError(f"{u.what}: copyreg._reconstructor may only create a Megatron record or a Namespace")
        return args[0]() if is_stub_class(args[0]) else object.__new__(args[0])

    def bytesio(u, args, kw):
        if kw or len(args) > 1 or (args and type(args[0]) not in (bytes, bytearray)):
            raise BridgeError(f"{u.what}: BytesIO() with arguments {[short_value(a) for a in args]}")
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
                raise BridgeError(f"{u.what}: {cls.__name__}() with arguments {[short_value(a) for a in args]}")
            return cls(*args)
        return rule

    def size(u, args, kw):
        if kw or len(args) != 1:
            raise BridgeError(f"{u.what}: torch.Size() needs one tuple of integers")
        return int_tuple(args[0], f"{u.what}: torch.Size")  # a tuple: torch.Size is one

    def device(u, args, kw):
        m = re.fullmatch(r"([a-z_]{1,24})(?::(\d{1,4}))?", args[0]) if args and isinstance(args[0], str) else None
        if kw or not 1 <= len(args) <= 2 or m is None or \
                (len(args) == 2 and (type(args[1]) is not int or not 0 <= args[1] < 1 << 16 or m.group(2))):
            raise BridgeError(f"{u.what}: torch.device() with arguments {[short_value(a) for a in args]}")
        index = args[1] if len(args) == 2 else int(m.group(2)) if m.group(2) else None
        return TorchDevice(m.group(1), index)

    def layout(u, args, kw):
        if kw or len(args) != 1 or not isinstance(args[0], str):
            raise BridgeError(f"{u.what}: _get_layout() needs a layout name")
        v = TORCH_NAMES.get(args[0][len("torch."):]) if args[0].startswith("torch.") else None
        if not isinstance(v, TorchLayout):
            raise BridgeError(f"{u.what}: unknown tensor layout {short_value(args[0])}")
        return v

    def rebuild_tensor(u, args, kw):
        if kw or not 4 <= len(args) <= 7:
            raise BridgeError(f"{u.what}: tensor rebuild with {len(args)} arguments")
        storage, offset, shape, stride = args[:4]
        hooks = args[5] if len(args) > 5 else None
        meta = args[6] if len(args) > 6 else None
        if not isinstance(storage, Storage):
            raise BridgeError(f"{u.what}: a tensor without a stored record (a tensor rebuild outside a torch.save archive)")
        shape = int_tuple(shape, f"{u.what}: tensor shape")
        stride = int_tuple(stride, f"{u.what}: tensor stride")
        if type(offset) is not int or offset < 0 or len(stride) != len(shape) \
                or (len(args) > 4 and not isinstance(args[4], bool)) or hooks or meta:
            raise BridgeError(f"{u.what}: invalid tensor rebuild arguments (offset {short_value(offset)}, "
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
            raise BridgeError(f"{u.what}: numpy dtype {short_value(args[0] if args else None)} refused: only "
                              f"bool/integer/float/complex arrays may be stored in a checkpoint")
        d = np.dtype(args[0], False, True)  # a private copy: BUILD must never change numpy's shared dtypes
        if not plain_numeric_dtype(d):
            raise BridgeError(f"{u.what}: numpy dtype {args[0]!r} refused (not a plain numeric type)")
        u.open_dtype(d)
        return d

    def reconstruct(u, args, kw):
        if kw or len(args) != 3 or args[0] is not np.ndarray or type(args[1]) is not tuple or args[1] != (0,) \
                or type(args[2]) not in (bytes, str) or args[2] not in (b"b", "b"):
            raise BridgeError(f"{u.what}: numpy array reconstruction with arguments "
                              f"{[short_value(a) for a in args]} refused (only plain ndarrays)")
        arr = np_reconstruct(np.ndarray, (0,), b"b")  # an empty int8 array until its BUILD
        u.open_array(arr)
        return arr

    def scalar(u, args, kw):
        if kw or len(args) != 2 or not plain_numeric_dtype(args[0]) or type(args[1]) is not bytes \
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


