"""The destinations this process holds: claimed, and neither published nor released yet.

Both kinds of claim enter here: `bridge.store.claim.DestinationClaim` (a file system) and
`bridge.store.remote.RemoteDestination` (object storage). This is no registry to find a claim by
its location: the claim is the handle `begin_checkpoint` / `Storage.claim` returns, passed down to
the commit. It serves the process's exit only: while any is held, SIGTERM / SIGHUP raise
`Terminated` in the main thread, so the `with` blocks that hold them release what they wrote; at
exit every one still held is released.
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import threading
from abc import ABC, abstractmethod
from typing import Self

from bridge.store.claim_info import ClaimInfo

_LIVE: list["HeldDestination"] = []   # claims of this process not yet published or released (by identity)
_LOCK = threading.Lock()
_PREVIOUS_HANDLERS: dict[int, object] = {}
_TERM_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


class Terminated(SystemExit):
    """SIGTERM (or SIGHUP) turned into an exception, so cleanup handlers run; exit code 128 + signal."""

    def __init__(self, signum: int) -> None:
        super().__init__(128 + signum)
        self.signum = signum


class HeldDestination(ABC):
    """What every `Destination` shares: the run id, and a `with` block that releases the destination
    unless it was published (on an error, SIGINT or SIGTERM: `Terminated`)."""

    info: ClaimInfo
    published: bool

    @property
    def run_id(self) -> str:
        return self.info.run_id

    def made_here(self) -> bool:
        """True in the process that claimed (never in another rank's process holding a handle on
        the same claim, nor in a forked child): only that process removes what the run wrote."""
        return self.info.pid == os.getpid() and self.info.host == socket.gethostname()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self.published:
            self.release(reason=release_reason(exc))

    @abstractmethod
    def release(self, reason: str = "") -> None:
        """Remove what this run wrote unless it was published (each storage knows its own)."""


def release_reason(exc: BaseException | None) -> str:
    if exc is None:
        return ""
    if isinstance(exc, Terminated):
        return f"terminated by {signal.Signals(exc.signum).name}"
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted"
    return ""  # errors are reported by whoever catches them


def hold(dest: HeldDestination) -> None:
    """`dest` is held by this process; SIGTERM / SIGHUP now raise `Terminated` (main thread)."""
    with _LOCK:
        if not any(d is dest for d in _LIVE):
            _LIVE.append(dest)
    install_signal_handlers()


def forget(dest: HeldDestination) -> None:
    """`dest` is no longer held (published or released); with the last one, the signal handlers
    the application had come back."""
    with _LOCK:
        _LIVE[:] = [d for d in _LIVE if d is not dest]
        empty = not _LIVE
    if empty:
        restore_signal_handlers()


def all_held() -> list[HeldDestination]:
    """Every destination this process holds (for its exit, and for a claim's stale check of its own run)."""
    with _LOCK:
        return list(_LIVE)


def _on_terminate(signum, frame) -> None:
    raise Terminated(signum)


def install_signal_handlers() -> None:
    if threading.current_thread() is not threading.main_thread():
        return  # only the main thread may set handlers; its own claims install them
    for sig in _TERM_SIGNALS:
        if sig in _PREVIOUS_HANDLERS:
            continue
        prev = signal.getsignal(sig)
        if prev not in (signal.SIG_DFL, None):
            continue  # the application handles it (e.g. a training loop's graceful stop): leave it be
        _PREVIOUS_HANDLERS[sig] = signal.SIG_DFL if prev is None else prev  # None: not set from Python
        signal.signal(sig, _on_terminate)


def restore_signal_handlers() -> None:
    if threading.current_thread() is not threading.main_thread():
        return
    for sig, prev in list(_PREVIOUS_HANDLERS.items()):
        if signal.getsignal(sig) is _on_terminate:
            signal.signal(sig, prev)
        del _PREVIOUS_HANDLERS[sig]


@atexit.register
def _release_all_at_exit() -> None:
    for dest in all_held():
        try:
            dest.release(reason="exiting before the commit")
        except OSError:
            pass
