"""`gtp-bridge diff` and its streamed element-wise comparison, checked against independent numpy math."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bridge.inspect.blocks import plan_blocks
from bridge.inspect.diff import ArrayDiff, ulp_distance
from inspect_fixtures import run_cli, save_plain_orbax, small_state


def _ulp_by_stepping(a: float, b: float, dtype) -> int:
    """Independent ulp count: walk with nextafter from min to max (small distances only)."""
    x, y = dtype(min(a, b)), dtype(max(a, b))
    n = 0
    while x != y:
        x = np.nextafter(x, y)
        n += 1
    return n


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_ulp_distance_matches_nextafter_walk(dtype):
    rng = np.random.default_rng(1)
    tiny = np.finfo(dtype).smallest_subnormal
    base = np.concatenate([rng.standard_normal(50), [0.0, -0.0, tiny, -tiny, 1.0, -1.0]]).astype(dtype)
    steps = rng.integers(-5, 6, base.size)
    other = base.copy()
    for i, k in enumerate(steps):  # move k representable steps away (crossing zero where it happens)
        for _ in range(abs(int(k))):
            other[i] = np.nextafter(other[i], dtype(np.inf) if k > 0 else dtype(-np.inf))
    got = ulp_distance(base, other)
    want = [_ulp_by_stepping(float(a), float(b), dtype) for a, b in zip(base, other)]
    # a walk across zero visits both -0.0 and +0.0 as one value: nextafter(-0.0, +) jumps to +tiny
    assert got.tolist() == want


def test_ulp_distance_bfloat16_adjacent_and_zero():
    a = np.array([1.0, 0.0, -0.0, 3.0], dtype=ml_dtypes.bfloat16)
    b = np.array([1.0078125, -0.0, 0.0, 3.0], dtype=ml_dtypes.bfloat16)  # 1 + 2**-7 is bf16's next after 1
    assert ulp_distance(a, b).tolist() == [1, 0, 0, 0]


@settings(max_examples=60, deadline=None)
@given(shape=st.lists(st.integers(1, 9), min_size=0, max_size=4), max_elems=st.integers(1, 80),
       chunk=st.lists(st.integers(1, 5), min_size=4, max_size=4), use_chunk=st.booleans())
def test_plan_blocks_tiles_with_whole_chunks(shape, max_elems, chunk, use_chunk):
    shape = tuple(shape)
    chunk = tuple(chunk[:len(shape)]) if use_chunk else None
    covered = np.zeros(shape, np.int32)
    for box in plan_blocks(shape, max_elems, chunk):
        assert box.size <= max_elems
        covered[box.slices] += 1
        if chunk is not None and np.prod(chunk) <= max_elems:  # blocks are unions of whole chunks
            for lo, hi, c, s in zip(box.start, box.stop, chunk, shape):
                assert lo % c == 0 and (hi % c == 0 or hi == s)
    assert (covered == 1).all()  # disjoint and complete


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 300), cut=st.integers(1, 64), seed=st.integers(0, 1000))
def test_array_diff_blocks_in_any_order_equal_whole_array_numpy(n, cut, seed):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal(n).astype(np.float32)
    a[rng.random(n) < 0.1] = np.nan
    b = a.copy()
    flip = rng.random(n) < 0.2
    b[flip] = np.nextafter(b[flip], np.float32(np.inf) * rng.choice([-1, 1], flip.sum()).astype(np.float32))
    b[rng.random(n) < 0.05] = np.nan
    d = ArrayDiff(shape=(n,), ulp=1)
    starts = list(range(0, n, cut))
    rng.shuffle(starts)
    for lo in starts:
        d.update(a[lo:lo + cut], b[lo:lo + cut], (lo,))
    # independent whole-array reference
    same = (a == b) | (np.isnan(a) & np.isnan(b))
    diff_idx = np.flatnonzero(~same)
    assert d.differing == diff_idx.size
    assert d.first_index == ((int(diff_idx[0]),) if diff_idx.size else None)
    assert d.nan_mismatch == int(np.count_nonzero(np.isnan(a) != np.isnan(b)))
    finite = ~same & ~np.isnan(a) & ~np.isnan(b)
    if finite.any():
        assert d.max_abs == (np.inf if d.nan_mismatch else float(np.max(np.abs(a[finite].astype(np.float64) - b[finite]))))
    # with ulp=1 only NaN-vs-number elements are beyond tolerance (each finite flip moved one step)
    assert d.beyond_tolerance == d.nan_mismatch


@pytest.fixture(scope="module")
def big_pair(tmp_path_factory):
    """Two plain-Orbax checkpoints equal except one element of a 16 MiB array (one mantissa bit flipped)."""
    root = tmp_path_factory.mktemp("diff")
    rng = np.random.default_rng(5)
    big = rng.standard_normal((1024, 4096), dtype=np.float32)
    state = small_state(0)
    state["params"]["big"] = big
    save_plain_orbax(str(root / "a"), state)
    flipped = big.copy()
    idx = (777, 2345)
    bits = flipped.view(np.uint32)
    bits[idx] ^= np.uint32(1 << 3)  # flips the mantissa bit worth 8 ulp
    state["params"]["big"] = flipped
    save_plain_orbax(str(root / "b"), state)
    return root, idx, float(big[idx]), float(flipped[idx])


@pytest.mark.slow
def test_diff_finds_single_flipped_element(big_pair):
    root, idx, va, vb = big_pair
    r = run_cli("diff", str(root / "a"), str(root / "b"), "--json", "--budget", "1M")
    assert r.returncode == 1, r.stderr
    rep = json.loads(r.stdout)
    rows = {x["name"]: x for x in rep["arrays"]}
    big = rows["params/big"]
    assert big["first_index"] == list(idx)
    assert big["differing"] == 1 and big["max_ulp"] == 8
    assert big["max_abs"] == pytest.approx(abs(va - vb), rel=0, abs=0)
    assert big["first_values"] == [va, vb]
    assert all(x["status"] == "equal" for n, x in rows.items() if n != "params/big")
    assert rep["equal"] is False and rep["only_in_a"] == [] and rep["only_in_b"] == []
    # the same flip is within --ulp 8 but not --ulp 7
    assert run_cli("diff", str(root / "a"), str(root / "b"), "--ulp", "8").returncode == 0
    text = run_cli("diff", str(root / "a"), str(root / "b"), "--ulp", "7")
    assert text.returncode == 1 and "(777,2345)" in text.stdout and "DIFFERENT" in text.stdout


def test_diff_identical_exit_zero(big_pair):
    root = big_pair[0]
    r = run_cli("diff", str(root / "a"), str(root / "a"))
    assert r.returncode == 0, r.stderr
    assert "equal within tolerance" in r.stdout


@pytest.mark.slow
def test_diff_nan_signed_zero_missing_arrays_and_shapes(tmp_path):
    a = {"x": np.array([np.nan, 0.0, 1.0, 2.0], np.float32), "only_a": np.ones(3, np.float32),
         "s": np.zeros((2, 3), np.float32), "h": np.array([1.0, 2.0], ml_dtypes.bfloat16)}
    b = {"x": np.array([np.nan, -0.0, 1.0, 2.0], np.float32), "only_b": np.ones(3, np.float32),
         "s": np.zeros((3, 2), np.float32), "h": np.array([1.0, 2.0], ml_dtypes.bfloat16)}
    save_plain_orbax(str(tmp_path / "a"), a)
    save_plain_orbax(str(tmp_path / "b"), b)
    rep = json.loads(run_cli("diff", str(tmp_path / "a"), str(tmp_path / "b"), "--json").stdout)
    rows = {x["name"]: x for x in rep["arrays"]}
    assert rows["x"]["status"] == "equal" and rows["x"]["signed_zero"] == 1  # NaN == NaN, -0.0 noted
    assert rows["s"]["status"] == "shape"
    assert rows["h"]["status"] == "equal"
    assert rep["only_in_a"] == ["only_a"] and rep["only_in_b"] == ["only_b"]
    assert rep["equal"] is False
    # restricted to the equal arrays, the exit code is 0
    r = run_cli("diff", str(tmp_path / "a"), str(tmp_path / "b"), "--only", "x", "--only", "h")
    assert r.returncode == 0 and "signed zeros" in r.stdout
    # NaN against a number is beyond any tolerance
    save_plain_orbax(str(tmp_path / "c"), {"x": np.array([1.0, 0.0, 1.0, 2.0], np.float32)})
    rep = json.loads(run_cli("diff", str(tmp_path / "a"), str(tmp_path / "c"), "--only", "x", "--json",
                             "--atol", "1e30").stdout)
    assert rep["arrays"][0]["nan_mismatch"] == 1 and rep["arrays"][0]["first_index"] == [0]
    assert rep["equal"] is False


@pytest.mark.slow
def test_diff_equal_across_writers_and_formats(tmp_path):
    """The same state written by Orbax (zarr2, zstd) and by the bridge store (zarr3, OCDBT) compares equal."""
    from bridge.store.commit import save_checkpoint

    state = small_state(4)
    state["params"]["embedding"]["word_embeddings"]["weight"][0, :3] = [np.nan, -0.0, np.inf]
    save_plain_orbax(str(tmp_path / "orbax"), state, use_zarr3=False, use_compression=True, chunk_byte_size=1024)

    def flat(tree, prefix=()):
        for k, v in tree.items():
            yield from flat(v, prefix + (k,)) if isinstance(v, dict) else [("/".join(prefix + (k,)), np.asarray(v))]

    save_checkpoint(str(tmp_path / "bridge"), dict(flat(state)))
    r = run_cli("diff", str(tmp_path / "orbax"), str(tmp_path / "bridge"), "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    rep = json.loads(r.stdout)
    assert len(rep["arrays"]) == len(dict(flat(state))) and all(a["status"] == "equal" for a in rep["arrays"])
