"""`read_arrays` (the JAX restore's read) from S3 and GCS in 2 JAX processes (jax.distributed on 127.0.0.1, 4 CPU devices each), onto
a global 2 x 4 mesh: every process builds the global arrays from its own devices' shards, each equal to the saved
array's slice, and reads only the boxes its devices hold (counted at the read seam)."""

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

SPECS = {"rows": ("a", None), "cols": (None, "b"), "both": ("b", "a"), "repl": ()}


def saved_arrays() -> dict[tuple, np.ndarray]:
    rng = np.random.default_rng(13)
    return {("params", k): rng.standard_normal((32, 48), dtype=np.float32) for k in SPECS}


def _worker(rank: int, world: int, port: int, urls: list[str]) -> None:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=world, process_id=rank)
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from bridge import _testing
    from bridge.jaxside import restore_io
    from jax_checkpoints import bits

    started = []

    def watch(event: str, nbytes: int) -> None:  # read_arrays' testing seam: each read started
        if event == "read":
            started.append(nbytes)

    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))
    arrays = saved_arrays()
    want = {p: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, P(*SPECS[p[1]])))
            for p, a in arrays.items()}
    for url in urls:
        started.clear()
        with _testing.seams(restore_watch=watch):
            got = restore_io.read_arrays(url, want, 1e-5)
        expected = 0
        for p, a in arrays.items():
            assert got[p].shape == a.shape and got[p].sharding == want[p].sharding, p
            shards = got[p].addressable_shards
            assert {s.device for s in shards} == {d for d in mesh.devices.flat if d.process_index == rank}, p
            for s in shards:
                assert np.array_equal(bits(s.data), bits(a[s.index])), (url, p, s.device)
            expected += len({tuple((i.start, i.stop) for i in s.index) for s in shards})
        assert len(started) == expected, (url, len(started), expected)
        print(f"OK {rank} {url} {len(started)} reads", flush=True)



@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_process_restore_remote():
    from bridge.store.commit import save_checkpoint

    with remote_servers() as servers:
        urls = [save_checkpoint(srv.url("mp_restore/ck"), saved_arrays(), num_writers=2) for srv in servers.values()]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), os.path.join(HERE, "support"), os.environ.get("PYTHONPATH", "")]))
        env.pop("XLA_FLAGS", None)
        port = free_port()
        procs = [subprocess.Popen([sys.executable, __file__, str(rank), "2", str(port), json.dumps(urls)],
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for rank in range(2)]
        logs = [p.communicate(timeout=280)[0].decode(errors="replace") for p in procs]
    for rank, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, log[-3000:]
        for url in urls:
            # rows: 1 box per process; cols: 4; both: 4; replicated: 1
            assert f"OK {rank} {url} 10 reads" in log, log[-2000:]


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4]))
