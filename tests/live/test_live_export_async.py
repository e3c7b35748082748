"""Asynchronous live export on spawned gloo ranks (real torch.distributed, CPU).

The checkpoint an asynchronous export commits must hold the state at the call, bit for bit, while
the "training" overwrites every source tensor right after the call returns (a seam holds the
background writer after its first batch until the mutation is done); it is compared with the state
assembled independently from the ranks' raw shards (`tests/support/live_reference.py`) through plain Orbax, and
with a synchronous export of the same state (digests). Failures in the background reach every rank
naming the failing one; a SIGKILL during the background write leaves nothing loadable and a retry
succeeds; staging slots are allocated once and reused.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from live_model import MODEL, STEP, expected_state, local_params
from test_live_export import _leaf, _orbax_restore
from spawn_ranks import spawn

SRC = (1, 2, 1, 4)  # TP1 x GTP2 x DP1, pad 4: pieces move between the two ranks (an exchange)


def _setup(rank, world):
    from bridge.layout import ParallelLayout
    from bridge.live.api import AdamConfig, LiveRun

    params, _ = local_params(MODEL, *SRC[:3], SRC[3], rank, None)
    run = LiveRun(ParallelLayout(tp=SRC[0], gtp=SRC[1], dp=SRC[2]), rank, STEP, AdamConfig(lr=1e-3))
    return params, run


def _tensors(params):
    for p in params:
        yield p.weight
        if p.optim is not None:
            yield from p.optim.tensors().values()


def _async_then_mutate(rank, world, dst_sync, dst_async, opts):
    """Sync export, then async export of the same state; every source tensor is overwritten right
    after the async call returns, while its background writer is held after its first batch (unless the
    slots are bounded: the call then returns only once all but the last batches are written)."""
    import threading

    import torch

    from bridge.live.export import Exporter, export_state
    from bridge.store.reader import open_checkpoint

    params, run = _setup(rank, world)
    exporter = Exporter()
    export_state(dst_sync, run, params, exporter=exporter, target_chunk_bytes=64)
    mutated = threading.Event()
    seen = []

    def hold(stage):
        seen.append(stage)
        if stage == "writing" and "staging_bytes" not in opts:  # bounded slots: the call itself waits for writes
            assert mutated.wait(60), "the test never released the writer"

    from bridge.live.export import ExportOptions

    handle = exporter.export_async(dst_async, run, params, ExportOptions(target_chunk_bytes=64, **opts), on_stage=hold)
    before = handle.done()
    with torch.no_grad():
        for t in _tensors(params):
            t.fill_(float("nan"))  # the training moves on
    mutated.set()
    report = handle.wait()
    digests = {}
    for path in (dst_sync, dst_async):
        ck = open_checkpoint(path)
        digests[path] = {name: rec.digest for name, rec in ck.manifest.arrays.items()}
    return {"done_before": before, "seen": seen, "path": report.path, "digests_equal": digests[dst_sync] ==
            digests[dst_async], "n": len(digests[dst_sync]), "slots": handle.staging.slots,
            "blocked": handle.blocked_s >= 0}


def _check_against_reference(dst):
    want = expected_state(MODEL, *SRC[:3], SRC[3], None)
    got = _orbax_restore(dst, want)
    for root in ("params", "model"):
        for name, arr in want[root].items():
            g = _leaf(got[root], name).astype(np.float32)
            assert np.array_equal(g.view(np.uint32), arr.view(np.uint32)), f"{root}/{name}"
    for root in ("mu", "nu"):
        for name, arr in want[root].items():
            g = _leaf(getattr(got["opt_state"][0], root), name)
            assert np.array_equal(g.view(np.uint32), arr.view(np.uint32)), f"{root}/{name}"
    assert int(got["step"]) == STEP


@pytest.mark.parametrize("opts", [{}, pytest.param({"budget": 4096, "staging_bytes": 2048},
                                                  marks=pytest.mark.slow)], ids=["slots_for_all", "two_slots"])
@pytest.mark.slow
def test_async_export_is_the_state_at_the_call(tmp_path, opts):
    """Sources overwritten with NaN right after the call: the checkpoint still holds the state at the
    call (plain Orbax vs the independently assembled state; digests equal to a synchronous export).
    With two slots of 1 KiB the call itself waits for the writer to free slots (many batches)."""
    dst_sync, dst_async = str(tmp_path / "sync"), str(tmp_path / "async")
    results, _ = spawn(2, _async_then_mutate, (dst_sync, dst_async, opts), tmp_path)
    for r in results:
        assert r["digests_equal"] and r["n"] > 5, r
        # unbounded: the writer starts after the call's copies; two slots: while the call still copies
        order = ["planned", "exchanged", "writing", "staged"] if opts else ["planned", "exchanged", "staged", "writing"]
        assert r["seen"] == order + ["written"], r
    if opts:
        assert results[0]["slots"] == 2
    else:
        assert not any(r["done_before"] for r in results)  # held by the seam: the call returned before the writes
    _check_against_reference(dst_async)
    assert not os.path.exists(dst_async + ".orbax-checkpoint-tmp")


def _fail_in_background(rank, world, base):
    """Rank 1's background writer fails: the next export raises on every rank naming rank 1; the
    export after that succeeds."""
    from bridge.errors import BridgeError
    from bridge.live.export import Exporter, export_state_async

    params, run = _setup(rank, world)
    exporter = Exporter()

    def fail(stage):
        if rank == 1 and stage == "writing":
            raise OSError("disk full (injected)")

    export_state_async(f"{base}/a", run, params, exporter=exporter, target_chunk_bytes=64, on_stage=fail)
    try:
        export_state_async(f"{base}/b", run, params, exporter=exporter, target_chunk_bytes=64)
        raised = None
    except BridgeError as e:
        raised = str(e)
    handle = export_state_async(f"{base}/c", run, params, exporter=exporter, target_chunk_bytes=64)
    handle.wait()
    return {"raised": raised, "b_exists": os.path.exists(f"{base}/b")}


@pytest.mark.slow
def test_background_failure_reaches_every_rank(tmp_path):
    """An error in rank 1's background writer is raised by the next export on both ranks, naming rank 1;
    the failed checkpoint leaves nothing behind; the next export commits."""
    from bridge.errors import BridgeError
    from bridge.store.reader import open_checkpoint

    base = str(tmp_path)
    results, _ = spawn(2, _fail_in_background, (base,), tmp_path)
    for r in results:
        assert r["raised"] is not None and "rank 1 failed during writing" in r["raised"], r
        assert "disk full (injected)" in r["raised"] and not r["b_exists"], r
    assert not os.path.exists(f"{base}/a") and not os.path.exists(f"{base}/a.orbax-checkpoint-tmp")
    with pytest.raises(BridgeError):
        open_checkpoint(f"{base}/a")
    _check_against_reference(f"{base}/c")


def _async_and_die(rank, world, dst, victim):
    import signal

    from bridge.live.export import Exporter, export_state_async

    params, run = _setup(rank, world)

    def die(stage):
        if rank == victim and stage == "writing":
            os.kill(os.getpid(), signal.SIGKILL)

    handle = export_state_async(dst, run, params, target_chunk_bytes=64, timeout=20, on_stage=die)
    handle.wait()
    return {"committed": True}


def _async_export(rank, world, dst):
    params, run = _setup(rank, world)
    from bridge.live.export import Exporter, export_state_async

    export_state_async(dst, run, params, target_chunk_bytes=64).wait()
    return {"committed": True}


@pytest.mark.slow
def test_sigkill_in_background_write_leaves_nothing_and_retry_succeeds(tmp_path):
    """Rank 1 SIGKILLed by a seam in its background writer (after its first batch): rank 0's wait()
    raises, nothing loadable is left at the destination, and a new run's export to it commits."""
    from bridge.errors import BridgeError
    from bridge.store.reader import open_checkpoint

    dst = str(tmp_path / "ckpt")
    _, errors = spawn(2, _async_and_die, (dst, 1), tmp_path, timeout_s=150, pg_timeout_s=20, allow_fail=True)
    assert errors.get(1) == "exit code -9", errors
    last = errors[0].strip().splitlines()[-1]
    assert last.startswith("bridge.errors.BridgeError: rank") and "nothing was committed" in last, errors[0]
    assert not os.path.exists(dst)
    with pytest.raises(BridgeError):
        open_checkpoint(dst)
    tmp = dst + ".orbax-checkpoint-tmp"
    if os.path.exists(tmp):
        with pytest.raises(BridgeError):
            open_checkpoint(tmp)
    spawn(2, _async_export, (dst,), tmp_path)  # the retry (a stale temp directory is taken over)
    _check_against_reference(dst)


