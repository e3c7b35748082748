"""The independent sharding reference (tests/support/live_reference.py) pinned to the worked examples
of docs/megatron-layout.md (§2.4, §4.5, §6.3)."""

from __future__ import annotations

import numpy as np
import pytest

from live_reference import RefParam, distopt_ranges, physical_index

# --- the doc's worked examples ------------------------------------------------------------------

def _rows(idx: np.ndarray, cols: int) -> list[int]:
    return [int(r[0]) // cols if r[0] >= 0 else -1 for r in idx]


def test_column_padding_matches_doc_example_2_4():
    p = RefParam("w", ((None, (10, 6)),))
    # rank (t=0, g=1): row 0 -> logical 4, rows 1..3 pad; (t=1, g=0): logical rows 5..8
    assert _rows(physical_index(p, 2, 2, 4, 0, 1), 6) == [4, -1, -1, -1]
    assert _rows(physical_index(p, 2, 2, 4, 1, 0), 6) == [5, 6, 7, 8]
    assert _rows(physical_index(p, 2, 2, 4, 1, 1), 6) == [9, -1, -1, -1]


def test_row_parallel_padding_matches_doc_example_2_4():
    p = RefParam("w", ((None, (6, 10)),), kind="row")
    idx = physical_index(p, 2, 2, 4, 1, 1)            # g=1 holds rows 4..5 + 2 pad, cols 5..9
    assert idx.shape == (4, 5)
    assert idx[0].tolist() == [45, 46, 47, 48, 49] and (idx[2:] == -1).all()


def test_swiglu_sections_match_doc_example_6_3():
    f, h = 6, 1
    p = RefParam("fc1", (("gate", (f, h)), ("up", (f, h))))
    # physical (t, g, i): j = 4g+i; j<3 -> gate row 3t+j; 3<=j<6 -> up row 3t+j-3; else pad
    for t in range(2):
        for g in range(2):
            got = physical_index(p, 2, 2, 4, t, g)[:, 0].tolist()
            want = []
            for i in range(4):
                j = 4 * g + i
                want.append(3 * t + j if j < 3 else (f + 3 * t + j - 3 if j < 6 else -1))
            assert got == want


def test_distopt_ranges_match_doc_example_4_5():
    assert distopt_ranges([240], 2, 0) == [(0, 128)]
    assert distopt_ranges([240], 2, 1) == [(128, 240)]
    assert distopt_ranges([24], 2, 1) == [(0, 0)]


@pytest.mark.parametrize("tp,gtp,a", [(2, 2, 4), (1, 4, 16), (4, 1, 0), (2, 3, 8)])
def test_shards_tile_the_logical_tensor(tp, gtp, a):
    p = RefParam("fc1", (("gate", (12, 4)), ("up", (12, 4))))
    counts = np.zeros(96, np.int64)
    for t in range(tp):
        for g in range(gtp):
            idx = physical_index(p, tp, gtp, a, t, g)
            np.add.at(counts, idx[idx >= 0], 1)
    assert (counts == 1).all()
