"""Chunk-ownership planning: one owner per chunk, owners end up holding whole chunks exactly once."""

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from bridge.errors import BridgeError
from bridge.layout import Box
from bridge.layout.chunks import ownership_from_claims
from bridge.layout.ownership import box_difference, plan_ownership, plan_ownership_many

from test_layout_properties import geometries

SETTINGS = settings(deadline=None, max_examples=int(os.environ.get("LAYOUT_EXAMPLES", 150)),
                    suppress_health_check=[HealthCheck.too_slow])


def holdings_of(geom, tp, gtp, cuts, replicas):
    """{array: [(rank, box)]}: physical shards (t, g) cut into flat fragments at `cuts` (fractions),
    fragment k of shard (t, g) on rank (t*G + g)*F + k; `replicas` extra copies on other ranks."""
    G = gtp if geom.gtp_active(gtp) else 1
    F = len(cuts) + 1
    out = {}
    numel = geom.physical_numel(tp, gtp)
    bounds = [0] + sorted(int(c * numel) for c in cuts) + [numel]
    nranks = tp * G * F
    for t in range(tp):
        for g in range(G):
            for idx in np.ndindex(*geom.prepend):
                for k in range(F):
                    rank = (t * G + g) * F + k
                    for p in geom.fragment_pieces(tp, gtp, t, g, bounds[k], bounds[k + 1], idx):
                        for rep in range(replicas + 1):
                            out.setdefault(p.array, []).append(((rank + rep * nranks), p.logical))
    return out


def check_plan(shape, hold, plan):
    own = plan.ownership
    # exactly one owner per chunk: the owners' claimed chunks rebuild the same ownership (no overlap, no gap)
    claims = {w: own.boxes_owned_by(w) for w in own.writers()}
    assert ownership_from_claims(shape, own.chunk_shape, claims) == own
    holders = {r for r, _ in hold}
    assert set(own.writers()) <= holders
    mine = {}
    for r, b in hold:
        mine.setdefault(r, np.zeros(shape, bool))[b.slices] = True
    count = np.zeros(shape, np.int64)
    owner_map = np.zeros(shape, np.int64)
    for idx in np.ndindex(*own.grid_shape):
        owner_map[own.chunk_box(idx).slices] = own.owners[idx]
    for r, m in mine.items():
        count[m & (owner_map == r)] += 1
    for t in plan.transfers:
        assert t.src != t.dst
        assert mine[t.src][t.box.slices].all(), "source does not hold what it sends"
        assert (owner_map[t.box.slices] == t.dst).all(), "transfer crosses into another owner's chunk"
        count[t.box.slices] += 1
    assert (count == 1).all(), np.unique(count)
    # chunks held whole by some rank need no transfer
    for idx in np.ndindex(*own.grid_shape):
        cb = own.chunk_box(idx)
        if any(m[cb.slices].all() for m in mine.values()):
            assert not any(t.box.intersect(cb) for t in plan.transfers)


@SETTINGS
@given(geometries(), st.lists(st.floats(0, 1), max_size=3), st.integers(0, 2), st.sampled_from([4, 64, 512, 1 << 20]))
def test_every_chunk_one_owner_and_owners_get_whole_chunks(case, cuts, replicas, target):
    geom, tp, gtp = case
    arrays = holdings_of(geom, tp, gtp, cuts, replicas)
    load = {}
    for name, shape in geom.logical_arrays().items():
        hold = arrays.get(name, [])
        if 0 in shape:
            continue
        plan = plan_ownership(shape, hold, 8, target_chunk_bytes=target, load=load, name=name)
        check_plan(shape, hold, plan)


def test_aligned_holdings_move_nothing():
    hold = {r: [Box((r * 4, 0), (r * 4 + 4, 8))] for r in range(4)}
    plan = plan_ownership((16, 8), hold, 4, target_chunk_bytes=4 * 8 * 4)
    assert plan.ownership.chunk_shape == (4, 8)
    assert plan.ownership.owners.ravel().tolist() == [0, 1, 2, 3] and plan.transfers == []


def test_row_parallel_tp_columns_followed():
    # TP=2 row-parallel: each rank holds all rows of half the columns
    hold = {0: [Box((0, 0), (6, 5))], 1: [Box((0, 5), (6, 10))]}
    plan = plan_ownership((6, 10), hold, 4)
    assert plan.ownership.chunk_shape == (6, 5) and plan.transfers == []


def test_replicas_are_balanced_across_arrays():
    ranks = range(8)
    arrays = {f"a{i}": ((64, 16), {r: [Box((0, 0), (64, 16))] for r in ranks}, 4) for i in range(32)}
    load = {}
    plans = plan_ownership_many(arrays, target_chunk_bytes=64 * 16 * 4, load=load)
    owners = [int(p.ownership.owners.ravel()[0]) for p in plans.values()]
    assert sorted(owners) == sorted(list(ranks) * 4)
    assert all(p.transfers == [] for p in plans.values())
    assert max(load.values()) == min(load.values())


def test_gap_is_an_error_naming_array_and_region():
    with pytest.raises(BridgeError, match=r"opt\.mu\.w: no rank holds region"):
        plan_ownership((4, 4), {0: [Box((0, 0), (2, 4))]}, 4, target_chunk_bytes=64, name="opt.mu.w")
    with pytest.raises(BridgeError, match="outside the array"):
        plan_ownership((4, 4), {0: [Box((0, 0), (5, 4))]}, 4, name="w")


@settings(deadline=None, max_examples=150)
@given(st.lists(st.integers(0, 6), min_size=4, max_size=4), st.lists(st.integers(0, 6), min_size=4, max_size=4))
def test_box_difference_is_exact(a, b):
    A = Box((min(a[0], a[1]), min(a[2], a[3])), (max(a[0], a[1]), max(a[2], a[3])))
    B = Box((min(b[0], b[1]), min(b[2], b[3])), (max(b[0], b[1]), max(b[2], b[3])))
    cnt = np.zeros((7, 7), int)
    for x in box_difference(A, B):
        cnt[x.slices] += 1
    want = np.zeros((7, 7), int)
    want[A.slices] = 1
    want[B.slices] = 0
    if A.empty:
        want[:] = 0
    assert (cnt == want).all()
