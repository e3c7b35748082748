"""Restore a store-written logical checkpoint onto several 8-device CPU meshes, bit-exactly."""

from __future__ import annotations

import os

import jax
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from bridge.errors import BridgeError
from bridge.jaxside.abstract import Target, abstract_tree, stored_arrays
from bridge.jaxside.keypaths import leaves_by_path
from bridge.jaxside.restore import restore
from bridge.jaxside.sharding_rules import ShardingRules
from jax_checkpoints import bits, logical_state, read_with_tensorstore, tiny_manifest, tiny_params, write_store_checkpoint


@pytest.fixture(scope="module")
def store_ckpt(tmp_path_factory):
    arrays = logical_state(tiny_params(0), step=100, specials=True)
    d = str(tmp_path_factory.mktemp("jaxrestore") / "ckpt")
    write_store_checkpoint(d, arrays, tiny_manifest(100), num_writers=2)
    return d, arrays


def _devices():
    return np.array(jax.devices())


def _mesh_2x4():
    return dict(mesh=Mesh(_devices().reshape(2, 4), ("fsdp", "tp")))


def _mesh_1x8():
    return dict(mesh=Mesh(_devices().reshape(1, 8), ("fsdp", "tp")))


def _mesh_8_fsdp_rules():
    mesh = Mesh(_devices().reshape(8, 1), ("data", "model"))
    return dict(mesh=mesh, rules=ShardingRules([("*/linear_fc2/weight", (None, None, "data")),
                                               ("re:.*layer_norm_weight", (None, "data")),
                                               ("embedding/*", ("data",))]))


def _reversed_4x2_explicit():
    mesh = Mesh(_devices()[::-1].reshape(4, 2), ("a", "b"))

    def pick(path, shape):
        if len(shape) >= 2 and shape[-1] % 2 == 0 and shape[-2] % 4 == 0:
            return NamedSharding(mesh, P(*([None] * (len(shape) - 2)), "a", "b"))
        return NamedSharding(mesh, P())
    return dict(shardings=pick)


def _nested_dict_explicit():
    """Explicit NamedShardings as a tree shaped like the parameters (what a JAX model would give)."""
    from bridge.jaxside.keypaths import nested_from_paths

    mesh = Mesh(_devices().reshape(4, 2), ("x", "y"))
    specs = {p: (P(*([None] * (a.ndim - 2)), "y", "x") if a.ndim >= 2 and a.shape[-1] % 4 == 0 and
                 a.shape[-2] % 2 == 0 else P())
             for p, a in tiny_params(0).items()}
    return dict(shardings=nested_from_paths({p: NamedSharding(mesh, s) for p, s in specs.items()}))


MESHES = {"fsdp2_tp4": _mesh_2x4, "nested_dict_explicit": _nested_dict_explicit, "tp8": _mesh_1x8, "fsdp8_rules": _mesh_8_fsdp_rules,
          "reversed4x2_explicit": _reversed_4x2_explicit}


@pytest.mark.parametrize("target", list(MESHES))
def test_restore_bit_exact_on_meshes(store_ckpt, target):
    d, arrays = store_ckpt
    r = restore(d, **MESHES[target]())
    got = {("params",) + p: a for p, a in leaves_by_path(r.params).items()}
    got.update({("model",) + p: a for p, a in leaves_by_path(r.model).items()})
    got.update({("opt_state", "0", "mu") + p: a for p, a in leaves_by_path(r.opt_state[0].mu).items()})
    got.update({("opt_state", "0", "nu") + p: a for p, a in leaves_by_path(r.opt_state[0].nu).items()})
    got[("opt_state", "0", "count")] = r.opt_state[0].count
    got[("step",)] = r.step
    assert set(got) == set(arrays)
    sharded = 0
    for p, a in got.items():
        ref = read_with_tensorstore(d, p)  # independent read, no bridge or Orbax code
        assert a.dtype == ref.dtype and a.shape == ref.shape, p
        assert np.array_equal(bits(a), bits(ref)), p
        for shard in a.addressable_shards:  # each device holds exactly its slice
            assert np.array_equal(bits(shard.data), bits(ref[shard.index])), (p, shard.device)
        sharded += not a.sharding.is_fully_replicated
    assert sharded >= 10  # the meshes really split the arrays
    # moments follow their parameter's sharding
    w = ("decoder", "layers", "mlp", "linear_fc2", "weight")
    pw = r.params["decoder"]["layers"]["mlp"]["linear_fc2"]["weight"]
    assert r.opt_state[0].mu["decoder"]["layers"]["mlp"]["linear_fc2"]["weight"].sharding == pw.sharding, w


