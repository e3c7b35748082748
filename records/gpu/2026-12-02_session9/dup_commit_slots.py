"""Stored / logical bytes of one CheckpointWriter (tests/test_store_writer_scale.py load, chunks whole) at 1 or 2
commits in flight, local disk. From the repository root: PYTHONPATH=$PWD python3 <this file>; with
TENSORSTORE_VERBOSE_LOGGING=ocdbt on stderr, count the lines "Manifest written: OK, success=false" (lost races)."""
import os, shutil, sys, tempfile
import numpy as np
sys.path.insert(0, "tests")
import test_store_writer_scale as T
from bridge.store.claim import claim_destination
from bridge.store.commit import commit_checkpoint
from bridge.store.writer import CheckpointWriter

def write(dst, batch, depth, params=None, **kw):
    src, plan = T._sources(), T._plan(1)
    with claim_destination(dst) as claim:
        w = CheckpointWriter(claim.tmp, plan, 0, inflight_bytes=batch, commit_depth=depth, **kw)
        for param in (params or T.PARAMS):
            aps = [plan.lookup(T._path(role, param)) for role in T.ROLES]
            for chunk in aps[0].ownership.boxes_owned_by(0):
                for ap in aps:
                    w.write(ap.spec.path, chunk, np.array(src[ap.spec.path][chunk.slices], order="C"))
        rep = w.finish(publish=False)
        ds = [os.path.join(claim.tmp, x, "d") for x in os.listdir(claim.tmp) if x.startswith("ocdbt.process_0")]
        stored = sum(T._disk_bytes(d) for d in ds); n = sum(len(os.listdir(d)) for d in ds); issued = w._issued
        commit_checkpoint(dst, plan, reports=[rep], claim=claim)
    logical = sum(src[ap.spec.path].nbytes for param in (params or T.PARAMS) for ap in [plan.lookup(T._path(r, param)) for r in T.ROLES])
    return stored / logical, n, issued

if __name__ == "__main__":
    tmp = tempfile.mkdtemp(prefix="r2_")
    for i, (batch, depth) in enumerate([(8, 1), (8, 2), (12, 2), (8, 2)]):
        r = write(os.path.join(tmp, str(i)), batch << 20, depth)
        print(batch, depth, "stored/logical %.3f files %d commits %d" % r, flush=True)
    shutil.rmtree(tmp)
