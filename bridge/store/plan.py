"""PURE write planning: the catalog of arrays and who writes which chunk (no I/O).

`make_write_plan` validates everything a write could trip over (names, dtypes, shapes, ownership
grids, writer ids, compression) so that a bad plan fails before any byte is written.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from functools import cached_property
from typing import Mapping, Sequence

from bridge.dtypes import ITEMSIZE, check_name
from bridge.errors import BridgeError
from bridge.layout.chunks import ArrayOwnership, regular_ownership
from bridge.store import specs
from bridge.format.tree import Path, check_tree_paths, path_str, path_to_name, validate_path


@dataclass(frozen=True)
class ArraySpec:
    """One logical array of the catalog: tree path, global shape, dtype name."""

    path: Path
    shape: tuple[int, ...]
    dtype: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", validate_path(self.path))
        try:
            shape = tuple(int(s) for s in self.shape)
        except (TypeError, ValueError):
            raise BridgeError(f"{path_str(self.path)}: shape {self.shape!r} is not a tuple of integers") from None
        if any(s < 0 for s in shape):
            raise BridgeError(f"{path_str(self.path)}: negative dimension in shape {shape}")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "dtype", check_name(str(self.dtype), path_str(self.path)))

    @cached_property  # looked up on every write: computed (and the path validated) once
    def name(self) -> str:
        """Orbax parameter name ("a.b.c")."""
        return path_to_name(self.path)

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]

    @property
    def nbytes(self) -> int:
        n = self.itemsize
        for s in self.shape:
            n *= s
        return n


@dataclass(frozen=True, eq=False)
class ArrayPlan:
    """How one array is written: its spec, chunk ownership and inner (read) chunk shape."""

    spec: ArraySpec
    ownership: ArrayOwnership
    inner_chunk_shape: tuple[int, ...]

    @property
    def meta_writer(self) -> int:
        """The writer that creates the array's zarr.json (owner of the first chunk, else writer 0)."""
        return int(self.ownership.owners.reshape(-1)[0]) if self.ownership.num_chunks else 0

    def to_json(self) -> dict:
        return {"path": list(self.spec.path), "shape": list(self.spec.shape), "dtype": self.spec.dtype,
                "ownership": self.ownership.to_json(), "inner_chunk_shape": list(self.inner_chunk_shape)}


@dataclass(frozen=True, eq=False)
class WritePlan:
    """Catalog + ownership for every array, the writer count, empty optax nodes, compression."""

    arrays: dict[str, ArrayPlan]                      # Orbax name -> plan, in catalog order
    num_writers: int
    empty_paths: tuple[Path, ...] = ()
    compression: str | None = None
    checksum: bool = True                             # crc32c per inner chunk
    _fingerprint: list = field(default_factory=list, repr=False)

    def lookup(self, path: Sequence[str] | str) -> ArrayPlan:
        """The plan of an array given as a path tuple or an Orbax name."""
        name = path if isinstance(path, str) else path_to_name(path)
        try:
            return self.arrays[name]
        except KeyError:
            raise BridgeError(f"array {name!r} is not in the write plan; add it to the catalog") from None

    def to_json(self) -> dict:
        return {"num_writers": self.num_writers, "compression": self.compression, "checksum": self.checksum,
                "empty_paths": [list(p) for p in self.empty_paths],
                "arrays": [a.to_json() for a in self.arrays.values()]}

    def fingerprint(self) -> str:
        """sha256 of the plan's JSON: writers' reports must carry the plan the committer holds."""
        if not self._fingerprint:
            blob = json.dumps(self.to_json(), sort_keys=True).encode()
            self._fingerprint.append(hashlib.sha256(blob).hexdigest())
        return self._fingerprint[0]

    @property
    def total_bytes(self) -> int:
        return sum(a.spec.nbytes for a in self.arrays.values())

    def stored_bytes(self) -> int | None:
        """Bytes TensorStore will store for every array's chunks (None when compressed: unknowable before).

        zarr3 `sharding_indexed`, data equal to the fill value stored too: each outer chunk (shard)
        holds every inner chunk that reaches into the array, whole (zarr pads edge chunks) plus its
        crc32c, then an index of 16 bytes per inner-chunk slot and the index's crc32c. Excludes
        `zarr.json`, OCDBT's B-tree nodes and the checkpoint's metadata files.

        >>> p = make_write_plan([ArraySpec(("params", "w"), (5, 2), "float32")], 1, inner_chunk_bytes=16)
        >>> p.lookup(("params", "w")).ownership.chunk_shape, p.lookup(("params", "w")).inner_chunk_shape
        ((5, 2), (1, 2))
        >>> p.stored_bytes()  # 5 inner chunks of 8 bytes + 4 (crc) each, an index of 5 x 16 + 4
        144
        """
        if self.compression:
            return None
        return sum(_stored_bytes(a, self.checksum) for a in self.arrays.values())

    def bytes_of_writer(self, writer: int) -> int:
        """Logical bytes writer `writer` owns (for balance reports)."""
        total = 0
        for a in self.arrays.values():
            for box in a.ownership.boxes_owned_by(writer):
                total += box.size * a.spec.itemsize
        return total


