"""Open a checkpoint for inspection: the list of arrays (lazy views + layout facts) and its provenance.

A thin adapter over the store's reader (`bridge.store.reader.open_checkpoint`, which opens any Orbax
PyTree checkpoint lazily, ours or plain Orbax's): inspection wants, per array, its '/'-joined tree
path, shape, dtype, bytes, storage chunking and a lazy TensorStore view, in tree order.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from bridge.errors import BridgeError
from bridge.store import Checkpoint, open_checkpoint


@dataclass
class ArrayEntry:
    """One stored array of a checkpoint."""

    path: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    chunk: tuple[int, ...] | None       # outer (write) chunk: the zarr chunk grid
    read_chunk: tuple[int, ...] | None  # inner chunk: the unit a read decodes (zarr3 sharding_indexed)
    compression: str | None
    view: Any = field(repr=False)      # lazy tensorstore.TensorStore

    @property
    def name(self) -> str:
        """Tree path joined with '/': `params/decoder/layers/mlp/linear_fc2/weight`."""
        return "/".join(self.path)


@dataclass
class CheckpointInfo:
    """What `open_for_inspection` returns: arrays in tree order, format flags, manifest (as JSON)."""

    directory: str
    arrays: list[ArrayEntry]
    use_ocdbt: bool
    use_zarr3: bool
    manifest: dict | None
    empty_nodes: list[str]  # tree nodes recorded as None (optax EmptyState)
    checkpoint: Checkpoint = field(repr=False)

    def get(self, name: str) -> ArrayEntry:
        """The array named `name` ('/'-joined tree path); BridgeError otherwise."""
        for a in self.arrays:
            if a.name == name:
                return a
        raise BridgeError(f"no array {name!r} in {self.directory}; run `gtp-bridge inspect {self.directory}` to list them")

    def record(self, name: str) -> dict | None:
        """The manifest's per-array record (shape, dtype, digest) of `name`, when the manifest has one."""
        m = self.checkpoint.manifest
        rec = m.arrays.get(name.replace("/", ".")) if m is not None else None
        return rec.to_json() if rec is not None else None


def open_for_inspection(directory: str | os.PathLike) -> CheckpointInfo:
    """Open `directory` lazily (no array data is read): every array's view, shape, dtype and chunking."""
    directory = os.fspath(directory)
    ck = open_checkpoint(directory)
    arrays = []
    for path, info in ck.arrays().items():  # opens them all at once
        arrays.append(ArrayEntry(
            path=tuple(path), shape=tuple(info.shape), dtype=info.dtype, nbytes=int(info.nbytes),
            chunk=tuple(info.chunk_shape) if info.shape else None,
            read_chunk=tuple(info.inner_chunk_shape) if info.shape else None,
            compression=info.compression, view=ck.open(path)))
    manifest = ck.manifest.to_json() if ck.manifest is not None else None
    return CheckpointInfo(directory=os.fspath(directory), arrays=arrays, use_ocdbt=ck.use_ocdbt,
                          use_zarr3=ck.use_zarr3, manifest=manifest,
                          empty_nodes=["/".join(p) for p in ck.empty_paths], checkpoint=ck)
