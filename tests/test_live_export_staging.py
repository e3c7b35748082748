"""The donated staging pipeline (the GPU export path) through a real CheckpointWriter, on the CPU.

`stage_and_write(..., stage_cpu=True)` sends CPU tensors through the same reused host buffers as
CUDA tensors take on a GPU machine; with `flush` the buffers are donated to the writer and only
refilled once the writer has committed them. Read back with the store reader and compared with
the source arrays; a control run whose flush does not commit shows the check catches early reuse.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bridge.layout.boxes import Box
from bridge.layout.chunks import ArrayOwnership
from bridge.live.staging import WriteItem, stage_and_write
from bridge.store.commit import begin_checkpoint, commit_checkpoint
from bridge.store.plan import ArraySpec, make_write_plan
from bridge.store.reader import open_checkpoint
from bridge.store.writer import CheckpointWriter
from bridge.dtypes import from_numpy, to_numpy

A = ("params", "a")
B = ("model", "b")


def _sources():
    rng = np.random.default_rng(5)
    a = rng.standard_normal((64, 48)).astype(np.float32)
    a.reshape(-1)[:4] = [np.nan, -0.0, np.inf, 1e-40]  # bit patterns must survive the buffers
    b = to_numpy(torch.from_numpy(rng.standard_normal((40, 40)).astype(np.float32)).to(torch.bfloat16))
    return {A: a, B: b}


def _items(src) -> list[WriteItem]:
    """Row blocks of both arrays, interleaved: `a` in whole 8-row chunks (TensorStore then references
    donated data instead of copying it), `b` in blocks of 1..9 rows (partial chunks, uneven slots)."""
    items = []
    for name, arr in src.items():
        sizes = [8] if name == A else [1, 4, 9, 2, 7]
        r, k = 0, 0
        while r < arr.shape[0]:
            r1 = min(arr.shape[0], r + sizes[k % len(sizes)])
            box = Box((r, 0), (r1, arr.shape[1]))
            items.append(WriteItem(".".join(name), box, from_numpy(np.ascontiguousarray(arr[r:r1]))))
            r, k = r1, k + 1
    items.sort(key=lambda it: (it.box.start[0] // 8, it.name, it.box.start[0]))   # chunk by chunk (8 rows)
    return items


def _plan(src: dict, inner_chunk_bytes: int, chunk_rows: int | None = None):
    """A one-writer plan for `src`: chunks of `chunk_rows` whole rows (default: the whole array)."""
    own = {p: ArrayOwnership(a.shape, (chunk_rows or a.shape[0], a.shape[1]),
                             np.zeros((a.shape[0] // (chunk_rows or a.shape[0]), 1), np.int32))
           for p, a in src.items()}
    return make_write_plan([ArraySpec(p, a.shape, a.dtype.name) for p, a in src.items()], 1, own,
                           inner_chunk_bytes=inner_chunk_bytes)


def _chunks(plan):
    """The store's outer chunks a box touches (what the live export passes as `chunks`)."""
    def chunks(name, box):
        sl = plan.lookup(name).ownership.chunks_touching(box)
        return [(name, i) for i in range(sl[0].start, sl[0].stop)]   # row-block chunks
    return chunks


def _export(dst: str, flush_commits: bool, depth: int = 1, part: int = 2048):
    src = _sources()
    plan = _plan(src, 512, chunk_rows=8)
    tmp = begin_checkpoint(dst)
    writer = CheckpointWriter(tmp, plan, 0, inflight_bytes=1 << 20, commit_depth=depth)
    flushes = []

    def flush():
        flushes.append(1)
        if flush_commits:
            writer.flush(wait=False)

    copied = []

    def write_copy(n, b, a):
        copied.append(n)
        writer.write(n, b, a)

    peak = stage_and_write(_items(src), write_copy, budget_bytes=(depth + 2) * part,
                           write_cpu=lambda n, b, a: writer.write(n, b, a, donate=True), flush=flush,
                           stage_cpu=True, commits_in_flight=depth,
                           drain=writer.flush if flush_commits else flush, chunks=_chunks(plan))
    writer.finish()
    commit_checkpoint(dst, plan)
    ck = open_checkpoint(dst)
    return src, {p: ck.read(p) for p in src}, len(flushes), peak, copied


def _same_bits(x: np.ndarray, y: np.ndarray) -> bool:
    return x.shape == y.shape and np.array_equal(x.view(np.uint8), y.view(np.uint8))


@pytest.mark.parametrize("depth", [1, 2])
def test_donated_staging_buffers_are_reused_only_after_commit(tmp_path, depth):
    """With `depth` writer commits in flight, depth + 2 buffers: none refilled before its commit landed."""
    src, got, flushes, peak, copied = _export(str(tmp_path / "ck"), flush_commits=True, depth=depth)
    assert not copied   # every chunk fits a buffer: all donated
    assert flushes > 6, "the budget must force many batches through the buffers"
    assert 0 < peak <= (depth + 2) * 2048
    for p in src:
        assert _same_bits(got[p], src[p]), p


def test_chunks_larger_than_a_staging_buffer_are_copied_and_written_in_one_transaction(tmp_path):
    """Buffers of 1 KiB, chunks of 8 rows of `a` (1536 bytes): `a`'s chunks cannot be donated
    whole, so they take the copying path and the writer commits each chunk in one transaction
    (it refuses a chunk rewritten across transactions); every element reads back exactly."""
    src, got, flushes, _, copied = _export(str(tmp_path / "ck"), flush_commits=True, depth=1, part=1024)
    assert ".".join(A) in copied and flushes >= 1   # `a` copied, some of `b` donated
    for p in src:
        assert _same_bits(got[p], src[p]), p


