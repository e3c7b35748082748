"""PURE TensorStore spec builders for the logical checkpoint (no I/O, no tensorstore import).

Roots are local paths or s3:// / gs:// URLs (`bridge.location`); the base kvstore under a root
comes from `bridge.store.kvstore.base_kvstore` (which reads the storage environment).

Layout written by the bridge (Orbax-compatible, see docs/orbax-tensorstore-optax.md §3.2):
writer w puts every array's owned chunks into its own OCDBT database ``<tmp>/ocdbt.process_<w>/``;
the array is zarr3 with one ``sharding_indexed`` codec: outer chunk = one owned block, inner
chunks sized for reads. Readers always go through the merged root database (or, for non-OCDBT
Orbax checkpoints, the per-array directory).
"""

from __future__ import annotations

from math import prod
from typing import Sequence

from bridge.dtypes import check_name
from bridge.errors import BridgeError
from bridge.location import is_remote
from bridge.store.kvstore import base_kvstore

COMPRESSIONS = (None, "zstd")
# 1 MiB inner chunks: 512x512 fp32, so 8/16-way row or column shards of typical matrices read no
# extra bytes, for a small write CPU cost over one inner chunk per shard.
DEFAULT_INNER_CHUNK_BYTES = 1 << 20
OCDBT_CONFIG = {"max_inline_value_bytes": 1024, "max_decoded_node_bytes": 100_000_000, "manifest_kind": "single"}
# OCDBT starts writing a data file once this many bytes of a transaction are encoded, several at
# once, while later shards are still being encoded (2 GiB, Orbax's value, means one file written by
# one thread after all encoding). What is left when the transaction commits is written only after
# every data file in flight has landed, so smaller files shorten each commit's serial tail; much
# smaller files cost more per file than they save (bench_ocdbt_commits, bench_store_write; figures
# in the README's performance section).
# A writer-side knob only: readers follow the B-tree, whatever the file sizes.
TARGET_DATA_FILE_SIZE = 16 << 20
# Readers' pool for zarr metadata and zarr3 shard indexes (16 bytes per inner chunk: a 1 GiB shard
# of 1 MiB inner chunks has a 16 KiB index). TensorStore keeps them in the driver's
# `metadata_cache_pool`, by default the data pool, which holds nothing (`context_spec`): so each
# read of part of a shard (a device's box, a verify block, a slice for Megatron) that no other
# read of the shard overlapped fetched and checksummed its index again, one more request per box
# on object storage.
METADATA_POOL_BYTES = 64 << 20
# Object storage reads as Orbax issues them (its values): OCDBT merges reads of one data file that
# arrive within 1 ms (or while an earlier read of it is in flight) and lie at most 1 MB apart into
# one request, so the inner chunks of a box are a ranged GET or two per data file, not one per inner
# chunk (each GET is billed and waits a round trip).
READ_COALESCING = {"experimental_read_coalescing_threshold_bytes": 1_000_000,
                   "experimental_read_coalescing_merged_bytes": 500_000_000_000,
                   "experimental_read_coalescing_interval": "1ms"}


def max_chunk_bytes(root: str) -> int:
    """Largest outer chunk a writer that chooses its own chunking (`make_write_plan`'s
    `max_chunk_bytes`) uses under `root`: 1 GiB locally, the data-file target on object storage.

    A chunk is one OCDBT value, never split across data files. On object storage each data file is
    one PUT, and OCDBT sends the file still open when a transaction commits only after every other
    file landed: chunks of the target size make files of about that size, so a transaction is many
    PUTs at once with a small last one (and a reader decodes many shards in parallel).

    >>> max_chunk_bytes("/ckpt/a") >> 20, max_chunk_bytes("s3://bkt/a") >> 20
    (1024, 16)
    """
    return TARGET_DATA_FILE_SIZE if is_remote(root) else 1 << 30


def check_compression(compression: str | None) -> str | None:
    if compression not in COMPRESSIONS:
        raise BridgeError(f"unknown compression {compression!r}; use None or 'zstd'")
    return compression


def writer_db_dir(root: str, writer: int) -> str:
    """Directory of writer `writer`'s own OCDBT database (Orbax's naming)."""
    return f"{root.rstrip('/')}/ocdbt.process_{writer}/"


def file_kvstore(path: str) -> dict:
    """The base kvstore under `path`: a local directory, or an s3:// / gs:// prefix (see
    `bridge.store.kvstore.base_kvstore`; the name stays for the local case, the common one).

    >>> file_kvstore("/c/x")
    {'driver': 'file', 'path': '/c/x/'}
    >>> file_kvstore("s3://bkt/c/x")["path"]
    'c/x/'
    """
    return base_kvstore(path)


