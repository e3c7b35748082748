"""Open a checkpoint for inspection: the list of arrays (lazy views + layout facts) and its provenance.

A thin adapter over the store's reader (`bridge.store.reader.open_checkpoint`), which opens any
Orbax checkpoint lazily. Inspection needs, per array, its tree path, shape, dtype, bytes, storage
chunking (outer write chunk and inner read chunk) and a lazy TensorStore view.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from math import prod
from typing import Any

import numpy as np

from bridge.errors import BridgeError

MANIFEST_KEY = "gtp_bridge"
_MAX_METADATA_BYTES = 256 << 20  # an untrusted _METADATA larger than this is refused


@dataclass
class ArrayEntry:
    """One stored array of a checkpoint."""

    path: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: str
    chunk: tuple[int, ...] | None       # outer (write) chunk: the zarr3 chunk grid / zarr2 chunks
    read_chunk: tuple[int, ...] | None  # inner chunk: the smallest unit a read fetches
    view: Any = field(repr=False)      # lazy tensorstore.TensorStore

    @property
    def name(self) -> str:
        """Tree path joined with '/': `params/decoder/layers/mlp/linear_fc2/weight`."""
        return "/".join(self.path)

    @property
    def nbytes(self) -> int:
        return prod(self.shape) * int(np.dtype(self.view.dtype.numpy_dtype).itemsize)


@dataclass
class CheckpointInfo:
    """What `open_for_inspection` returns: arrays in tree order, format flags, manifest."""

    directory: str
    arrays: list[ArrayEntry]
    use_ocdbt: bool
    use_zarr3: bool
    manifest: dict | None
    custom_metadata: dict
    empty_nodes: list[str]  # tree nodes recorded as None (optax EmptyState)

    def get(self, name: str) -> ArrayEntry:
        """The array named `name` ('/'-joined tree path); BridgeError listing close names otherwise."""
        for a in self.arrays:
            if a.name == name:
                return a
        raise BridgeError(f"no array {name!r} in {self.directory}; run `gtp-bridge inspect {self.directory}` to list them")


def open_for_inspection(directory: str | os.PathLike) -> CheckpointInfo:
    """Open `directory` (an Orbax PyTree checkpoint, ours or plain Orbax's) lazily: no array data is read."""
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        hint = " (an uncommitted save: rerun the save)" if os.path.isdir(directory + ".orbax-checkpoint-tmp") else ""
        raise BridgeError(f"{directory} is not a directory{hint}; pass a checkpoint directory")
    meta = _read_metadata(directory)
    use_ocdbt, use_zarr3 = bool(meta.get("use_ocdbt", True)), bool(meta.get("use_zarr3", False))
    custom = meta.get("custom_metadata") or {}
    arrays, empty = [], []
    import tensorstore as ts

    ctx = ts.Context({"cache_pool": {"total_bytes_limit": 0}})
    for entry in (meta.get("tree_metadata") or {}).values():
        keys = tuple(str(k["key"]) for k in entry["key_metadata"])
        _check_keys(keys, directory)
        if entry.get("value_metadata", {}).get("value_type") == "None" or entry.get("value_metadata", {}).get("skip_deserialize"):
            empty.append("/".join(keys))
            continue
        view = _open_array(directory, ".".join(keys), use_ocdbt, use_zarr3, ctx)
        layout = view.chunk_layout
        arrays.append(ArrayEntry(
            path=keys, shape=tuple(int(s) for s in view.shape), dtype=str(np.dtype(view.dtype.numpy_dtype)),
            chunk=_shape_or_none(layout.write_chunk.shape), read_chunk=_shape_or_none(layout.read_chunk.shape),
            view=view))
    manifest = custom.get(MANIFEST_KEY) if isinstance(custom, dict) else None
    return CheckpointInfo(directory, arrays, use_ocdbt, use_zarr3, manifest, custom if isinstance(custom, dict) else {}, empty)


def _read_metadata(directory: str) -> dict:
    path = os.path.join(directory, "_METADATA")
    if not os.path.isfile(path):
        raise BridgeError(f"{directory} has no _METADATA, so it is not a committed Orbax PyTree checkpoint; "
                          "pass the checkpoint directory itself (for a CheckpointManager, the item folder such as <step>/state)")
    if os.path.getsize(path) > _MAX_METADATA_BYTES:
        raise BridgeError(f"{path} is larger than {_MAX_METADATA_BYTES >> 20} MiB; refusing to parse it (damaged checkpoint?)")
    try:
        with open(path, "rb") as f:
            meta = json.loads(f.read())
        if not isinstance(meta, dict):
            raise ValueError("top level is not an object")
    except ValueError as e:
        raise BridgeError(f"{path} is not valid Orbax metadata JSON ({e}); the checkpoint is damaged") from None
    return meta


def _check_keys(keys: tuple[str, ...], directory: str) -> None:
    for k in keys:
        if not k or "/" in k or k in (".", ".."):
            raise BridgeError(f"array key {k!r} in {directory}/_METADATA would escape the checkpoint; refusing it")


def _open_array(directory: str, name: str, use_ocdbt: bool, use_zarr3: bool, ctx: Any) -> Any:
    import tensorstore as ts

    base = os.path.abspath(directory)
    if use_ocdbt:
        kvstore = {"driver": "ocdbt", "base": {"driver": "file", "path": base + "/"}, "path": name + "/"}
    else:
        kvstore = {"driver": "file", "path": os.path.join(base, name) + "/"}
    spec = {"driver": "zarr3" if use_zarr3 else "zarr", "kvstore": kvstore,
            "recheck_cached_data": False, "recheck_cached_metadata": False}
    try:
        return ts.open(spec, open=True, read=True, context=ctx).result()
    except Exception as e:  # tensorstore raises ValueError/RuntimeError subclasses with long messages
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise BridgeError(f"cannot open array {name!r} of {directory}: {first}") from None


def _shape_or_none(shape: Any) -> tuple[int, ...] | None:
    if shape is None:
        return None
    return tuple(int(s) for s in shape)
