"""JAX trains, saves back; the store's reader and `gtp-bridge verify` accept it bit-exactly."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh

from bridge.cli import main as cli_main
from bridge.errors import BridgeError
from bridge.jaxside.keypaths import leaves_by_path, nested_from_paths
from bridge.jaxside.manifest_view import optimizer_from_manifest, section_orders
from bridge.jaxside.optax_state import extract_adam
from bridge.jaxside.restore import restore
from bridge.jaxside.save import save
from bridge.store import digest
from bridge.store.reader import open_checkpoint
from bridge.jaxside.naming import JoinSections, NamingMap, Rename, Transpose, Unstack
from jax_checkpoints import (bits, logical_state, make_jax_checkpoint, tiny_manifest, tiny_params, train,
                             write_store_checkpoint)

STEP = 100


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    arrays = logical_state(tiny_params(0), step=STEP, specials=False)
    d = str(tmp_path_factory.mktemp("jaxsave") / "src")
    write_store_checkpoint(d, arrays, tiny_manifest(STEP), num_writers=2)
    return d, arrays


@pytest.fixture(scope="module")
def mesh():
    return Mesh(np.array(jax.devices()).reshape(2, 4), ("fsdp", "tp"))


def _abstract():
    return nested_from_paths({p: jax.ShapeDtypeStruct(a.shape, jnp.float32) for p, a in tiny_params(0).items()})


@pytest.mark.slow
def test_train_save_back_read_by_store(src, mesh, tmp_path):
    d, _ = src
    manifest = tiny_manifest(STEP)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optimizer_from_manifest(manifest))
    r = restore(d, mesh=mesh, optimizer=jax.eval_shape(tx.init, _abstract()))
    params, opt_state = train(r.params, 3, tx, opt_state=r.opt_state, start_step=STEP)
    model = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    mu, nu, count = extract_adam(opt_state)
    assert int(count) == STEP + 3
    expected = {}
    for p, a in leaves_by_path(params).items():
        expected[("params",) + p] = np.asarray(a)
        expected[("opt_state", "0", "mu") + p] = np.asarray(mu[p])
        expected[("opt_state", "0", "nu") + p] = np.asarray(nu[p])
        expected[("model",) + p] = np.asarray(leaves_by_path(model)[p])
    expected[("opt_state", "0", "count")] = np.array(STEP + 3, np.int32)
    expected[("step",)] = np.array(STEP + 3, np.int32)

    dst = str(tmp_path / "out")
    written = save(dst, params=params, opt_state=opt_state, step=int(r.step) + 3, model=model, manifest=r.manifest)
    ck = open_checkpoint(dst)
    assert set(ck.paths()) == set(expected) | set()  # exactly the logical tree, nothing else
    for p, want in expected.items():
        got = ck.read(p)
        assert got.dtype == want.dtype and got.shape == want.shape, p
        assert np.array_equal(bits(got), bits(want)), p
        assert written.arrays[".".join(p)].digest == digest.to_hex(digest.digest_array(want)), p
    # the manifest PyTorch needs: section tables, hyper-parameters, new step, writer layout
    m = ck.manifest
    assert section_orders(m) == section_orders(manifest)
    assert m.optimizer.betas == (0.9, 0.95) and m.optimizer.weight_decay == 0.1 and m.optimizer.step == STEP + 3
    assert m.optimizer.no_decay == manifest.optimizer.no_decay
    assert m.source.framework == "jax" and m.extra["previous_source"]["tp"] == 2
    assert m.source.pad_for_alignment == manifest.source.pad_for_alignment == 32
    # the tree is Orbax's own for adamw: EmptyState entries recorded as None
    tree = json.load(open(os.path.join(dst, "_METADATA")))["tree_metadata"]
    assert tree["('opt_state', '1')"]["value_metadata"]["value_type"] == "None"
    assert cli_main(["verify", dst]) == 0


@pytest.mark.slow
def test_naming_round_trip_is_bit_exact(src, mesh, tmp_path):
    """Restore through a naming map (joined, unstacked, transposed, renamed), save back unchanged:
    the logical arrays come back bit-identical."""
    d, arrays = src
    nm = NamingMap([JoinSections("*/linear_qkv/weight"), JoinSections("*/linear_fc1/weight"),
                    Unstack("decoder/layers/*"), Transpose("*/weight"),
                    Rename(r"^decoder/layers/(\d+)/", r"blocks/\1/")])
    r = restore(d, mesh=mesh, naming=nm)
    blk = r.params["blocks"]["1"]
    assert blk["self_attention"]["linear_qkv"]["weight"].shape == (16, 48)      # [in, q|k|v]
    assert blk["mlp"]["linear_fc1"]["weight"].shape == (16, 48)                 # [in, gate|up]
    gate1 = arrays[("params", "decoder", "layers", "mlp", "linear_fc1", "weight", "gate")][1]
    assert np.array_equal(np.asarray(blk["mlp"]["linear_fc1"]["weight"])[:, :24], gate1.T)
    assert section_orders(r.manifest)  # the join order came from the manifest's section table
    dst = str(tmp_path / "named")
    save(dst, params=r.params, opt_state=r.opt_state, step=r.step, model=r.model, manifest=r.manifest, plans=r.plans)
    ck = open_checkpoint(dst)
    assert set(ck.paths()) == set(arrays)
    for p, want in arrays.items():
        assert np.array_equal(bits(ck.read(p)), bits(want)), p
    assert cli_main(["verify", dst]) == 0


@pytest.mark.slow
def test_stacked_sections_restore_sharded_and_save_back(src, mesh, tmp_path):
    """gate/up stacked as [layers, 2, ffn, hidden]: TP splits ffn inside each section; exact round trip."""
    from jax.sharding import PartitionSpec as P

    d, arrays = src
    nm = NamingMap([JoinSections("*/linear_fc1/weight", stack=True)])
    r = restore(d, mesh=mesh, naming=nm, items=("params", "opt_state", "step"))
    fc1 = r.params["decoder"]["layers"]["mlp"]["linear_fc1"]["weight"]
    assert fc1.shape == (2, 2, 24, 16) and fc1.sharding.spec == P(None, None, "tp", "fsdp")
    up = arrays[("params", "decoder", "layers", "mlp", "linear_fc1", "weight", "up")]
    assert np.array_equal(np.asarray(fc1)[:, 1], up)
    dst = str(tmp_path / "stacked")
    save(dst, params=r.params, opt_state=r.opt_state, step=r.step, manifest=r.manifest, plans=r.plans)
    ck = open_checkpoint(dst)
    for p in ck.paths():
        assert np.array_equal(bits(ck.read(p)), bits(arrays[p])), p


@pytest.mark.slow
def test_make_jax_checkpoint_helper(tmp_path):
    """The helper other tests use: what it returns is exactly what the store reader sees."""
    dst = str(tmp_path / "helper")
    expected = make_jax_checkpoint(dst, steps=2)
    ck = open_checkpoint(dst)
    assert set(ck.paths()) == set(expected)
    for p, want in expected.items():
        assert np.array_equal(bits(ck.read(p)), bits(want)), p
    assert int(expected[("opt_state", "0", "count")]) == 2
    first = ("params", "output_layer", "weight")
    assert not np.array_equal(expected[first], tiny_params(0)[first[1:]])  # it really trained
    custom = {("params", "a", "weight"): np.ones((8, 4), np.float32)}
    exp2 = make_jax_checkpoint(str(tmp_path / "custom"), params={p[1:]: a for p, a in custom.items()}, steps=1,
                               with_model=False)
    assert ("model", "a", "weight") not in exp2 and exp2[("params", "a", "weight")].shape == (8, 4)


@pytest.mark.slow
def test_save_refusals(src, mesh, tmp_path):
    d, _ = src
    r = restore(d, mesh=mesh)
    with pytest.raises(BridgeError, match="exists"):
        save(d, params=r.params, opt_state=r.opt_state, step=r.step)
    partial = dict(r.params)
    partial.pop("output_layer")
    dst = tmp_path / "x"
    with pytest.raises(BridgeError, match="mu and params differ at output_layer/weight"):
        save(str(dst), params=partial, opt_state=r.opt_state, step=r.step)
    with pytest.raises(BridgeError, match="no Adam moments"):
        save(str(dst), params=r.params, opt_state=optax.sgd(0.1).init(r.params), step=r.step)
    nm = NamingMap([Unstack("decoder/layers/*")])
    rn = restore(d, mesh=mesh, naming=nm, items=("params", "opt_state", "step"))
    bad = jax.tree.map(lambda x: x, rn.params)
    del bad["decoder"]["layers"]["1"]
    bad_state = (rn.opt_state[0]._replace(mu=jax.tree.map(lambda x: x, bad), nu=jax.tree.map(lambda x: x, bad)),
                 ) + tuple(rn.opt_state[1:])
    with pytest.raises(BridgeError, match="lacks decoder/layers/1/"):
        save(str(dst), params=bad, opt_state=bad_state, step=rn.step, plans=rn.plans)
    assert not os.path.exists(dst) and not os.path.exists(str(dst) + ".orbax-checkpoint-tmp")
    dotted = {"a.b": jnp.ones((2,), jnp.float32)}
    with pytest.raises(BridgeError, match="must not contain '.'"):
        save(str(dst), params=dotted, opt_state=optax.adam(0.1).init(dotted), step=0)
    assert not os.path.exists(dst)


def test_stale_temp_from_a_crashed_save_is_replaced_and_a_users_dir_kept(src, mesh, tmp_path):
    """A save killed before its final rename leaves only its claimed temp dir, which the next save
    removes (its process is dead); a temp-named dir that is not a claim of ours is never touched."""
    import json
    import subprocess
    import sys

    from bridge.store.claim import CLAIM_FILE, ClaimInfo, tmp_dir_for

    d, arrays = src
    r = restore(d, mesh=mesh, items=("params", "opt_state", "step"))
    dst = str(tmp_path / "out")
    tmp = tmp_dir_for(dst)
    os.makedirs(os.path.join(tmp, "item"))
    open(os.path.join(tmp, "item", "_METADATA"), "w").write("{garbage")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    # a claim of an exited process ("1": no live process has that start time, should the pid be reused)
    info = ClaimInfo.mine(dst).__dict__ | {"pid": int(dead.stdout), "pid_start": "1"}
    json.dump(info, open(os.path.join(tmp, CLAIM_FILE), "w"))
    with pytest.raises(BridgeError):
        open_checkpoint(dst)  # nothing at the destination yet
    save(dst, params=r.params, opt_state=r.opt_state, step=r.step)
    assert not os.path.exists(tmp)
    ck = open_checkpoint(dst)
    p = ("opt_state", "0", "nu", "output_layer", "weight")
    assert np.array_equal(bits(ck.read(p)), bits(arrays[p]))
    dst2 = str(tmp_path / "out2")
    os.makedirs(tmp_dir_for(dst2))
    open(os.path.join(tmp_dir_for(dst2), "notes.txt"), "w").write("mine")
    with pytest.raises(BridgeError, match="holds no gtp-bridge claim"):
        save(dst2, params=r.params, opt_state=r.opt_state, step=r.step)
    assert open(os.path.join(tmp_dir_for(dst2), "notes.txt")).read() == "mine" and not os.path.exists(dst2)