def _stored_bytes(a: ArrayPlan, checksum: bool) -> int:
    """`WritePlan.stored_bytes` of one uncompressed array (per axis: shards' inner chunks summed)."""
    inner, outer, shape = a.inner_chunk_shape, a.ownership.chunk_shape, a.spec.shape
    present = shards = slots = 1
    for s, o, i in zip(shape, outer, inner):
        extents = [min(o, s - start) for start in range(0, s, o)]
        present *= sum(-(-e // i) for e in extents)
        shards *= len(extents)
        slots *= o // i
    chunk = a.spec.itemsize * _prod(inner) + (4 if checksum else 0)
    return present * chunk + shards * (16 * slots + 4)


def _prod(xs: Sequence[int]) -> int:
    n = 1
    for x in xs:
        n *= int(x)
    return n


def make_write_plan(catalog: Sequence[ArraySpec], num_writers: int,
                    ownership: Mapping[Sequence[str] | str, ArrayOwnership] | None = None, *,
                    empty_paths: Sequence[Sequence[str]] = (), compression: str | None = None,
                    inner_chunk_bytes: int | None = specs.DEFAULT_INNER_CHUNK_BYTES, checksum: bool = True,
                    max_chunk_bytes: int = 1 << 30,
                    stacked: Mapping[Sequence[str] | str, int] | None = None) -> WritePlan:
    """Validate a catalog and ownership into a WritePlan (pure; raises BridgeError, writes nothing).

    Arrays without an entry in `ownership` get `regular_ownership` (leading-axis blocks, small
    arrays spread round-robin over writers). Inner chunks follow `specs.inner_chunk_shape`: one
    layer / expert per inner chunk along the leading stacked axes (`stacked` overrides how many
    an array has, by path or name; default `specs.stacked_axes(path)`), the rest at most
    `inner_chunk_bytes` (None: not split, cheapest to write). `checksum=False` drops the crc32c
    of each inner chunk (flipped bytes are then found only by `verify`'s digests).

    >>> plan = make_write_plan([ArraySpec(("params", "w"), (8, 2), "float32")], num_writers=2)
    >>> plan.lookup(("params", "w")).ownership.owners.ravel().tolist()
    [0, 1]
    """
    if not isinstance(num_writers, int) or num_writers < 1:
        raise BridgeError(f"num_writers must be a positive integer, got {num_writers!r}")
    specs.check_compression(compression)
    catalog = list(catalog)
    empty = tuple(validate_path(p) for p in empty_paths)
    check_tree_paths([a.path for a in catalog] + list(empty))
    given: dict[str, ArrayOwnership] = {}
    for key, own in (ownership or {}).items():
        given[key if isinstance(key, str) else path_to_name(key)] = own
    names = {a.name for a in catalog}
    n_stacked = {(k if isinstance(k, str) else path_to_name(k)): int(v) for k, v in (stacked or {}).items()}
    for key in list(given) + list(n_stacked):
        if key not in names:
            raise BridgeError(f"ownership or stacked axes given for {key!r}, which is not in the catalog")
    arrays: dict[str, ArrayPlan] = {}
    for i, a in enumerate(catalog):
        own = given.get(a.name)
        if own is None:
            own = regular_ownership(a.shape, num_writers, a.itemsize, first_writer=i, max_chunk_bytes=max_chunk_bytes)
        if not isinstance(own, ArrayOwnership):
            raise BridgeError(f"{path_str(a.path)}: ownership must be an ArrayOwnership, got {type(own).__name__}")
        if own.shape != a.shape:
            raise BridgeError(f"{path_str(a.path)}: ownership is for shape {own.shape}, catalog says {a.shape}")
        try:
            own.validate(num_writers)
        except BridgeError as e:
            raise BridgeError(f"{path_str(a.path)}: {e}") from None
        inner = specs.inner_chunk_shape(a.path, own.chunk_shape, a.itemsize, inner_chunk_bytes,
                                        stacked=n_stacked.get(a.name))
        arrays[a.name] = ArrayPlan(a, own, inner)
    return WritePlan(arrays, num_writers, empty, compression, bool(checksum))
