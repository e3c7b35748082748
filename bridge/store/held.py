"""The destinations this process holds: claimed, and neither published nor released yet.

Both kinds of claim register here: `bridge.store.claim.DestinationClaim` (a file system; keyed by
its temporary directory) and `bridge.store.remote.RemoteDestination` (object storage; keyed by its
URL). While any is held, SIGTERM / SIGHUP raise `Terminated` in the main thread, so the `with`
blocks that hold them release what they wrote; at exit every one still held is released.
"""

from __future__ import annotations

import atexit
import signal
import threading
from abc import ABC, abstractmethod
from typing import Self

from bridge.store.claim_info import ClaimInfo

_HELD: dict[str, "HeldDestination"] = {}   # a local claim's temp directory / a remote claim's URL -> its claim
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


def hold(key: str, dest: HeldDestination) -> None:
    """Register `dest` as held under `key`; SIGTERM / SIGHUP now raise `Terminated` (main thread)."""
    with _LOCK:
        _HELD[key] = dest
    install_signal_handlers()


def forget(key: str, dest: HeldDestination) -> None:
    """`dest` is no longer held (published or released); with the last one, the signal handlers
    the application had come back."""
    with _LOCK:
        if _HELD.get(key) is dest:
            del _HELD[key]
        empty = not _HELD
    if empty:
        restore_signal_handlers()


def lookup(key: str) -> HeldDestination | None:
    """The destination held under `key`, if any."""
    with _LOCK:
        return _HELD.get(key)


def all_held() -> list[HeldDestination]:
    with _LOCK:
        return list(_HELD.values())


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
