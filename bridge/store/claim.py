"""Exclusive ownership of a destination: one run writes DST, nobody else's files are ever deleted.

Every writer (convert, to-megatron, live export, JAX save) claims its destination the same way:

    with claim_destination(dst, sources=[src]) as claim:     # refuses DST, SRC/DST overlaps, a busy temp
        ... write everything into claim.tmp ...
        claim.publish()                                      # atomic no-replace rename claim.tmp -> DST

The claim is `<DST>.orbax-checkpoint-tmp` (Orbax's temp name, the same for every process of a
multi-process run, so ranks agree on it without talking), created with an atomic `mkdir` and
holding `.gtpb-claim.json` (run id, pid, host, boot id, the pid's start time). A second run to the
same DST finds the directory and fails in one line. An existing temp directory is removed only when
its claim file proves it is a stale temp of a gtp-bridge run on this host whose process is dead
(then the removal is reported); anything else (a user's directory, a live run, another host) is
refused and never touched. On an exception, SIGINT or SIGTERM the run removes what it created; the
rename never replaces a DST that appeared meanwhile (renameat2 RENAME_NOREPLACE).

Claims are made under an flock of DST's parent directory, so two processes on one host never
inspect, take over or create the temp directory at the same time. Every process of the run (the
claimant, and each writer process that calls `hold_claim(tmp)`) keeps a shared flock on the claim
file while it lives; the kernel drops it when the process dies, so a temp directory that some
process of a killed run (an orphaned worker) still writes into is never taken for stale.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import os
import shutil
import socket
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict
from typing import Iterable, Iterator, Protocol, Sequence

from bridge.errors import BridgeError
from bridge.location import is_remote
from bridge.store import held, remote
from bridge.store.claim_info import CLAIM_FILE, TOOL, ClaimInfo, process_alive  # noqa: F401 - TOOL: from here too
from bridge.store.durable import fsync_path, fsync_tree, write_bytes_atomic
from bridge.store.held import HeldDestination, Terminated  # noqa: F401 - Terminated: from here too

TMP_SUFFIX = ".orbax-checkpoint-tmp"


def tmp_dir_for(dst: str) -> str:
    """The temporary directory (and claim) of a run writing `dst`.

    >>> tmp_dir_for("/c/step_1/")
    '/c/step_1.orbax-checkpoint-tmp'
    """
    return os.path.abspath(dst).rstrip("/") + TMP_SUFFIX


class ClaimHold:
    """A shared lock on a claim file, held by one process of the run until `close()` (or its death)."""

    def __init__(self, tmp: str) -> None:
        path = os.path.join(tmp, CLAIM_FILE)
        try:
            self._fd: int | None = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise BridgeError(f"{tmp} holds no gtp-bridge claim; create it with begin_checkpoint(dst) or "
                              f"claim_destination(dst) before starting writers") from None
        fcntl.flock(self._fd, fcntl.LOCK_SH)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "ClaimHold":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def hold_claim(tmp: str) -> ClaimHold:
    """For a writer process of a multi-process run: mark `tmp`'s claim as in use while this process
    lives, so a later run never removes it as stale while this process may still write into it."""
    return ClaimHold(tmp)


# -- sources vs destination -------------------------------------------------------------------
def _inside(a: str, b: str) -> bool:
    """True when path a equals b or lies below it (both real, absolute)."""
    return a == b or a.startswith(b.rstrip("/") + "/")


def check_sources(dst: str, sources: Iterable[str | os.PathLike] = ()) -> None:
    """Refuse a destination that would overwrite or swallow a source: SRC == DST, SRC == DST's temp
    directory, SRC inside DST (or its temp), DST inside SRC. Symlinks are resolved first.

    >>> check_sources("/x/out", ["/x/in"])
    >>> check_sources("/x/out", ["/x/out.orbax-checkpoint-tmp"])
    Traceback (most recent call last):
    bridge.errors.BridgeError: source /x/out.orbax-checkpoint-tmp is the temporary directory of destination /x/out; write to another destination

    An s3:// / gs:// destination: a source prefix inside it or holding it is refused
    (`bridge.store.remote.check_remote_sources`).
    """
    if is_remote(os.fspath(dst)):
        remote.check_remote_sources(os.fspath(dst), [os.fspath(s) for s in sources])
        return
    d = os.path.realpath(dst)
    t = os.path.realpath(tmp_dir_for(dst))
    for src in sources:
        if is_remote(os.fspath(src)):
            continue  # a URL never overlaps a local path
        s = os.path.realpath(os.fspath(src))
        if s == t:
            raise BridgeError(f"source {src} is the temporary directory of destination {dst}; "
                              f"write to another destination")
        if _inside(s, d) or _inside(s, t):
            raise BridgeError(f"source {src} lies inside destination {dst}; write to another destination")
        if _inside(d, s) or _inside(t, s):
            raise BridgeError(f"destination {dst} lies inside source {src}; write outside the source")


# -- no-replace rename --------------------------------------------------------------------------
_RENAME_NOREPLACE = 1
_AT_FDCWD = -100


def rename_noreplace(src: str, dst: str) -> None:
    """Rename `src` to `dst`; FileExistsError if `dst` exists (atomic where the kernel and file
    system support renameat2 RENAME_NOREPLACE; otherwise a check just before the rename)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fn = getattr(libc, "renameat2", None)
    if fn is not None:
        if fn(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE) == 0:
            return
        err = ctypes.get_errno()
        if err == errno.EEXIST or (err == errno.ENOTEMPTY):
            raise FileExistsError(err, os.strerror(err), dst)
        if err not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
            raise OSError(err, os.strerror(err), src)
    if os.path.lexists(dst):  # fallback: a small window remains on file systems without NOREPLACE
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), dst)
    os.rename(src, dst)


