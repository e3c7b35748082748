"""The donated staging pipeline (the GPU export path) through a real CheckpointWriter, on the CPU.

`StagedWriter(..., stage_all=True)` sends CPU tensors through the same reused host buffers as
CUDA tensors take on a GPU machine; donated, the buffers are handed to the writer and only
refilled once the writer has committed them. Read back with the store reader and compared with
the source arrays; a control run whose writer's flush does not commit shows the check catches
early reuse.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bridge.layout.boxes import Box
from bridge.layout.chunks import ArrayOwnership
from bridge.live.staging import StagedWriter, WriteItem
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


class _Watched:
    """A real CheckpointWriter that counts its flushes and copied writes; `commit=False` (the
    control) makes its background flush a no-op, as a writer that never commits in between."""

    def __init__(self, writer: CheckpointWriter, commit: bool = True) -> None:
        self.w, self.plan, self.commit = writer, writer.plan, commit
        self.flushes, self.copied = 0, []

    def write(self, name, box, data, donate=False):
        if not donate:
            self.copied.append(name)
        self.w.write(name, box, data, donate=donate)

    def flush(self, wait=True):
        if not wait:
            self.flushes += 1
        if self.commit:
            self.w.flush(wait=wait)

    def finish(self):
        return self.w.finish()


def _export(dst: str, flush_commits: bool, depth: int = 1, part: int = 2048):
    src = _sources()
    plan = _plan(src, 512, chunk_rows=8)
    claim = begin_checkpoint(dst)
    tmp = claim.tmp
    writer = _Watched(CheckpointWriter(tmp, plan, 0, batch_bytes=1 << 20, commit_depth=depth), flush_commits)
    staged = StagedWriter(writer, (depth + 2) * part, commit_depth=depth, stage_all=True, cut_cells=False)
    staged.write_items(_items(src))
    staged.finish()
    commit_checkpoint(claim, plan)
    ck = open_checkpoint(dst)
    return src, {p: ck.read(p) for p in src}, writer.flushes, staged.peak_bytes, writer.copied


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
    dst = str(tmp_path / "ck")
    plan = _plan(src, 512, chunk_rows=8)
    claim = begin_checkpoint(dst)
    writer = _Watched(CheckpointWriter(claim.tmp, plan, 0, batch_bytes=1 << 20))
    StagedWriter(writer, budget, donate=False, stage_all=True).write_items(_items(src))
    writer.finish()
    commit_checkpoint(claim, plan)
    assert len(writer.copied) > len(_items(src)) or budget > 64
    ck = open_checkpoint(dst)
    for p, a in src.items():
        assert _same_bits(ck.read(p), a), p


def _export_staged(rank, world, dst, commits=1):
    """Export with every piece staged through the donated host buffers (the CUDA flow) on gloo."""
    from live_model import FP8, MODEL, STEP, local_params

    from bridge.layout import ParallelLayout
    from bridge.live.api import AdamConfig, LiveRun
    from bridge import _testing
    from bridge.live.export import ExportOptions, export_state

    params, _ = local_params(MODEL, 1, 2, 2, 4, rank, FP8)
    run = LiveRun(ParallelLayout(tp=1, gtp=2, dp=2), rank, STEP, AdamConfig(lr=1e-3))
    with _testing.seams(stage_all=True):
        rep = export_state(dst, run, params, ExportOptions(budget=3 * 1024, target_chunk_bytes=64,
                                                           commit_depth=commits))
    return {"peak": rep.staging.peak_bytes, "calls": rep.staging.write_calls}


@pytest.mark.slow
@pytest.mark.parametrize("commits", [1, 2])
def test_export_through_donated_staging_matches_reference(tmp_path, commits):
    """World 4, TP1xGTP2xDP2 with FP8 and padding: the staged (GPU-shaped) flow writes exactly the
    state assembled independently from the ranks' raw shards."""
    from live_model import FP8, MODEL, expected_state
    from spawn_ranks import spawn

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

    class Boxes(_Watched):
        """Records the boxes handed to the writer."""

        def __init__(self, writer):
            super().__init__(writer)
            self.boxes = []

        def write(self, name, box, data, donate=False):
            self.boxes.append((name, box))
            super().write(name, box, data, donate)

    def export(dst, cut):
        claim = begin_checkpoint(dst)
        writer = Boxes(CheckpointWriter(claim.tmp, plan, 0, batch_bytes=1 << 20, commit_depth=2))
        items = [WriteItem(".".join(p), Box((r, 0), (r + 256, a.shape[1])), from_numpy(a[r:r + 256].copy()))
                 for p, a in src.items() for r in range(0, a.shape[0], 256)]
        staged = StagedWriter(writer, 4 << 20, commit_depth=2, stage_all=True, cut_cells=cut)
        staged.write_items(items)
        staged.finish()
        commit_checkpoint(claim, plan)
        return writer.w.bytes_staged, writer.boxes

    staged, boxes = export(str(tmp_path / "cut"), True)
    assert staged == 0
    assert all(b.shape == inner[n] for n, b in boxes)          # every write is one whole inner chunk
    staged_uncut, _ = export(str(tmp_path / "uncut"), False)
    assert staged_uncut == sum(a.nbytes for a in src.values())  # the control: the writer copies it all
    ck = open_checkpoint(str(tmp_path / "cut"))
    for p, a in src.items():
        assert _same_bits(ck.read(p), a), p
