"""The store on object storage vs raw TensorStore kvstore I/O of the same bytes, same local server, one run.

    python benchmarks/bench_remote.py --mib 256 --reps 3 --server s3

A local S3 server (moto) or GCS emulator (fake-gcs-server) is started on 127.0.0.1 (tests/support/servers.py).
Variants, each on the same `--mib` MiB of fp32 in `--arrays` arrays:
  store_write  `save_checkpoint` to a fresh prefix: claim object, OCDBT databases of `--writers` writers,
               merge, metadata objects, `_METADATA` last (the whole commit)
  raw_write    plain TensorStore kvstore writes of the same bytes as objects of the store's OCDBT
               data-file size (16 MiB), all issued at once
  store_read   every array read back whole through the bridge's reader (threads over arrays)
  raw_read     the raw objects read back whole, all at once
After an untimed warm-up, reps are interleaved in A B B A order (store then raw, raw then store, ...),
so load that drifts during the run (a shared host) hits both sides alike. Reported: median MB/s; the
ratio store / raw as the median over reps of each rep's adjacent pair (and its range), which is what
to quote on a noisy host; the CPU seconds the client process and the server process spent per variant
(median; on a host where the server competes for the same cores, extra CPU is extra time). Then each variant runs
once more through a counting HTTP proxy in front of the server, which reports the requests per
checkpoint by kind (object stores bill per request) and per GiB, and the bytes moved each way. The last line, "SUMMARY {json}",
has the medians, ratios and counts for scripts.

The servers are single-process emulators on this host (moto keeps objects in memory here, as
fake-gcs-server's file backend keeps them in the page cache): absolute rates say little about a
cloud store, the ratios and request counts do.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import http.server
import json
import os
import statistics
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import parse_qs, urlsplit

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests", "support"))

COLS = 4096
RAW_OBJECT_BYTES = 16 << 20


def request_kind(method: str, target: str) -> str:
    """What an object-store HTTP request does, for billing-style counts (S3 and GCS JSON API).

    >>> request_kind("GET", "/bkt/a/b?list-type=2&prefix=a/"), request_kind("GET", "/bkt/a/b")
    ('LIST', 'GET')
    >>> request_kind("GET", "/storage/v1/b/bkt/o?prefix=a%2F"), request_kind("POST", "/upload/storage/v1/b/bkt/o")
    ('LIST', 'PUT')
    """
    path, _, query = target.partition("?")
    q = parse_qs(query)
    if method == "GET" and ("list-type" in q or (path.rstrip("/").endswith("/o") and "alt" not in q)):
        return "LIST"
    if method in ("PUT",) or (method == "POST" and path.startswith("/upload/")):
        return "PUT"
    if method == "POST" and "delete" in q:
        return "DELETE"
    return method


class CountingProxy:
    """An HTTP forwarder to `upstream` that counts requests by kind (thread-safe)."""

    def __init__(self, upstream: str) -> None:
        u = urlsplit(upstream)
        self.host, self.port = u.hostname, u.port
        self.counts: Counter = Counter()
        self.events: list[tuple[float, float, str, str, int]] = []  # (start, end, kind, key, bytes up)
        self.lock = threading.Lock()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            # headers and body go out as two writes: with Nagle's algorithm the body would wait for
            # the client's delayed ACK (40 ms on Linux), a stall of the proxy, not of the server
            disable_nagle_algorithm = True

            def log_message(self, *args) -> None:
                pass

            def _forward(self) -> None:
                t0 = time.perf_counter()
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n) if n else None
                kind = request_kind(self.command, self.path)
                with proxy.lock:
                    proxy.counts[kind] += 1
                    proxy.counts["bytes_up"] += n
                conn = http.client.HTTPConnection(proxy.host, proxy.port, timeout=120)
                headers = {k: v for k, v in self.headers.items() if k.lower() != "connection"}
                conn.request(self.command, self.path, body=body, headers=headers)
                r = conn.getresponse()
                data = r.read()
                with proxy.lock:
                    proxy.counts["bytes_down"] += len(data)
                self.send_response(r.status, r.reason)
                for k, v in r.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                conn.close()
                with proxy.lock:
                    proxy.events.append((t0, time.perf_counter(), kind, self.path.partition("?")[0], n))

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def take(self) -> dict:
        with self.lock:
            out = dict(self.counts)
            self.counts.clear()
            self.events.clear()
        return out

    def take_events(self) -> list[tuple[float, float, str, str, int]]:
        with self.lock:
            out = sorted(self.events)
            self.events.clear()
        return out

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def timeline(events, t0: float, t1: float, big: int = 1 << 20) -> list[str]:
    """A compact request timeline of one variant (seconds from its start `t0` to its end `t1`):
    small requests one a line, in order; the runs of large uploads / downloads (>= `big` bytes)
    each as one line (count, when the first started and the last ended, MiB).

    >>> ev = [(1.0, 1.1, "LIST", "/b/k", 0), (1.2, 2.0, "PUT", "/b/k/d/1", 2 << 20), (1.3, 2.2, "PUT", "/b/k/d/2", 2 << 20)]
    >>> timeline(ev, 1.0, 2.5)
    ['  +0.000 -> +0.100  LIST /b/k', '  +0.200 -> +1.200  2 x PUT (4 MiB)', '  end +1.500']
    """
    out, run = [], []

    def close_run() -> None:
        if run:
            out.append(f"  +{run[0][0] - t0:.3f} -> +{max(e[1] for e in run) - t0:.3f}  {len(run)} x {run[0][2]} "
                       f"({sum(e[4] for e in run) >> 20} MiB)")
            run.clear()

    for e in events:
        if e[4] >= big:
            run.append(e)
            continue
        close_run()
        out.append(f"  +{e[0] - t0:.3f} -> +{e[1] - t0:.3f}  {e[2]} {e[3]}")
    close_run()
    out.append(f"  end +{t1 - t0:.3f}")
    return out


def paired_ratio(raw: list[float], store: list[float]) -> float:
    """Median over reps of raw time / store time of the same rep (1.0: the store as fast as raw).

    >>> paired_ratio([1.0, 2.0, 1.0], [2.0, 2.0, 1.25])
    0.8
    """
    return round(statistics.median(r / s for r, s in zip(raw, store)), 3)


def ratio_range(raw: list[float], store: list[float]) -> list[float]:
    """[lowest, highest] per-rep ratio raw / store."""
    ratios = [r / s for r, s in zip(raw, store)]
    return [round(min(ratios), 3), round(max(ratios), 3)]


class CpuClock:
    """Wall time and CPU seconds (user + system) of this process and of the server process (Linux
    /proc; the server's CPU reads 0 elsewhere)."""

    def __init__(self, server_pid: int) -> None:
        self.stat = f"/proc/{server_pid}/stat"
        self.tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    def _server(self) -> float:
        try:
            with open(self.stat) as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            return 0.0
        return (int(fields[11]) + int(fields[12])) / self.tick  # utime, stime

    @contextlib.contextmanager
    def timed(self, walls: list, cpus: list):
        c0, s0, t0 = time.process_time(), self._server(), time.perf_counter()
        yield
        walls.append(time.perf_counter() - t0)
        cpus.append((time.process_time() - c0, self._server() - s0))


def make_arrays(mib: float, n: int) -> dict[str, np.ndarray]:
    rows = max(1, int(mib * (1 << 20) / 4 / COLS / n))
    rng = np.random.default_rng(0)
    return {f"params/layer{i}/w": rng.random((rows, COLS), dtype=np.float32) for i in range(n)}


def store_write(url: str, arrays, writers: int) -> None:
    from bridge.store.commit import save_checkpoint

    save_checkpoint(url, arrays, num_writers=writers)


def store_read(url: str, arrays) -> None:
    from bridge.store.reader import open_checkpoint

    ck = open_checkpoint(url)
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda k: ck.read(tuple(k.split("/"))), arrays))
    assert all(g.shape == arrays[k].shape for g, k in zip(got, arrays))