# -- the claim ---------------------------------------------------------------------------------
def check_destination_free(dst: str | os.PathLike) -> None:
    """BridgeError when `dst` exists (checkpoints are never overwritten): the one check and wording
    of every writer, made early (before any work) and again when the destination is claimed.

    >>> check_destination_free("/")
    Traceback (most recent call last):
    bridge.errors.BridgeError: destination / already exists; choose a new directory or remove it
    """
    if is_remote(os.fspath(dst)):
        remote.check_remote_free(os.fspath(dst))
    elif os.path.lexists(dst):
        raise BridgeError(f"destination {os.fspath(dst)} already exists; choose a new directory or remove it")


class Destination(Protocol):
    """Where one run writes a checkpoint and how it becomes visible: the seam of the commit.

    `DestinationClaim` (a local file system: write into DST's temp directory, publish by one
    no-replace rename) is one; a location without rename (object storage) provides another whose
    `tmp` is DST's own prefix and whose `publish` writes `files` in order, `_METADATA` last (a
    reader takes a prefix with `_METADATA` for committed). `bridge.store.commit.publish_checkpoint`
    is the one commit every writer ends with; it calls `publish` and, on failure, `release`.
    """

    dst: str   # where the checkpoint appears
    tmp: str   # where this run's writers write

    def check_owned(self) -> None:
        """BridgeError unless the destination is still this run's."""

    def publish(self, payload: str | None = None, *, files: Sequence[tuple[str, bytes]] = (),
                fsync: bool = True) -> str:
        """Write `files` (in order) into `payload` (default `tmp`) and make it the checkpoint at `dst`."""

    def release(self, reason: str = "") -> None:
        """Remove what this run wrote (never anyone else's files)."""


@contextmanager
def _parent_lock(dst: str) -> Iterator[None]:
    """flock of DST's parent directory: claims on one host are inspected and made one at a time."""
    parent = os.path.dirname(os.path.abspath(dst).rstrip("/")) or "/"
    try:
        os.makedirs(parent, exist_ok=True)  # as before claims: a destination's parents are created
        fd = os.open(parent, os.O_RDONLY)
    except (FileExistsError, NotADirectoryError):
        raise BridgeError(f"the parent of destination {dst} is not a directory; choose another destination") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


