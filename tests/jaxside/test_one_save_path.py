"""One JAX save path and one restore read for local paths and object storage (issue 32).

`bridge.jaxside.save` writes with the store's writer and commit wherever it writes, and
`bridge.jaxside.restore` reads with the store's reader wherever it reads. Checked against
independent references: the numpy arrays the state was built from, plain TensorStore (an OCDBT
kvstore opened by hand, every key's value), boto3 for the objects on the local S3 server, and plain
Orbax's own restore of a local save (no bridge code on the restore side).

Intended differences between a local and an s3:// save of the same state, not seen at these sizes:
an array over 16 MiB gets 16 MiB outer chunks on object storage (1 GiB locally:
`bridge.store.specs.max_chunk_bytes`); and always `_CHECKPOINT_METADATA`'s timestamps and
`commit_success.txt` (it names the destination).
"""

from __future__ import annotations

import doctest
import json
import os
import sys

import jax
import ml_dtypes
import numpy as np
import pytest
import tensorstore as ts
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "support"))  # tests/support: shared helpers
from jax_checkpoints import bits, logical_state, tiny_manifest, tiny_params  # noqa: E402
from servers import S3Server, environ  # noqa: E402
from restore_watch import counting_watch  # noqa: E402

from bridge import _testing  # noqa: E402

ADAM = ("opt_state", "0")


def _mesh() -> Mesh:
    return Mesh(np.array(jax.devices()).reshape(2, 4), ("fsdp", "tp"))


def _spec(shape: tuple) -> P:
    """Shard the leading dim 2 ways and the last 4 ways where they divide (scalars replicated)."""
    spec = [None] * len(shape)
    if shape and shape[-1] % 4 == 0:
        spec[-1] = "tp"
    if len(shape) >= 2 and shape[0] % 2 == 0:
        spec[0] = "fsdp"
    return P(*spec)


def _nested(flat: dict) -> dict:
    out: dict = {}
    for p, v in flat.items():
        node = out
        for k in p[:-1]:
            node = node.setdefault(k, {})
        node[p[-1]] = v
    return out


@pytest.fixture(scope="module")
def state():
    """Reference numpy arrays (NaN, Inf, -0.0, subnormals planted) and the same state as sharded
    jax.Arrays on an 8-device mesh, as `save`'s keywords."""
    import optax

    arrays = logical_state(tiny_params(0), step=100, specials=True)
    mesh = _mesh()
    on = {p: jax.device_put(a, NamedSharding(mesh, _spec(a.shape))) for p, a in arrays.items()}

    def role(prefix):
        return _nested({p[len(prefix):]: a for p, a in on.items() if p[:len(prefix)] == prefix and len(p) > len(prefix)})

    opt = (optax.ScaleByAdamState(count=on[ADAM + ("count",)], mu=role(ADAM + ("mu",)), nu=role(ADAM + ("nu",))),
           optax.EmptyState(), optax.EmptyState())
    kw = dict(params=role(("params",)), opt_state=opt, step=on[("step",)], model=role(("model",)),
              manifest=tiny_manifest(100), allow_inconsistent_model=True)  # the planted specials differ on purpose
    return arrays, kw


def _ocdbt_items(base: dict) -> dict[bytes, bytes]:
    """Every key of the OCDBT database on `base` and its value, read with plain TensorStore."""
    kv = ts.KvStore.open({"driver": "ocdbt", "base": base}).result()
    return {k: kv.read(k).result().value for k in kv.list().result()}


def _read_zarr(base: dict, path: tuple) -> np.ndarray:
    spec = {"driver": "zarr3", "kvstore": {"driver": "ocdbt", "base": base, "path": ".".join(path) + "/"}}
    return np.asarray(ts.open(spec, open=True).result().read().result())


