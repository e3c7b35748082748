"""JAX `save` to object storage from 2 processes (jax.distributed on 127.0.0.1, 4 CPU devices each):
each process writes the shards its devices hold as its own writer, process 0 commits. The result
must hold exactly the arrays the processes were built from, with the digests of a single-process
save of the same arrays, on S3 and GCS and into a CheckpointManager root."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/
sys.path.insert(0, os.path.join(HERE, "support"))
from servers import free_port, remote_servers  # noqa: E402

SHAPES = {"w": (16, 24), "b": (24,), "emb": (64, 8)}


def host_params() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(11)
    return {k: rng.standard_normal(s, dtype=np.float32) for k, s in SHAPES.items()}


def _build(mesh):
    """Params and an Adam state on `mesh` (moments made non-zero), from `host_params` alone."""
    import jax
    import optax
    from jax.sharding import NamedSharding, PartitionSpec as P

    specs = {"w": P("fsdp", "tp"), "b": P(), "emb": P(None, "tp")}
    host = host_params()

    def place(a, spec):
        return jax.make_array_from_callback(a.shape, NamedSharding(mesh, spec), lambda idx: a[idx])

    params = {k: place(host[k], specs[k]) for k in host}
    state = optax.adam(1e-3).init(params)
    mu = {k: place(host[k] * 0.5, specs[k]) for k in host}
    nu = {k: place(host[k] * host[k], specs[k]) for k in host}
    return params, (state[0]._replace(mu=mu, nu=nu), *state[1:])


def _worker(rank: int, world: int, port: int, urls: list[str], root: str) -> None:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=world, process_id=rank)
    from jax.sharding import Mesh

    from bridge.jaxside.save import save

    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("fsdp", "tp"))
    params, opt_state = _build(mesh)
    for url in urls:
        save(url, params=params, opt_state=opt_state, step=7)
    save(root, params=params, opt_state=opt_state, step=7, orbax_manager=True)
    try:
        save(urls[0], params=params, opt_state=opt_state, step=7)
    except Exception as e:  # every process refuses the existing destination the same way
        print(f"REFUSED {rank}: {e}", flush=True)



@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_process_jax_save_to_object_storage(tmp_path):
    import jax
    from jax.sharding import Mesh

    from bridge.cli import main as cli_main
    from bridge.jaxside.keypaths import leaves_by_path
    from bridge.jaxside.save import save
    from bridge.store.reader import open_checkpoint
    from jax_checkpoints import bits

    with remote_servers() as servers:
        s3, gs = servers["s3"], servers["gs"]
        urls = [s3.url("mp/jax"), gs.url("mp/jax")]
        root = gs.url("mp/mgr")
        port = free_port()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")]))
        env.pop("XLA_FLAGS", None)
        procs = [subprocess.Popen([sys.executable, __file__, str(rank), "2", str(port), json.dumps(urls), root],
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for rank in range(2)]
        logs = [p.communicate(timeout=280)[0].decode(errors="replace") for p in procs]
        for p, log in zip(procs, logs):
            assert p.returncode == 0, log[-3000:]
        for rank, log in enumerate(logs):
            assert f"REFUSED {rank}: " in log and "already exists" in log.split(f"REFUSED {rank}: ")[1], log[-2000:]

        # single-process reference: the same arrays saved from this process (8 devices, one writer)
        mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("fsdp", "tp"))
        params, opt_state = _build(mesh)
        ref_dir = str(tmp_path / "ref")
        save(ref_dir, params=params, opt_state=opt_state, step=7)
        ref = open_checkpoint(ref_dir)
        host = host_params()
        for url, srv, prefix in ((urls[0], s3, "mp/jax/"), (urls[1], gs, "mp/jax/"), (root, gs, "mp/mgr/7/default/")):
            keys = srv.list_keys(prefix)
            for w in (0, 1):  # both processes wrote data of their own
                assert any(k.startswith(f"{prefix}ocdbt.process_{w}/d/") for k in keys), (url, w)
            assert not any("_gtpb_claim" in k or "_gtp_bridge_writers" in k for k in keys)
            ck = open_checkpoint(url)
            assert ck.paths() == ref.paths()
            for k, a in host.items():
                assert np.array_equal(bits(ck.read(("params", k))), bits(a)), (url, k)
                assert np.array_equal(bits(ck.read(("opt_state", "0", "nu", k))), bits(a * a)), (url, k)
            for p in ref.paths():
                assert np.array_equal(bits(ck.read(p)), bits(ref.read(p))), (url, p)
            assert {n: r.digest for n, r in ck.manifest.arrays.items()} == \
                   {n: r.digest for n, r in ref.manifest.arrays.items()}
            assert int(ck.read(("step",))) == 7
            assert cli_main(["verify", url]) == 0
        assert "mp/mgr/7/commit_success.txt" in gs.list_keys("mp/mgr/")
        assert leaves_by_path(params).keys() == {(k,) for k in SHAPES}


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4]), sys.argv[5])
