"""Staged writes (inner chunks copied into reused slabs) store exactly the caller's bytes.

The writer copies boxes that span inner chunks into recycled staging slabs and lets TensorStore
reference them; these tests force many small batches (slab reuse while commits are in flight)
and check every byte against the original arrays, the digests against an independent
whole-array digest, and that a caller may reuse a non-donated buffer as soon as write returns.
"""

import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bridge.layout.boxes import Box
from bridge.layout.chunks import ArrayOwnership
from bridge.store import ArraySpec, CheckpointWriter, begin_checkpoint, commit_checkpoint, make_write_plan
from bridge.store import open_checkpoint
from bridge.store.digest import digest_array, to_hex
from bridge.dtypes import numpy_dtype
from bridge.store.staging import SlabPool, grid_cells, num_grid_cells
from bridge.store.verify import verify_checkpoint


@pytest.mark.slow
@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 12), st.integers(1, 9)), min_size=0, max_size=3))
def test_grid_cells_tile_the_box_within_single_grid_cells(dims):
    box = Box(tuple(a for a, _, _ in dims), tuple(a + n for a, n, _ in dims))
    cell_shape = tuple(c for _, _, c in dims)
    cells = grid_cells(box, cell_shape)
    if box.empty:
        return
    assert len(cells) == num_grid_cells(box, cell_shape)
    # Brute force: every element of the box is in exactly one cell, and each cell lies in one grid cell.
    hits = np.zeros(box.shape, dtype=np.int64)
    for c in cells:
        assert box.contains(c) and not c.empty
        assert all(a // k == (b - 1) // k for a, b, k in zip(c.start, c.stop, cell_shape))
        hits[c.relative_to(box).slices] += 1
    assert (hits == 1).all()


def test_slab_pool_reuses_released_slabs_only_once_unreferenced_and_keeps_views_apart():
    pool = SlabPool(slab_bytes=1 << 12, keep_bytes=1 << 13)
    a = pool.take((10, 10), np.float32)
    b = pool.take((10, 10), np.float32)
    a[...] = 1
    b[...] = 2
    assert (a == 1).all() and not np.shares_memory(a, b)
    big = pool.take((2048,), np.float32)          # larger than a slab: its own buffer
    assert big.nbytes == 8192 and big.flags.c_contiguous
    slabs = pool.seal()
    assert len(slabs) == 1 and pool.leased == 1   # a and b (400 B each, 64-B aligned) share one 4 KiB slab
    # Not released yet: a new batch gets a fresh slab.
    c = pool.take((10, 10), np.float32)
    assert not np.shares_memory(c, slabs[0].arr) and pool.fresh_slabs == 2
    pool.release(slabs)
    # Released, but `a` (standing in for TensorStore's reference) still views it: not refilled.
    pool.seal()
    d = pool.take((10, 10), np.float32)
    assert not np.shares_memory(d, slabs[0].arr) and pool.held == 1 and (a == 1).all()
    del a, b
    pool.seal()
    e = pool.take((10, 10), np.float32)
    assert np.shares_memory(e, slabs[0].arr) and pool.fresh_slabs == 3


def _catalog():
    """Arrays whose owned blocks span several ~0.5-1 MiB inner chunks (so the writer stages them)."""
    return {
        ("params", "w"): ((1536, 1024), "float32"),
        ("params", "b16"): ((1024, 1536), "bfloat16"),
        ("opt_state", "0", "mu", "e"): ((4, 384, 512), "float32"),
        ("params", "v"): ((1 << 20,), "float32"),
    }


def _reference(seed=11):
    rng = np.random.default_rng(seed)
    out = {}
    for path, (shape, dtype) in _catalog().items():
        a = rng.standard_normal(shape).astype(np.float32)
        a.reshape(-1)[:4] = [np.nan, np.inf, -0.0, 1e-42]
        out[path] = a.astype(numpy_dtype(dtype))
    return out


def _plan(num_writers=2):
    catalog = [ArraySpec(p, s, d) for p, (s, d) in _catalog().items()]
    own = {("params", "w"): ArrayOwnership((1536, 1024), (768, 1024), np.array([[0], [1]], np.int32)),
           ("params", "b16"): ArrayOwnership((1024, 1536), (1024, 768), np.array([[1, 0]], np.int32)),
           ("opt_state", "0", "mu", "e"): ArrayOwnership((4, 384, 512), (2, 384, 512),
                                                          np.array([[[0]], [[1]]], np.int32)),
           ("params", "v"): ArrayOwnership((1 << 20,), (1 << 19,), np.array([1, 0], np.int32))}
    return make_write_plan(catalog, num_writers, own)


def _pieces(box: Box, parts: int):
    """Split a box along its first axis into `parts` uneven pieces that ignore the inner grid."""
    n = box.shape[0]
    cuts = sorted({0, n} | {max(1, n * k // parts - 7 * k) for k in range(1, parts)})
    return [Box((box.start[0] + a,) + box.start[1:], (box.start[0] + b,) + box.stop[1:])
            for a, b in zip(cuts[:-1], cuts[1:])]


@pytest.mark.parametrize("donate,threads", [(False, 1), (True, 1), (False, 3)])
def test_staged_writes_store_exact_bytes_across_many_batches(tmp_path, donate, threads):
    plan = _plan()
    ref = _reference()
    inner = {ap.spec.path: ap.inner_chunk_shape for ap in plan.arrays.values()}
    assert all(len(grid_cells(Box.full(ap.ownership.chunk_shape), inner[ap.spec.path])) > 1
               for ap in plan.arrays.values()), "the catalog must exercise staging"
    dst = str(tmp_path / "ck")
    claim = begin_checkpoint(dst)
    tmp = claim.tmp
    for w in range(plan.num_writers):
        # Tiny budget + two commits in flight: slabs are recycled while other batches still commit.
        t0 = time.perf_counter()
        writer = CheckpointWriter(tmp, plan, w, batch_bytes=1 << 20, commit_depth=2, threads=threads,
                                  staging=True)
        for ap in plan.arrays.values():
            for owned in ap.ownership.boxes_owned_by(w):
                for box in _pieces(owned, 3):
                    src = ref[ap.spec.path][box.slices]
                    if ap.spec.path == ("params", "b16"):   # a non-contiguous source view
                        src = np.asfortranarray(src)
                    buf = src.copy(order="K")
                    writer.write(ap.spec.path, box, buf, donate=donate)
                    if not donate:
                        buf[...] = 0                        # the caller reuses its buffer at once
        writer.finish()
        assert writer.bytes_staged > 0
        # finish() waits for the last commit at least; the waits are part of this writer's wall time
        assert 0 < writer.commit_wait_s <= time.perf_counter() - t0
    commit_checkpoint(claim, plan, timeout=10)
    ck = open_checkpoint(dst)
    for path, a in ref.items():
        got = ck.read(path)
        assert got.dtype == a.dtype and np.array_equal(got.view(np.uint8), a.view(np.uint8)), path
        # The recorded digest equals an independent whole-array digest of the original data.
        assert ck.manifest.arrays[".".join(path)].digest == to_hex(digest_array(a)), path
    assert verify_checkpoint(dst).ok


def test_staging_off_and_on_write_identical_checkpoint_contents(tmp_path):
    plan = _plan()
    ref = _reference(5)
    results = []
    for staging in (False, True):
        dst = str(tmp_path / f"ck_{staging}")
        claim = begin_checkpoint(dst)
        tmp = claim.tmp
        for w in range(plan.num_writers):
            writer = CheckpointWriter(tmp, plan, w, staging=staging, batch_bytes=2 << 20)
            for ap in plan.arrays.values():
                for box in ap.ownership.boxes_owned_by(w):
                    writer.write(ap.spec.path, box, ref[ap.spec.path][box.slices])
            writer.finish()
        commit_checkpoint(claim, plan, timeout=10)
        ck = open_checkpoint(dst)
        results.append({p: ck.read(p).tobytes() for p in ref})
        results[-1]["digests"] = {n: r.digest for n, r in ck.manifest.arrays.items()}
    assert results[0] == results[1]


@pytest.mark.parametrize("shape,threads", [((2048, 1024), 1), ((2048, 1024), 3), ((64, 256), 1)])
def test_caller_may_reuse_a_non_donated_buffer_as_soon_as_write_returns(tmp_path, shape, threads):
    """Also on the paths that do not stage (tiny inner chunks): an 8 MiB box TensorStore copies
    itself (write waits for that copy; with threads > 1 its digest is split over them meanwhile)
    and a 64 KiB one the writer copies before referencing it."""
    plan = make_write_plan([ArraySpec(("params", "w"), shape, "float32")], 1, inner_chunk_bytes=16 << 10)
    assert plan.lookup(("params", "w")).inner_chunk_shape == (64, 64)   # 16 KiB cells: not staged
    ref = np.random.default_rng(2).standard_normal(shape).astype(np.float32)
    dst = str(tmp_path / "ck")
    claim = begin_checkpoint(dst)
    writer = CheckpointWriter(claim.tmp, plan, 0, threads=threads)
    buf = ref.copy()
    writer.write(("params", "w"), Box.full(shape), buf)
    buf[...] = 7.0
    writer.finish()
    commit_checkpoint(claim, plan, timeout=10)
    assert writer.bytes_staged == 0
    ck = open_checkpoint(dst)
    assert np.array_equal(ck.read(("params", "w")), ref)
    assert ck.manifest.arrays["params.w"].digest == to_hex(digest_array(ref))