class DestinationClaim(HeldDestination):
    """This run's exclusive hold on `dst`: write into `.tmp`, then `publish()`; `release()` undoes."""

    def __init__(self, dst: str, info: ClaimInfo) -> None:
        self.dst = os.path.abspath(dst).rstrip("/")
        self.tmp = tmp_dir_for(self.dst)
        self.info = info
        self.published = False
        self.released = False
        self._hold: ClaimHold | None = None
        self.thread = threading.get_ident()

    def owned(self) -> bool:
        """True while `tmp` still holds this run's claim."""
        other = ClaimInfo.load(self.tmp)
        return other is not None and other.run_id == self.run_id

    def check_owned(self) -> None:
        if not self.owned():
            raise BridgeError(f"temporary directory {self.tmp} no longer holds this run's claim (removed or "
                              f"replaced by another process); nothing was committed, rerun")

    def publish(self, payload: str | None = None, *, files: Sequence[tuple[str, bytes]] = (),
                fsync: bool = True) -> str:
        """Write `files` (name, bytes; in order) into `payload` (default: the whole temp directory),
        fsync it and atomically rename it to DST, never replacing an existing DST; on any failure
        what this run created is removed. Returns DST. (The finalisation step of a local
        `Destination`; see bridge.store.commit.publish_checkpoint.)"""
        try:
            self.check_owned()
            src = self.tmp if payload is None else os.path.abspath(payload)
            if payload is not None and not _inside(os.path.realpath(src), os.path.realpath(self.tmp)):
                raise BridgeError(f"publish: {payload} is not inside this run's temporary directory {self.tmp}")
            for name, data in files:
                write_bytes_atomic(os.path.join(src, name), data, fsync=False)  # fsync'd with the tree
            if fsync:
                fsync_tree(src)
            self._drop_hold()
            try:
                rename_noreplace(src, self.dst)
            except FileExistsError:
                raise BridgeError(f"destination {self.dst} appeared while this run was writing (another process "
                                  f"created it); nothing was committed and this run's temporary files were "
                                  f"removed") from None
            self.published = True
            if payload is None:
                _remove_quietly(os.path.join(self.dst, CLAIM_FILE))
                fsync_path(self.dst)
            fsync_path(os.path.dirname(self.dst) or "/")
        except BaseException:
            self.release()
            raise
        finally:
            _forget(self)
        if payload is not None:
            self.release(published=True)
        return self.dst

    def _drop_hold(self) -> None:
        if self._hold is not None:
            self._hold.close()
            self._hold = None

    def release(self, reason: str = "", *, published: bool = False) -> None:
        """Remove the temp directory if it still holds this run's claim (never anyone else's files)."""
        if self.released:
            return
        self.released = True
        _forget(self)
        self._drop_hold()
        if not self.made_here():
            return  # a forked child, or another rank's handle on this claim, never cleans it
        if not os.path.isdir(self.tmp) or not self.owned():
            return
        _rmtree_retry(self.tmp)
        if reason and not published:
            print(f"gtp-bridge: {reason}; removed this run's temporary directory {self.tmp}", file=sys.stderr)


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def _rmtree_claim_last(path: str) -> None:
    """rmtree of a temp directory, its claim file last: a removal cut short (a second signal, as
    torchrun's SIGTERM landing in rank 0's cleanup after a peer died) leaves a claim a later run can
    prove stale, never a directory without one, which no run may touch."""
    with os.scandir(path) as it:
        names = [e.name for e in it if e.name != CLAIM_FILE]
    for name in names:
        p = os.path.join(path, name)
        if os.path.isdir(p) and not os.path.islink(p):
            shutil.rmtree(p)
        else:
            _remove_quietly(p)
    _remove_quietly(os.path.join(path, CLAIM_FILE))
    os.rmdir(path)


def _rmtree_retry(path: str, attempts: int = 5) -> None:
    """rmtree that tolerates files still appearing (in-flight writes of a dying run)."""
    for i in range(attempts):
        try:
            _rmtree_claim_last(path)
            return
        except FileNotFoundError:
            return
        except OSError:
            if i == attempts - 1:
                raise
            time.sleep(0.05 * (i + 1))


def _forget(claim: DestinationClaim) -> None:
    held.forget(claim)


def resume_claim(dst: str | os.PathLike) -> DestinationClaim:
    """A handle on the claim another process of this run made on `dst` (e.g. the writer that commits
    after the file barrier, in a process that did not call `begin_checkpoint`): read from the claim
    file in DST's temp directory. BridgeError when there is none."""
    dst = os.path.abspath(os.fspath(dst)).rstrip("/")
    tmp = tmp_dir_for(dst)
    if not os.path.isdir(tmp):
        raise BridgeError(f"no checkpoint in progress at {tmp}; call begin_checkpoint(dst) and run the writers first")
    info = ClaimInfo.load(tmp)
    if info is None:
        raise BridgeError(f"{tmp} holds no gtp-bridge claim; it was not created by begin_checkpoint(dst): "
                          f"nothing was committed")
    return DestinationClaim(dst, info)


