"""Reload direction: build a rank's physical shard / TP-local fused tensor / DP flat fragment
from logical arrays. Pure: the caller passes `read(array, box) -> ndarray` (a TensorStore read, a
numpy slice, ...). Padding (GTP tail rows, alignment) is restored as zeros.

>>> import numpy as np
>>> from bridge.layout.params import ParamGeometry
>>> w = ParamGeometry("w", (10, 6), "column", gtp=True, pad_for_alignment=4)
>>> full = np.arange(60.0).reshape(10, 6)
>>> shard = assemble_shard(w, 2, 2, t=1, g=1, read=lambda a, b: full[b.slices], dtype=np.float64)
>>> shard[:, 0].tolist()                                  # logical row 9, then 3 zero pad rows
[54.0, 0.0, 0.0, 0.0]
"""

from __future__ import annotations

from typing import Callable, Iterator, Sequence

import numpy as np

from bridge.layout.boxes import Box
from bridge.layout.params import ParamGeometry
from bridge.layout.rectangles import Piece

Reader = Callable[[str, Box], np.ndarray]


def fill_flat(pieces: Sequence[Piece], numel: int, read: Reader, dtype) -> np.ndarray:
    """Zero flat buffer of `numel` with every piece read in place.

    >>> fill_flat([Piece("a", Box((1,), (3,)), 2)], 5, lambda a, b: np.array([7, 8]), np.int32).tolist()
    [0, 0, 7, 8, 0]
    """
    out = np.zeros(numel, dtype=dtype)
    for p in pieces:
        p.put(out, read(p.array, p.logical))
    return out


def assemble_shard(geom: ParamGeometry, tp: int, gtp: int, t: int, g: int, read: Reader, dtype,
                   index: Sequence[int] | None = None) -> np.ndarray:
    """Physical shard (padded GTP shard, or TP-local tensor) of (TP rank t, GTP rank g)."""
    shape = geom.physical_shape(tp, gtp)
    flat = fill_flat(geom.shard_pieces(tp, gtp, t, g, index), int(np.prod(shape, dtype=np.int64)), read, dtype)
    return flat.reshape(shape)


def assemble_tp_local(geom: ParamGeometry, tp: int, t: int, read: Reader, dtype, index: Sequence[int] | None = None) -> np.ndarray:
    """TP-local tensor (fused sections re-interleaved as Megatron holds them) of TP rank t."""
    return assemble_shard(geom, tp, 1, t, 0, read, dtype, index)


def assemble_fragment(geom: ParamGeometry, tp: int, gtp: int, t: int, g: int, f0: int, f1: int, read: Reader, dtype,
                      index: Sequence[int] | None = None) -> np.ndarray:
    """DP flat fragment [f0, f1) of the physical shard (what a DistOpt rank's state holds)."""
    return fill_flat(geom.fragment_pieces(tp, gtp, t, g, f0, f1, index), f1 - f0, read, dtype)


def split_local(pieces: Sequence[Piece], local_flat: np.ndarray) -> Iterator[tuple[str, Box, np.ndarray]]:
    """Export direction: (array, logical box, data view) for each piece of a local flat tensor."""
    flat = np.asarray(local_flat).reshape(-1)
    for p in pieces:
        yield p.array, p.logical, p.take(flat)
