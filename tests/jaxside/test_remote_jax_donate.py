"""JAX save to S3 hands its host blocks to the writer without a copy only where they are its own.

The save (`bridge.jaxside.save_io.write_tree`) donates the host blocks of jax.Arrays (views of an immutable buffer, or the save's
own device-to-host copy) and lets the writer copy a numpy leaf (the caller's live buffer). Saved
from 8-device CPU meshes to a local S3 server (moto); the stored arrays, read with plain
TensorStore (no bridge reader), equal the reference tree bit for bit, and the caller's arrays are
unchanged. The writer's `write` calls are recorded (the real writer runs): jax leaves donated, no
donated block sharing memory with the caller's numpy leaf.
"""

from __future__ import annotations

import os
import sys

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "support"))  # tests/support: shared helpers
from jax_checkpoints import bits, logical_state, tiny_manifest, tiny_params, write_store_checkpoint  # noqa: E402
from servers import S3Server, environ  # noqa: E402

from bridge import _testing  # noqa: E402
from bridge.jaxside.keypaths import leaves_by_path  # noqa: E402


def _read(url: str, path: tuple) -> np.ndarray:
    import tensorstore as ts

    from bridge.store import kvstore

    spec = {"driver": "zarr3", "kvstore": {"driver": "ocdbt", "base": kvstore.base_kvstore(url),
                                           "path": ".".join(path) + "/"}}
    return np.asarray(ts.open(spec, open=True).result().read().result())


@pytest.mark.slow
def test_save_to_s3_donates_only_its_own_blocks_and_stores_exact(tmp_path):
    from bridge.jaxside.restore import restore
    from bridge.jaxside.save import save
    from bridge.store.writer import CheckpointWriter

    arrays = logical_state(tiny_params(0), step=100)
    src = write_store_checkpoint(str(tmp_path / "src"), arrays, tiny_manifest(100))
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("fsdp", "tp"))
    r = restore(src, mesh=mesh)
    leaves, treedef = jax.tree_util.tree_flatten(r.params)
    live = leaves[0] = np.array(jax.device_get(leaves[0]))  # the caller's own, mutable buffer
    params = jax.tree_util.tree_unflatten(treedef, leaves)
    before = {p: np.array(jax.device_get(a)) for p, a in leaves_by_path(params).items()}

    calls = []

    class Recording(CheckpointWriter):  # the real writer, its write calls recorded
        def write(self, path, box, data, *, donate=False):
            calls.append((path, donate, np.shares_memory(data, live)))
            return super().write(path, box, data, donate=donate)

    with S3Server() as srv, environ(**srv.env):
        url = srv.url("jax/donated")
        with _testing.seams(writer_class=Recording):
            save(url, params=params, opt_state=r.opt_state, step=r.step, model=r.model, manifest=r.manifest)
        for path, want in arrays.items():
            got = _read(url, path)
            assert got.dtype == want.dtype and np.array_equal(bits(got), bits(want)), path
    after = {p: np.array(jax.device_get(a)) for p, a in leaves_by_path(params).items()}
    assert all(np.array_equal(bits(after[p]), bits(before[p])) for p in before)
    assert any(d for _, d, _ in calls), "no jax.Array block was donated"
    assert any(s for _, _, s in calls), "the numpy leaf was not written from the caller's buffer"
    assert not any(d and s for _, d, s in calls), "the caller's numpy buffer was donated"
