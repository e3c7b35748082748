"""How OCDBT commit granularity sets write speed: one process, one array, the store's own spec.

    python benchmarks/bench_ocdbt_commits.py --mib 1024 --reps 5
    python benchmarks/bench_ocdbt_commits.py --modes txn128d2,txn512d1,stream256,cells256,raw

The same N MiB of fp32 (4 MiB outer chunks = shards, 1 MiB inner chunks, crc32c, OCDBT, exactly
as CheckpointWriter writes them) are written in one of these ways, reps interleaved:
  txn<B>d<D>  transactions of B MiB, D commits in flight (the store writer's scheme)
  stream<W>   whole-shard writes outside any transaction, W MiB awaiting their commit
  cells<W>    the same, but each shard as 4 inner-chunk writes (partial shards: TensorStore then
              reads, modifies and rewrites the shard, and OCDBT keeps every version; see bytes on disk)
  shardtxn<W> one small transaction per shard, W shards in flight
  lanes<K>    txn128d2, each batch dealt round-robin by shard to K databases (a transaction each)
  raw         plain zarr3 on the file kvstore, 4 MiB chunks, one write call, fsync'd
A suffix f<M> (e.g. txn128d2f4) sets OCDBT's target data file size to M MiB for that mode (default:
the store's): OCDBT writes a data file as soon as it holds that much, several at once, while the
rest of a commit's data waits for the commit and for every data file in flight.
Session-4 and -5 figures (README "Performance") came from this script on the GPU host and on the VM.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

from bridge.store.durable import fsync_tree  # noqa: E402

SHARD = (1024, 1024)   # 4 MiB of fp32
INNER = (256, 1024)    # 1 MiB


def _du(root: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs)


class Bench:
    def __init__(self, mib: int, root: str) -> None:
        self.n = max(1, mib // 4)
        self.target_file = None   # OCDBT target data file size of the mode being run (None: the store's)
        self.root = root
        self.shape = (self.n * SHARD[0], SHARD[1])
        rng = np.random.default_rng(0)
        self.data = [rng.integers(0, 2 ** 31, SHARD, dtype=np.int32).view(np.float32) for _ in range(self.n)]

    def _fresh(self, dbs: int = 1) -> list:
        """The array created empty in each of `dbs` OCDBT databases (one per writer id)."""
        import tensorstore as ts

        from bridge.store import specs

        shutil.rmtree(self.root, ignore_errors=True)
        os.makedirs(self.root)
        ctx = ts.Context(specs.context_spec())
        out = []
        for db in range(dbs):
            sp = specs.array_write_spec(self.root, db, "a", self.shape, "float32", SHARD, INNER)
            if self.target_file:
                sp["kvstore"]["target_data_file_size"] = self.target_file
            out.append(ts.open(sp, create=True, context=ctx).result())
        return out

    def _rows(self, i: int, c: int | None = None) -> slice:
        if c is None:
            return slice(i * SHARD[0], (i + 1) * SHARD[0])
        return slice(i * SHARD[0] + c * INNER[0], i * SHARD[0] + (c + 1) * INNER[0])

    def txn(self, batch_mib: int, depth: int, dbs: int = 1) -> None:
        """Transactions of `batch_mib`, `depth` in flight; with `dbs` > 1 each batch's shards are dealt
        round-robin to that many databases, a transaction each, committed together (OCDBT serializes
        commits per database)."""
        import tensorstore as ts

        stores, per, rounds = self._fresh(dbs), max(1, batch_mib // 4), []
        for b in range(0, self.n, per):
            while len(rounds) >= depth:
                for c in rounds.pop(0):
                    c.result()
            txns = [ts.Transaction(atomic=True) for _ in stores]
            bound = [st.with_transaction(t) for st, t in zip(stores, txns)]
            for f in [bound[i % dbs][self._rows(i)].write(self.data[i], can_reference_source_data_indefinitely=True)
                      for i in range(b, min(self.n, b + per))]:
                f.result()
            rounds.append([t.commit_async() for t in txns])
        for r in rounds:
            for c in r:
                c.result()

    def stream(self, window_mib: int, cells: bool = False) -> None:
        st, futs = self._fresh()[0], []
        window = max(1, window_mib if cells else window_mib // 4)   # writes in flight
        for i in range(self.n):
            for c in (range(SHARD[0] // INNER[0]) if cells else [None]):
                if len(futs) >= window:
                    futs.pop(0).commit.result()
                src = self.data[i] if c is None else self.data[i][c * INNER[0]:(c + 1) * INNER[0]]
                futs.append(st[self._rows(i, c)].write(src, can_reference_source_data_indefinitely=True))
        for f in futs:
            f.commit.result()

    def shardtxn(self, window: int) -> None:
        import tensorstore as ts

        st, commits = self._fresh()[0], []
        for i in range(self.n):
            if len(commits) >= window:
                commits.pop(0).result()
            txn = ts.Transaction(atomic=True)
            bound = st.with_transaction(txn)
            for f in [bound[self._rows(i, c)].write(self.data[i][c * INNER[0]:(c + 1) * INNER[0]],
                                                    can_reference_source_data_indefinitely=True)
                      for c in range(SHARD[0] // INNER[0])]:
                f.result()   # staged in the transaction before it commits
            commits.append(txn.commit_async())
        for c in commits:
            c.result()

    def raw(self) -> None:
        import tensorstore as ts

        shutil.rmtree(self.root, ignore_errors=True)
        st = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": self.root + "/raw/"},
                      "metadata": {"shape": list(self.shape), "data_type": "float32",
                                   "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(SHARD)}}}},
                     create=True).result()
        for f in [st[self._rows(i)].write(self.data[i]) for i in range(self.n)]:
            f.result()
        fsync_tree(self.root)

    def run(self, mode: str) -> None:
        """Run one mode by name.

        >>> [parse_mode(m) for m in ("txn128d2", "stream256f4", "raw")]
        [('txn', '128', '2', None), ('stream', '256', None, '4'), ('raw', '', '', None)]
        """
        kind, a, b, f = parse_mode(mode)
        self.target_file = int(f) << 20 if f else None
        if kind == "txn":
            self.txn(int(a), int(b or 1))
        elif kind in ("stream", "cells"):
            self.stream(int(a), cells=kind == "cells")
        elif kind == "shardtxn":
            self.shardtxn(int(a))
        elif kind == "lanes":
            self.txn(128, 2, dbs=int(a))
        else:
            self.raw()


MODE = re.compile(r"(?:(txn|stream|cells|shardtxn|lanes)(\d+)(?:d(\d+))?|(raw)()())(?:f(\d+))?")


def parse_mode(mode: str) -> tuple:
    m = MODE.fullmatch(mode)
    if m is None:
        raise SystemExit(f"unknown mode {mode!r}; see --help")
    g = m.groups()
    return (g[:3] if g[0] else g[3:6]) + (g[6],)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--modes", default="txn128d2,txn512d1,stream256,stream1024,raw")
    ap.add_argument("--dir", default="/tmp/bench_ocdbt_commits")
    a = ap.parse_args(argv)
    modes = a.modes.split(",")
    for m in modes:
        parse_mode(m)   # refuse a typo before any work
    bench = Bench(a.mib, a.dir)
    times: dict[str, list] = {m: [] for m in modes}
    disk: dict[str, int] = {}
    for rep in range(a.reps):
        for m in modes[rep % len(modes):] + modes[:rep % len(modes)]:
            t0 = time.perf_counter()
            bench.run(m)
            times[m].append(time.perf_counter() - t0)
            disk[m] = _du(a.dir)
    shutil.rmtree(a.dir, ignore_errors=True)
    print(f"{bench.n * 4} MiB, {a.reps} interleaved reps, {os.cpu_count()} CPUs")
    for m, ts_ in times.items():
        med = statistics.median(ts_)
        print(f"{m:12} median {med:.3f} s  {bench.n * 4 / 1024 / med:.2f} GiB/s  on disk "
              f"{disk[m] / 2 ** 20:.0f} MiB  runs {[round(t, 3) for t in ts_]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
