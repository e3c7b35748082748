"""Read any committed Orbax PyTree checkpoint lazily with TensorStore (no JAX needed).

    ck = open_checkpoint("/ckpt/step_100")
    ck.arrays()[("params", "w")]                    # ArrayInfo(shape, dtype, chunk_shape, ...)
    block = ck.read(("params", "w"), Box((0, 0), (128, 64)))

Works on checkpoints written by the bridge and by Orbax itself (zarr2/zarr3, OCDBT or per-array
directories, compressed or not). `.manifest` is None for checkpoints not written by the bridge.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from bridge.errors import BridgeError, IntegrityError
from bridge.layout.boxes import Box
from bridge.location import is_remote, location
from bridge.store import specs
from bridge.store.claim import TMP_SUFFIX
from bridge.format.manifest import Manifest, manifest_from_custom
from bridge.format.seal import CHECKSUM_KEY, metadata_problems
from bridge.format.sharding_file import SHARDING_DIGEST_KEY, SHARDING_FILE, sharding_problems
from bridge.dtypes import numpy_dtype
from bridge.format.tree import Path, parse_tree_metadata, path_str, validate_path

# Orbax item sub-directories (v1 `state/`, CheckpointManager `default/`) when given the step dir.
ITEM_DIRS = ("state", "default")
# Files that mark a directory as a (possibly damaged) checkpoint even without _METADATA.
CHECKPOINT_MARKERS = ("_CHECKPOINT_METADATA", "manifest.ocdbt", "commit_success.txt")
ALLOW_EDITED_ENV = "GTP_BRIDGE_ALLOW_EDITED_METADATA"
# Reads are bounded by what is stored (checkpoints are untrusted: a zarr.json may claim any shape).
# A read may decode at most EXPANSION times the checkpoint's bytes on disk (zstd of real weights and
# moments gains 1-3x; only constant arrays compress further), and never less than MIN_READ_BOUND.
EXPANSION = 1024
MIN_READ_BOUND = 256 << 20


@dataclass(frozen=True)
class ArrayInfo:
    """Shape, dtype and chunking of one stored array."""

    shape: tuple[int, ...]
    dtype: str
    chunk_shape: tuple[int, ...]         # outer chunk (zarr chunk grid)
    inner_chunk_shape: tuple[int, ...]   # zarr3 sharding_indexed inner chunk (= chunk_shape otherwise)
    compression: str | None

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * numpy_dtype(self.dtype).itemsize


def find_checkpoint_root(path: str) -> str:
    """The directory holding `_METADATA`: `path` itself or its single Orbax item sub-directory."""
    from bridge.store.manager import resolve

    if is_remote(path):
        from bridge.store.committed import committed_root

        return committed_root(location(path))
    path = os.path.abspath(resolve(path))  # refuses URLs; an Orbax manager root -> its latest step
    if path.rstrip("/").endswith(TMP_SUFFIX):
        raise BridgeError(f"{path} is an uncommitted (temporary) checkpoint directory; it was never completed")
    if not os.path.exists(path):
        raise BridgeError(f"{path} is not a directory: it does not exist; pass a checkpoint directory")
    if not os.path.isdir(path):
        raise BridgeError(f"{path} is not a directory; pass a checkpoint directory")
    if os.path.isfile(os.path.join(path, "_METADATA")):
        return path
    for item in ITEM_DIRS:
        if os.path.isfile(os.path.join(path, item, "_METADATA")):
            return os.path.join(path, item)
    if os.path.isfile(os.path.join(path, ".metadata")):
        raise BridgeError(f"{path} is a torch_dist (Megatron/DCP) checkpoint, not a logical one; "
                          f"convert it first: gtp-bridge convert {path} OUT")
    for d in (path,) + tuple(os.path.join(path, i) for i in ITEM_DIRS):
        if any(os.path.exists(os.path.join(d, m)) for m in CHECKPOINT_MARKERS):
            raise IntegrityError(f"{d}/_METADATA is missing; the checkpoint is damaged")
    raise BridgeError(f"{path} has no _METADATA: not a committed Orbax checkpoint")


class Checkpoint:
    """A committed checkpoint opened for lazy reads.

    `metadata_problems` lists what is wrong with `_METADATA` (edited after commit, manifest
    removed or malformed); non-empty only when opened with `allow_edited_metadata`."""

    def __init__(self, root: str, metadata: dict, problems: Sequence[str] = ()) -> None:
        import tensorstore as ts

        self._ts = ts
        self.root = root
        self.metadata = metadata
        try:
            self._arrays, self.empty_paths = parse_tree_metadata(metadata["tree_metadata"])
        except (KeyError, TypeError, AttributeError) as e:
            raise IntegrityError(f"{root}/_METADATA has no valid tree_metadata ({e}); the checkpoint is damaged") from e
        self.use_ocdbt = bool(metadata.get("use_ocdbt", True))
        self.use_zarr3 = bool(metadata.get("use_zarr3", False))
        # When every chunk was stored, a missing chunk means damage, not zeros.
        self.fill_missing = not metadata.get("store_array_data_equal_to_fill_value", False)
        self.metadata_problems = list(problems)
        custom = metadata.get("custom_metadata") or {}
        self.manifest: Manifest | None = None
        try:
            self.manifest = manifest_from_custom(custom)
        except IntegrityError as e:
            if not problems:
                raise
            self.metadata_problems.append(str(e))  # opened to inspect damage: the arrays stay readable
        self.metadata_checksum: str | None = custom.get(CHECKSUM_KEY) if isinstance(custom, dict) else None
        self.context = ts.Context(specs.context_spec())
        self._info: dict[Path, ArrayInfo] = {}
        self._stores: dict[Path, object] = {}

    def paths(self) -> list[Path]:
        """Array leaf paths, sorted."""
        return sorted(self._arrays)

    def name_of(self, path: Sequence[str] | str) -> str:
        return path if isinstance(path, str) else ".".join(path)

    def _path(self, path: Sequence[str] | str) -> Path:
        p = tuple(path.split(".")) if isinstance(path, str) else tuple(path)
        if p not in self._arrays:
            raise BridgeError(f"array {path_str(p)} is not in checkpoint {self.root}; "
                              f"it has {len(self._arrays)} arrays (see `gtp-bridge inspect`)")
        return p

    def open(self, path: Sequence[str] | str):
        """Lazy read-only ts.TensorStore of one array (IntegrityError naming it if unreadable)."""
        return self.open_many([path])[0]

    def open_many(self, paths: Sequence[Sequence[str] | str]) -> list:
        """`open` for several arrays, opened concurrently (a model has thousands; each open takes about
        a millisecond of TensorStore's time, most of it waiting)."""
        ps = [self._path(p) for p in paths]
        pending = {}
        for p in dict.fromkeys(ps):
            if p not in self._stores:
                spec = specs.array_read_spec(self.root, ".".join(p), use_ocdbt=self.use_ocdbt,
                                             use_zarr3=self.use_zarr3, fill_missing=self.fill_missing)
                pending[p] = self._ts.open(spec, read=True, context=self.context)
        for p, fut in pending.items():
            try:
                self._stores[p] = fut.result()  # checkpoints are immutable: one handle per array is enough
            except Exception as e:
                raise IntegrityError(f"array {path_str(p)}: cannot open in {self.root}: {one_line(e)}") from e
        return [self._stores[p] for p in ps]

    def info(self, path: Sequence[str] | str) -> ArrayInfo:
        """Shape, dtype and chunking of one array (reads its zarr metadata)."""
        p = self._path(path)
        if p not in self._info:
            t = self.open(p)
            self._info[p] = _array_info(t, self.use_zarr3)
        return self._info[p]

    def arrays(self) -> dict[Path, ArrayInfo]:
        """path -> ArrayInfo for every array."""
        self.open_many(list(self.paths()))
        return {p: self.info(p) for p in self.paths()}

    def checked_info(self, path: Sequence[str] | str) -> ArrayInfo:
        """`info`, refused (IntegrityError naming the array) when the manifest records another shape or
        dtype for it (`record_problem`: the comparison `verify` makes)."""
        p = self._path(path)
        info = self.info(p)
        record = self.manifest.arrays.get(".".join(p)) if self.manifest is not None else None
        problem = record_problem(info, record) if record is not None else None
        if problem:
            raise IntegrityError(f"array {path_str(p)} in {self.root}: {problem}; the checkpoint is damaged "
                                 f"(see `gtp-bridge verify`)")
        self.check_chunk_bytes(p)
        return info

    def check_chunk_bytes(self, path: Sequence[str] | str) -> None:
        """TensorStore decodes a whole (inner) chunk for any read that touches it, however small the read:
        refuse (`check_read_bytes`) an array whose one chunk the stored bytes cannot hold."""
        p = self._path(path)
        info = self.info(p)
        elems = int(np.prod([min(int(c), int(s)) for c, s in zip(info.inner_chunk_shape, info.shape)], dtype=object))
        self.check_read_bytes(elems * numpy_dtype(info.dtype).itemsize, f"array {path_str(p)}'s chunk")

    def stored_bytes(self) -> int | None:
        """Bytes of the checkpoint's files on disk (local checkpoints; None on object storage)."""
        if not hasattr(self, "_stored"):
            self._stored = None if is_remote(self.root) else sum(
                os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(self.root) for f in fs
                if os.path.isfile(os.path.join(d, f)))
        return self._stored

    def check_read_bytes(self, nbytes: int, what: str) -> None:
        """Refuse (IntegrityError) a read of `nbytes` decoded bytes that the stored bytes cannot hold:
        more than max(MIN_READ_BOUND, EXPANSION x the checkpoint's size on disk). Called before any
        allocation, so a zarr.json claiming a huge shape is refused instead of exhausting memory."""
        stored = self.stored_bytes()
        if stored is None:
            return
        bound = max(MIN_READ_BOUND, EXPANSION * stored)
        if nbytes > bound:
            raise IntegrityError(f"{what} in {self.root}: its metadata claims {nbytes:,} bytes, more than "
                                 f"{EXPANSION}x the {stored:,} bytes the checkpoint stores; its zarr.json "
                                 f"(shape or dtype) is damaged or forged")

    def read(self, path: Sequence[str] | str, box: Box | None = None) -> np.ndarray:
        """Read a box (default: all) into a numpy array; IntegrityError naming the array on damage, on
        metadata that disagrees with the manifest and on a size the stored bytes cannot hold."""
        t = self.open(path)
        p = self._path(path)
        info = self.checked_info(p)
        shape = tuple(int(s) for s in t.shape)
        if box is not None and (box.ndim != len(shape) or not Box.full(shape).contains(box)):
            raise BridgeError(f"array {path_str(p)}: box {box} is outside its shape {shape}")
        n = box.size if box is not None else int(np.prod(shape, dtype=object))
        self.check_read_bytes(n * numpy_dtype(info.dtype).itemsize, f"array {path_str(p)}")
        try:
            view = t if box is None else t[box.slices]
            return np.asarray(view.read().result())
        except Exception as e:
            raise IntegrityError(f"array {path_str(p)}: read of {box or 'all'} failed: {one_line(e)}") from e


def record_problem(info: ArrayInfo, record) -> str | None:
    """How an array's stored metadata disagrees with its manifest record (shape, dtype), or None.

    >>> from bridge.format.manifest import ArrayRecord
    >>> record_problem(ArrayInfo((72, 24), "float32", (72, 24), (72, 24), None), ArrayRecord((72, 24), "float32"))
    >>> record_problem(ArrayInfo((10**7, 24), "float32", (72, 24), (72, 24), None), ArrayRecord((72, 24), "float32"))
    'stored shape (10000000, 24) != manifest shape (72, 24)'
    """
    if tuple(record.shape) != tuple(info.shape):
        return f"stored shape {info.shape} != manifest shape {tuple(record.shape)}"
    if record.dtype != info.dtype:
        return f"stored dtype {info.dtype} != manifest dtype {record.dtype}"
    return None


def one_line(e: Exception) -> str:
    """An exception's message as one line of at most 500 characters (for BridgeError / IntegrityError texts)."""
    return " ".join(str(e).split())[:500]




def _array_info(t, zarr3: bool) -> ArrayInfo:
    spec = t.spec().to_json()
    meta = spec.get("metadata", {})
    shape = tuple(int(s) for s in t.shape)
    dtype = t.dtype.name
    compression = None
    if zarr3:
        outer = tuple(meta.get("chunk_grid", {}).get("configuration", {}).get("chunk_shape", shape))
        inner, codecs = outer, meta.get("codecs", [])
        for c in codecs:
            if c.get("name") == "sharding_indexed":
                inner = tuple(c["configuration"]["chunk_shape"])
                codecs = c["configuration"].get("codecs", [])
        names = [c.get("name") for c in codecs if c.get("name") not in ("bytes", "transpose", "crc32c")]
        compression = names[0] if names else None
        return ArrayInfo(shape, dtype, outer, inner, compression)
    chunks = tuple(meta.get("chunks", shape))
    comp = meta.get("compressor")
    return ArrayInfo(shape, dtype, chunks, chunks, comp.get("id") if comp else None)


def _read_file(root: str, name: str) -> bytes:
    """A small file of a checkpoint root (a local directory or an s3:// / gs:// prefix)."""
    if is_remote(root):
        from bridge.store import kvstore

        data = kvstore.read_bytes(root, name)
        if data is None:
            raise FileNotFoundError(f"{root}/{name} does not exist")
        return data
    with open(os.path.join(root, name), "rb") as f:
        return f.read()


def read_metadata(root: str) -> tuple[dict, list[str]]:
    """`_METADATA` of a checkpoint root and the problems `metadata_problems` finds in it."""
    try:
        metadata = json.loads(_read_file(root, "_METADATA"))
    except (OSError, ValueError) as e:
        raise IntegrityError(f"{root}/_METADATA is unreadable ({one_line(e)}); the checkpoint is damaged") from e
    if not isinstance(metadata, dict):
        raise IntegrityError(f"{root}/_METADATA is not a JSON object; the checkpoint is damaged")
    try:
        ckpt_meta = json.loads(_read_file(root, "_CHECKPOINT_METADATA"))
    except (OSError, ValueError):
        ckpt_meta = None  # optional (older Orbax); the checksum in _METADATA still applies
    problems = metadata_problems(metadata, ckpt_meta)
    custom = metadata.get("custom_metadata")
    if isinstance(custom, dict) and SHARDING_DIGEST_KEY in custom:  # sealed with its `_sharding`
        try:
            sharding = _read_file(root, SHARDING_FILE)
        except FileNotFoundError:
            sharding = None
        except OSError as e:
            raise IntegrityError(f"{root}/{SHARDING_FILE} is unreadable ({one_line(e)}); the checkpoint is "
                                 f"damaged") from e
        problems += sharding_problems(metadata, sharding)
    return metadata, problems


def edited_metadata_allowed(allow: bool | None) -> bool:
    """`allow_edited_metadata` as given, else the GTP_BRIDGE_ALLOW_EDITED_METADATA environment variable."""
    if allow is not None:
        return bool(allow)
    return os.environ.get(ALLOW_EDITED_ENV, "").strip().lower() not in ("", "0", "false", "no")


def check_metadata(root: str, allow_edited_metadata: bool | None = None) -> tuple[dict, list[str]]:
    """Read `_METADATA`; IntegrityError (one line) when it was edited after commit, unless allowed."""
    metadata, problems = read_metadata(root)
    if problems and not edited_metadata_allowed(allow_edited_metadata):
        raise IntegrityError(f"{root}: {problems[0]}; refusing to read edited checkpoint metadata (see `gtp-bridge "
                             f"verify`); to read it anyway pass allow_edited_metadata=True or set "
                             f"{ALLOW_EDITED_ENV}=1")
    return metadata, problems


def open_root(path: str, allow_edited_metadata: bool | None = None) -> tuple[str, dict, list[str]]:
    """The one set of rules for opening a committed checkpoint: (root, `_METADATA`, its problems).

    Shared by `open_checkpoint` and the JAX side's `stored_arrays`, so both accept and refuse the
    same directories: the location is resolved (an Orbax manager root -> its latest step, a step ->
    its item sub-directory); temporary, missing, torch_dist and damaged directories are refused;
    `_METADATA` edited after commit is refused unless allowed; every array name is checked
    (checkpoints are untrusted) before anything opens an array.
    """
    root = find_checkpoint_root(path)
    metadata, problems = check_metadata(root, allow_edited_metadata)
    try:
        arrays, empty = parse_tree_metadata(metadata["tree_metadata"])
    except (KeyError, TypeError, AttributeError) as e:
        raise IntegrityError(f"{root}/_METADATA has no valid tree_metadata ({one_line(e)}); "
                             "the checkpoint is damaged") from None
    for p in list(arrays) + list(empty):
        validate_path(p)
    return root, metadata, problems


def open_checkpoint(path: str, *, allow_edited_metadata: bool | None = None) -> Checkpoint:
    """Open a committed checkpoint directory (never a `*.orbax-checkpoint-tmp` one).

    A bridge checkpoint whose `_METADATA` fails its checksum (any field edited, the manifest
    removed) is refused with an IntegrityError unless `allow_edited_metadata=True` (or the
    environment variable GTP_BRIDGE_ALLOW_EDITED_METADATA=1); the problems are then listed in
    `Checkpoint.metadata_problems`. The rules: `open_root`.
    """
    root, metadata, problems = open_root(path, allow_edited_metadata)
    if not problems:
        # a malformed manifest under a matching checksum is still damage: the Checkpoint raises
        return Checkpoint(root, metadata)
    return Checkpoint(root, metadata, problems)
