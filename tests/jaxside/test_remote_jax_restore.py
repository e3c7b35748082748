"""`read_arrays` (the JAX restore's read, here from s3:// / gs://, issue 20): every device box of every array is read
at once within the restore's host-memory budget, then placed.

Exactness against the arrays that were saved (numpy, before any bridge read) on an 8-device CPU mesh for
row, column, replicated and 2-D shardings, with budgets from "everything at once" to "smaller than one
block", against moto (S3) and fake-gcs-server (GCS). The bound is checked through the two seams of the
restore, the start of a TensorStore read and the placement of its block on devices: the bytes between
them never exceed the budget, though the arrays are larger, and more than one block is in flight
(the reads overlap). GETs are TensorStore's own counter.
"""

from __future__ import annotations

import os
import sys

import jax
import ml_dtypes
import numpy as np
import pytest
import tensorstore as ts
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from bridge import _testing
from bridge.errors import BridgeError
from bridge.jaxside import placement, restore_io
from bridge.store.commit import save_checkpoint

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "support"))  # tests/support: shared helpers
from jax_checkpoints import bits  # noqa: E402
from servers import remote_servers  # noqa: E402
from restore_watch import counting_watch  # noqa: E402

W, B, S = ("params", "w"), ("params", "b"), ("step",)


@pytest.fixture(scope="module")
def saved():
    """The same small checkpoint on S3 and on GCS, and the arrays saved."""
    rng = np.random.default_rng(7)
    arrays = {W: rng.standard_normal((64, 96), dtype=np.float32),
              B: rng.standard_normal(96).astype(ml_dtypes.bfloat16),
              S: np.array(123, np.int32)}
    with remote_servers() as servers:
        urls = {k: save_checkpoint(srv.url("restore_remote/ck"), arrays, num_writers=2) for k, srv in servers.items()}
        yield urls, arrays


def mesh_1d():
    return Mesh(np.array(jax.devices()), ("d",))


def mesh_2d():
    return Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))


SHARDINGS = {
    "rows": lambda: (NamedSharding(mesh_1d(), P("d", None)), NamedSharding(mesh_1d(), P("d"))),
    "columns": lambda: (NamedSharding(mesh_1d(), P(None, "d")), NamedSharding(mesh_1d(), P())),
    "replicated": lambda: (NamedSharding(mesh_1d(), P()), NamedSharding(mesh_1d(), P())),
    "2d": lambda: (NamedSharding(mesh_2d(), P("a", "b")), NamedSharding(mesh_2d(), P("b"))),
    "2d_swapped": lambda: (NamedSharding(mesh_2d(), P("b", "a")), NamedSharding(mesh_2d(), P(("a", "b")))),
}


def check_exact(got: jax.Array, ref: np.ndarray, sharding) -> None:
    assert got.shape == ref.shape and got.dtype == ref.dtype and got.sharding == sharding
    assert np.array_equal(bits(got), bits(ref))
    index = sharding.devices_indices_map(ref.shape)
    assert {s.device for s in got.addressable_shards} == set(index)
    for shard in got.addressable_shards:
        assert shard.index == index[shard.device]
        assert np.array_equal(bits(shard.data), bits(ref[shard.index])), shard.device


@pytest.mark.parametrize("scheme", ["s3", "gs"])
@pytest.mark.parametrize("layout", sorted(SHARDINGS))
@pytest.mark.parametrize("concurrent_gb", [None, 1e-5, 1e-9])  # all at once / 3 row blocks of w / under one block
def test_restore_remote_equals_saved_arrays(saved, scheme, layout, concurrent_gb):
    urls, arrays = saved
    w_sh, b_sh = SHARDINGS[layout]()
    want = {W: jax.ShapeDtypeStruct(arrays[W].shape, np.float32, sharding=w_sh),
            B: jax.ShapeDtypeStruct(arrays[B].shape, arrays[B].dtype, sharding=b_sh),
            S: jax.ShapeDtypeStruct((), np.int32, sharding=NamedSharding(w_sh.mesh, P()))}
    got = restore_io.read_arrays(urls[scheme], want, concurrent_gb)
    assert set(got) == set(want)
    for p, w in want.items():
        check_exact(got[p], arrays[p], w.sharding)


def test_restore_remote_casts_on_host(saved):
    """A requested dtype other than the stored one is the stored value cast by numpy (a bf16 target
    of an fp32 array, an fp32 target of a bf16 one)."""
    urls, arrays = saved
    sh = NamedSharding(mesh_2d(), P("a", "b"))
    want = {W: jax.ShapeDtypeStruct(arrays[W].shape, ml_dtypes.bfloat16, sharding=sh),
            B: jax.ShapeDtypeStruct(arrays[B].shape, np.float32, sharding=NamedSharding(mesh_2d(), P("b")))}
    got = restore_io.read_arrays(urls["s3"], want, 1e-5)
    for p, w in want.items():
        check_exact(got[p], arrays[p].astype(w.dtype), w.sharding)


def test_restore_remote_matches_plain_tensorstore_reads(saved, tmp_path):
    """The same arrays saved locally and read whole by plain TensorStore (zarr3 through OCDBT, no bridge
    spec) equal what the remote restore placed."""
    urls, arrays = saved
    local = save_checkpoint(str(tmp_path / "ck"), arrays)
    sh = NamedSharding(mesh_2d(), P("b", "a"))
    got = restore_io.read_arrays(urls["gs"], {W: jax.ShapeDtypeStruct(arrays[W].shape, np.float32, sharding=sh)})
    kv = {"driver": "ocdbt", "base": {"driver": "file", "path": local + "/"}, "path": ".".join(W) + "/"}
    plain = ts.open({"driver": "zarr3", "kvstore": kv, "open": True}, read=True).result().read().result()
    assert np.array_equal(np.asarray(got[W]), plain)


