"""Orbax CheckpointManager roots on object storage (issue 20): JAX `save(..., orbax_manager=True)` and
`convert --orbax-step-dir` into an s3:// / gs:// root, read back through the root (its latest committed
step) by our readers, `restore`, and, on GCS, by Orbax's own CheckpointManager (gcsfs)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "support"))  # tests/support: shared helpers
from jax_checkpoints import bits  # noqa: E402
from servers import environ, remote_servers  # noqa: E402

from bridge.errors import BridgeError  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def stores():
    with remote_servers() as servers:
        yield servers


def _state(seed: int):
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("fsdp", "tp"))
    rng = np.random.default_rng(seed)
    host = {"w": rng.standard_normal((16, 24), dtype=np.float32), "b": rng.standard_normal(24, dtype=np.float32)}
    params = {"w": jax.device_put(host["w"], NamedSharding(mesh, P("fsdp", "tp"))),
              "b": jax.device_put(host["b"], NamedSharding(mesh, P()))}
    return host, params, optax.adam(1e-3).init(params)


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["s3", "gs"])
def test_jax_save_into_a_manager_root_on_object_storage(stores, scheme):
    from bridge.jaxside.restore import restore
    from bridge.jaxside.save import save
    from bridge.store.reader import open_checkpoint

    srv = stores[scheme]
    root = srv.url("mgr/jax")
    host12, params12, opt12 = _state(12)
    host5, params5, opt5 = _state(5)
    save(root, params=params12, opt_state=opt12, step=12, orbax_manager=True)
    save(root, params=params5, opt_state=opt5, step=5, orbax_manager=True)  # written last, but not the latest
    keys = srv.list_keys("mgr/jax/")
    for step in (5, 12):
        for k in ("commit_success.txt", "_CHECKPOINT_METADATA", "default/_METADATA"):
            assert f"mgr/jax/{step}/{k}" in keys
    assert not any("_gtpb_claim" in k for k in keys)
    # a killed writer's step 20 (claim, no _METADATA, no commit_success.txt) is not a step
    if scheme == "s3":
        srv.client().put_object(Bucket=srv.buckets[0], Key="mgr/jax/20/default/_gtpb_claim.json", Body=b"{}")
    ck = open_checkpoint(root)
    assert ck.root == f"{root}/12/default"
    assert np.array_equal(bits(ck.read(("params", "w"))), bits(host12["w"]))
    assert np.array_equal(bits(open_checkpoint(f"{root}/5").read(("params", "b"))), bits(host5["b"]))
    back = restore(root, mesh=Mesh(np.array(jax.devices()), ("d",)))
    assert int(back.step) == 12 and np.array_equal(bits(np.asarray(back.params["w"])), bits(host12["w"]))
    with pytest.raises(BridgeError, match="already has step 12"):
        save(root, params=params12, opt_state=opt12, step=12, orbax_manager=True)
    with pytest.raises(BridgeError, match="is a checkpoint, not an Orbax CheckpointManager root"):
        save(f"{root}/12", params=params12, opt_state=opt12, step=13, orbax_manager=True)


@pytest.mark.slow
def test_orbax_checkpoint_manager_lists_and_restores_our_steps_on_gcs(stores):
    """Orbax's own CheckpointManager on the GCS root: it takes a step as finalized by its
    commit_success.txt, so it lists exactly the committed steps and restores our arrays."""
    pytest.importorskip("gcsfs", reason="Orbax opens gs:// through etils epath, which needs gcsfs")
    import orbax.checkpoint as ocp

    from bridge.jaxside.abstract import Target, abstract_tree, stored_arrays
    from bridge.jaxside.keypaths import leaves_by_path
    from bridge.jaxside.save import save

    root = stores["gs"].url("mgr/orbax")
    host, params, opt = _state(3)
    save(root, params=params, opt_state=opt, step=3, orbax_manager=True)
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("fsdp", "tp"))
    abstract = abstract_tree(stored_arrays(root), Target(mesh=mesh))
    with environ(GOOGLE_CLOUD_PROJECT="test"):  # gcsfs wants a project; the emulator ignores it
        mgr = ocp.CheckpointManager(root)
        assert mgr.all_steps() == [3] and mgr.latest_step() == 3
        got = leaves_by_path(mgr.restore(3, args=ocp.args.PyTreeRestore(
            abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract))))
        mgr.close()
    assert np.array_equal(bits(np.asarray(got[("params", "w")])), bits(host["w"]))


@pytest.mark.slow
def test_convert_orbax_step_dir_on_s3_equals_a_local_convert(stores, tmp_path):
    """`gtp-bridge convert SRC s3://.../mgr --orbax-step-dir` writes step <iteration> in place; `verify`
    and our reader take the root; the arrays equal a plain local conversion of the same source."""
    from bridge.commands.demo import DEMO_SRC
    from bridge.store.reader import open_checkpoint

    s3 = stores["s3"]
    root = s3.url("mgr/convert")
    env = {**os.environ, "PYTHONPATH": str(REPO)}

    def cli(*argv):
        return subprocess.run([sys.executable, "-m", "bridge.cli", *argv], capture_output=True, text=True, env=env,
                              cwd=tmp_path)

    r = cli("convert", str(DEMO_SRC), root, "--orbax-step-dir", "--workers", "1")
    assert r.returncode == 0, r.stderr
    assert cli("convert", str(DEMO_SRC), str(tmp_path / "plain"), "--workers", "1").returncode == 0
    plain = open_checkpoint(str(tmp_path / "plain"))
    step = int(plain.read(("step",)))
    keys = s3.list_keys("mgr/convert/")
    assert {k.split("/")[2] for k in keys} == {str(step)} and f"mgr/convert/{step}/commit_success.txt" in keys
    assert not any(Path(tmp_path).glob("s3*")), "nothing may be written locally for a URL"
    got = open_checkpoint(root)
    assert got.root == f"{root}/{step}/default" and got.paths() == plain.paths()
    for p in plain.paths():
        assert np.array_equal(bits(np.asarray(got.read(p))), bits(np.asarray(plain.read(p)))), p
    v = cli("verify", root)
    assert v.returncode == 0, v.stdout + v.stderr
    again = cli("convert", str(DEMO_SRC), root, "--orbax-step-dir", "--workers", "1")
    assert again.returncode == 2 and f"already has step {step}" in again.stderr