def test_control_reusing_donated_buffers_before_commit_corrupts(tmp_path):
    """Without commits between batches the buffers are refilled while the writer still references
    them: the read-back differs, so the test above would notice a pipeline that reuses too early."""
    src, got, flushes, _, _ = _export(str(tmp_path / "ck"), flush_commits=False)
    assert flushes > 6
    assert not _same_bits(got[A], src[A])


@pytest.mark.parametrize("budget", [64, 3 * 2048])
def test_copying_staging_path_round_trips(tmp_path, budget):
    """Without `flush` (a writer that copies) two buffers are reused at once; every element lands once."""
    src = _sources()
    out = {".".join(p): np.zeros_like(a) for p, a in src.items()}
    calls = []

    def write(n, b, a):
        calls.append(n)
        out[n][b.slices] = a  # copies, as the contract of the copying path requires

    stage_and_write(_items(src), write, budget_bytes=budget, stage_cpu=True)
    assert len(calls) > len(_items(src)) or budget > 64
    for p, a in src.items():
        assert _same_bits(out[".".join(p)], a), p


def _export_staged(rank, world, dst, commits=1):
    """Export with every piece staged through the donated host buffers (the CUDA flow) on gloo."""
    from test_live_export import FP8, MODEL, STEP, local_params

    from bridge.layout import ParallelLayout
    from bridge.live import export as ex
    from bridge.live.api import AdamConfig, LiveRun

    ex._STAGE_ALL = True
    ex._DEVICE_COMMITS = commits
    params, _ = local_params(MODEL, 1, 2, 2, 4, rank, FP8)
    run = LiveRun(ParallelLayout(tp=1, gtp=2, dp=2), rank, STEP, AdamConfig(lr=1e-3))
    rep = ex.export_state(dst, run, params, inflight_bytes=3 * 1024, target_chunk_bytes=64)
    return {"peak": rep.staging_peak_bytes, "calls": rep.write_calls}


@pytest.mark.parametrize("commits", [1, 2])
def test_export_through_donated_staging_matches_reference(tmp_path, commits):
    """World 4, TP1xGTP2xDP2 with FP8 and padding: the staged (GPU-shaped) flow writes exactly the
    state assembled independently from the ranks' raw shards."""
    from test_live_export import FP8, MODEL, expected_state
    from test_live_sharding import spawn

    from bridge.store.reader import open_checkpoint
    from bridge.format.tree import megatron_key_to_path

    dst = str(tmp_path / "ck")
    results, _ = spawn(4, _export_staged, (dst, commits), tmp_path, timeout_s=240)
    assert all(0 < r["peak"] <= (commits + 2) * 1024 for r in results)
    want = expected_state(MODEL, 1, 2, 2, 4, FP8)
    roots = {"model": ("model",), "params": ("params",), "mu": ("opt_state", "0", "mu"), "nu": ("opt_state", "0", "nu")}
    ck = open_checkpoint(dst)
    for root, arrays in want.items():
        for name, arr in arrays.items():
            got = ck.read(roots[root] + megatron_key_to_path(name)).astype(np.float32)
            assert np.array_equal(got.view(np.uint32), arr.view(np.uint32)), f"{root}/{name}"


def test_cells_cut_before_staging_are_written_without_a_second_copy(tmp_path):
    """With `cell_shape`, staged items reach the writer as whole inner chunks, which it references:
    no copy into its staging slabs (bytes_staged == 0; without the cut the writer copies every byte
    of these 256 KiB cells there), and every element reads back exactly."""
    rng = np.random.default_rng(11)
    src = {A: rng.standard_normal((1024, 768)).astype(np.float32),
           B: to_numpy(torch.from_numpy(rng.standard_normal((512, 1024)).astype(np.float32)).to(torch.bfloat16))}
    plan = _plan(src, 256 << 10, chunk_rows=256)   # chunks of 512-768 KiB: whole in a 1 MiB buffer
    inner = {".".join(p): plan.lookup(p).inner_chunk_shape for p in src}

    def export(dst, cut):
        writer = CheckpointWriter(begin_checkpoint(dst), plan, 0, inflight_bytes=1 << 20, commit_depth=2)
        boxes = []

        def write_donated(n, b, a):
            boxes.append((n, b))
            writer.write(n, b, a, donate=True)

        items = [WriteItem(".".join(p), Box((r, 0), (r + 256, a.shape[1])), from_numpy(a[r:r + 256].copy()))
                 for p, a in src.items() for r in range(0, a.shape[0], 256)]
        stage_and_write(items, None, budget_bytes=4 << 20, write_cpu=write_donated,
                        flush=lambda: writer.flush(wait=False), stage_cpu=True, commits_in_flight=2,
                        drain=writer.flush, cell_shape=inner.__getitem__ if cut else None, chunks=_chunks(plan))
        writer.finish()
        commit_checkpoint(dst, plan)
        return writer.bytes_staged, boxes

    staged, boxes = export(str(tmp_path / "cut"), True)
    assert staged == 0
    assert all(b.shape == inner[n] for n, b in boxes)          # every write is one whole inner chunk
    staged_uncut, _ = export(str(tmp_path / "uncut"), False)
    assert staged_uncut == sum(a.nbytes for a in src.values())  # the control: the writer copies it all
    ck = open_checkpoint(str(tmp_path / "cut"))
    for p, a in src.items():
        assert _same_bits(ck.read(p), a), p