def claim_destination(dst: str | os.PathLike, *, sources: Iterable[str | os.PathLike] = ()) -> DestinationClaim:
    """Claim `dst` for this run; BridgeError (one line) when it cannot be claimed without risk.

    Refuses an existing DST, a DST overlapping a source (`check_sources`), and an existing temp
    directory unless it is a stale claim of a dead gtp-bridge process on this host (removed, and
    reported on stderr). Use as a context manager: leaving it by an exception removes `claim.tmp`.
    SIGTERM / SIGHUP raise `Terminated` in the main thread while a claim is held, so cleanup runs.
    """
    if is_remote(os.fspath(dst)):  # object storage: no rename, `_METADATA` written last (bridge.store.remote)
        return remote.claim_remote(os.fspath(dst), sources=[os.fspath(s) for s in sources])
    dst = os.path.abspath(os.fspath(dst)).rstrip("/")
    check_sources(dst, sources)
    _prune_finished()
    tmp = tmp_dir_for(dst)
    with _parent_lock(dst):
        check_destination_free(dst)
        if os.path.lexists(tmp):
            _take_over_stale(dst, tmp)
        try:
            os.mkdir(tmp)
        except FileExistsError:  # another host (no shared lock) was quicker
            raise BridgeError(f"destination {dst} is being written by another run ({tmp} appeared); "
                              f"wait for it or choose another destination") from None
        info = ClaimInfo.mine(dst)
        try:
            with open(os.path.join(tmp, CLAIM_FILE), "x") as f:
                json.dump(asdict(info), f)
                f.flush()
                os.fsync(f.fileno())
            fsync_path(os.path.dirname(tmp))
            hold = hold_claim(tmp)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    claim = DestinationClaim(dst, info)
    claim._hold = hold
    held.hold(claim)
    return claim


def _prune_finished() -> None:
    """Forget claims of this process whose temp directory is gone (another process of the run
    published it): closes their lock and, with the last one, restores the signal handlers."""
    done = [c for c in held.all_held() if isinstance(c, DestinationClaim) and not os.path.isdir(c.tmp)]
    for c in done:
        c.release()


def _take_over_stale(dst: str, tmp: str) -> None:
    """Remove `tmp` if it is provably a stale claim of ours; else raise naming who holds it."""
    if not os.path.isdir(tmp) or os.path.islink(tmp):
        raise BridgeError(f"{tmp} exists and is not a gtp-bridge temporary directory; "
                          f"move it away or choose another destination than {dst}")
    info = ClaimInfo.load(tmp)
    if info is None:
        raise BridgeError(f"{tmp} exists and holds no gtp-bridge claim (a user's directory, another tool's or a "
                          f"run that is just starting); it was left untouched: remove it yourself if no run is "
                          f"writing {dst}, or choose another destination")
    mine = next((c for c in held.all_held() if isinstance(c, DestinationClaim) and c.run_id == info.run_id), None)
    if mine is not None:
        if mine.thread != threading.get_ident():
            raise BridgeError(f"destination {dst} is already being written by another thread of this process "
                              f"(run {info.run_id[:8]}); wait for it or choose another destination")
        # The same thread starts over: its earlier run to dst failed without releasing (e.g. a live export
        # whose collective failed inside a training process that carries on). Nothing else writes there.
        mine.release()
        print(f"gtp-bridge: removed {tmp}, left by this process's earlier unfinished run to {dst}", file=sys.stderr)
        return
    if not info.dead_here(tmp):
        if info.host != socket.gethostname():
            where = "a run on another host"
        elif process_alive(info.pid, info.pid_start):
            where = "a live run"
        else:
            where = "a run whose main process died but whose writer processes still hold its claim"
        raise BridgeError(f"destination {dst} is being written by {where} ({info.describe()}; {tmp}); "
                          f"wait for it, or if that run is dead remove {tmp} yourself")
    try:
        _rmtree_retry(tmp)
    except OSError as e:
        raise BridgeError(f"could not remove the stale temporary directory {tmp} of a killed run "
                          f"({info.describe()}): {e}; is a process of that run still writing?") from None
    print(f"gtp-bridge: removed the stale temporary directory {tmp} left by a killed run ({info.describe()})",
          file=sys.stderr)
