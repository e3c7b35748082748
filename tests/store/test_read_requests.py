"""What a read of the store fetches: each stored byte and each shard index once, and on object
storage few requests per box (issue 20).

Counted by TensorStore's own counters (`ts.experimental_collect_matching_metrics`, process-wide
totals, so each test takes the difference around its reads): `kvstore/ocdbt/read` is one read of
an OCDBT value or of a byte range of one (a shard index, an inner chunk, a whole shard),
`kvstore/s3/read` one GET. The expected counts come from the array's stored chunking, read from
its zarr metadata by plain TensorStore, not from the reader under test.
"""

from __future__ import annotations

import os
import sys
from math import prod

import numpy as np
import pytest
import tensorstore as ts

from bridge.layout.boxes import Box
from bridge.store import specs
from bridge.store.commit import save_checkpoint
from bridge.store.reader import open_checkpoint

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "support"))  # tests/support: shared helpers
from servers import remote_servers  # noqa: E402

NAME = ("params", "w")


def counters(*names: str) -> dict[str, int]:
    """Current totals of TensorStore counters (0 for one never incremented in this process)."""
    got = {m["name"]: m["values"][0]["value"] for m in ts.experimental_collect_matching_metrics("/tensorstore/")
           if m["name"] in names and m.get("values")}
    return {n: int(got.get(n, 0)) for n in names}


def counted(fn, *names: str) -> dict[str, int]:
    before = counters(*names)
    fn()
    after = counters(*names)
    return {n: after[n] - before[n] for n in names}


def stored_chunking(root: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(outer chunk, inner chunk) of NAME in the local checkpoint `root` as its zarr.json says,
    opened by plain TensorStore through OCDBT (no bridge spec)."""
    kv = {"driver": "ocdbt", "base": {"driver": "file", "path": root + "/"}, "path": ".".join(NAME) + "/"}
    meta = ts.open({"driver": "zarr3", "kvstore": kv, "open": True}, read=True).result().spec().to_json()["metadata"]
    outer = tuple(meta["chunk_grid"]["configuration"]["chunk_shape"])
    (shard,) = [c for c in meta["codecs"] if c["name"] == "sharding_indexed"]
    return outer, tuple(shard["configuration"]["chunk_shape"])


def inner_boxes(shape, inner):
    return [Box((r, c), (r + inner[0], c + inner[1])) for r in range(0, shape[0], inner[0])
            for c in range(0, shape[1], inner[1])]


def test_box_reads_fetch_each_shard_index_once(tmp_path):
    """Reading an array one inner chunk at a time (as a restore to many devices or a slice for
    Megatron does) reads the one shard's index once, then each inner chunk: the index stays
    cached between reads. Before, with the zarr metadata pool sharing the empty data pool, every
    box read fetched and checksummed the index again (2 reads per box)."""
    a = np.random.default_rng(0).random((1024, 2048), dtype=np.float32)  # 8 MiB: one shard of 8 inner chunks
    root = save_checkpoint(str(tmp_path / "ck"), {NAME: a})
    outer, inner = stored_chunking(root)
    assert outer == a.shape and prod(a.shape) // prod(inner) == 8, (outer, inner)
    ck = open_checkpoint(root)
    ck.info(NAME)  # open (zarr metadata) outside the count
    boxes = inner_boxes(a.shape, inner)
    got = {}
    n = counted(lambda: got.update({b: ck.read(NAME, b) for b in boxes}),
                "/tensorstore/kvstore/ocdbt/read", "/tensorstore/cache/chunk_cache/reads")
    assert all(np.array_equal(v, a[b.slices]) for b, v in got.items())
    assert n["/tensorstore/cache/chunk_cache/reads"] == len(boxes)
    assert n["/tensorstore/kvstore/ocdbt/read"] == len(boxes) + 1, n  # inner chunks + the index once


def test_whole_read_larger_than_the_ocdbt_pool_reads_each_shard_once(tmp_path):
    """The OCDBT cache pool holds B-tree nodes, never array data: with it at 0 bytes (every array
    larger than it) a whole-array read still reads each shard once, as one OCDBT value, and
    decodes each inner chunk once. Guards the diagnosis that a pool smaller than the data does not
    make reads fetch or decode more."""
    arrays = {("params", f"w{i}"): np.random.default_rng(i).random((512, 1024), dtype=np.float32) for i in range(4)}
    root = save_checkpoint(str(tmp_path / "ck"), arrays)
    ck = open_checkpoint(root)
    # The reader's own context, with the OCDBT pool emptied (its instance attribute: no module state patched).
    ck.context = ts.Context({**specs.context_spec(), "cache_pool#ocdbt": {"total_bytes_limit": 0}})
    ck.arrays()
    got = {}
    n = counted(lambda: got.update({p: ck.read(p) for p in arrays}),
                "/tensorstore/kvstore/ocdbt/read", "/tensorstore/cache/chunk_cache/reads")
    assert all(np.array_equal(got[p], a) for p, a in arrays.items())
    inner_per_array = 2  # 2 MiB arrays, 1 MiB inner chunks, one shard each
    assert n == {"/tensorstore/kvstore/ocdbt/read": len(arrays),
                 "/tensorstore/cache/chunk_cache/reads": len(arrays) * inner_per_array}, n


@pytest.fixture(scope="module")
def s3():
    with remote_servers() as servers:
        yield servers["s3"]


@pytest.mark.slow
def test_s3_box_reads_merge_inner_chunks_into_few_gets(s3):
    """On object storage the inner chunks of one box are fetched by a few ranged GETs (OCDBT read
    coalescing, as Orbax configures it), not one GET each plus one for the shard index per box."""
    a = np.random.default_rng(1).random((1024, 4096), dtype=np.float32)  # 16 MiB: one shard, 2 x 8 inner chunks
    root = save_checkpoint(s3.url("read_requests/ck"), {NAME: a})
    ck = open_checkpoint(root)
    ck.info(NAME)
    inner = ck.info(NAME).inner_chunk_shape
    assert prod(a.shape) // prod(inner) == 16 and inner[1] < a.shape[1], inner
    rows = [Box((r, 0), (r + inner[0], a.shape[1])) for r in range(0, a.shape[0], inner[0])]  # 8 inner chunks each
    got = {}
    n = counted(lambda: got.update({b: ck.read(NAME, b) for b in rows}), "/tensorstore/kvstore/s3/read")
    assert all(np.array_equal(v, a[b.slices]) for b, v in got.items())
    # Typically 3: the index once, then one GET per box; before: 2 x (8 + 1) = 18. OCDBT sends what
    # arrived within 1 ms, then everything that queued meanwhile in one more GET, so a busy host may
    # split a box's reads: the bound is half of one GET per inner chunk.
    assert n["/tensorstore/kvstore/s3/read"] <= len(rows) * 4 + 1, n
