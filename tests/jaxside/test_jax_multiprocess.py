"""Multi-process JAX (jax.distributed, 2 processes x 4 CPU devices): restore, step, save back.

Each process must read only its addressable shards (TensorStore byte counters) and hold exactly the
stored values; the checkpoint both processes save must equal a single-process computation.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/
sys.path.insert(0, os.path.join(HERE, "support"))
from servers import free_port  # noqa: E402


def _worker(rank: int, world: int, port: int, src: str, dst: str, out: str) -> None:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=world, process_id=rank)
    import jax.numpy as jnp
    import optax
    import tensorstore as ts
    from jax.sharding import Mesh

    sys.path.insert(0, os.path.join(HERE, "support"))
    from bridge.jaxside.keypaths import leaves_by_path
    from bridge.jaxside.manifest_view import optimizer_from_manifest
    from bridge.jaxside.restore import restore
    from bridge.jaxside.save import save
    from jax_checkpoints import bits, read_with_tensorstore, tiny_manifest

    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("fsdp", "tp"))
    tx = optimizer_from_manifest(tiny_manifest())
    abstract = _abstract_params(src)

    def bytes_read() -> int:
        return sum(int(v.get("value", 0)) for m in ts.experimental_collect_matching_metrics("/tensorstore/kvstore/")
                   if m["name"].endswith("/bytes_read") for v in m["values"])

    before = bytes_read()
    r = restore(src, mesh=mesh, optimizer=jax.eval_shape(tx.init, abstract))
    read = bytes_read() - before
    checked = 0
    for prefix, tree in (("params",), r.params), (("opt_state", "0", "mu"), r.opt_state[0].mu):
        for p, a in leaves_by_path(tree).items():
            ref = read_with_tensorstore(src, prefix + p)
            for shard in a.addressable_shards:
                assert np.array_equal(bits(shard.data), bits(ref[shard.index])), (rank, p)
                checked += 1
    # a naming map (transposed, unstacked) restores across processes too: transforms run under jit
    from bridge.jaxside.naming import NamingMap, Transpose, Unstack

    nm = NamingMap([Unstack("decoder/layers/*"), Transpose("*/linear_fc2/weight")])
    rn = restore(src, mesh=mesh, naming=nm, items=("params",))
    fc2 = read_with_tensorstore(src, ("params", "decoder", "layers", "mlp", "linear_fc2", "weight"))
    got = rn.params["decoder"]["layers"]["1"]["mlp"]["linear_fc2"]["weight"]
    for shard in got.addressable_shards:
        assert np.array_equal(bits(shard.data), bits(fc2[1].T[shard.index])), (rank, shard.index)
        checked += 1
    grads = jax.tree.map(lambda x: jnp.full_like(x, 1e-3), r.params)
    upd, state = jax.jit(tx.update)(grads, r.opt_state, r.params)
    params = optax.apply_updates(r.params, upd)
    save(dst, params=params, opt_state=state, step=r.step + 1, manifest=r.manifest)
    with open(out, "w") as f:
        json.dump({"rank": rank, "bytes_read": read, "checked_shards": checked,
                   "local_devices": len(jax.local_devices())}, f)


def _abstract_params(src: str):
    import jax
    import jax.numpy as jnp

    from bridge.jaxside.abstract import PARAMS, stored_arrays
    from bridge.jaxside.keypaths import nested_from_paths

    return nested_from_paths({p: jax.ShapeDtypeStruct(a.shape, jnp.float32)
                              for p, a in stored_arrays(src).section(PARAMS).items()})



@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_process_restore_step_save(tmp_path):
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import Mesh

    from bridge.cli import main as cli_main
    from bridge.jaxside.keypaths import leaves_by_path
    from bridge.jaxside.manifest_view import optimizer_from_manifest
    from bridge.jaxside.restore import restore
    from bridge.store.reader import open_checkpoint
    from jax_checkpoints import bits, logical_state, tiny_manifest, tiny_params, write_store_checkpoint

    params = dict(tiny_params(0))
    # one array large enough (16 MiB) that the store's inner chunks are smaller than a process's half
    params[("decoder", "big", "weight")] = np.random.default_rng(5).standard_normal((2048, 2048)).astype(np.float32)
    arrays = logical_state(params, step=100, model=False)
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    write_store_checkpoint(src, arrays, tiny_manifest(100), num_writers=2)
    port = free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")]))
    env.pop("XLA_FLAGS", None)
    procs = [subprocess.Popen([sys.executable, __file__, str(rank), "2", str(port), src, dst,
                               str(tmp_path / f"r{rank}.json")], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for rank in range(2)]
    logs = [p.communicate(timeout=280)[0].decode(errors="replace") for p in procs]
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]
    results = [json.load(open(tmp_path / f"r{rank}.json")) for rank in range(2)]
    total = sum(a.nbytes for p, a in arrays.items() if p[0] in ("params", "opt_state"))
    print("bytes read per process:", [r["bytes_read"] for r in results], "of", total)
    for res in results:
        assert res["local_devices"] == 4 and res["checked_shards"] > 0
        # each process reads its own half of the big arrays (+ small ones and metadata), never everything
        assert res["bytes_read"] < 0.65 * total, (res, total)

    # single-process reference of the same step (same XLA CPU element-wise ops -> bit-identical)
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("fsdp", "tp"))
    tx = optimizer_from_manifest(tiny_manifest())
    r = restore(src, mesh=mesh, optimizer=jax.eval_shape(tx.init, _abstract_params(src)))
    grads = jax.tree.map(lambda x: jnp.full_like(x, 1e-3), r.params)
    upd, state = jax.jit(tx.update)(grads, r.opt_state, r.params)
    params = optax.apply_updates(r.params, upd)
    ck = open_checkpoint(dst)
    nu = leaves_by_path(state[0].nu)
    for p, a in leaves_by_path(params).items():
        assert np.array_equal(bits(ck.read(("params",) + p)), bits(a)), p
        assert np.array_equal(bits(ck.read(("opt_state", "0", "nu") + p)), bits(nu[p])), p
    assert int(ck.read(("opt_state", "0", "count"))) == 101 and int(ck.read(("step",))) == 101
    assert ck.manifest.source.world_size == 2
    assert cli_main(["verify", dst]) == 0


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5], sys.argv[6])
