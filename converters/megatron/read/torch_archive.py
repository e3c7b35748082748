"""What a `torch.save` archive holds, as plain values: torch is never imported to read one.

`converters.megatron.read.dcp`'s restricted unpickler builds these instead of torch objects: a
dtype, layout, memory format or device is a small frozen record (`TorchDtype("bfloat16")` prints as
`torch.bfloat16`), `torch.Size` is a tuple, and a tensor is an `ArchiveTensor`: its storage record
(key, dtype, bytes shared with the archive buffer), element offset, shape and stride. `.numpy()`
views its bytes without a copy (dtypes through `bridge.dtypes`, bf16 through ml_dtypes).

Importing torch adds hundreds of MiB to a process's resident memory (issue 16's per-process bound);
convert's processes read every record this way and so never import it. Code that wants torch
objects converts at its edge (`to_torch`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace
from math import prod
from typing import Any

import numpy as np

from bridge.dtypes import FLOAT_NAMES, ITEMSIZE, numpy_dtype
from bridge.errors import BridgeError

#: torch dtype names a pickle may name (`torch.float32` pickles as the global `torch float32`)
DTYPE_NAMES = frozenset(ITEMSIZE) | {"complex32", "complex64", "complex128", "float8_e4m3fn", "float8_e5m2",
                                     "float8_e4m3fnuz", "float8_e5m2fnuz"}
LAYOUT_NAMES = frozenset({"strided", "sparse_coo", "sparse_csr", "sparse_csc", "sparse_bsr", "sparse_bsc", "_mkldnn"})
MEMORY_FORMAT_NAMES = frozenset({"contiguous_format", "channels_last", "channels_last_3d", "preserve_format"})

#: torch.save's typed storage classes (`torch FloatStorage`) -> element dtype; only dtypes numpy holds
STORAGE_DTYPES = {"FloatStorage": "float32", "DoubleStorage": "float64", "HalfStorage": "float16",
                  "BFloat16Storage": "bfloat16", "LongStorage": "int64", "IntStorage": "int32",
                  "ShortStorage": "int16", "CharStorage": "int8", "ByteStorage": "uint8", "BoolStorage": "bool"}


def _is_torch(x: Any, kind: str) -> bool:
    """`x` is a real torch object of class `kind` (checked without importing torch)."""
    t = type(x)
    return t.__module__ == "torch" and t.__name__ == kind


@dataclass(frozen=True)
class _TorchName:
    """A torch constant known by its name (`torch.<name>`), built without importing torch."""

    name: str

    def __repr__(self) -> str:
        return f"torch.{self.name}"

    def torch(self) -> Any:
        """The real torch object (imports torch)."""
        import torch

        return getattr(torch, self.name)


@dataclass(frozen=True, eq=False, repr=False)
class TorchDtype(_TorchName):
    """A torch dtype by name. Equal to the real `torch.<name>` too, so values read here compare as
    torch's would.

    >>> d = TorchDtype("bfloat16"); str(d), d.itemsize, d.numpy().name, d == TorchDtype("bfloat16")
    ('torch.bfloat16', 2, 'bfloat16', True)
    """

    __str__ = _TorchName.__repr__

    def __eq__(self, other: Any) -> bool:
        if isinstance(other, TorchDtype):
            return other.name == self.name
        if _is_torch(other, "dtype"):
            return str(other) == str(self)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(("torch.dtype", self.name))

    @property
    def itemsize(self) -> int | None:
        return ITEMSIZE.get(self.name)

    def numpy(self) -> np.dtype:
        """The numpy dtype (bridge.dtypes' table); BridgeError for one numpy cannot hold."""
        if self.name not in ITEMSIZE:
            raise BridgeError(f"tensor dtype {self} has no numpy equivalent here; supported: {', '.join(ITEMSIZE)}")
        return numpy_dtype(self.name)


@dataclass(frozen=True, repr=False)
class TorchLayout(_TorchName):
    """A torch tensor layout by name (`torch.strided`)."""


@dataclass(frozen=True, repr=False)
class TorchMemoryFormat(_TorchName):
    """A torch memory format by name (`torch.contiguous_format`)."""


@dataclass(frozen=True)
class TorchDevice:
    """A torch device (`device(type='cuda', index=0)`): where a tensor lived when it was saved."""

    type: str
    index: int | None = None

    def __repr__(self) -> str:
        return f"device(type={self.type!r}" + (f", index={self.index})" if self.index is not None else ")")

    def torch(self) -> Any:
        import torch

        return torch.device(self.type, self.index) if self.index is not None else torch.device(self.type)


@dataclass(frozen=True)
class Storage:
    """One `data/<key>` member of a torch.save archive: `nbytes` bytes of `dtype` elements.
    `data` shares the archive buffer (None when only the archive's layout was read)."""

    key: str
    dtype: TorchDtype
    nbytes: int
    data: memoryview | None = field(default=None, compare=False, repr=False)


def c_contiguous(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """Row-major with no gaps (torch's is_contiguous: size-1 dimensions' strides do not matter).

    >>> c_contiguous((2, 3), (3, 1)), c_contiguous((2, 3), (1, 2)), c_contiguous((1, 3), (7, 1)), c_contiguous((0, 3), (9, 9))
    (True, False, True, True)
    """
    if 0 in shape:
        return True
    want = 1
    for n, s in zip(reversed(shape), reversed(stride)):
        if n != 1 and s != want:
            return False
        want *= n
    return True


@dataclass(eq=False)
class ArchiveTensor:
    """A tensor of a torch.save archive: `shape` elements of `storage` from element `offset` with
    `stride`. The unpickler has checked that every element lies inside the storage.
    Equal to another when dtype, shape and element bits are equal."""

    storage: Storage
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    requires_grad: bool = False
    parameter: bool = False    # saved as a torch.nn.Parameter

    @property
    def dtype(self) -> TorchDtype:
        return self.storage.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def dim(self) -> int:
        return len(self.shape)

    def numel(self) -> int:
        return prod(self.shape)

    def is_contiguous(self) -> bool:
        return c_contiguous(self.shape, self.stride)

    def as_parameter(self, requires_grad: bool) -> "ArchiveTensor":
        return replace(self, parameter=True, requires_grad=requires_grad)

    def numpy(self) -> np.ndarray:
        """The elements as a numpy array sharing the archive's bytes (bit-exact, no copy)."""
        if not self.is_contiguous():
            raise BridgeError(f"a tensor of shape {self.shape} stored with strides {self.stride} (not row-major "
                              f"contiguous); torch_dist records are contiguous: the record is damaged or foreign")
        if self.storage.data is None:
            raise BridgeError(f"tensor storage {self.storage.key!r} was not read (layout only)")
        d = self.dtype.numpy()
        return np.frombuffer(self.storage.data, dtype=d, count=self.numel(),
                             offset=self.offset * d.itemsize).reshape(self.shape)

    def item(self) -> Any:
        """The one element as a Python number, as torch's `.item()`."""
        if self.numel() != 1:
            raise BridgeError(f"item() of a tensor of {self.numel()} elements")
        v = self.numpy().reshape(())[()]
        name = self.dtype.name
        return float(v) if name in FLOAT_NAMES else bool(v) if name == "bool" else int(v)

    def __eq__(self, other: Any) -> bool:
        if not isinstance(other, ArchiveTensor):
            return NotImplemented
        if self.dtype != other.dtype or self.shape != other.shape:
            return False
        return self.numpy().tobytes() == other.numpy().tobytes()

    __hash__ = object.__hash__  # identity, as torch tensors (never dict keys in a checkpoint)

    def __repr__(self) -> str:
        return f"ArchiveTensor(shape={self.shape}, dtype={self.dtype})"


def _torch_tensor(t: ArchiveTensor) -> Any:
    import torch

    if t.storage.data is None:
        raise BridgeError(f"tensor storage {t.storage.key!r} was not read (layout only)")
    raw = torch.frombuffer(t.storage.data, dtype=torch.uint8) if t.storage.nbytes \
        else torch.empty(0, dtype=torch.uint8)
    out = torch.empty(0, dtype=t.dtype.torch())
    out.set_(raw.untyped_storage(), t.offset, t.shape, t.stride)
    if t.parameter:
        return torch.nn.Parameter(out, t.requires_grad)
    return out.requires_grad_(True) if t.requires_grad else out


def to_torch(obj: Any) -> Any:
    """`obj` with every stand-in of this module replaced by the torch object it stands for (tensors
    share the archive's bytes), through lists, tuples, dicts and namespaces: for code that hands
    the values to torch (tests re-saving a common state, torch-facing readers). Imports torch."""
    if isinstance(obj, ArchiveTensor):
        return _torch_tensor(obj)
    if isinstance(obj, (TorchDtype, TorchLayout, TorchMemoryFormat, TorchDevice)):
        return obj.torch()
    if type(obj) in (list, tuple):
        return type(obj)(to_torch(x) for x in obj)
    if isinstance(obj, dict):
        out = copy.copy(obj)  # keeps a defaultdict's factory, an OrderedDict's type
        out.clear()
        out.update((to_torch(k), to_torch(v)) for k, v in obj.items())
        return out
    if type(obj).__name__ in ("Namespace", "SimpleNamespace") and hasattr(obj, "__dict__"):
        out = copy.copy(obj)
        for k, v in vars(obj).items():
            setattr(out, k, to_torch(v))
        return out
    return obj
