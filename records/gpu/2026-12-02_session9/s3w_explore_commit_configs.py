"""Exploration (s3w, session 9; run from the repository root with PYTHONPATH=$PWD:$PWD/tests, MIB=512 REPS=4): store write configurations vs raw TensorStore, same moto server, A B B A reps.
config = inflight_MiB,commit_depth,donate[,databases]  (databases > 1: that many writers, concurrent threads)."""
import time, sys, os, statistics, numpy as np
from concurrent.futures import ThreadPoolExecutor
from servers import S3Server, environ
from benchmarks.bench_remote import make_arrays, raw_write, delete_all, CountingProxy
import bridge.store.commit as C, bridge.store.writer as W
from bridge.store.claim import claim_destination
from bridge.store.plan import make_write_plan
from bridge.store import specs

def save(dst, arrays, inflight, depth, donate=0, dbs=1):
    catalog = C.catalog_of(arrays)
    plan = make_write_plan(catalog, dbs, max_chunk_bytes=specs.max_chunk_bytes(dst))
    data = {spec.name: np.asarray(a) for spec, a in zip(catalog, arrays.values())}
    with claim_destination(dst) as claim:
        def one(w):
            wr = W.CheckpointWriter(claim.tmp, plan, w, inflight_bytes=inflight, commit_depth=depth)
            for name, ap in plan.arrays.items():
                for box in ap.ownership.boxes_owned_by(w):
                    wr.write(name, box, data[name][box.slices], donate=bool(donate))
            return wr.finish(publish=False)
        if dbs == 1:
            reps = [one(0)]
        else:
            with ThreadPoolExecutor(dbs) as pool:
                reps = list(pool.map(one, range(dbs)))
        return C.commit_checkpoint(dst, plan, None, timeout=10.0, claim=claim, reports=reps)

def summary(events, t0, t1, big=1 << 20):
    data = [e for e in events if e[4] >= big]
    if not data:
        return f"no data PUTs, end {t1 - t0:.3f}"
    first, last = min(e[0] for e in data) - t0, max(e[1] for e in data) - t0
    before = sum(1 for e in events if e[4] < big and e[0] - t0 < first)
    after = sum(1 for e in events if e[4] < big and e[0] - t0 >= last)
    return (f"first data PUT +{first:.3f}, last data PUT ends +{last:.3f}, end +{t1 - t0:.3f}; "
            f"{len(data)} data PUTs, {len(events)} requests; {before} small before, {after} small after the data")

mib = float(os.environ.get("MIB", 256)); reps = int(os.environ.get("REPS", 4))
configs = [tuple(map(int, c.split(","))) for c in sys.argv[1:]]
res = {c: [] for c in configs}
with S3Server(memory_objects=True) as srv, environ(**srv.env):
    arrays = make_arrays(mib, 16)
    save(srv.url("w/warm"), make_arrays(1, 2), 1 << 30, 1)
    raw_write(srv.url("w/warmraw"), make_arrays(1, 2))
    for rep in range(reps):
        order = configs + [None] if rep % 2 == 0 else [None] + configs[::-1]
        t = {}
        for c in order:
            u = srv.url(f"w/{rep}/{c}".replace(" ", "").replace(",", "_").replace("(", "").replace(")", ""))
            t0 = time.perf_counter()
            if c is None: raw_write(u, arrays)
            else: save(u, arrays, c[0] << 20, c[1], *c[2:])
            t[c] = time.perf_counter() - t0
            delete_all(u)
        for c in configs: res[c].append(t[None] / t[c])
        print(rep, {str(c): round(t[None] / t[c], 2) for c in configs}, "raw s", round(t[None], 3), flush=True)
    for c in configs:
        print(c, "median ratio", round(statistics.median(res[c]), 3), "range", round(min(res[c]), 2), round(max(res[c]), 2), flush=True)
    proxy = CountingProxy(srv.endpoint)
    with environ(AWS_ENDPOINT_URL=proxy.url):
        for c in [None] + configs:
            u = srv.url(f"p/{c}".replace(" ", "").replace(",", "_").replace("(", "").replace(")", ""))
            proxy.take_events()
            t0 = time.perf_counter()
            if c is None: raw_write(u, arrays)
            else: save(u, arrays, c[0] << 20, c[1], *c[2:])
            t1 = time.perf_counter()
            print("timeline", c or "raw", summary(proxy.take_events(), t0, t1), flush=True)
            delete_all(u)
