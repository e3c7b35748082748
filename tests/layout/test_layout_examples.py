"""Every worked example of docs/megatron-layout.md, with its numbers."""

import numpy as np
import pytest

from bridge.layout import Box, ParallelLayout, ParamGeometry, FusedSpec
from bridge.layout.distopt import BufferParam, buffer_layout, owned_ranges
from bridge.layout.params import GtpSplit, gtp_shard_dim0


def boxes(pieces):
    return [(p.array, p.logical.start, p.logical.shape, p.local_start) for p in pieces]


# §1.3: world 8, TP=2, G=2, DP=2 --------------------------------------------------------------------
TABLE_1_3 = [  # r, t, g, d, TP grp, GTP grp, DP grp, DP-with-GTP grp, its rank, dp_group_idx
    (0, 0, 0, 0, [0, 1], [0, 2], [0, 4], [0, 2, 4, 6], 0, 0),
    (1, 1, 0, 0, [0, 1], [1, 3], [1, 5], [1, 3, 5, 7], 0, 1),
    (2, 0, 1, 0, [2, 3], [0, 2], [2, 6], [0, 2, 4, 6], 1, 2),
    (3, 1, 1, 0, [2, 3], [1, 3], [3, 7], [1, 3, 5, 7], 1, 3),
    (4, 0, 0, 1, [4, 5], [4, 6], [0, 4], [0, 2, 4, 6], 2, 0),
    (5, 1, 0, 1, [4, 5], [5, 7], [1, 5], [1, 3, 5, 7], 2, 1),
    (6, 0, 1, 1, [6, 7], [4, 6], [2, 6], [0, 2, 4, 6], 3, 2),
    (7, 1, 1, 1, [6, 7], [5, 7], [3, 7], [1, 3, 5, 7], 3, 3),
]


@pytest.mark.parametrize("row", TABLE_1_3, ids=lambda r: f"rank{r[0]}")
def test_1_3_rank_table(row):
    r, t, g, d, tpg, gtpg, dpg, dpgtp, dpgtp_rank, idx = row
    lay = ParallelLayout(tp=2, gtp=2, dp=2)
    c = lay.coords(r)
    assert (c.t, c.g, c.d, c.c, c.p) == (t, g, d, 0, 0)
    assert r == t + 2 * g + 4 * d == lay.rank(t=t, g=g, d=d)
    assert lay.tp_group(r) == tpg
    assert lay.gtp_group(r) == gtpg
    assert lay.distopt_group(r) == dpg and lay.distopt_rank(r) == d
    assert lay.dp_cp_gtp_group(r) == dpgtp and lay.dense.group_rank(r, "gtp_remat-dp-cp") == dpgtp_rank
    assert lay.dp_group_idx(r) == idx


def test_1_1_default_formulas():
    lay = ParallelLayout(tp=2, gtp=2, cp=2, dp=3, pp=2, ep=2, etp=1, egtp=2)
    assert lay.dense.order == ("tp", "gtp_remat", "cp", "ep", "dp", "pp")
    assert lay.expert.order == ("tp", "cp", "ep", "gtp_remat", "dp", "pp")
    for r in range(lay.world):
        c = lay.coords(r)
        assert r == c.t + 2 * c.g + 4 * c.c + 8 * c.d + 24 * c.p
        ETP, EP, EG, EDP = 1, 2, 2, lay.edp
        assert r == c.et + ETP * c.e + ETP * EP * c.eg + ETP * EP * EG * c.ed + ETP * EP * EG * EDP * c.p
        assert lay.distopt_rank(r) == c.c + 2 * c.d
        assert lay.dp_group_idx(r) == c.t + 2 * c.g + 4 * c.p
        assert lay.expert_dp_group_idx(r) == c.et + ETP * c.e + ETP * EP * c.eg + ETP * EP * EG * c.p
        assert lay.expert_distopt_rank(r) == c.ed


# §2.2 ------------------------------------------------------------------------------------------------
def test_2_2_all_padding_shard():
    assert gtp_shard_dim0(1152, 4, 128) == (384, 384)
    sp = GtpSplit(1152, 384, 384, 4)
    assert [sp.keep(g) for g in range(4)] == [384, 384, 384, 0]
    w = ParamGeometry("w", (1152, 2), "row", gtp=True, pad_for_alignment=128)
    assert w.shard_pieces(1, 4, 0, 3) == []


# §2.4 ------------------------------------------------------------------------------------------------
def test_2_4_column_w10x6():
    w = ParamGeometry("w", (10, 6), "column", gtp=True, pad_for_alignment=4)
    assert w.split(2, 2) == GtpSplit(rows=5, pad=3, shard_rows=4, size=2)
    assert w.physical_shape(2, 2) == (4, 6) and w.physical_numel(2, 2) == 24
    lay = ParallelLayout(tp=2, gtp=2, dp=2)
    expect = {0: (0, 4), 4: (0, 4), 2: (4, 1), 6: (4, 1), 1: (5, 4), 5: (5, 4), 3: (9, 1), 7: (9, 1)}
    for r, (row0, keep) in expect.items():
        t, g = lay.shard_coords(r)
        assert boxes(w.shard_pieces(2, 2, t, g)) == [("w", (row0, 0), (keep, 6), 0)]
        assert w.split(2, 2).keep(g) == keep


