"""The handle of an asynchronous export, and the process group its background part talks over.

`ExportHandle` is what `Exporter.export_async` returns once the rank's bytes are in host memory:
the rest of the export runs on a thread; `done()` says whether it finished, `wait()` returns the
`ExportReport` or raises its failure. The background parts of all ranks meet (and rank 0 commits)
over a process group of their own (`background_group`), so a failure reaches every rank, naming
the failing one, and the same error is raised by `wait()` (or by the next export) on each.
"""

from __future__ import annotations

import threading
import time
import traceback
from typing import Any, Callable

from bridge.errors import BridgeError


def background_group(group: Any, timeout: float = 600.0) -> Any:
    """A gloo process group over the ranks of `group`, for collectives issued from a background thread.

    Why a group of its own: the training loop issues its own collectives on its groups (NCCL on
    GPU) from its thread, in its own order. A collective of the background thread on one of those
    groups would interleave with them in a different order on different ranks (a deadlock, or two
    different collectives paired up). A separate gloo group is a separate communicator on the CPU
    (TCP): it never enters the training's CUDA streams nor its NCCL communicators, and only the
    background threads use it, one export at a time, so every rank issues its collectives in the
    same order. (torch DCP's `async_save` takes a gloo group for the same reason.) Creating it is a
    collective over `group`'s members (`use_local_synchronization`): the caller does it in the
    foreground, where every rank calls the export at the same point. `timeout` (seconds): how long a
    background collective waits for a peer.
    """
    import datetime

    import torch.distributed as dist

    ranks = sorted(dist.get_process_group_ranks(group))
    return dist.new_group(ranks=ranks, backend="gloo", use_local_synchronization=True,
                          timeout=datetime.timedelta(seconds=timeout))


class ExportHandle:
    """An asynchronous export in flight (see `Exporter.export_async`).

    `path`: the checkpoint once committed. `blocked_s`: seconds the call blocked the caller.
    `staging`: the staging slots' `SnapshotStats`. `done()` does not block; `wait()` blocks until the
    background part finished and returns this rank's `ExportReport`, or raises its failure — the
    same `BridgeError` on every rank, naming the rank that failed (every later `wait()` raises it too).
    """

    def __init__(self, path: str, run: Callable[[], Any], *, blocked_s: float = 0.0, staging: Any = None) -> None:
        self.path = path
        self.blocked_s = blocked_s
        self.staging = staging
        self._report: Any = None
        self._error: BaseException | None = None
        self.finished_at: float | None = None   # time.perf_counter() when the background part ended

        def body() -> None:
            try:
                self._report = run()
            except BaseException as e:  # kept for wait(): the thread has nobody else to tell
                self._error = _kept(e)
            finally:
                self.finished_at = time.perf_counter()

        # Not a daemon: a script that ends without wait() still finishes (and commits) the checkpoint.
        self._thread = threading.Thread(target=body, name="gtp-bridge-export", daemon=False)

    def start(self) -> "ExportHandle":
        self._thread.start()
        return self

    def done(self) -> bool:
        """Whether the background part finished (committed or failed); never blocks."""
        return not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> Any:
        """Block until the checkpoint is committed; returns this rank's `ExportReport`.

        Raises the background failure (the same on every rank): each call a new copy of it (type,
        message, attributes; the background thread's traceback as a note), see `_kept`. With
        `timeout` (seconds) and the export still running then, raises BridgeError saying so (the
        export continues).
        """
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise BridgeError(f"export to {self.path} still running after {timeout:.0f} s; call wait() again")
        if self._error is not None:
            raise _copy_to_raise(self._error)
        return self._report


# Why a failure is kept without tracebacks and raised as a copy: a traceback holds the frames it went
# through, and a frame its function (hence closures) and its caller's frame, even once cleared. The
# background thread's frames hold the exporter and this handle; raising the stored object itself
# would add the caller's frames, which hold this handle too. Either way the handle, the exporter and
# its gloo group (`background_group`) form a reference cycle, alive until the garbage collector runs:
# `destroy_process_group` then leaves that group's worker threads running, and one still releasing
# its last collective when the interpreter finalizes aborts the process (std::terminate, SIGABRT:
# a rank dying at exit after a failed export, 1 to 6 in 30 runs on a loaded 2-core machine).


def _kept(e: BaseException) -> BaseException:
    """`e` as a handle keeps it: the background thread's traceback as text (a note), no traceback
    object left in it, its cause's or its context's (nothing holding a frame)."""
    text = "".join(traceback.format_exception(e)).rstrip()
    seen: set[int] = set()
    stack: list[BaseException | None] = [e]
    while stack:
        x = stack.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        x.__traceback__ = None
        stack += [x.__cause__, x.__context__]
    e.add_note(f"raised in the export's background thread:\n{text}")
    return e


def _copy_to_raise(e: BaseException) -> BaseException:
    """A new exception equal to `e` (type, args, attributes, notes, cause), raised in its place so
    that the caller's frames go into the copy's traceback, never into `e`'s."""
    reduced = e.__reduce__()   # (type, arguments, ...): an OSError's filename is among them, not in `args`
    args = reduced[1] if reduced[0] is type(e) else e.args
    new = type(e).__new__(type(e), *args)  # no __init__: its parameters need not be these
    new.__dict__.update(e.__dict__)
    if "__notes__" in e.__dict__:
        new.__notes__ = list(e.__notes__)  # a note the caller adds stays on its copy
    new.__cause__, new.__context__, new.__suppress_context__ = e.__cause__, e.__context__, e.__suppress_context__
    return new