def _twice(rank, world, base):
    from bridge.live.export import Exporter, export_state_async

    params, run = _setup(rank, world)
    exporter = Exporter()
    first = export_state_async(f"{base}/one", run, params, exporter=exporter, target_chunk_bytes=64)
    ptrs = [s.data_ptr() for s in exporter.slots.slots]
    allocs = exporter.slots.allocations
    second = export_state_async(f"{base}/two", run, params, exporter=exporter, target_chunk_bytes=64)
    first_done = first.done()  # the second call waited for the first
    second.wait()
    return {"first_done": first_done, "same_ptrs": ptrs == [s.data_ptr() for s in exporter.slots.slots],
            "allocs": [allocs, exporter.slots.allocations], "reported": [first.staging.allocations,
                                                                         second.staging.allocations]}


@pytest.mark.slow
def test_two_exports_reuse_the_staging_slots(tmp_path):
    """The second asynchronous export waits for the first and copies into the same slots (no allocation)."""
    results, _ = spawn(2, _twice, (str(tmp_path),), tmp_path)
    for r in results:
        assert r["first_done"] and r["same_ptrs"], r
        assert r["allocs"][0] >= 1 and r["allocs"][0] == r["allocs"][1] and r["reported"][0] == r["reported"][1], r
    _check_against_reference(f"{tmp_path}/one")
    _check_against_reference(f"{tmp_path}/two")