@pytest.fixture(scope="module")
def big():
    """Two 2 MiB arrays on S3: larger than the budgets below."""
    rng = np.random.default_rng(3)
    arrays = {("params", "x"): rng.standard_normal((512, 1024), dtype=np.float32),
              ("params", "y"): rng.standard_normal((512, 1024), dtype=np.float32)}
    with remote_servers() as servers:
        yield save_checkpoint(servers["s3"].url("restore_remote/big"), arrays), arrays


@pytest.mark.parametrize("budget_bytes, most_blocks", [(700_000, 2), (2_000_000, 7), (100_000, 1)])
def test_restore_remote_holds_at_most_the_budget(big, budget_bytes, most_blocks):
    """4 MiB in two arrays, one split by rows and one by columns (8 blocks of 256 KiB each): the
    bytes read and not yet placed stay within the budget (a block larger than the budget alone),
    several blocks are in flight whenever the budget holds several, and every byte is read once."""
    url, arrays = big
    mesh = mesh_1d()
    want = {("params", "x"): jax.ShapeDtypeStruct((512, 1024), np.float32, sharding=NamedSharding(mesh, P("d", None))),
            ("params", "y"): jax.ShapeDtypeStruct((512, 1024), np.float32, sharding=NamedSharding(mesh, P(None, "d")))}
    seen, watch = counting_watch()
    with _testing.seams(restore_watch=watch):
        got = restore_io.read_arrays(url, want, budget_bytes / 1e9)
    block = 512 * 1024 * 4 // 8
    assert seen["started"] == sum(a.nbytes for a in arrays.values()) and seen["blocks"] == 16 and seen["now"] == 0
    assert seen["peak"] == most_blocks * block, seen
    assert seen["peak"] <= max(budget_bytes, block)
    for p, w in want.items():
        check_exact(got[p], arrays[p], w.sharding)


def test_restore_remote_refuses_a_budget_of_nothing(big):
    url, _ = big
    want = {("params", "x"): jax.ShapeDtypeStruct((512, 1024), np.float32, sharding=NamedSharding(mesh_1d(), P()))}
    with pytest.raises(BridgeError, match="concurrent_gb=0 must be positive"):
        restore_io.read_arrays(url, want, 0)


def _s3_gets() -> int:
    got = [m for m in ts.experimental_collect_matching_metrics("/tensorstore/kvstore/s3/read")
           if m["name"] == "/tensorstore/kvstore/s3/read" and m.get("values")]
    return int(got[0]["values"][0]["value"]) if got else 0


def test_row_split_restore_fetches_a_shard_in_few_gets():
    """A 16 MiB array (one shard of 16 inner chunks) split by rows over 8 devices: the 8 device boxes
    are read together, so the reader coalesces their chunks into a few GETs. Read one box after
    another, each box cost a GET of its own."""
    a = np.random.default_rng(5).random((1024, 4096), dtype=np.float32)
    with remote_servers() as servers:
        url = save_checkpoint(servers["s3"].url("restore_remote/gets"), {W: a})
        want = {W: jax.ShapeDtypeStruct(a.shape, np.float32, sharding=NamedSharding(mesh_1d(), P("d", None)))}
        before = _s3_gets()
        got = restore_io.read_arrays(url, want)
        gets = _s3_gets() - before
    check_exact(got[W], a, want[W].sharding)
    # 6 here: _METADATA, the OCDBT manifest and B-tree nodes, zarr.json and the shard index (5 before
    # the first chunk either way), then the chunks in one or two GETs; box after box: 13.
    assert gets <= 9, gets


def test_restore_remote_names_the_array_whose_data_is_gone():
    """A data file removed from the bucket after the commit: the restore fails with IntegrityError naming
    the array, the box and the process, not a bare TensorStore error."""
    from bridge.errors import IntegrityError

    a = np.random.default_rng(9).random((1024, 4096), dtype=np.float32)
    with remote_servers() as servers:
        s3 = servers["s3"]
        url = save_checkpoint(s3.url("restore_remote/damaged"), {W: a})
        c = s3.client()
        data = [o for o in c.list_objects_v2(Bucket=s3.buckets[0], Prefix="restore_remote/damaged/")["Contents"]
                if "/d/" in o["Key"]]
        biggest = max(data, key=lambda o: o["Size"])
        assert biggest["Size"] > a.nbytes // 2, data
        c.delete_object(Bucket=s3.buckets[0], Key=biggest["Key"])
        want = {W: jax.ShapeDtypeStruct(a.shape, np.float32, sharding=NamedSharding(mesh_1d(), P(None, "d")))}
        with pytest.raises(IntegrityError, match=r"process 0: array params/w: read of \[0:1024, 0:512\] from s3://"):
            restore_io.read_arrays(url, want)


def test_default_budget_is_orbaxs_restore_default():
    """The restore's default bound is Orbax's PyTreeCheckpointHandler's (the knob a user of Orbax knows)."""
    pytree_handler = pytest.importorskip("orbax.checkpoint._src.handlers.pytree_checkpoint_handler")
    assert placement.DEFAULT_CONCURRENT_GB == pytree_handler.DEFAULT_CONCURRENT_GB
