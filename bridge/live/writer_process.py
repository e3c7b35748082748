"""The asynchronous export's writer process: digests, encoding and writes outside the training's GIL.

An asynchronous export copies this rank's bytes into staging slots and returns; what follows
(digests, TensorStore's encoding and writes, the per-batch commits) is CPU work in Python and
numpy. Done by a thread of the training process it takes the GIL from the training loop, whose
steps are mostly Python launching kernels: measured on one H200 (0.85 B run), steps 3.9-6.2x
slower while an export wrote. So that work runs in a writer process of its own:

- the slots are shared memory (`SharedSlots`: one `memfd` each, not bounded by /dev/shm's size),
  pinned for CUDA copies with `cudaHostRegister`, allocated once and kept across exports; the
  writer maps each slot once (its file descriptor passed over the pipe);
- `WriterProcess` is started once per exporter (a plain `python -m` child, so a training script's
  `__main__` is never re-imported, unlike multiprocessing's spawn) and reused by every export;
  it is started again after it died;
- per export the training process only sends small messages (the batch's slot and its pieces:
  name, box, dtype, offset) and hears back which slots the store let go of; the ranks' meeting and
  rank 0's commit stay in the training process (its gloo group), so a writer that dies leaves
  nothing committed, and a writer dies with its parent (its pipe reaches end of file).

Protocol (parent -> child): ("slot", i, size) followed by the descriptor; ("slots", n): unmap
slots n and above; ("begin", kwargs);
("batch", slot, pieces); ("finish", scalars); ("abort",). Child -> parent: ("released", slot),
("error", text), ("done", bytes, calls, commit_wait_s).
"""

from __future__ import annotations

import mmap
import os
import socket
import subprocess
import sys
import threading
from collections import deque
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle, send_handle
from typing import Any, Callable, Sequence

from bridge.errors import BridgeError
from bridge.worker_life import die_with_parent

