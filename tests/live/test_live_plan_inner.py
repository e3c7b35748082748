"""`choose_inner_bytes` / `read_amplification`: the export's inner (read) chunk choice.

`read_amplification` is checked against a brute-force count of the inner chunks each box touches;
`choose_inner_bytes` on hand-made plans where the right answer follows from the chunk arithmetic.
"""

from __future__ import annotations

import numpy as np
import pytest

from bridge.layout.boxes import Box
from bridge.layout.chunks import ArrayOwnership
from bridge.live.plan import ExportPlan, Source, Transfer, choose_inner_bytes, read_amplification
from bridge.store.plan import ArraySpec


def _brute(shape, inner, boxes) -> float:
    read = need = 0
    for b in boxes:
        hit = np.zeros(tuple(-(-s // c) for s, c in zip(shape, inner)), bool)
        hit[tuple(slice(a // c, -(-z // c)) for a, z, c in zip(b.start, b.stop, inner))] = True
        for idx in np.argwhere(hit):  # elements of each touched inner chunk (edge chunks are clipped)
            read += int(np.prod([min(s, (i + 1) * c) - i * c for i, s, c in zip(idx, shape, inner)]))
        need += b.size
    return read / need


@pytest.mark.parametrize("seed", range(5))
def test_read_amplification_matches_a_brute_force_count(seed):
    rng = np.random.default_rng(seed)
    shape = (int(rng.integers(5, 40)), int(rng.integers(5, 40)))
    inner = (int(rng.integers(1, 9)), int(rng.integers(1, 9)))
    boxes = []
    for _ in range(6):
        a = [int(rng.integers(0, s - 1)) for s in shape]
        boxes.append(Box(tuple(a), tuple(int(rng.integers(x + 1, s + 1)) for x, s in zip(a, shape))))
    st = np.array([b.start for b in boxes]); sp = np.array([b.stop for b in boxes])
    assert read_amplification(shape, inner, st, sp) == pytest.approx(_brute(shape, inner, boxes))


def _plan(shape, halves: int) -> ExportPlan:
    """One fp32 array held in `halves` row blocks by as many ranks, each block its own outer chunk."""
    rows = shape[0] // halves
    spec = ArraySpec(("params", "w"), shape, "float32")
    own = ArrayOwnership(shape, (rows, shape[1]), np.arange(halves, dtype=np.int32).reshape(halves, 1))
    tr = []
    for r in range(halves):
        box = Box((r * rows, 0), ((r + 1) * rows, shape[1]))
        tr.append(Transfer(Source(spec.name, box, r, 0, 0, 0), box, r))
    return ExportPlan(halves, [spec], {spec.name: own}, tr, {spec.name: 4})


def test_large_shards_get_1_mib_inner_chunks():
    # outer (2048, 4096) -> 1 MiB inner (512, 512): halves of a shard fall on inner chunk edges
    assert choose_inner_bytes(_plan((4096, 4096), 2)) == 1 << 20


def test_mid_shards_get_the_largest_size_that_keeps_reads_tight():
    # outer (512, 1024): 1 MiB inner = (512, 512) reads whole shards for row halves (1.5x);
    # 512 KiB inner = (256, 512) keeps both halvings aligned
    assert choose_inner_bytes(_plan((1024, 1024), 2)) == 512 << 10


def test_small_arrays_fall_back_to_the_smallest_choice():
    assert choose_inner_bytes(_plan((64, 64), 2)) == 256 << 10
