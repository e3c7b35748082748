"""A B B A: jaxside save_remote to moto with the host blocks copied (A, the code before) or donated (B)."""
import os, sys, time, statistics
sys.path.insert(0, "tests")
import numpy as np, jax, jax.numpy as jnp
from servers import S3Server, environ
from bridge.format.manifest import Manifest
from bridge.jaxside.remote import save_remote
from bridge.store.writer import CheckpointWriter

MIB = int(os.environ.get("MIB", "256")); N = 8
real = CheckpointWriter.write
mode = {"copy": False}
def write(self, path, box, data, *, donate=False):
    return real(self, path, box, data, donate=False if mode["copy"] else donate)
CheckpointWriter.write = write
rng = np.random.default_rng(0)
tree = {"params": {f"w{i}": jnp.asarray(rng.standard_normal((MIB << 20) // N // 4, dtype=np.float32).reshape(-1, 256)) for i in range(N)}}
jax.block_until_ready(tree)
times = {"A": [], "B": []}
with S3Server(memory_objects=True) as srv, environ(**srv.env):
    c = srv.client()
    k = 0
    for rep in range(int(os.environ.get("REPS", "2"))):
        for v in "ABBA":
            mode["copy"] = v == "A"
            url = srv.url(f"b/{k}"); k += 1
            t = time.perf_counter(); save_remote(url, tree, Manifest()); dt = time.perf_counter() - t
            times[v].append(dt)
            keys = [o["Key"] for p in c.get_paginator("list_objects_v2").paginate(Bucket=srv.buckets[0], Prefix=f"b/{k-1}/") for o in p.get("Contents", [])]
            for i in range(0, len(keys), 1000):
                c.delete_objects(Bucket=srv.buckets[0], Delete={"Objects": [{"Key": x} for x in keys[i:i+1000]]})
            print(v, f"{dt:.2f} s", flush=True)
ma, mb = statistics.median(times["A"]), statistics.median(times["B"])
print(f"{MIB} MiB, {len(times['A'])} pairs: copied (A) median {ma:.2f} s = {MIB/ma:.0f} MiB/s, donated (B) {mb:.2f} s = {MIB/mb:.0f} MiB/s, B/A speed {ma/mb:.2f}x; pairs A/B {[round(a/b, 2) for a, b in zip(times['A'], times['B'])]}")