def _training_loop(rank, world, save_dir):
    """A loop shaped like Megatron-LM's with `AsyncSave`: finalize at each step's start, save every 2 steps."""
    from converters.megatron.live.async_save import AsyncSave
    from converters.megatron.read.rundir import read_tracker

    params, run = _setup(rank, world)
    saver = AsyncSave(save_dir)
    finalized, trackers = [], []
    for it in range(1, 6):
        done = saver.maybe_finalize()
        if done is not None:
            finalized.append(done)
        if it % 2 == 0:
            saver.save_state(it, run, params)
            trackers.append(read_tracker(save_dir))  # the previous save was finalized first
    finalized.append(saver.maybe_finalize(blocking=True))
    return {"finalized": finalized, "trackers": trackers, "final": read_tracker(save_dir)}


@pytest.mark.slow
def test_megatron_async_save_hook_run_directory(tmp_path):
    """`AsyncSave` writes iter_0000002 / iter_0000004 and the tracker as each commits; every save is finalized."""
    from converters.megatron.read.rundir import iteration_dir_name

    save_dir = str(tmp_path / "run")
    results, _ = spawn(2, _training_loop, (save_dir,), tmp_path)
    for r in results:
        assert r["trackers"][0] is None and r["trackers"][1] == 2 and r["final"] == 4, r
        assert set(r["finalized"]) <= {2, 4} and r["finalized"][-1] == 4, r  # 2 finalized by a step or by save(4)
    assert sorted(os.listdir(save_dir)) == [iteration_dir_name(2), iteration_dir_name(4),
                                            "latest_checkpointed_iteration.txt"]
    _check_against_reference(os.path.join(save_dir, iteration_dir_name(4)))


def test_snapshot_recipe_copies_every_piece_exactly():
    """The recipe's copies (runs merged along an item, and 2-row x 4-column outer chunks that are not
    contiguous in their item) put each piece's bytes at its slot offset: compared with numpy slicing."""
    import torch

    from bridge.layout.boxes import Box
    from bridge.layout.chunks import ArrayOwnership
    from bridge.live.snapshot import HostSlots, Recipe, SlotRing, Snapshot
    from bridge.live.staging import WriteItem
    from bridge.store.plan import ArraySpec, make_write_plan

    a = torch.arange(8 * 12, dtype=torch.float32).reshape(8, 12)
    b = torch.arange(64, dtype=torch.int16).to(torch.bfloat16)
    own = {"a": ArrayOwnership((8, 12), (2, 4), np.zeros((4, 3), dtype=np.int32)),   # columns cut: not contiguous
           "b": ArrayOwnership((64,), (8,), np.zeros((8,), dtype=np.int32))}          # 8 chunks of one item: one run
    plan = make_write_plan([ArraySpec("a", (8, 12), "float32"), ArraySpec("b", (64,), "bfloat16")], 1, own,
                           inner_chunk_bytes=None)
    items = [WriteItem("a", Box((0, 0), (8, 12)), a), WriteItem("b", Box((0,), (64,)), b)]
    recipe = Recipe.of(items, plan, 1 << 10)
    runs = [r for batch in recipe.runs for r in batch]
    assert sum(r.box is not None for r in runs) == 12 and sum(r.box is None for r in runs) >= 1
    assert sum(r.nbytes for r in runs if r.box is None and r.item == 1) == 128  # b: merged runs, all its bytes
    slots, _ = HostSlots().get(len(recipe.runs), recipe.slot_bytes, pinned=False)
    snap = Snapshot(SlotRing(slots), False, recipe, items)
    staged = [snap.stage(k) for k in range(len(recipe.runs))]
    snap.sync()
    a.fill_(-1.0)  # after the copies: the slots keep the state at the call
    seen = 0
    ref = {"a": np.arange(96, dtype=np.float32).reshape(8, 12), "b": np.arange(64, dtype=np.float32)}
    for s in staged:
        for it in s.items():
            got = it.data.float().numpy()
            assert np.array_equal(got, ref[it.name][it.box.slices]), (it.name, it.box)
            seen += it.box.size
    assert seen == 96 + 64