def _raw_pieces(arrays):
    for name, a in arrays.items():
        flat = a.reshape(-1).view(np.uint8)
        for j, lo in enumerate(range(0, flat.size, RAW_OBJECT_BYTES)):
            yield f"{name}/{j}", flat[lo:lo + RAW_OBJECT_BYTES]


def raw_write(url: str, arrays) -> None:
    import tensorstore as ts

    from bridge.store.kvstore import base_kvstore

    kv = ts.KvStore.open(base_kvstore(url)).result()
    futs = [kv.write(key, piece.tobytes()) for key, piece in _raw_pieces(arrays)]
    for f in futs:
        f.result()


def raw_read(url: str, arrays) -> None:
    import tensorstore as ts

    from bridge.store.kvstore import base_kvstore

    kv = ts.KvStore.open(base_kvstore(url)).result()
    keys = [key for key, _ in _raw_pieces(arrays)]
    futs = [kv.read(k) for k in keys]
    assert all(len(f.result().value) > 0 for f in futs)


def delete_all(url: str) -> None:
    from bridge.store.kvstore import delete_prefix

    delete_prefix(url)


def run(server: str, mib: float, n_arrays: int, reps: int, writers: int, show_timeline=()) -> dict:
    from servers import S3Server, GcsServer, environ

    arrays = make_arrays(mib, n_arrays)
    nbytes = sum(a.nbytes for a in arrays.values())
    make_server = (lambda: S3Server(memory_objects=True)) if server == "s3" else GcsServer
    times: dict[str, list[float]] = {v: [] for v in ("store_write", "raw_write", "store_read", "raw_read")}
    cpu: dict[str, list[tuple[float, float]]] = {v: [] for v in times}
    counts: dict[str, dict] = {}
    timelines: dict[str, list[str]] = {v: [] for v in show_timeline}
    with make_server() as srv, environ(**srv.env):
        small = make_arrays(1, 2)  # warm-up, untimed: imports, connections, the server's first requests
        store_write(srv.url("bench/warm_store"), small, writers)
        store_read(srv.url("bench/warm_store"), small)
        raw_write(srv.url("bench/warm_raw"), small)
        raw_read(srv.url("bench/warm_raw"), small)
        clock = CpuClock(srv.proc.pid)
        for rep in range(reps):
            order = ["store", "raw"] if rep % 2 == 0 else ["raw", "store"]
            for v in order:
                url = srv.url(f"bench/{v}{rep}")
                with clock.timed(times[f"{v}_write"], cpu[f"{v}_write"]):
                    (store_write(url, arrays, writers) if v == "store" else raw_write(url, arrays))
            for v in order:
                url = srv.url(f"bench/{v}{rep}")
                with clock.timed(times[f"{v}_read"], cpu[f"{v}_read"]):
                    (store_read(url, arrays) if v == "store" else raw_read(url, arrays))
            for v in order:  # the server's memory / disk holds one rep at a time
                delete_all(srv.url(f"bench/{v}{rep}"))
        proxy = CountingProxy(srv.endpoint)  # each variant once more, counted
        via = {"AWS_ENDPOINT_URL": proxy.url} if server == "s3" else \
            {"TENSORSTORE_GCS_HTTP_URL": proxy.url, "STORAGE_EMULATOR_HOST": proxy.url}
        try:
            with environ(**via):
                for v, fn, where in (("store_write", lambda u: store_write(u, arrays, writers), "store"),
                                     ("store_read", lambda u: store_read(u, arrays), "store"),
                                     ("raw_write", lambda u: raw_write(u, arrays), "raw"),
                                     ("raw_read", lambda u: raw_read(u, arrays), "raw")):
                    t0 = time.perf_counter()
                    fn(srv.url(f"bench/counted_{where}"))
                    t1 = time.perf_counter()
                    if v in timelines:
                        timelines[v] = timeline(proxy.take_events(), t0, t1)
                    counts[v] = proxy.take()
            objects = len(srv.list_keys("bench/counted_store/"))
        finally:
            proxy.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    rate = {k: nbytes / t / 1e6 for k, t in med.items()}
    gib = nbytes / (1 << 30)
    out = {"server": server, "bytes": nbytes, "arrays": n_arrays, "writers": writers, "reps": reps,
           "MBps": {k: round(v, 1) for k, v in rate.items()},
           "ratio_write": paired_ratio(times["raw_write"], times["store_write"]),
           "ratio_read": paired_ratio(times["raw_read"], times["store_read"]),
           "ratio_write_range": ratio_range(times["raw_write"], times["store_write"]),
           "ratio_read_range": ratio_range(times["raw_read"], times["store_read"]),
           "cpu_s_per_GiB": {k: {"client": round(statistics.median(c for c, _ in v) / gib, 2),
                                 "server": round(statistics.median(s for _, s in v) / gib, 2)}
                             for k, v in cpu.items()},
           "objects_per_checkpoint": objects,
           "requests": {k: {kind: n for kind, n in c.items() if not kind.startswith("bytes")} for k, c in counts.items()},
           "bytes_moved": {k: {kind: n for kind, n in c.items() if kind.startswith("bytes")} for k, c in counts.items()}}
    out["timelines"] = timelines
    out["requests_per_GiB"] = {k: round(sum(c.values()) / gib, 1) for k, c in out["requests"].items()}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=float, default=128)
    ap.add_argument("--arrays", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--writers", type=int, default=1)
    ap.add_argument("--server", choices=("s3", "gs", "both"), default="s3")
    ap.add_argument("--timeline", action="store_true",
                    help="print the requests of the counted store and raw writes on a time line")
    args = ap.parse_args(argv)
    results = []
    for server in (("s3", "gs") if args.server == "both" else (args.server,)):
        r = run(server, args.mib, args.arrays, args.reps, args.writers,
                ("store_write", "raw_write") if args.timeline else ())
        results.append(r)
        print(f"{server}: {r['bytes'] / 2**20:.0f} MiB in {r['arrays']} arrays, {r['writers']} writer(s), "
              f"median of {r['reps']}")
        for k, v in r["MBps"].items():
            print(f"  {k:12s} {v:8.1f} MB/s")
        print(f"  store/raw (median of per-rep pairs): write {r['ratio_write']:.2f}x "
              f"(range {r['ratio_write_range'][0]:.2f}-{r['ratio_write_range'][1]:.2f}), "
              f"read {r['ratio_read']:.2f}x (range {r['ratio_read_range'][0]:.2f}-{r['ratio_read_range'][1]:.2f}) "
              f"(1.0 = as fast as raw TensorStore)")
        for k, c in r["cpu_s_per_GiB"].items():
            print(f"  CPU s per GiB {k:12s} client {c['client']:.2f}  server {c['server']:.2f}")
        print(f"  objects per checkpoint: {r['objects_per_checkpoint']}")
        for k, c in r["requests"].items():
            moved = r["bytes_moved"][k]
            print(f"  requests {k:12s} {sum(c.values()):6d}  {dict(sorted(c.items()))}  "
                  f"({r['requests_per_GiB'][k]:.0f} per GiB; up {moved.get('bytes_up', 0) / 2**20:.1f} MiB, "
                  f"down {moved.get('bytes_down', 0) / 2**20:.1f} MiB)")
        for k, lines in r.pop("timelines").items():
            print(f"  timeline of the counted {k} (through the proxy):")
            print("\n".join(lines))
    print("SUMMARY " + json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