@pytest.mark.slow
def test_local_and_s3_saves_write_the_same_logical_bytes(state, tmp_path):
    """The same state saved to a local path and to s3:// (local S3 server): the same OCDBT keys with the
    same values (zarr.json and every stored chunk, crc32c included), the same `_METADATA` and
    `_sharding` bytes; every decoded array equals the reference bit for bit."""
    from bridge.jaxside.save import save

    arrays, kw = state
    local = str(tmp_path / "local")
    save(local, **kw)
    local_base = {"driver": "file", "path": local + "/"}
    with S3Server() as srv, environ(**srv.env):
        url = srv.url("one/saved")
        save(url, **kw)
        s3_base = {"driver": "s3", "bucket": srv.buckets[0], "path": "one/saved/", "endpoint": srv.endpoint,
                   "aws_region": "us-east-1", "aws_credentials": {"type": "environment"}}
        a, b = _ocdbt_items(local_base), _ocdbt_items(s3_base)
        assert sorted(a) == sorted(b)
        assert [k for k in a if a[k] != b[k]] == []
        # every array, its metadata and its chunks: one zarr.json per array (+ chunk keys)
        assert {k.decode().partition("/")[0] for k in a if k.endswith(b"/zarr.json")} == \
               {".".join(p) for p in arrays}
        meta = json.loads(a[b"params.output_layer.weight/zarr.json"])
        assert any(c["name"] == "crc32c" for c in meta["codecs"][0]["configuration"]["codecs"]), meta
        for p, want in arrays.items():
            for base in (local_base, s3_base):
                got = _read_zarr(base, p)
                assert got.dtype == want.dtype and np.array_equal(bits(got), bits(want)), (base["driver"], p)
        objects = srv.client()
        remote_files = {}
        for name in ("_METADATA", "_sharding", "_CHECKPOINT_METADATA", "commit_success.txt"):
            remote_files[name] = objects.get_object(Bucket=srv.buckets[0], Key=f"one/saved/{name}")["Body"].read()
    local_files = {name: open(os.path.join(local, name), "rb").read() for name in remote_files}
    assert local_files["_METADATA"] == remote_files["_METADATA"]
    assert local_files["_sharding"] == remote_files["_sharding"]
    # `_CHECKPOINT_METADATA`: the same but for the times of the save
    times = ("init_timestamp_nsecs", "commit_timestamp_nsecs")
    la, ra = (json.loads(f["_CHECKPOINT_METADATA"]) for f in (local_files, remote_files))
    assert {k: v for k, v in la.items() if k not in times} == {k: v for k, v in ra.items() if k not in times}
    assert remote_files["commit_success.txt"].decode().endswith(url)


def test_plain_orbax_restores_a_local_save(state, tmp_path):
    """A user's plain Orbax (`StandardCheckpointer`, an abstract tree with shardings built from the
    reference shapes, no bridge code) restores what `save` wrote locally, bit for bit, onto the mesh
    (saved with writer batches of 1 MiB: `concurrent_gb` far below the state; 0 is refused, nothing
    written)."""
    import orbax.checkpoint as ocp

    from bridge.errors import BridgeError
    from bridge.jaxside.save import save

    arrays, kw = state
    d = str(tmp_path / "ck")
    with pytest.raises(BridgeError, match="concurrent_gb=0 must be positive"):
        save(d, concurrent_gb=0, **kw)
    assert os.listdir(tmp_path) == []
    save(d, concurrent_gb=0.001, **kw)
    mesh = _mesh()
    abstract = _nested({p: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, _spec(a.shape)))
                        for p, a in arrays.items()})
    abstract["opt_state"] = [abstract["opt_state"]["0"], None, None]   # optax.adamw(...).init's structure
    out = ocp.StandardCheckpointer().restore(d, abstract)
    out["opt_state"] = {"0": out["opt_state"][0]}
    for p, want in arrays.items():
        got = out
        for k in p:
            got = got[k]
        assert got.dtype == want.dtype and np.array_equal(bits(got), bits(want)), p
        assert got.sharding.spec == _spec(want.shape), p
        for shard in got.addressable_shards:
            assert np.array_equal(bits(shard.data), bits(want[shard.index])), (p, shard.device)


def test_bridge_restore_of_a_local_save_partial_and_cast(state, tmp_path):
    """`restore` of a local save: every array back bit for bit; a partial restore (params only) and
    casts on read (params to bf16, model to fp32) equal numpy's casts of the reference."""
    from bridge.jaxside.keypaths import leaves_by_path
    from bridge.jaxside.restore import restore
    from bridge.jaxside.save import save

    arrays, kw = state
    d = str(tmp_path / "ck")
    save(d, **kw)
    mesh = _mesh()
    r = restore(d, mesh=mesh)
    got = {("params",) + p: a for p, a in leaves_by_path(r.params).items()}
    got.update({("model",) + p: a for p, a in leaves_by_path(r.model).items()})
    got.update({ADAM + ("mu",) + p: a for p, a in leaves_by_path(r.opt_state[0].mu).items()})
    got.update({ADAM + ("nu",) + p: a for p, a in leaves_by_path(r.opt_state[0].nu).items()})
    got[ADAM + ("count",)], got[("step",)] = r.opt_state[0].count, r.step
    assert set(got) == set(arrays)
    for p, a in got.items():
        assert a.dtype == arrays[p].dtype and np.array_equal(bits(a), bits(arrays[p])), p
    part = restore(d, mesh=mesh, items=("params", "model"), dtypes={"params": ml_dtypes.bfloat16, "model": np.float32})
    assert part.opt_state is None and part.step is None
    for prefix, tree, dt in (("params", part.params, ml_dtypes.bfloat16), ("model", part.model, np.float32)):
        for p, a in leaves_by_path(tree).items():
            want = arrays[(prefix,) + p].astype(dt)
            assert a.dtype == dt and np.array_equal(bits(a), bits(want)), (prefix, p)


