"""Chunk ownership of one logical array: an outer chunk grid and one owner writer per chunk.

Pure numpy. The outer chunk is the zarr3 chunk-grid cell (= one `sharding_indexed` shard, one
key in a writer's OCDBT database). Every chunk has exactly one owner: two writers touching one
chunk would silently lose data at the OCDBT merge (see docs/format.md), so the store refuses any write
outside the writer's own chunks.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from math import ceil, prod
from typing import Iterator, Mapping, Sequence

import numpy as np

from bridge.errors import BridgeError
from bridge.layout.boxes import Box


def grid_shape(shape: Sequence[int], chunk_shape: Sequence[int]) -> tuple[int, ...]:
    """Number of chunks per dimension (last chunk may be partial).

    >>> grid_shape((10, 4), (4, 4))
    (3, 1)
    """
    return tuple(ceil(s / c) for s, c in zip(shape, chunk_shape))


@dataclass(frozen=True, eq=False)
class ArrayOwnership:
    """Outer chunk grid of one array and the owner writer id of every chunk.

    >>> own = ArrayOwnership((10, 4), (4, 4), np.array([[0], [1], [1]], dtype=np.int32))
    >>> own.chunk_box((2, 0))
    Box(start=(8, 0), stop=(10, 4))
    >>> own.boxes_owned_by(1)
    [Box(start=(4, 0), stop=(8, 4)), Box(start=(8, 0), stop=(10, 4))]
    >>> own.owner_of(Box((5, 0), (10, 2)))
    1
    """

    shape: tuple[int, ...]
    chunk_shape: tuple[int, ...]
    owners: np.ndarray  # int32, shape == grid_shape(shape, chunk_shape)

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        object.__setattr__(self, "chunk_shape", tuple(int(c) for c in self.chunk_shape))
        object.__setattr__(self, "owners", np.asarray(self.owners, dtype=np.int32))
        self.validate()

    @property
    def grid_shape(self) -> tuple[int, ...]:
        return grid_shape(self.shape, self.chunk_shape)

    @property
    def num_chunks(self) -> int:
        return prod(self.grid_shape)

    def validate(self, num_writers: int | None = None) -> None:
        """Raise BridgeError unless shapes agree and every owner is a valid writer id."""
        if len(self.chunk_shape) != len(self.shape):
            raise BridgeError(f"chunk shape {self.chunk_shape} does not match the rank of array shape {self.shape}")
        if any(s < 0 for s in self.shape) or any(c < 1 for c in self.chunk_shape):
            raise BridgeError(f"bad chunking: shape {self.shape}, chunk shape {self.chunk_shape} (chunk dims must be >= 1)")
        if self.owners.shape != self.grid_shape:
            raise BridgeError(f"owner grid has shape {self.owners.shape}, expected the chunk grid {self.grid_shape}")
        if self.owners.size and self.owners.min() < 0:
            raise BridgeError(f"negative owner id {int(self.owners.min())} in the chunk grid")
        if num_writers is not None and self.owners.size and self.owners.max() >= num_writers:
            raise BridgeError(f"owner id {int(self.owners.max())} is not a writer (there are {num_writers} writers)")

    def chunk_box(self, idx: Sequence[int]) -> Box:
        """The region of chunk `idx` of the grid, clipped to the array."""
        start = tuple(i * c for i, c in zip(idx, self.chunk_shape))
        stop = tuple(min(a + c, s) for a, c, s in zip(start, self.chunk_shape, self.shape))
        return Box(start, stop)

    def chunk_indices(self) -> Iterator[tuple[int, ...]]:
        """All grid indices in C order."""
        return itertools.product(*(range(g) for g in self.grid_shape))

    def chunks_owned_by(self, writer: int) -> list[tuple[int, ...]]:
        """Grid indices of the chunks `writer` owns, in C order."""
        return [tuple(int(i) for i in idx) for idx in np.argwhere(self.owners == writer)]

    def boxes_owned_by(self, writer: int) -> list[Box]:
        """Regions of the chunks `writer` owns, in C order."""
        return [self.chunk_box(idx) for idx in self.chunks_owned_by(writer)]

    def chunks_touching(self, box: Box) -> tuple[slice, ...]:
        """Grid slices of the chunks that `box` overlaps."""
        return tuple(slice(a // c, -(-b // c)) for a, b, c in zip(box.start, box.stop, self.chunk_shape))

    def owner_of(self, box: Box) -> int:
        """The one writer owning every chunk `box` touches; BridgeError if several do.

        An empty box belongs to nobody in particular: -1.
        """
        if not Box.full(self.shape).contains(box):
            raise BridgeError(f"box {box} lies outside the array of shape {self.shape}")
        if box.empty:
            return -1
        sel = self.owners[self.chunks_touching(box)]
        owners = np.unique(sel)
        if owners.size != 1:
            raise BridgeError(f"box {box} spans chunks owned by writers {owners.tolist()}; "
                              "split the box along chunk boundaries or move data to one owner")
        return int(owners[0])

    def writers(self) -> list[int]:
        """Writer ids owning at least one chunk."""
        return [int(w) for w in np.unique(self.owners)]

    def to_json(self) -> dict:
        return {"shape": list(self.shape), "chunk_shape": list(self.chunk_shape),
                "owners": self.owners.reshape(-1).tolist()}

    @classmethod
    def from_json(cls, d: Mapping) -> "ArrayOwnership":
        shape, chunk = tuple(d["shape"]), tuple(d["chunk_shape"])
        return cls(shape, chunk, np.asarray(d["owners"], dtype=np.int32).reshape(grid_shape(shape, chunk)))

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, ArrayOwnership) and self.shape == other.shape
                and self.chunk_shape == other.chunk_shape and np.array_equal(self.owners, other.owners))

    def __repr__(self) -> str:
        return f"ArrayOwnership(shape={self.shape}, chunk_shape={self.chunk_shape}, writers={self.writers()})"


def regular_ownership(shape: Sequence[int], num_writers: int, itemsize: int = 4, *, first_writer: int = 0,
                      max_chunk_bytes: int = 1 << 30) -> ArrayOwnership:
    """Balanced ownership for callers that hold whole arrays: contiguous blocks of the leading axis.

    The leading axis is cut into `num_writers` near-equal blocks (fewer when the axis is short),
    each block further cut so no chunk exceeds `max_chunk_bytes`. Block k goes to writer
    `(first_writer + k) % num_writers`, so callers spread small arrays by varying `first_writer`.
    0-d arrays are one chunk owned by `first_writer`.

    >>> own = regular_ownership((10, 3), 4)
    >>> own.chunk_shape, own.owners.ravel().tolist()
    ((3, 3), [0, 1, 2, 3])
    >>> regular_ownership((), 4, first_writer=2).owners.tolist()
    2
    """
    shape = tuple(int(s) for s in shape)
    if num_writers < 1:
        raise BridgeError(f"num_writers must be >= 1, got {num_writers}")
    first = first_writer % num_writers
    if not shape:
        return ArrayOwnership((), (), np.array(first, dtype=np.int32))
    n0 = shape[0]
    row_bytes = max(1, prod(shape[1:]) * itemsize)
    rows = max(1, ceil(n0 / num_writers))
    rows = max(1, min(rows, max_chunk_bytes // row_bytes))
    chunk = (rows,) + tuple(max(1, s) for s in shape[1:])
    grid = grid_shape(shape, chunk)
    g0 = grid[0]
    # Consecutive chunks go to the same writer so each writer holds one contiguous slab.
    per_writer = max(1, ceil(g0 / num_writers))
    lead = (first + np.arange(g0) // per_writer) % num_writers
    owners = np.broadcast_to(lead.reshape((g0,) + (1,) * (len(shape) - 1)), grid).astype(np.int32)
    return ArrayOwnership(shape, chunk, owners.copy())


def ownership_from_claims(shape: Sequence[int], chunk_shape: Sequence[int], claims: Mapping[int, Sequence[Box]],
                          name: str = "array") -> ArrayOwnership:
    """Build ownership from boxes each writer claims; refuse overlaps, misaligned claims and gaps.

    >>> from bridge.layout.boxes import Box
    >>> ownership_from_claims((4,), (2,), {0: [Box((0,), (2,))], 1: [Box((2,), (4,))]}).owners.tolist()
    [0, 1]
    """
    shape, chunk_shape = tuple(shape), tuple(chunk_shape)
    grid = grid_shape(shape, chunk_shape)
    owners = np.full(grid, -1, dtype=np.int32)
    probe = ArrayOwnership(shape, chunk_shape, np.zeros(grid, dtype=np.int32))
    for w, boxes in sorted(claims.items()):
        for box in boxes:
            if box.empty:
                continue
            sl = probe.chunks_touching(box)
            covered = Box(tuple(s.start * c for s, c in zip(sl, chunk_shape)),
                          tuple(min(s.stop * c, n) for s, c, n in zip(sl, chunk_shape, shape)))
            if covered != box:
                raise BridgeError(f"{name}: writer {w} claims box {box}, which is not aligned to chunks of "
                                  f"shape {chunk_shape}; claim whole chunks")
            prev = owners[sl]
            taken = prev[(prev >= 0) & (prev != w)]
            if taken.size:
                raise BridgeError(f"{name}: writers {int(taken[0])} and {w} both claim chunks in box {box}; "
                                  "every chunk needs exactly one owner")
            owners[sl] = w
    if owners.size and (owners < 0).any():
        idx = tuple(int(i) for i in np.argwhere(owners < 0)[0])
        raise BridgeError(f"{name}: chunk {probe.chunk_box(idx)} has no owner; every chunk needs exactly one owner")
    return ArrayOwnership(shape, chunk_shape, owners)