def test_2_4_row_variant():
    w = ParamGeometry("w", (6, 10), "row", gtp=True, pad_for_alignment=4)
    assert w.split(2, 2) == GtpSplit(rows=6, pad=2, shard_rows=4, size=2)
    for t in range(2):
        assert boxes(w.shard_pieces(2, 2, t, 0)) == [("w", (0, 5 * t), (4, 5), 0)]
        assert boxes(w.shard_pieces(2, 2, t, 1)) == [("w", (4, 5 * t), (2, 5), 0)]


# §2.5 B and §5.1 -------------------------------------------------------------------------------------
def test_2_5_b_logical_offsets_and_5_1_layer_axis():
    w = ParamGeometry("w", (10, 6), "column", gtp=True, pad_for_alignment=4)
    lay = ParallelLayout(tp=2, gtp=2, dp=1)
    got = {r: boxes(w.shard_pieces(2, 2, *lay.shard_coords(r)))[0][1:3] for r in range(4)}
    assert got == {0: ((0, 0), (4, 6)), 2: ((4, 0), (1, 6)), 1: ((5, 0), (4, 6)), 3: ((9, 0), (1, 6))}
    layered = ParamGeometry("w", (10, 6), "column", gtp=True, pad_for_alignment=4, prepend=(24,))
    assert layered.logical_arrays() == {"w": (24, 10, 6)}
    (p,) = layered.shard_pieces(2, 2, 0, 1, index=(3,))
    assert p.logical == Box((3, 4, 0), (4, 5, 6))


# §4.5 ------------------------------------------------------------------------------------------------
def test_4_5_distopt_example():
    lay = buffer_layout([BufferParam("w", 24)], None, 2)
    assert lay.index["w"] == (0, 24, 0) and lay.buckets == [(0, 128)] and lay.numel_unpadded == [24]
    assert lay.shard_size(0) == 64
    assert [o.param for o in owned_ranges(lay, 0)] == [(0, 24)] and owned_ranges(lay, 1) == []
    lay = buffer_layout([BufferParam("w", 240)], None, 2)
    assert lay.buckets == [(0, 256)] and lay.shard_size(0) == 128
    assert [o.param for o in owned_ranges(lay, 0)] == [(0, 128)]
    assert [o.param for o in owned_ranges(lay, 1)] == [(128, 240)]
    w = ParamGeometry("w", (10, 60), "column", gtp=True, pad_for_alignment=4)
    # d=0: rows 0-1 full + row 2 cols 0-7; d=1: row 2 cols 8-59 + row 3
    assert boxes(w.fragment_pieces(2, 2, 0, 0, 0, 128)) == [("w", (0, 0), (2, 60), 0), ("w", (2, 0), (1, 8), 120)]
    assert boxes(w.fragment_pieces(2, 2, 0, 0, 128, 240)) == [("w", (2, 8), (1, 52), 0), ("w", (3, 0), (1, 60), 52)]
    # g=1 shard: only flat [0, 60) (row 0) is logical
    assert boxes(w.fragment_pieces(2, 2, 0, 1, 0, 240)) == [("w", (4, 0), (1, 60), 0)]


# §6.6 ------------------------------------------------------------------------------------------------
def test_6_6_flat_fragments():
    w = ParamGeometry("w", (10, 60), "column", gtp=True, pad_for_alignment=4)
    assert boxes(w.fragment_pieces(2, 2, 0, 1, 0, 128)) == [("w", (4, 0), (1, 60), 0)]
    assert w.fragment_pieces(2, 2, 0, 1, 128, 240) == []
    lw = ParamGeometry("w", (10, 60), "column", gtp=True, pad_for_alignment=4, prepend=(24,))
    first = lw.fragment_pieces(2, 2, 0, 0, 0, 128, index=(3,))[0]
    assert (first.logical.start, first.logical.shape) == ((3, 0, 0), (1, 2, 60))


