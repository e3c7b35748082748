"""Planning benchmark: 1024 ranks (TP=8 x GTP=2 x DP=64) x N parameters.

Measures, for N in --sizes (default 2500, 5000, 10000):
  distopt  - DistOpt buffer layout + every rank's owned ranges + their logical Pieces (optimizer state);
  owners   - chunk grid, owners and transfers for every logical array from all ranks' pieces;
  peak MiB - peak resident memory growth of a fresh process doing the planning (ru_maxrss after
             planning minus after building the parameter list).
Times are CPU seconds of the planning process (the machine may be shared). Anchor (same run, CPU
seconds): `pairs` = the cheapest possible rank x parameter loop (one divmod per pair), what a planner
that visits every (rank, parameter) pair pays at least. Reported: seconds, ratio to the
anchor, and per-parameter time and memory (linear when these stay flat as N grows).

  python benchmarks/bench_planning.py [--sizes 2500 5000 10000] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time
import multiprocessing as mp
import resource
from collections import defaultdict

from bridge.layout import FusedSpec, ParallelLayout, ParamGeometry
from bridge.layout.distopt import BufferParam, buffer_layout, owned_ranges
from bridge.layout.bulk import paused_gc
from bridge.layout.ownership import plan_ownership_many

TP, GTP, DP = 8, 2, 64
HIDDEN, FFN, HEADS, GROUPS, HEAD_DIM = 1024, 4096, 16, 8, 64


def model_params(n: int) -> list[ParamGeometry]:
    """n parameters cycling through a GPT layer's kinds (fused qkv / swiglu, row, norms, biases)."""
    qkv = FusedSpec.qkv(HEADS, GROUPS, HEAD_DIM)
    kinds = [
        lambda i: ParamGeometry(f"l{i}.input_layernorm.weight", (HIDDEN,), "replicated"),
        lambda i: ParamGeometry(f"l{i}.linear_qkv.weight", (qkv.rows, HIDDEN), "column", True, 16, fused=qkv),
        lambda i: ParamGeometry(f"l{i}.linear_qkv.bias", (qkv.rows,), "column", False, fused=qkv),
        lambda i: ParamGeometry(f"l{i}.linear_proj.weight", (HIDDEN, HEADS * HEAD_DIM), "row", True, 16),
        lambda i: ParamGeometry(f"l{i}.pre_mlp_layernorm.weight", (HIDDEN,), "replicated"),
        lambda i: ParamGeometry(f"l{i}.linear_fc1.weight", (2 * FFN, HIDDEN), "column", True, 16,
                                fused=FusedSpec.swiglu(FFN)),
        lambda i: ParamGeometry(f"l{i}.linear_fc2.weight", (HIDDEN, FFN), "row", True, 16),
        lambda i: ParamGeometry(f"l{i}.linear_fc2.bias", (HIDDEN,), "replicated"),
    ]
    return [kinds[k % len(kinds)](k // len(kinds)) for k in range(n)]


def anchor_pairs(world: int, n: int) -> float:
    """CPU seconds of the cheapest rank x parameter loop."""
    t0 = time.process_time()
    acc = 0
    for r in range(world):
        for i in range(n):
            acc += divmod(i, r + 1)[1]
    return time.process_time() - t0


def all_holdings(lay: ParallelLayout, geoms: list[ParamGeometry]) -> tuple[dict[str, list], int]:
    """Every rank's optimizer-state pieces: {logical array: [(rank, Box)]}, and the piece count."""
    by_name = {g.name: g for g in geoms}
    cache = {}
    holdings: dict[str, list] = defaultdict(list)
    pieces = 0
    for rank in range(lay.world):
        c = lay.coords(rank)
        # every rank computes its own buffer layout (cached by the physical numels it holds)
        key = tuple(g.physical_numel(TP, GTP) for g in geoms) if not cache else next(iter(cache))
        blay = cache.get(key)
        if blay is None:
            blay = cache[key] = buffer_layout([BufferParam(g.name, k) for g, k in zip(geoms, key)], 40_000_000, DP)
        for o in owned_ranges(blay, lay.distopt_rank(rank)):
            geom = by_name[o.name]
            # one copy of replicated state: GTP-replicated from g=0, TP-replicated from t=0
            if (c.g and not geom.gtp_active(GTP)) or (c.t and geom.tp_kind == "replicated"):
                continue
            for p in geom.fragment_pieces(TP, GTP, c.t, c.g, o.param[0], o.param[1]):
                holdings[p.array].append((rank, p.logical))
                pieces += 1
    return holdings, pieces


def plan(n: int) -> dict:
    lay = ParallelLayout(tp=TP, gtp=GTP, dp=DP)
    geoms = model_params(n)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0, c0 = time.perf_counter(), time.process_time()
    with paused_gc():   # what a bulk planner (converter, exporter) does around this loop
        holdings, pieces = all_holdings(lay, geoms)
    c1 = time.process_time()
    shapes = {a: s for g in geoms for a, s in g.logical_arrays().items()}
    plans = plan_ownership_many({a: (shapes[a], h, 4) for a, h in holdings.items()})
    t2, c2 = time.perf_counter(), time.process_time()
    peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) * 1024
    chunks = sum(p.ownership.num_chunks for p in plans.values())
    moved = sum(p.moved_elements() for p in plans.values())
    total = sum(s[0] * (s[1] if len(s) > 1 else 1) for s in shapes.values())
    return {"params": n, "arrays": len(shapes), "pieces": pieces, "chunks": chunks, "distopt_s": c1 - c0,
            "owners_s": c2 - c1, "total_s": c2 - c0, "wall_s": t2 - t0, "peak_mib": peak / 2**20,
            "moved_fraction": moved / total}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[2500, 5000, 10000])
    ap.add_argument("--json")
    a = ap.parse_args()
    world = TP * GTP * DP
    rows = []
    ctx = mp.get_context("spawn")   # a fresh process per size: ru_maxrss is per process
    for n in a.sizes:
        with ctx.Pool(1) as pool:
            r = pool.apply(plan, (n,))
        with ctx.Pool(1) as pool:
            r["anchor_pairs_s"] = pool.apply(anchor_pairs, (world, n))
        r["ratio_to_anchor"] = r["total_s"] / r["anchor_pairs_s"]
        rows.append(r)
    print(f"planning, {world} ranks (TP={TP} GTP={GTP} DP={DP}); anchor = {world} x N divmod loop")
    print("CPU seconds (process_time; wall clock in 'wall s' depends on other load on the machine)")
    print("| params | pieces | chunks | distopt s | owners s | total s | wall s | anchor s | total/anchor | peak MiB "
          "| us/param | KiB/param | moved |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['params']} | {r['pieces']} | {r['chunks']} | {r['distopt_s']:.2f} | {r['owners_s']:.2f} | "
              f"{r['total_s']:.2f} | {r['wall_s']:.2f} | {r['anchor_pairs_s']:.2f} | {r['ratio_to_anchor']:.2f} | {r['peak_mib']:.0f} | "
              f"{1e6 * r['total_s'] / r['params']:.0f} | {1024 * r['peak_mib'] / r['params']:.1f} | "
              f"{100 * r['moved_fraction']:.2f}% |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