def test_local_restore_holds_at_most_the_budget(tmp_path):
    """`restore(path, concurrent_gb=)` on a local path: the bytes read and not yet placed on devices
    (heard through `bridge._testing`'s `restore_watch`) stay within the budget, several blocks are
    in flight, every byte is read once, and the arrays are exact."""
    from bridge.jaxside.keypaths import leaves_by_path
    from bridge.jaxside.restore import restore
    from bridge.jaxside.sharding_rules import ShardingRules
    from bridge.store.commit import save_checkpoint

    rng = np.random.default_rng(3)
    arrays = {("params", "x"): rng.standard_normal((512, 1024), dtype=np.float32),
              ("params", "y"): rng.standard_normal((512, 1024), dtype=np.float32)}
    d = save_checkpoint(str(tmp_path / "big"), arrays)
    seen, watch = counting_watch()

    mesh = Mesh(np.array(jax.devices()), ("d",))
    budget = 700_000
    block = 512 * 1024 * 4 // 8
    with _testing.seams(restore_watch=watch):
        r = restore(d, mesh=mesh, rules=ShardingRules([("x", ("d", None)), ("y", (None, "d"))]), items=("params",),
                    concurrent_gb=budget / 1e9)
    assert seen["started"] == sum(a.nbytes for a in arrays.values()) and seen["blocks"] == 16 and seen["now"] == 0
    assert seen["peak"] == 2 * block <= budget, seen
    for p, a in leaves_by_path(r.params).items():
        assert np.array_equal(bits(a), bits(arrays[("params",) + p])), p


def test_local_save_of_a_converted_state_equals_converts_output(tmp_path):
    """The demo's embedded Megatron checkpoint converted, restored onto a 2x4 mesh and saved back
    locally unchanged: the same files, the same OCDBT keys with the same values, the same `_sharding`
    and manifest array records (digests) as `convert` wrote; the manifest differs only where it
    records the writer (`source`, and `extra`'s record of the previous source)."""
    pytest.importorskip("torch")
    from bridge.commands.demo import DEMO_SRC
    from bridge.jaxside.restore import restore
    from bridge.jaxside.save import save
    from converters.megatron.convert import ConvertOptions
    from converters.megatron.convert_entry import convert

    converted, saved = str(tmp_path / "converted"), str(tmp_path / "saved")
    convert(str(DEMO_SRC), converted, ConvertOptions(workers=1))
    r = restore(converted, mesh=_mesh())
    save(saved, params=r.params, opt_state=r.opt_state, step=r.step, model=r.model, manifest=r.manifest)
    assert sorted(os.listdir(converted)) == sorted(os.listdir(saved))
    a, b = (_ocdbt_items({"driver": "file", "path": d + "/"}) for d in (converted, saved))
    assert len(a) > 100 and sorted(a) == sorted(b)
    assert [k for k in a if a[k] != b[k]] == []
    assert open(os.path.join(converted, "_sharding"), "rb").read() == open(os.path.join(saved, "_sharding"), "rb").read()
    ma, mb = (json.load(open(os.path.join(d, "_METADATA"))) for d in (converted, saved))
    assert {k for k in ma if ma[k] != mb[k]} == {"custom_metadata"}
    ga, gb = ma["custom_metadata"]["gtp_bridge"], mb["custom_metadata"]["gtp_bridge"]
    assert ga["arrays"] == gb["arrays"]
    assert {k for k in set(ga) | set(gb) if ga.get(k) != gb.get(k)} == {"source", "extra"}
    assert gb["source"]["framework"] == "jax"


def test_restore_reads_a_checkpoint_plain_orbax_wrote(tmp_path):
    """`restore` reads what plain Orbax saved itself (a user's checkpoint, or a local save of a bridge
    before the fold), zarr3 over OCDBT and per-array zarr alike, bit for bit onto the mesh."""
    import orbax.checkpoint as ocp

    from bridge.jaxside.keypaths import leaves_by_path
    from bridge.jaxside.restore import restore

    arrays = {p: a for p, a in logical_state(tiny_params(1), step=7).items() if p[0] in ("params", "step")}
    mesh = _mesh()
    tree = _nested({p: jax.device_put(a, NamedSharding(mesh, _spec(a.shape))) for p, a in arrays.items()})
    for ocdbt in (True, False):
        d = str(tmp_path / f"orbax_ocdbt_{ocdbt}")
        ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=ocdbt, use_zarr3=ocdbt)).save(
            d, args=ocp.args.PyTreeSave(tree))
        r = restore(d, mesh=mesh, items=("params", "step"))
        got = {("params",) + p: a for p, a in leaves_by_path(r.params).items()}
        got[("step",)] = r.step
        assert set(got) == set(arrays) and r.manifest is None
        for p, a in got.items():
            assert a.dtype == arrays[p].dtype and np.array_equal(bits(a), bits(arrays[p])), (ocdbt, p)


def test_placement_docstring_examples():
    from bridge.jaxside import placement

    res = doctest.testmod(placement)
    assert res.attempted > 0 and res.failed == 0