def ocdbt_kvstore(db_dir: str, key_prefix: str | None = None, *, write: bool = False,
                  target_data_file_size: int | None = None) -> dict:
    """OCDBT kvstore over the database in `db_dir`; `key_prefix` = array name (adds a trailing '/').

    >>> ocdbt_kvstore("/c/ocdbt.process_1", "params.w")["path"]
    'params.w/'
    """
    kv: dict = {"driver": "ocdbt", "base": file_kvstore(db_dir), "cache_pool": "cache_pool#ocdbt"}
    if key_prefix is not None:
        kv["path"] = key_prefix.rstrip("/") + "/"
    if write:
        # As Orbax: data files are written in place (content-addressed, referenced only once the
        # manifest commits, so a crash leaves unreferenced garbage, never a torn value); the manifest
        # keeps atomic replace. Writers create fresh databases, so the config is fixed, not read.
        if kv["base"]["driver"] == "file":
            kv["base"]["file_io_locking"] = {"mode": "non_atomic"}
        kv["manifest"] = file_kvstore(db_dir)
        kv.update({"config": dict(OCDBT_CONFIG), "assume_config": True, "target_data_file_size": int(target_data_file_size or TARGET_DATA_FILE_SIZE)})
    return kv


def divisors(n: int) -> list[int]:
    """Divisors of n in increasing order (n >= 1).

    >>> divisors(12)
    [1, 2, 3, 4, 6, 12]
    """
    small = [d for d in range(1, int(n ** 0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def choose_inner_chunk(chunk_shape: Sequence[int], itemsize: int,
                       target_bytes: int | None = DEFAULT_INNER_CHUNK_BYTES) -> tuple[int, ...]:
    """Inner (read) chunk: divides the outer chunk, at most `target_bytes` where possible
    (``None``: the whole outer chunk).

    Repeatedly shrinks the currently largest dimension to its next smaller divisor, so inner
    chunks stay roughly square (good for both row and column shards of a later reader).

    >>> choose_inner_chunk((1024, 4096), 4, 1 << 20)
    (512, 512)
    >>> choose_inner_chunk((), 4)
    ()
    >>> choose_inner_chunk((1024, 0), 4, None)
    (1024, 1)
    """
    inner = [int(c) for c in chunk_shape]
    if not inner:
        return ()
    divs = [divisors(max(1, c)) for c in inner]
    while target_bytes is not None and prod(inner) * itemsize > target_bytes:
        k = max(range(len(inner)), key=lambda i: inner[i])
        if inner[k] <= 1:
            break
        smaller = [d for d in divs[k] if d < inner[k]]
        inner[k] = smaller[-1]
    return tuple(max(1, c) for c in inner)


def stacked_axes(path: Sequence[str], ndim: int | None = None) -> int:
    """Leading stacked axes of a logical array, from its tree path: the layer axis of a homogeneous
    block (`.../layers/<name>...`, not `.../layers/<i>/...`) and the expert axis of routed experts
    (`.../experts/...`, not `shared_experts`); at most `ndim`.

    >>> stacked_axes(("params", "decoder", "layers", "mlp", "linear_fc1", "weight", "gate"))
    1
    >>> stacked_axes(("opt_state", "0", "mu", "decoder", "layers", "mlp", "experts", "linear_fc1", "weight"))
    2
    >>> stacked_axes(("params", "decoder", "layers", "3", "mixer", "in_proj", "weight"))
    0
    >>> stacked_axes(("params", "decoder", "layers", "norm", "weight"), ndim=0)
    0
    """
    parts = tuple(path)[:-1]
    n = 0
    if any(c == "layers" and i + 1 < len(path) and not str(path[i + 1]).isdigit() for i, c in enumerate(parts)):
        n += 1
    if "experts" in parts:
        n += 1
    return n if ndim is None else min(n, int(ndim))


def inner_chunk_shape(path: Sequence[str], chunk_shape: Sequence[int], itemsize: int,
                      target_bytes: int | None = DEFAULT_INNER_CHUNK_BYTES, *,
                      stacked: int | None = None) -> tuple[int, ...]:
    """THE inner (read) chunk policy of every writer (store writer, live export, convert, JAX save).

    The leading `stacked` axes (default `stacked_axes(path)`: layer, expert) get inner size 1, so
    reading one layer (one expert) reads about its own bytes; the remaining dims of the outer chunk
    are split by `choose_inner_chunk` to at most `target_bytes` (``None``: not split).

    >>> inner_chunk_shape(("params", "decoder", "layers", "w"), (16, 1024, 4096), 4)
    (1, 512, 512)
    >>> inner_chunk_shape(("params", "output_layer", "weight"), (1024, 4096), 4)
    (512, 512)
    >>> inner_chunk_shape(("params", "decoder", "layers", "mlp", "experts", "w"), (4, 8, 64), 2, None)
    (1, 1, 64)
    """
    chunk = tuple(int(c) for c in chunk_shape)
    k = stacked_axes(path, len(chunk)) if stacked is None else max(0, min(int(stacked), len(chunk)))
    return (1,) * k + choose_inner_chunk(chunk[k:], itemsize, target_bytes)


def zarr3_metadata(shape: Sequence[int], dtype: str, chunk_shape: Sequence[int], inner_chunk_shape: Sequence[int],
                   compression: str | None = None, checksum: bool = True) -> dict:
    """zarr3 array metadata: regular outer grid, one sharding_indexed codec (Orbax's shape).

    `checksum` adds a crc32c codec to every inner chunk, so a flipped byte fails the read of that
    chunk (in TensorStore, hence also in Orbax's restore) instead of returning wrong numbers.
    """
    check_compression(compression)
    codecs: list[dict] = [{"name": "bytes", "configuration": {"endian": "little"}}]
    if compression == "zstd":
        codecs.append({"name": "zstd", "configuration": {"level": 1, "checksum": False}})
    if checksum:
        codecs.append({"name": "crc32c"})
    outer = [max(1, int(c)) for c in chunk_shape]
    inner = [max(1, int(c)) for c in inner_chunk_shape]
    for o, i in zip(outer, inner):
        if o % i:
            raise BridgeError(f"inner chunk {tuple(inner)} does not divide outer chunk {tuple(outer)}")
    return {
        "shape": [int(s) for s in shape],
        "data_type": check_name(dtype),
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": outer}},
        "chunk_key_encoding": {"name": "default"},
        "codecs": [{"name": "sharding_indexed", "configuration": {
            "chunk_shape": inner,
            "codecs": codecs,
            "index_codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}],
            "index_location": "end"}}],
    }


def array_write_spec(root: str, writer: int, name: str, shape: Sequence[int], dtype: str,
                     chunk_shape: Sequence[int], inner_chunk_shape: Sequence[int],
                     compression: str | None = None, checksum: bool = True,
                     target_data_file_size: int | None = None) -> dict:
    """Spec for writer `writer` to write array `name` into its own OCDBT database under `root`
    (`target_data_file_size`: None for `TARGET_DATA_FILE_SIZE`)."""
    return {
        "driver": "zarr3",
        "kvstore": ocdbt_kvstore(writer_db_dir(root, writer), name, write=True,
                                 target_data_file_size=target_data_file_size),
        "metadata": zarr3_metadata(shape, dtype, chunk_shape, inner_chunk_shape, compression, checksum),
        # Orbax declares store_array_data_equal_to_fill_value: all-zero chunks must still be stored.
        "store_data_equal_to_fill_value": True,
        "recheck_cached_data": False,
        "recheck_cached_metadata": False,
    }


def array_read_spec(root: str, name: str, *, use_ocdbt: bool = True, use_zarr3: bool = True,
                    fill_missing: bool = False) -> dict:
    """Spec to open array `name` of a committed checkpoint read-only (zarr2 or zarr3, OCDBT or not).

    ``fill_missing=False`` makes a missing chunk an error rather than silent zeros (Orbax restores
    this way when the checkpoint says all chunks were stored).
    """
    if name in ("", ".", "..") or "/" in name or "\\" in name:
        raise BridgeError(f"array name {name!r} would escape the checkpoint directory; the checkpoint is unsafe")
    kv = ocdbt_kvstore(root, name) if use_ocdbt else file_kvstore(f"{root.rstrip('/')}/{name}")
    if use_ocdbt and is_remote(root):
        kv.update(READ_COALESCING)
    return {"driver": "zarr3" if use_zarr3 else "zarr", "kvstore": kv, "open": True,
            "fill_missing_data_reads": bool(fill_missing),
            "metadata_cache_pool": "cache_pool#metadata",
            "recheck_cached_data": False, "recheck_cached_metadata": False}


def context_spec(io_concurrency: int = 64) -> dict:
    """Shared ts.Context resources (one Context must serve both sides of an OCDBT merge)."""
    # Chunk data is never cached (each byte is read once); OCDBT B-tree nodes are, as in Orbax.
    # Shard indexes are (`array_read_spec`'s metadata pool): with none, every read of part of a
    # shard fetches its index again.
    # TensorStore fsyncs every file it writes (file_io_sync, its default); leaving that to one
    # parallel fsync pass at the end measured no faster (bench_store_write).
    return {"file_io_concurrency": {"limit": io_concurrency}, "cache_pool": {"total_bytes_limit": 0},
            "cache_pool#ocdbt": {"total_bytes_limit": 100_000_000},
            "cache_pool#metadata": {"total_bytes_limit": METADATA_POOL_BYTES}}
