"""What a writer process does so that it never outlives the command that started it.

Every command that writes through worker processes (`convert`'s writers, the streamed MaxText
moves) starts them with `spawn`; a worker calls `die_with_parent()` first. A parent that ends
normally, by an error or by Ctrl-C kills its workers itself; one that is SIGKILLed (the OOM killer,
a scheduler's kill, `kill -9`) cannot, and its workers would go on writing into a temporary
directory nobody will commit or remove.
"""

from __future__ import annotations

import os
import signal
import sys
import time


def die_with_parent() -> None:
    """In a worker: be killed (SIGKILL) when the parent process dies, however it dies (Linux's
    PR_SET_PDEATHSIG), and leave SIGINT to the parent, which stops the workers and cleans up."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        try:
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass
    # the parent died before the death signal was armed: we were reparented already
    if os.getppid() != parent or parent == 1:
        os._exit(1)


#: private test seam, not an option: a directory where each writer, once its first block is written,
#: creates `held.<writer>` (holding its pid) and then waits, so that a test signals a run known to be
#: mid-write
TESTING_HOLD_ENV = "_GTP_BRIDGE_TESTING_HOLD_WRITERS"


def testing_hold(writer_id: int) -> None:
    """The seam `TESTING_HOLD_ENV`: hold this writer after its first block, for the tests."""
    where = os.environ.get(TESTING_HOLD_ENV)
    if where and not os.path.exists(os.path.join(where, f"held.{writer_id}")):
        tmp = os.path.join(where, f".held.{writer_id}.{os.getpid()}")
        with open(tmp, "w") as f:
            f.write(str(os.getpid()))
        os.replace(tmp, os.path.join(where, f"held.{writer_id}"))   # whole, with its pid, when it appears
        while True:
            time.sleep(3600)   # until the test's signal ends the run