# §6.2 Mamba in_proj ----------------------------------------------------------------------------------
def test_6_2_mamba_in_proj():
    spec = FusedSpec.mamba_in_proj(d_inner=8, ngroups=2, d_state=2, nheads=4)
    assert [(s.section, s.local_row, s.rows) for s in spec.segments(2)] == [
        ("z", 0, 4), ("x", 4, 4), ("B", 8, 2), ("C", 10, 2), ("dt", 12, 2)]
    w = ParamGeometry("in_proj.weight", (spec.rows, 3), "column", gtp=True, pad_for_alignment=4, fused=spec)
    assert w.split(2, 2) == GtpSplit(rows=14, pad=2, shard_rows=8, size=2)
    n = "in_proj.weight."
    assert boxes(w.shard_pieces(2, 2, 0, 0)) == [(n + "z", (0, 0), (4, 3), 0), (n + "x", (0, 0), (4, 3), 12)]
    assert boxes(w.shard_pieces(2, 2, 0, 1)) == [(n + "B", (0, 0), (2, 3), 0), (n + "C", (0, 0), (2, 3), 6),
                                                 (n + "dt", (0, 0), (2, 3), 12)]
    # TP rank 1, g=1, physical row 4 -> j=12 -> dt, logical row 1*2+0 = 2
    dt = [p for p in w.shard_pieces(2, 2, 1, 1) if p.array == n + "dt"][0]
    assert dt.local_start == 4 * 3 and dt.logical.start == (2, 0)
    assert w.logical_arrays()[n + "dt"] == (4, 3) and w.logical_arrays()[n + "B"] == (4, 3)


# §6.3 SwiGLU -----------------------------------------------------------------------------------------
def test_6_3_swiglu_physical_rows():
    F, K = 6, 2
    w = ParamGeometry("fc1", (2 * F, K), "column", gtp=True, pad_for_alignment=4, fused=FusedSpec.swiglu(F))
    assert w.split(2, 2) == GtpSplit(rows=6, pad=2, shard_rows=4, size=2)
    for t in range(2):
        for g in range(2):
            rows = {}
            for p in w.shard_pieces(2, 2, t, g):
                for r in range(p.logical.shape[0]):
                    rows[p.local_start // K + r] = (p.array.split(".")[-1], p.logical.start[0] + r)
            for i in range(4):
                j = 4 * g + i
                if j < 3:
                    assert rows[i] == ("gate", 3 * t + j)      # global fused row 3t+j
                elif j < 6:
                    assert rows[i] == ("up", 3 * t + j - 3)    # global fused row 6+3t+(j-3)
                else:
                    assert i not in rows                       # pad


# §2.5 A legacy padded grid: see tests/layout/test_layout_legacy.py


# §4.6 (a): dp_reshardable keys are bound to dp_group_idx; offsets d*s + gbuf_local_start -------------
def test_4_6_dp_reshardable_offsets():
    lay = ParallelLayout(tp=2, gtp=2, dp=2)
    assert lay.dp_group_idx(2) == lay.dp_group_idx(6) == 2      # same key dp_group_idx_2
    buf = buffer_layout([BufferParam("a", 300), BufferParam("w", 240)], None, lay.distopt_size)
    s = buf.shard_size(0)
    for r in (2, 6):
        d = lay.distopt_rank(r)
        for o in owned_ranges(buf, d):
            # global offset inside the bucket's 1-D tensor = d*s + gbuf_local_start
            assert d * s + o.gbuf_local[0] == o.gbuf_world[0] - buf.buckets[o.bucket][0]


# §2.7 routed experts: expert axis, EGTP composes with expert TP ----------------------------------------
def test_2_7_grouped_experts_expert_grid():
    lay = ParallelLayout(tp=2, dp=4, ep=2, etp=1, egtp=2)       # world 8, edp 2
    n_local, L = 2, 3
    fc1 = ParamGeometry("decoder.layers.mlp.experts.linear_fc1.weight", (12, 4), "column", gtp=True,
                        pad_for_alignment=4, prepend=(L, lay.ep * n_local), fused=FusedSpec.swiglu(6), expert=True)
    assert fc1.logical_arrays()["decoder.layers.mlp.experts.linear_fc1.weight.gate"] == (3, 4, 6, 4)
    count = np.zeros((3, 4, 6, 4), int)
    for r in range(lay.world):
        c = lay.coords(r)
        if c.ed:            # expert DP replicas hold the same shard
            continue
        tp, gtp, t, g = fc1.placement(lay, r)
        assert (tp, gtp, t, g) == (1, 2, c.et, c.eg)
        for layer in range(L):
            for i in range(n_local):
                for p in fc1.shard_pieces(tp, gtp, t, g, index=(layer, c.e * n_local + i)):
                    if p.array.endswith("gate"):
                        count[p.logical.slices] += 1
    assert (count == 1).all()


def test_distopt_expert_buffer_uses_edp():
    from bridge.layout.distopt import DistOptParam, distopt_layouts
    lays = distopt_layouts([DistOptParam("d", 100), DistOptParam("e", 100, expert=True),
                            DistOptParam("f", 10, param_dtype="float32")], None, dp_size=4, edp_size=3)
    keys = list(lays)
    assert [(k.param_dtype, k.expert) for k in keys] == [("bfloat16", False), ("bfloat16", True), ("float32", False)]
    assert lays[keys[0]].buckets == [(0, 128)] and lays[keys[1]].buckets == [(0, 384)]   # lcm(4,128), lcm(3,128)
    assert lays[keys[0]].dp_size == 4 and lays[keys[1]].dp_size == 3
