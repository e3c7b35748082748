"""Bit-exact torch <-> numpy views; numpy has no bfloat16, so bf16 goes through ml_dtypes' type.

torch is imported by the callers that have tensors; this module only needs it at call time.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import numpy as np


@lru_cache(maxsize=None)  # called per staged item: a dtype lookup, not a tensor allocation
def numpy_dtype_of(torch_dtype: Any) -> np.dtype:
    """numpy dtype for a torch dtype (bf16 via ml_dtypes).

    >>> import torch; numpy_dtype_of(torch.bfloat16).name, numpy_dtype_of(torch.float32).name
    ('bfloat16', 'float32')
    """
    import torch

    if torch_dtype == torch.bfloat16:
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return torch.empty(0, dtype=torch_dtype).numpy().dtype


def to_numpy(t: Any) -> np.ndarray:
    """A CPU tensor as numpy, bit-exact (a view when `t` is contiguous)."""
    import torch

    t = t.contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(numpy_dtype_of(torch.bfloat16))
    return t.numpy()


def from_numpy(a: np.ndarray) -> Any:
    """A numpy array as a CPU tensor, bit-exact (a view when `a` is contiguous)."""
    import torch

    a = np.ascontiguousarray(a)
    if a.dtype == numpy_dtype_of(torch.bfloat16):
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)