def test_default_rules_follow_megatron_splits(store_ckpt):
    d, _ = store_ckpt
    r = restore(d, mesh=Mesh(_devices().reshape(2, 4), ("fsdp", "tp")), items=("params",))
    layers = r.params["decoder"]["layers"]
    assert layers["mlp"]["linear_fc1"]["weight"]["gate"].sharding.spec == P(None, "tp", "fsdp")   # column
    assert layers["mlp"]["linear_fc2"]["weight"].sharding.spec == P(None, "fsdp", "tp")           # row
    assert layers["mlp"]["linear_fc1"]["layer_norm_weight"].sharding.spec == P(None, None)        # 1-D
    assert r.params["embedding"]["word_embeddings"]["weight"].sharding.spec == P("tp", "fsdp")
    assert r.opt_state is None and r.model is None and r.step is None


def test_dtype_cast_on_read(store_ckpt):
    d, arrays = store_ckpt
    r = restore(d, mesh=Mesh(_devices().reshape(2, 4), ("fsdp", "tp")), items=("params", "model"),
                dtypes={"params": ml_dtypes.bfloat16, "model": np.float32})
    for p, a in leaves_by_path(r.params).items():
        want = arrays[("params",) + p].astype(ml_dtypes.bfloat16)  # numpy round-to-nearest-even
        assert a.dtype == ml_dtypes.bfloat16 and np.array_equal(bits(a), bits(want)), p
    for p, a in leaves_by_path(r.model).items():
        want = arrays[("model",) + p].astype(np.float32)           # exact widening (NaN/Inf/-0 kept)
        assert a.dtype == np.float32 and np.array_equal(bits(a), bits(want)), p


def test_abstract_tree_works_with_plain_orbax(store_ckpt):
    d, arrays = store_ckpt
    mesh = Mesh(_devices().reshape(2, 4), ("fsdp", "tp"))
    abstract = abstract_tree(stored_arrays(d), Target(mesh=mesh))
    out = ocp.StandardCheckpointer().restore(d, abstract)
    flat = leaves_by_path(out)
    assert len(flat) == len(arrays)
    for p, a in flat.items():
        assert np.array_equal(bits(a), bits(arrays[p])), p


def test_restore_errors(store_ckpt, tmp_path):
    d, _ = store_ckpt
    mesh = Mesh(_devices().reshape(2, 4), ("fsdp", "tp"))
    with pytest.raises(BridgeError, match="does not exist"):
        restore(str(tmp_path / "nope"), mesh=mesh)
    tmp = tmp_path / "x.orbax-checkpoint-tmp"
    tmp.mkdir()
    with pytest.raises(BridgeError, match="uncommitted"):
        restore(str(tmp), mesh=mesh)
    with pytest.raises(BridgeError, match="no _METADATA"):
        restore(str(tmp_path), mesh=mesh)
    with pytest.raises(BridgeError, match=r"array decoder/layers/\S+ \(2, 16\): dim 0 \(2\) is not divisible"):
        restore(d, mesh=Mesh(_devices().reshape(1, 8), ("fsdp", "tp")), rules=ShardingRules([("*", ("tp",))]))
    with pytest.raises(BridgeError, match="mesh has no axis 'model'"):
        restore(d, mesh=mesh, rules=ShardingRules([("*", ("model",))]))
    with pytest.raises(BridgeError, match="no target"):
        restore(d)
    with pytest.raises(BridgeError, match="explicit shardings have no entry for"):
        restore(d, shardings={"output_layer": {"weight": NamedSharding(mesh, P())}})
    with pytest.raises(BridgeError, match="unknown items"):
        restore(d, mesh=mesh, items=("params", "extra"))
    assert os.listdir(tmp) == []  # nothing written anywhere


def test_untrusted_names_refused_before_any_read(tmp_path):
    """A _METADATA naming an array outside the checkpoint is refused before Orbax opens anything."""
    import json

    d = tmp_path / "evil"
    d.mkdir()
    entry = {"key_metadata": [{"key": "params", "key_type": 2}, {"key": "../../etc", "key_type": 2}],
             "value_metadata": {"value_type": "jax.Array", "skip_deserialize": False}}
    (d / "_METADATA").write_text(json.dumps({"tree_metadata": {"('params', '../../etc')": entry},
                                             "use_ocdbt": False, "use_zarr3": True}))
    with pytest.raises(BridgeError, match=r"bad tree name component '\.\./\.\./etc'"):
        restore(str(d), mesh=Mesh(_devices().reshape(2, 4), ("fsdp", "tp")))
    (d / "_METADATA").write_text("{not json")
    with pytest.raises(BridgeError, match="_METADATA is unreadable"):
        restore(str(d), mesh=Mesh(_devices().reshape(2, 4), ("fsdp", "tp")))
