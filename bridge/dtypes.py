"""The one dtype table: stored name <-> numpy dtype <-> torch dtype, and bit views.

Names are numpy's (``bfloat16`` through ml_dtypes, since numpy has none); a torch dtype maps to
the name after its ``torch.`` prefix. torch is imported only by the functions that take or make
tensors, so the store and the JAX side use this module without it.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import numpy as np

from bridge.errors import BridgeError

#: every dtype a logical checkpoint may store, and its element size in bytes
ITEMSIZE = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "int64": 8, "int32": 4, "int16": 2,
            "int8": 1, "uint64": 8, "uint32": 4, "uint16": 2, "uint8": 1, "bool": 1}
NAMES = tuple(ITEMSIZE)
FLOAT_NAMES = ("float64", "float32", "bfloat16", "float16")

_UINT_OF_SIZE = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def check_name(dtype: Any, what: str = "array") -> str:
    """A stored dtype name, normalised; BridgeError for anything the store cannot hold.

    >>> check_name("float32"), check_name(np.dtype("int8"))
    ('float32', 'int8')
    """
    d = str(dtype)
    if d not in ITEMSIZE:
        raise BridgeError(f"{what}: unsupported dtype {d!r}; use one of {', '.join(NAMES)}")
    return d


@lru_cache(maxsize=None)
def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype of a stored dtype name (bfloat16 through ml_dtypes).

    >>> numpy_dtype("bfloat16").name, numpy_dtype("float32").name
    ('bfloat16', 'float32')
    """
    if name == "bfloat16":
        import ml_dtypes  # registers bfloat16 with numpy

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def name_of_torch(torch_dtype: Any) -> str | None:
    """Stored name of a torch dtype (or of its string form, as DCP metadata records it); None if
    the table has none.

    >>> name_of_torch("torch.bfloat16"), name_of_torch("torch.complex64")
    ('bfloat16', None)
    """
    s = str(torch_dtype)
    name = s[len("torch."):] if s.startswith("torch.") else None
    return name if name in ITEMSIZE else None


@lru_cache(maxsize=None)
def torch_dtype(name: str) -> Any:
    """The torch dtype of a stored dtype name.

    >>> import torch; torch_dtype("bfloat16") is torch.bfloat16
    True
    """
    import torch

    return getattr(torch, check_name(name))


@lru_cache(maxsize=None)  # called per staged item: a dtype lookup, not a tensor allocation
def numpy_dtype_of_torch(t: Any) -> np.dtype:
    """numpy dtype for a torch dtype (bf16 via ml_dtypes).

    >>> import torch; numpy_dtype_of_torch(torch.bfloat16).name, numpy_dtype_of_torch(torch.float32).name
    ('bfloat16', 'float32')
    """
    name = name_of_torch(t)
    if name is None:
        raise BridgeError(f"dtype {t} has no numpy equivalent here; use one of {', '.join(NAMES)}")
    return numpy_dtype(name)


def uint_view(a: np.ndarray) -> np.ndarray:
    """The elements' bits as unsigned integers of the same width (no value conversion): NaN == NaN
    when its payload matches, -0.0 != 0.0.

    >>> uint_view(np.array([1.0, -0.0], np.float32)).tolist()
    [1065353216, 2147483648]
    """
    a = np.asarray(a)
    try:
        return a.view(_UINT_OF_SIZE[a.dtype.itemsize])
    except KeyError:
        raise ValueError(f"no unsigned view for dtype {a.dtype} (itemsize {a.dtype.itemsize})") from None


def to_numpy(t: Any) -> np.ndarray:
    """A CPU tensor as numpy, bit-exact (a view when `t` is contiguous).

    >>> import torch; to_numpy(torch.tensor([1.5], dtype=torch.bfloat16)).dtype.name
    'bfloat16'
    """
    import torch

    t = t.contiguous()
    if t.dtype == torch.bfloat16:  # numpy cannot hold torch's bf16: go through its 16-bit pattern
        return t.view(torch.int16).numpy().view(numpy_dtype("bfloat16"))
    return t.numpy()


def from_numpy(a: np.ndarray) -> Any:
    """A numpy array as a CPU tensor, bit-exact (a view when `a` is contiguous).

    >>> from_numpy(np.array([1.5], numpy_dtype("bfloat16"))).dtype
    torch.bfloat16
    """
    import torch

    a = np.ascontiguousarray(a)
    if a.dtype == numpy_dtype("bfloat16"):
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)
