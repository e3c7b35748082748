"""The asynchronous export's writer process (bridge/live/writer_process.py), on spawned gloo ranks.

The background writes of `export_async` run in a process of the exporter's own (out of the
training's GIL): it writes the checkpoint's bytes (its /proc write counter grows by at least the
bytes written), is reused across exports and follows the exporter's slots when they are allocated
again at another size, is replaced after it died (SIGKILLed mid-write: every
rank raises naming the rank, nothing loadable is left, the next export commits), and dies with
its parent (the rank SIGKILLed while its writer holds a batch).
"""

from __future__ import annotations

import os
import select
import signal

import pytest

from test_live_export_async import _check_against_reference, _setup
from spawn_ranks import spawn


def _wchar(pid: int) -> int:
    with open(f"/proc/{pid}/io") as f:
        return int(next(line.split()[1] for line in f if line.startswith("wchar:")))


def _kill_writer_then_retry(rank, world, base):
    """Rank 1 SIGKILLs its writer process after the first batch went to it; both ranks' wait() raise;
    the same exporter's next export starts a new writer and commits; the one after reuses it."""
    from bridge.errors import BridgeError
    from bridge.live.export import Exporter, export_state_async

    params, run = _setup(rank, world)
    exporter = Exporter()
    first_pid = []

    def kill_writer(stage):
        if stage == "writing":
            first_pid.append(exporter.writer.pid)
            if rank == 1:
                os.kill(exporter.writer.pid, signal.SIGKILL)

    export_state_async(f"{base}/a", run, params, exporter=exporter, target_chunk_bytes=64, on_stage=kill_writer)
    try:  # the failure surfaces at the next export (it waits for the one in flight)
        export_state_async(f"{base}/a", run, params, exporter=exporter, target_chunk_bytes=64)
        raised = None
    except BridgeError as e:
        raised = str(e)
    h = export_state_async(f"{base}/a", run, params, exporter=exporter, target_chunk_bytes=64)
    h.wait()
    second_pid = exporter.writer.pid
    sizes = [h.staging.slot_bytes]

    def scribble():  # committed: the slots' content is no longer needed; a writer still reading them is caught
        for t in exporter.slots.slots:
            t.fill_(255)

    scribble()
    before = _wchar(second_pid)
    # smaller slots (more of them: every slot allocated again), then larger ones again (fewer)
    h = export_state_async(f"{base}/b", run, params, exporter=exporter, target_chunk_bytes=64, inflight_bytes=4096)
    report = h.wait()
    wrote = _wchar(second_pid) - before
    sizes.append(h.staging.slot_bytes)
    scribble()
    h = export_state_async(f"{base}/c", run, params, exporter=exporter, target_chunk_bytes=64)
    h.wait()
    sizes.append(h.staging.slot_bytes)
    return {"raised": raised, "pids": [first_pid[0], second_pid, exporter.writer.pid], "me": os.getpid(),
            "child_wrote": wrote, "bytes_written": report.bytes_written, "slot_bytes": sizes}


# A rank aborting (SIGABRT, exit -6) in its teardown fails these two tests. After a failure in the
# writer process the failed handle, the exporter and its background gloo group used to form a
# reference cycle (the failure's traceback held their frames), so `destroy_process_group` left that
# group's gloo threads running into the interpreter's finalization, where one still dropping its last
# collective aborted the process. The order matters: the exporter must be freed (by reference
# counting, tests/live/test_live_export_failure_frees.py) before the group is destroyed, so that the
# group's threads are joined while Python can still run them. Measured on the 2-core machine under
# the other sessions' load, both tests' rank functions interleaved: a rank aborted in 10 of 140 runs
# at 5855b1c, 0 of 138 with the fix (issue 33).
def test_writer_process_killed_mid_write_fails_every_rank_and_is_replaced(tmp_path):
    base = str(tmp_path)
    results, _ = spawn(2, _kill_writer_then_retry, (base,), tmp_path, timeout_s=200, pg_timeout_s=30)
    for rank, r in enumerate(results):
        assert r["raised"] is not None and "rank 1 failed during writing" in r["raised"], r
        assert "writer process" in r["raised"] and "signal 9" in r["raised"] and "nothing" in r["raised"], r
        first, second, third = r["pids"]
        assert r["me"] not in (first, second) and second == third, r
        assert (first != second) == (rank == 1), r  # rank 1's writer was replaced, rank 0's kept
        assert r["bytes_written"] > 0 and r["child_wrote"] >= r["bytes_written"], r  # the child wrote the bytes
        a, b, c = r["slot_bytes"]
        assert b < a and c == a, r
    _check_against_reference(f"{base}/a")  # the retry over the failed export's destination committed
    _check_against_reference(f"{base}/b")  # new slots: the writer maps the new memory, not the old
    _check_against_reference(f"{base}/c")


