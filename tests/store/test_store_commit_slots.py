"""A writer with two commits in flight stores each logical byte once, on disk and on S3.

Two TensorStore transactions committing into one OCDBT database race for its manifest; the
loser's retry writes all its values again into new data files, the first copy left unreferenced
(1.1-1.4x the logical bytes stored with this load). The writer therefore commits transaction i
into the database of slot i mod `commit_depth` (`ocdbt.process_<w>.<s>`), merged at the commit.
The load: tests/store/test_store_writer_scale.py's converter-shaped one (fp32 master, two moments, a
bf16 copy per parameter, 110 MB in chunks of 3-13 MB), every chunk whole in one write, batches
of 8 MiB. Stored bytes are
every file / object under the checkpoint (listed by boto3 on S3), the logical bytes the sources'
own sizes; the checkpoint reads back equal (plain TensorStore on the root database).
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "support"))  # tests/support: shared helpers
from servers import S3Server, environ  # noqa: E402

import test_store_writer_scale as scale  # noqa: E402  (its converter-shaped load)


def _sources() -> dict:
    return scale._sources()


def _write(dst: str, src: dict, depth: int, donate: bool) -> None:
    from bridge.store.claim import claim_destination
    from bridge.store.commit import commit_checkpoint
    from bridge.store.writer import CheckpointWriter

    plan = scale._plan(1)
    with claim_destination(dst) as claim:
        w = CheckpointWriter(claim.tmp, plan, 0, batch_bytes=8 << 20, commit_depth=depth)
        for param in scale.PARAMS:
            for chunk in plan.lookup(scale._path("params", param)).ownership.boxes_owned_by(0):
                for role in scale.ROLES:
                    path = scale._path(role, param)
                    w.write(path, chunk, np.array(src[path][chunk.slices]), donate=donate)
        report = w.finish(publish=False)
        assert w._issued >= 8
        commit_checkpoint(claim, plan, reports=[report])


def _read_back(dst: str, src: dict) -> None:
    import tensorstore as ts

    from bridge.store import kvstore

    for path, a in src.items():
        spec = {"driver": "zarr3", "kvstore": {"driver": "ocdbt", "base": kvstore.base_kvstore(dst),
                                               "path": ".".join(path) + "/"}}
        got = ts.open(spec, open=True, read=True).result().read().result()
        assert np.array_equal(got.view(np.uint8), a.view(np.uint8)), path


def _check(stored: int, src: dict) -> None:
    logical = sum(a.nbytes for a in src.values())
    assert logical <= stored < logical * 1.01 + (64 << 10), (stored, logical, stored / logical)


@pytest.mark.slow
@pytest.mark.parametrize("depth,donate", [(2, False), (2, True), (3, False)])
def test_commits_in_flight_store_each_byte_once_on_disk(tmp_path, depth, donate):
    src = _sources()
    dst = str(tmp_path / "ck")
    _write(dst, src, depth, donate)
    _check(sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(dst) for f in fs), src)
    assert sorted(n for n in os.listdir(dst) if n.startswith("ocdbt.")) == \
        ["ocdbt.process_0"] + [f"ocdbt.process_0.{s}" for s in range(1, depth)]
    _read_back(dst, src)
    if depth == 2 and not donate:
        _orbax_restores(dst, src)


def _orbax_restores(dst: str, src: dict) -> None:
    """Plain Orbax restores the checkpoint whose root database references the slot databases."""
    import orbax.checkpoint as ocp

    abstract: dict = {}
    for path, a in src.items():
        node = abstract
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = np.empty(a.shape, a.dtype)
    abstract["opt_state"] = [abstract["opt_state"]["0"]]  # Orbax restores the "0" level as a list
    got = ocp.StandardCheckpointer().restore(dst, abstract)
    for path, a in src.items():
        node = got
        for k in path:
            node = node[int(k)] if isinstance(node, list) else node[k]
        assert np.array_equal(np.asarray(node).view(np.uint8), a.view(np.uint8)), path


@pytest.mark.slow
def test_commits_in_flight_store_each_byte_once_on_s3():
    src = _sources()
    with S3Server(memory_objects=True) as srv, environ(**srv.env):
        dst = srv.url("slots/ck")
        _write(dst, src, 2, False)
        pages = srv.client().get_paginator("list_objects_v2").paginate(Bucket=srv.buckets[0], Prefix="slots/ck/")
        _check(sum(o["Size"] for page in pages for o in page.get("Contents", [])), src)
        _read_back(dst, src)