class WriterProcess:
    """The writer child of one exporter (see the module docstring); `ensure()` starts it when needed.

    `pid` is the child's process id (None before the first start). Slots are sent to the child once
    each (`share`); a new child gets every slot again.
    """

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self._shared: dict[int, int] = {}   # slot index -> serial of the SharedSlot the child maps
        self._lock = threading.Lock()       # one sender at a time (the call shares slots, the thread batches)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def ensure(self) -> None:
        """Start the child unless it is running."""
        if self.alive():
            return
        self.close()
        parent, child = socket.socketpair()
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
        # No CUDA in the writer: it only reads host memory.
        env["CUDA_VISIBLE_DEVICES"] = ""
        self._proc = subprocess.Popen([sys.executable, "-m", "bridge.live.writer_process", str(child.fileno())],
                                      pass_fds=(child.fileno(),), env=env, stdin=subprocess.DEVNULL)
        child.close()
        self._conn = Connection(parent.detach())
        self._shared.clear()

    def share(self, slots: Sequence[Any]) -> None:
        """Make the child map exactly `slots` (every `SharedSlot` the exporter holds, by index): the
        ones it does not map yet are sent, the ones the exporter dropped are unmapped."""
        with self._lock:
            for i, s in enumerate(slots):
                if self._shared.get(i) != s.serial:
                    self._conn.send(("slot", i, s.size))
                    send_handle(self._conn, s.fd, self._proc.pid)
                    self._shared[i] = s.serial
            if len(self._shared) > len(slots):
                self._conn.send(("slots", len(slots)))
                for i in range(len(slots), len(self._shared)):
                    del self._shared[i]

    def send(self, msg: tuple) -> None:
        with self._lock:
            self._conn.send(msg)

    def recv(self) -> tuple:
        """The child's next message; BridgeError naming the child when it died."""
        try:
            return self._conn.recv()
        except (EOFError, OSError):
            code = self._proc.wait()
            how = f"signal {-code}" if code < 0 else f"exit code {code}"
            raise BridgeError(f"the export's writer process (pid {self._proc.pid}) died ({how}); "
                              "nothing of this checkpoint was committed") from None

    def __del__(self) -> None:
        # The exporter is gone: closing the pipe ends the child (it exits at end of file).
        if self._conn is not None:
            self._conn.close()

    def close(self) -> None:
        """Stop the child (its pipe closes: it exits) and wait for it."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self._proc is not None:
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None


def write_in_process(proc: WriterProcess, job: Any, slots: Sequence[Any], begin: dict, scalars: list,
                     on_first: Callable[[], None] | None) -> tuple[int, int, float]:
    """The parent's side of one export: each staged batch (from `job.queue`, None ends) handed to the
    writer process, its slot released to `job.ring` when the child says the store let go of it.
    Failures go to `job.failed` (reported at the ranks' meeting), never raised; returns (bytes
    written, writer calls, seconds the writer waited for commits)."""
    failed = job.failed
    result: dict = {}

    def listen() -> None:  # a thread: slot releases arrive while the call may still be copying
        try:
            while True:
                msg = proc.recv()
                if msg[0] == "released":
                    job.ring.release(msg[1])
                elif msg[0] == "error":
                    e = BridgeError(msg[1])
                    failed.append(e)
                    job.ring.close(e)
                elif msg[0] == "done":
                    result["done"] = msg[1:]
                    return
        except BridgeError as e:
            failed.append(e)
            job.ring.close(e)

    sent_first = False
    try:
        proc.ensure()
        proc.share(slots)
        proc.send(("begin", begin))
    except Exception as e:  # noqa: BLE001 (reported at the meeting)
        failed.append(BridgeError(f"could not start the export's writer process: {e}"))
        job.ring.close(failed[-1])
        while job.queue.get() is not None:
            pass
        return 0, 0, 0.0
    listener = threading.Thread(target=listen, name="gtp-bridge-writer-listen", daemon=True)
    listener.start()
    while (staged := job.queue.get()) is not None:
        try:
            staged.wait()  # the call's copies into this slot are done
            proc.send(("batch", staged.slot, staged.wire_pieces()))
        except Exception as e:  # noqa: BLE001
            failed.append(e)
        if not sent_first and on_first is not None and not failed:
            sent_first = True
            try:
                on_first()
            except Exception as e:  # noqa: BLE001
                failed.append(e)
    try:
        proc.send(("abort",) if failed else ("finish", scalars))
    except Exception:  # noqa: BLE001 (the child is gone: the listener reports it)
        pass
    listener.join()
    return result.get("done", (0, 0, 0.0))


# -- the child ----------------------------------------------------------------------------------------

def _child(fd: int) -> None:
    """The writer process's loop (see the module docstring)."""
    import numpy as np

    from bridge.dtypes import numpy_dtype
    from bridge.layout.boxes import Box
    from bridge.store import CheckpointWriter

    # Ctrl-C reaches the whole process group: the training process decides. A killed trainer's
    # writer stops at once (not at its pipe's end after the batch in hand): the other ranks remove
    # the temporary directory, and an orphan still writing would recreate it without a claim.
    die_with_parent()
    conn = Connection(fd)
    maps: dict[int, mmap.mmap] = {}
    writer = None
    failed = None
    inflight: deque = deque()
    depth = 1
    calls = 0

    def release_down_to(keep: int) -> None:
        while len(inflight) > keep:
            conn.send(("released", inflight.popleft()))

    def fail(e: BaseException) -> None:
        nonlocal failed
        if failed is None:
            failed = f"{type(e).__name__}: {e}" if not isinstance(e, BridgeError) else str(e)
            conn.send(("error", failed))

    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):  # the parent is gone (or closed us): nothing to commit here
            os._exit(0)
        kind = msg[0]
        if kind == "slot":
            _, i, size = msg
            h = recv_handle(conn)
            maps[i] = mmap.mmap(h, size)   # the slot it replaces, if any, is unmapped
            os.close(h)
        elif kind == "slots":  # the exporter holds fewer slots now
            for i in [i for i in maps if i >= msg[1]]:
                del maps[i]
        elif kind == "begin":
            kw = msg[1]
            depth = kw.pop("depth")
            writer, failed, calls = None, None, 0
            try:
                writer = CheckpointWriter(kw.pop("tmp"), kw.pop("plan"), kw.pop("rank"), commit_depth=depth, **kw)
            except Exception as e:  # noqa: BLE001
                fail(e)
        elif kind == "batch":
            _, slot, pieces = msg
            if failed is None:
                try:
                    buf, arr = maps[slot], None
                    for name, start, stop, dtype, off in pieces:
                        box = Box(start, stop)
                        dt = numpy_dtype(dtype)
                        arr = np.frombuffer(buf, dtype=dt, count=box.size, offset=off).reshape(box.shape)
                        writer.write(name, box, arr, donate=True)
                    del arr
                    writer.flush(wait=False)   # returns once all but the last depth - 1 commits landed
                    calls += len(pieces)
                except Exception as e:  # noqa: BLE001
                    fail(e)
            inflight.append(slot)
            release_down_to(0 if failed is not None else depth)
        elif kind in ("finish", "abort"):
            if (kind == "abort" or failed is not None) and writer is not None:
                try:  # let TensorStore finish with the slots (and the temporary directory) first
                    writer.flush()
                except Exception:  # noqa: BLE001 (already failing; the first error was reported)
                    pass
            if kind == "finish" and failed is None:
                try:
                    for name, value, dtype in msg[1]:
                        writer.write(name, Box((), ()), np.asarray(value, dtype=dtype))
                    writer.finish()   # every commit landed: no slot is referenced any more
                except Exception as e:  # noqa: BLE001
                    fail(e)
            release_down_to(0)
            out = writer
            writer = None
            conn.send(("done", out.bytes_written if out else 0, calls, out.commit_wait_s if out else 0.0))


if __name__ == "__main__":
    _child(int(sys.argv[1]))
