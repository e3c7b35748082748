"""Bytes stored / logical bytes when a CheckpointWriter has 1 or 2 commits in flight (s3w, session 9).

The converter-shaped load of tests/test_store_writer_scale.py (fp32 master, two moments and a bf16
copy per parameter; 110 MB), written by one writer in batches of 8 or 12 MiB, on a local directory
and on a local S3 server (moto), every chunk whole in one write (`--pieces`: in slabs of one batch,
as the test does). Run from the repository root: PYTHONPATH=$PWD python3 <this file> [--pieces]
"""
import os
import shutil
import sys
import tempfile

import numpy as np

sys.path.insert(0, "tests")
import test_store_writer_scale as T  # noqa: E402
from servers import S3Server, environ  # noqa: E402

from bridge.store.claim import claim_destination  # noqa: E402
from bridge.store.commit import commit_checkpoint  # noqa: E402
from bridge.store.writer import CheckpointWriter  # noqa: E402


def write(dst: str, batch: int, depth: int, donate: bool, pieces: bool) -> None:
    src, plan = T._sources(), T._plan(1)
    keep = []
    with claim_destination(dst) as claim:
        w = CheckpointWriter(claim.tmp, plan, 0, inflight_bytes=batch, commit_depth=depth)
        for param in T.PARAMS:
            aps = [plan.lookup(T._path(role, param)) for role in T.ROLES]
            row = src[aps[0].spec.path][:1].nbytes
            for chunk in aps[0].ownership.boxes_owned_by(0):
                for box in (T._pieces(chunk, row, batch) if pieces else [chunk]):
                    for ap in aps:
                        buf = np.array(src[ap.spec.path][box.slices], order="C")
                        keep.append(buf)
                        w.write(ap.spec.path, box, buf, donate=donate)
        commit_checkpoint(dst, plan, reports=[w.finish(publish=False)], claim=claim)


def main() -> None:
    pieces = "--pieces" in sys.argv
    logical = sum(a.nbytes for a in T._sources().values())
    runs = [(b << 20, d, donate) for d in (1, 2) for b in (8, 12) for donate in (False, True)]
    tmp = tempfile.mkdtemp(prefix="s3w_dup_")
    try:
        for batch, depth, donate in runs:
            dst = os.path.join(tmp, f"{batch >> 20}_{depth}_{int(donate)}")
            write(dst, batch, depth, donate, pieces)
            print(f"local  batch {batch >> 20:2d} MiB, commit_depth {depth}, donate {int(donate)}: stored / logical "
                  f"{T._disk_bytes(dst) / logical:.3f}", flush=True)
            shutil.rmtree(dst)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    with S3Server(memory_objects=True) as srv, environ(**srv.env):
        c = srv.client()
        for batch, depth, donate in runs:
            key = f"dup/{batch >> 20}_{depth}_{int(donate)}"
            write(srv.url(key), batch, depth, donate, pieces)
            stored = sum(o["Size"] for page in c.get_paginator("list_objects_v2").paginate(
                Bucket=srv.buckets[0], Prefix=key + "/ocdbt.process_") for o in page.get("Contents", []))
            print(f"s3     batch {batch >> 20:2d} MiB, commit_depth {depth}, donate {int(donate)}: stored / logical "
                  f"{stored / logical:.3f}", flush=True)


if __name__ == "__main__":
    main()
