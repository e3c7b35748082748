"""W=4 spawned writer processes; plain Orbax restores the result bit-exactly on several meshes.

The writers import numpy + tensorstore only. Restores use nothing but
`ocp.StandardCheckpointer().restore(path, abstract)` with an `optax.adamw(...).init` template.
"""

import multiprocessing as mp
import os

import ml_dtypes
import numpy as np
import pytest

from bridge.layout.boxes import Box
from bridge.layout.chunks import ArrayOwnership
from bridge.store import (ArraySpec, CheckpointWriter, Manifest, adamw_empty_paths, begin_checkpoint, finalize,
                          make_write_plan, open_checkpoint)

W = 4
SPECIAL32 = np.array([np.nan, -np.nan, np.inf, -np.inf, -0.0, 0.0, 1e-45, -1e-40, 1.17e-38, 3.4e38], np.float32)


def _with_specials(a: np.ndarray) -> np.ndarray:
    """Put NaN (incl. a payload NaN), +-Inf, -0.0 and subnormals at the start of an array."""
    flat = a.reshape(-1)
    with np.errstate(over="ignore"):  # 3.4e38 -> inf in fp16 is intended
        sp = SPECIAL32.astype(a.dtype)
    n = min(flat.size, sp.size)
    flat[:n] = sp[:n]
    if a.dtype == np.float32 and flat.size > n:
        flat[n:n + 1] = np.array([0x7FC00123], np.uint32).view(np.float32)  # NaN with payload
    return a


def tree_data() -> dict:
    """The logical tree (deterministic): params fp32, adam mu/nu, model bf16/fp16/int32, step."""
    rng = np.random.default_rng(1234)
    shapes = {"w": (24, 16), "b": (13,), "e3": (4, 6, 10), "s0": ()}
    out = {}
    for k, s in shapes.items():
        p = _with_specials(rng.standard_normal(s).astype(np.float32) if s else np.array(rng.standard_normal(), np.float32))
        out[("params", k)] = p
        out[("opt_state", "0", "mu", k)] = _with_specials((rng.standard_normal(s) * 1e-3).astype(np.float32))
        out[("opt_state", "0", "nu", k)] = np.abs(rng.standard_normal(s)).astype(np.float32) * 0  # all zeros: fill value
    out[("opt_state", "0", "count")] = np.array(5, np.int32)
    out[("model", "w")] = _with_specials(rng.standard_normal((24, 16)).astype(ml_dtypes.bfloat16))
    out[("model", "h")] = _with_specials(rng.standard_normal((9, 5)).astype(np.float16))
    out[("model", "ids")] = rng.integers(-2**31, 2**31 - 1, (7, 3), dtype=np.int64).astype(np.int32)
    out[("step",)] = np.array(5, np.int32)
    return out


def make_plan():
    data = tree_data()
    catalog = [ArraySpec(p, a.shape, a.dtype.name) for p, a in data.items()]
    rng = np.random.default_rng(7)
    # Uneven 2-D chunk grid with scattered owners for the big matrices; default plan elsewhere.
    own = {}
    for p in [("params", "w"), ("opt_state", "0", "mu", "w"), ("model", "w")]:
        own[p] = ArrayOwnership((24, 16), (5, 6), rng.integers(0, W, (5, 3)).astype(np.int32))
    own[("params", "e3")] = ArrayOwnership((4, 6, 10), (3, 4, 10), np.array([[[0], [1]], [[2], [3]]], np.int32))
    return make_write_plan(catalog, W, own, empty_paths=adamw_empty_paths()), data


def writer_main(dst: str, writer_id: int) -> None:
    """One writer process: write owned chunks in two halves each (partial-chunk writes), then finalize."""
    from bridge.store.claim import tmp_dir_for

    plan, data = make_plan()
    w = CheckpointWriter(tmp_dir_for(dst), plan, writer_id, batch_bytes=2048)
    for name, ap in plan.arrays.items():
        full = data[ap.spec.path]
        for box in ap.ownership.boxes_owned_by(writer_id):
            if box.ndim and box.shape[0] > 1:
                mid = box.start[0] + box.shape[0] // 2
                parts = [Box(box.start, (mid,) + box.stop[1:]), Box((mid,) + box.start[1:], box.stop)]
            else:
                parts = [box]
            for part in parts:
                w.write(ap.spec.path, part, np.array(full[part.slices]))  # np.array keeps 0-d
    w.finish()
    finalize(dst, plan, writer_id, Manifest(), timeout=60)
    import sys

    assert "jax" not in sys.modules and "torch" not in sys.modules, "writers must need neither JAX nor torch"


def write_with_processes(dst: str) -> None:
    begin_checkpoint(dst)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=writer_main, args=(dst, w)) for w in range(W)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0] * W


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    dst = str(tmp_path_factory.mktemp("mw") / "ckpt")
    write_with_processes(dst)
    return dst


