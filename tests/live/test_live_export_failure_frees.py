"""A failed asynchronous export leaves no reference cycle (bridge/live/background.py, issue 33).

An exception's traceback holds the frames it went through (their locals, their function's
closure). When `ExportHandle` kept its failure with the background thread's traceback, and
raised that same object from every `wait()` (adding the caller's frames), the handle, the
exporter and the exporter's background gloo group formed a cycle that only the garbage
collector frees. `destroy_process_group` then did not destroy that group, its gloo worker threads
ran on into the interpreter's finalization, and a worker still dropping its last collective then
needed the GIL: std::terminate, SIGABRT at the rank's exit (1 to 6 in 30 runs of the writer
process' failure tests). These tests run with the garbage collector off: what reference counting
does not free is a cycle.
"""

from __future__ import annotations

import gc
import os
import weakref
from contextlib import contextmanager

import pytest

from spawn_ranks import spawn
from test_live_export_async import _setup


@contextmanager
def _no_gc():
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


class _Owner:
    """Stands for the exporter: what the background function's closure holds."""


def test_a_failed_handle_and_what_its_background_held_are_freed_without_the_collector():
    """The caller keeps the handle and catches its failure (a traceback through the caller's frame):
    once the caller drops the handle, the handle and the objects its background function held are
    gone by reference counting. Every wait() raises the failure: same type, message, attributes."""
    from bridge.dist import CollectiveError
    from bridge.errors import BridgeError
    from bridge.live.background import ExportHandle

    def start(owner: _Owner) -> ExportHandle:
        def background():
            held = owner  # noqa: F841 (a local of the failing frame, as the export's are)
            raise CollectiveError("writing", {1: "rank 1: disk full"}, job="export to /c") from OSError("disk full")

        return ExportHandle("/c", background).start()

    with _no_gc():
        owner = _Owner()
        h = start(owner)
        seen = []
        for _ in range(2):
            try:
                h.wait()
            except BridgeError as e:
                seen.append((type(e), str(e), e.failures, e.stage, type(e.__cause__)))
                note = "\n".join(getattr(e, "__notes__", []))
        refs = weakref.ref(owner), weakref.ref(h)
        del owner, h
        freed = [r() is None for r in refs]
    assert seen == [(CollectiveError, "export to /c: rank 1 failed during writing: disk full", {1: "rank 1: disk full"},
                     "writing", OSError)] * 2, seen
    assert freed == [True, True], freed
    assert "in background" in note and "raise CollectiveError" in note, note  # where it was raised, as text


def _fail_then_drop(rank, world, dst):
    """Rank 1's store writer fails inside the writer process (as in test_live_export_writer_process);
    both ranks catch it from wait() and again from the next export, then drop the exporter."""
    from bridge.errors import BridgeError
    from bridge.live.export import Exporter, export_state_async

    def run() -> tuple[weakref.ref, weakref.ref, list]:
        params, live = _setup(rank, world)
        exporter = Exporter()

        def block(stage):
            if rank == 1 and stage == "staged":
                open(os.path.join(dst + ".orbax-checkpoint-tmp", "ocdbt.process_1"), "w").close()

        raised = []
        h = export_state_async(dst, live, params, exporter=exporter, target_chunk_bytes=64, on_stage=block)
        try:
            h.wait()
        except BridgeError as e:
            raised.append(str(e))
        try:
            export_state_async(dst, live, params, exporter=exporter, target_chunk_bytes=64)
        except BridgeError as e:
            raised.append(str(e))
        return weakref.ref(exporter), weakref.ref(h), raised

    import torch.distributed as dist

    with _no_gc():
        exporter, handle, raised = run()
        out = {"exporter_freed": exporter() is None, "handle_freed": handle() is None, "raised": raised,
               "gloo_threads": _gloo_threads()}
        dist.destroy_process_group()
        out["gloo_threads_after_destroy"] = _gloo_threads()   # what would run into the interpreter's exit
    # a group again, for `spawn`'s own destroy_process_group
    dist.init_process_group("gloo", init_method=f"file://{dst}.pg", rank=rank, world_size=world)
    return out


def _gloo_threads() -> int:
    """This process's gloo worker threads (torch names them pt_gloo_runloop)."""
    n = 0
    for t in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{t}/comm") as f:
                n += f.read().strip() == "pt_gloo_runloop"
        except OSError:  # the thread ended meanwhile
            pass
    return n


@pytest.mark.slow
def test_a_failed_export_frees_its_exporter_without_the_collector(tmp_path):
    """After a failure in the writer process, every rank's exporter (its background gloo group, its
    writer process, its slots) is freed as soon as the rank drops it, so `destroy_process_group`
    destroys that group and joins its gloo threads before the interpreter exits."""
    dst = str(tmp_path / "ckpt")
    results, _ = spawn(2, _fail_then_drop, (dst,), tmp_path, timeout_s=200, pg_timeout_s=30)
    for r in results:
        assert len(r["raised"]) == 2 and all("rank 1 failed during writing" in m for m in r["raised"]), r
        assert r["exporter_freed"] and r["handle_freed"], r
        # the world's group and the exporter's background group had theirs; none is left
        assert r["gloo_threads"] > 0 and r["gloo_threads_after_destroy"] == 0, r