def _die_while_writing(rank, world, base):
    """Each rank records its writer's pid and SIGKILLs itself once the first batch went to the writer."""
    from bridge.live.export import Exporter, export_state_async

    params, run = _setup(rank, world)
    exporter = Exporter()

    def die(stage):
        if stage == "writing":
            with open(f"{base}/writer_{rank}.pid", "w") as f:
                f.write(str(exporter.writer.pid))
            os.kill(os.getpid(), signal.SIGKILL)

    export_state_async(f"{base}/ckpt", run, params, exporter=exporter, target_chunk_bytes=64, on_stage=die).wait()


@pytest.mark.slow
def test_writer_process_dies_with_its_parent(tmp_path):
    """SIGKILL of the training process: its writer process exits too, and nothing loadable is left."""
    from bridge.errors import BridgeError
    from bridge.store.reader import open_checkpoint

    base = str(tmp_path)
    _, errors = spawn(2, _die_while_writing, (base,), tmp_path, timeout_s=150, pg_timeout_s=20, allow_fail=True)
    assert errors == {0: "exit code -9", 1: "exit code -9"}, errors
    for rank in range(2):
        pid = int(open(f"{base}/writer_{rank}.pid").read())
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            continue  # gone already
        try:
            # Readable once the process exited; the writer exits when its pipe ends (the parent died).
            ready, _, _ = select.select([fd], [], [], 60)
            assert ready, f"writer process {pid} of rank {rank} outlived its parent"
        finally:
            os.close(fd)
    with pytest.raises(BridgeError):
        open_checkpoint(f"{base}/ckpt")


def _writer_fails_in_child(rank, world, dst):
    """Rank 1's store writer fails inside the writer process (its database path is taken by a file,
    put there before the writer starts); then the same exporter exports again to `dst`."""
    from bridge.errors import BridgeError
    from bridge.live.export import Exporter, export_state_async

    params, run = _setup(rank, world)
    exporter = Exporter()

    def block(stage):
        if rank == 1 and stage == "staged":  # the call's copies are done; the writer starts after this
            open(os.path.join(dst + ".orbax-checkpoint-tmp", "ocdbt.process_1"), "w").close()

    h = export_state_async(dst, run, params, exporter=exporter, target_chunk_bytes=64, on_stage=block)
    try:
        h.wait()
        raised = None
    except BridgeError as e:
        raised = str(e)
    try:  # the failure is raised again by the next export (it waits for the one in flight)
        export_state_async(dst, run, params, exporter=exporter, target_chunk_bytes=64)
    except BridgeError:
        pass
    export_state_async(dst, run, params, exporter=exporter, target_chunk_bytes=64).wait()
    return {"raised": raised}


@pytest.mark.slow
def test_failure_inside_the_writer_process_reaches_every_rank(tmp_path):
    """An error of rank 1's store writer in its writer process: both ranks' wait() raise it naming
    rank 1; nothing is committed; the next export to the same destination commits."""
    dst = str(tmp_path / "ckpt")
    results, _ = spawn(2, _writer_fails_in_child, (dst,), tmp_path, timeout_s=200, pg_timeout_s=30)
    for r in results:
        assert r["raised"] is not None and "rank 1 failed during writing" in r["raised"], r
        assert "ocdbt.process_1" in r["raised"] or "writer 1" in r["raised"], r
    _check_against_reference(dst)


def test_shared_slots_free_their_memory():
    """Slots allocated again at another size, or an exporter's slots dropped without close (as
    `export_state_async` without `exporter=` does), give their shared memory back: the process's
    open descriptors (each slot's memfd and its mapping's) return to where they were."""
    import gc

    import torch  # noqa: F401 (imported before the count: it opens descriptors of its own)

    from bridge.live.shared_slots import SharedSlots

    def open_fds() -> int:
        """Descriptors of shared memory (memfds) this process holds: other descriptors come and go with
        whatever earlier tests left for the collector."""
        n = 0
        for fd in os.listdir("/proc/self/fd"):
            try:
                n += os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:")
            except OSError:
                pass
        return n

    gc.collect()
    n0 = open_fds()
    slots = SharedSlots()
    slots.get(4, 1 << 20, pinned=False)
    assert open_fds() == n0 + 8 and len(slots.shared) == 4
    slots.get(3, 2 << 20, pinned=False)  # another size: the four are freed, three allocated
    assert open_fds() == n0 + 6 and len(slots.shared) == 3 and slots.allocations == 7
    del slots
    gc.collect()
    assert open_fds() == n0