def _bits(a) -> bytes:
    return np.asarray(a).tobytes()


@pytest.mark.slow
def test_four_writers_read_back_bit_exact_with_digests(written):
    data = tree_data()
    ck = open_checkpoint(written)
    assert set(ck.paths()) == set(data)
    assert sorted(ck.empty_paths) == adamw_empty_paths()
    for p, a in data.items():
        got = ck.read(p)
        assert got.dtype == a.dtype and got.shape == a.shape and _bits(got) == _bits(a), p
    assert sorted(os.listdir(written)) == sorted(["_CHECKPOINT_METADATA", "_METADATA", "_sharding", "commit_success.txt", "d",
                                                  "manifest.ocdbt"] + [f"ocdbt.process_{w}" for w in range(W)])


@pytest.mark.slow
def test_plain_orbax_restores_on_meshes_and_one_device_bit_exact(written):
    import jax
    import jax.numpy as jnp
    import optax
    import orbax.checkpoint as ocp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, SingleDeviceSharding

    data = tree_data()
    assert len(jax.devices()) == 8
    params = {k[1]: jnp.asarray(v) for k, v in data.items() if k[0] == "params"}
    template = {
        "params": jax.eval_shape(lambda: params),
        "opt_state": jax.eval_shape(optax.adamw(1e-3).init, params),
        "model": {k[1]: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in data.items() if k[0] == "model"},
        "step": jax.ShapeDtypeStruct((), jnp.int32),
    }
    devs = np.array(jax.devices())
    layouts = [
        (Mesh(devs.reshape(2, 4), ("data", "model")),
         {(24, 16): P("data", "model"), (4, 6, 10): P(None, "data", None), (13,): P(), (9, 5): P()}),
        (Mesh(devs.reshape(8), ("fsdp",)),
         {(24, 16): P("fsdp"), (4, 6, 10): P(None, None, None), (13,): P(), (9, 5): P()}),
        (Mesh(devs[::-1].reshape(4, 2), ("a", "b")),
         {(24, 16): P("b", "a"), (4, 6, 10): P("a", "b", None), (13,): P(), (9, 5): P()}),
    ]

    def check(restored):
        flat = {}
        for kp, leaf in jax.tree_util.tree_leaves_with_path(restored):
            path = tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in kp)
            flat[path] = leaf
        assert isinstance(restored["opt_state"][0], optax.ScaleByAdamState)
        assert isinstance(restored["opt_state"][1], optax.EmptyState)
        assert set(flat) == set(data), set(flat) ^ set(data)
        for p, a in data.items():
            got = np.asarray(jax.device_get(flat[p]))
            assert got.dtype == a.dtype and _bits(got) == _bits(a), p

    ck = ocp.StandardCheckpointer()
    for mesh, rule in layouts:
        def with_sharding(x, mesh=mesh, rule=rule):
            spec = rule.get(tuple(x.shape), P())
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))
        restored = ck.restore(written, jax.tree.map(with_sharding, template))
        check(restored)
        w = restored["params"]["w"]
        assert len({s.device for s in w.addressable_shards}) == 8
    one = SingleDeviceSharding(jax.devices()[3])
    check(ck.restore(written, jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one), template)))


def _dist_writer(dst: str, rank: int, world: int, port: int) -> None:
    """torch.distributed (gloo) rank: begin + write + finalize use the process group as barrier."""
    import torch.distributed as dist

    from bridge.dist import TorchCoordinator

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        coord = TorchCoordinator(dist.group.WORLD)
        plan, data = make_plan_for(world)
        claim = begin_checkpoint(dst, coordinator=coord)
        w = CheckpointWriter(claim.tmp, plan, rank)
        for ap in plan.arrays.values():
            for box in ap.ownership.boxes_owned_by(rank):
                w.write(ap.spec.path, box, np.array(data[ap.spec.path][box.slices]))
        w.finish()
        assert finalize(claim, plan, rank, Manifest(), coordinator=coord) == os.path.abspath(dst)
        assert os.path.isdir(dst)          # every rank sees the committed checkpoint
    finally:
        dist.destroy_process_group()


def make_plan_for(world: int):
    data = {k: v for k, v in tree_data().items() if k[0] != "model"}
    catalog = [ArraySpec(p, a.shape, a.dtype.name) for p, a in data.items()]
    return make_write_plan(catalog, world, empty_paths=adamw_empty_paths()), data


@pytest.mark.slow
def test_torch_distributed_barrier_commit(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dst = str(tmp_path / "ckpt")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_dist_writer, args=(dst, r, 2, port)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0]
    _, data = make_plan_for(2)
    ck = open_checkpoint(dst)
    for p, a in data.items():
        assert ck.read(p).tobytes() == a.tobytes(), p
