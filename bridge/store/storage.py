"""Where a checkpoint lives, decided once: `open_storage(location)` -> a `LocalStorage` (a file
system path) or an `ObjectStorage` (an s3:// / gs:// prefix). Callers above `bridge.store` hold
this object and call its methods; they never ask again whether a location is remote.

It owns what differs between the two: the destination claim (a temporary directory renamed into
place, or objects written in place with `_METADATA` last), reading and writing small files,
listing, ranged reads of a checkpoint's files, the steps of a manager root and the TensorStore
kvstore spec. Orbax draws the same line with its temporary-path classes (`AtomicRenameTemporaryPath`
vs `CommitFileTemporaryPath`) and torch DCP with `FileSystemBase`.

>>> s = open_storage("runs/ck")
>>> type(s).__name__, s.at("iter_0000001").root, s.file_system
('LocalStorage', 'runs/ck/iter_0000001', True)
>>> o = open_storage("s3://bkt/runs/ck/")
>>> type(o).__name__, o.root, o.at("iter_0000001").root, o.file_system
('ObjectStorage', 's3://bkt/runs/ck', 's3://bkt/runs/ck/iter_0000001', False)
"""

from __future__ import annotations

import contextlib
import os
import shutil
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Iterable

from bridge.errors import BridgeError
from bridge.location import Location, is_remote, join, location


def open_storage(where: Location, what: str = "checkpoint") -> "Storage":
    """The storage of `where` (checked by `bridge.location.location`; `what` names it in messages)."""
    if isinstance(where, Storage):
        return where
    root = location(where, what)
    return ObjectStorage(root) if is_remote(root) else LocalStorage(root)


class Storage(ABC):
    """One checkpoint location and the operations whose implementation depends on its kind."""

    #: True where libraries that take a file path (Orbax, MaxText's readers, torch DCP's file system
    #: reader) can open the location: a local file system. Orbax cannot open s3:// (and needs gcsfs
    #: for gs://), so the bridge reads and writes those with TensorStore. The one question about the
    #: kind of storage that callers may still ask: which library to hand the location to.
    file_system: bool
    #: True where plain Orbax (a user's `ocp.StandardCheckpointer().restore`) opens the location
    #: without extra packages: a local path (s3:// it cannot open, gs:// only with gcsfs installed).
    orbax_can_open: bool
    #: True where a writer stages into a temporary directory renamed into place at the commit
    #: (a file system); false where everything is written in place, `_METADATA` last (object storage).
    renames: bool
    #: True where a file can be opened and appended to while it is written (a file system); false
    #: where each object is put whole in one request (object storage), so a writer of a long file
    #: collects its bytes in memory and puts them as parts.
    appends: bool

    def __init__(self, root: str) -> None:
        self.root = root

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.root!r})"

    def __str__(self) -> str:
        return self.root

    def at(self, *names: str) -> "Storage":
        """The storage of `root/names...` (same kind)."""
        return type(self)(join(self.root, *names))

    # -- the destination ----------------------------------------------------------------------------
    def check_free(self) -> None:
        """BridgeError when a committed checkpoint (or, locally, anything) is already there."""
        from bridge.store.claim import check_destination_free

        check_destination_free(self.root)

    @abstractmethod
    def claim(self, sources: Iterable[str | os.PathLike] = (), *, marker: str = "_METADATA"):
        """Claim the location for this run: a `bridge.store.claim.Destination` (`with` it; `publish()`).

        `marker` is the file whose presence makes the checkpoint complete: `_METADATA` for a logical
        checkpoint, `.metadata` for a torch_dist one (on object storage it is written last)."""

    @abstractmethod
    def claimed(self, marker: str = "_METADATA"):
        """A handle (`Destination`) on the claim another process of this run made here, read from what
        that claim recorded; BridgeError when there is none. Its `release()` removes nothing unless
        this process made the claim."""

    @abstractmethod
    def handle(self, info, marker: str = "_METADATA"):
        """A handle (`Destination`) on the claim `info` (a `ClaimInfo`) made here by another rank of
        this run, which sent it (`begin_checkpoint`): no I/O."""

    @abstractmethod
    def visible(self) -> bool:
        """True when this process sees the location (a temporary directory another process of the
        run created must be on a file system they share; an object-store prefix always is)."""

    @abstractmethod
    def hold_claim(self):
        """For a writer process of a multi-process run: a context manager keeping the claim another
        process made on `root` (its temporary directory) in use while this process writes."""

    @contextlib.contextmanager
    def joined(self, record: object, marker: str = "_METADATA"):
        """For a process of a multi-process run that writes into the claim another of its processes
        made here and sent as `record` (`ClaimInfo.record()`, JSON): a handle (`Destination`) on that
        claim, held in use while the block runs (`hold_claim`); its `release()` removes nothing
        (`HeldDestination.made_here`). BridgeError (one line) when the record is no gtp-bridge claim,
        is a claim of another destination, or is not the claim recorded here (forged, or replaced)."""
        from bridge.store.claim_info import ClaimInfo

        info = ClaimInfo.from_record(record)
        if info is None:
            raise BridgeError(f"the claim record sent for {self.root} is not a gtp-bridge claim; every process of "
                              f"the run must run the same gtp-bridge version")
        handle = self.handle(info, marker)
        claimed_dst = open_storage(info.dst).handle(info, marker).dst   # both as the handle resolves them
        if claimed_dst != handle.dst:
            raise BridgeError(f"the claim sent for {handle.dst} is a claim of {claimed_dst}; start every process "
                              f"of the run with the same destination")
        tmp = open_storage(handle.tmp)
        if not tmp.visible():
            raise BridgeError(f"the temporary directory {handle.tmp} claimed for {handle.dst} is not visible here: "
                              f"every process of the run must share its file system (or write to s3:// / gs://)")
        with tmp.hold_claim():   # before the check: the claim checked is the one held
            try:
                found = self.claimed(marker).info
            except BridgeError:
                found = None
            if found != info:
                raise BridgeError(f"the claim sent for {handle.dst} (run {info.run_id[:8]}, pid {info.pid} on "
                                  f"{info.host}) is not the claim at {handle.tmp}; nothing was written")
            yield handle

    @abstractmethod
    def check_sources(self, sources: Iterable[str | os.PathLike]) -> None:
        """BridgeError when writing here would overwrite or swallow one of `sources`."""

    # -- small files, listing -----------------------------------------------------------------------
    @abstractmethod
    def read_bytes(self, name: str) -> bytes | None:
        """The content of `root/name`, or None when it does not exist."""

    @abstractmethod
    def exists(self, name: str) -> bool:
        """True when `root/name` exists."""

    @abstractmethod
    def replace_bytes(self, name: str, data: bytes) -> None:
        """Write `root/name` atomically (readers see the old or the new content, never a part)."""

    @abstractmethod
    def list_keys(self, prefix: str = "") -> list[str]:
        """The keys (relative names of files / objects) under `root` that start with `prefix`."""

    @abstractmethod
    def occupied(self) -> bool:
        """True when something is already there (a file or directory; an object under the prefix)."""

    @abstractmethod
    def make_dirs(self) -> bool:
        """Create the directory `root` where directories exist (nothing on object storage); True when
        this call created it (nothing was there), so that a failed run can take it back."""

    @abstractmethod
    def path(self):
        """`root` for readers written against `pathlib.Path` (`/`, `name`, `parent`, `is_file`,
        `read_bytes`, `glob`, ...): a `Path`, or on object storage a str with those methods over objects."""

    @abstractmethod
    def holds_partial(self) -> bool:
        """True when a run of this tool claimed `root` and never committed: what is there is its partial
        checkpoint (locally its temporary directory beside `root`; on object storage its claim object)."""

    @abstractmethod
    def remove_published(self, marker: str = "_METADATA") -> None:
        """Take back a checkpoint this run published at `root` (a later step of the command failed):
        the directory, or on object storage the objects a writer of `marker` checkpoints writes
        (others under the prefix stay)."""

    def committed_steps(self) -> list[int]:
        """The committed steps of the manager root `root`, ascending (`bridge.store.manager`)."""
        from bridge.store.manager import committed_steps

        return committed_steps(self.root)

    # -- ranged reads -------------------------------------------------------------------------------
    @abstractmethod
    def source(self):
        """The byte source (`bridge.store.sources`) of the checkpoint directory `root`."""

    def open_range(self, name: str):
        """A `bridge.store.ranged.RangeReader` over `root/name`."""
        from bridge.store.ranged import open_range

        return open_range(join(self.root, name))

    # -- TensorStore ----------------------------------------------------------------------------------
    def kvstore_spec(self) -> dict:
        """The TensorStore kvstore spec of `root` (OCDBT over a file or an object-store driver)."""
        from bridge.store.kvstore import kvstore_spec

        return kvstore_spec(self.root)

    def default_batch_bytes(self) -> int:
        """Bytes per writer transaction when the caller does not say (`bridge.store.writer`)."""
        from bridge.store.writer import default_batch_bytes

        return default_batch_bytes(not self.renames)


class LocalStorage(Storage):
    """A directory of a local (or shared, POSIX) file system; `root` as the caller named it."""

    file_system = True
    orbax_can_open = True
    renames = True
    appends = True

    def check_sources(self, sources: Iterable[str | os.PathLike]) -> None:
        from bridge.store.claim import check_sources

        check_sources(self.root, sources)

    def claim(self, sources: Iterable[str | os.PathLike] = (), *, marker: str = "_METADATA"):
        from bridge.store.claim import claim_destination

        return claim_destination(self.root, sources=sources)   # complete once renamed: no marker needed

    def claimed(self, marker: str = "_METADATA"):
        from bridge.store.claim import resume_claim

        return resume_claim(self.root)

    def handle(self, info, marker: str = "_METADATA"):
        from bridge.store.claim import DestinationClaim

        return DestinationClaim(self.root, info)

    def visible(self) -> bool:
        return os.path.isdir(self.root)

    def hold_claim(self):
        from bridge.store.claim import hold_claim

        return hold_claim(self.root)

    def read_bytes(self, name: str) -> bytes | None:
        try:
            with open(os.path.join(self.root, name), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def exists(self, name: str) -> bool:
        return os.path.exists(os.path.join(self.root, name))

    def replace_bytes(self, name: str, data: bytes) -> None:
        """Temp file (named by this process: concurrent writers never share one) + fsync + rename +
        directory fsync; the temp file is removed when the write fails."""
        from bridge.store.durable import fsync_path

        path = os.path.join(self.root, name)
        tmp = f"{path}.tmp-{os.getpid()}"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            if os.path.lexists(tmp):
                os.unlink(tmp)
            raise
        fsync_path(os.path.dirname(path) or ".")

    def list_keys(self, prefix: str = "") -> list[str]:
        """The files under `root` (paths relative to it, '/'-separated) that start with `prefix`."""
        out = []
        for d, _, files in os.walk(self.root):
            rel = os.path.relpath(d, self.root)
            out += [f if rel == "." else f"{rel}/{f}" for f in files]
        return sorted(k for k in out if k.startswith(prefix))

    def occupied(self) -> bool:
        return os.path.lexists(self.root)

    def make_dirs(self) -> bool:
        created = not os.path.lexists(self.root)
        os.makedirs(self.root, exist_ok=True)
        return created

    def path(self) -> Path:
        return Path(self.root)

    def holds_partial(self) -> bool:
        from bridge.store.claim import ClaimInfo, tmp_dir_for

        return ClaimInfo.load(tmp_dir_for(self.root)) is not None

    def remove_published(self, marker: str = "_METADATA") -> None:
        shutil.rmtree(self.root, ignore_errors=True)   # renamed into place whole: all of it is this run's

    def source(self):
        from bridge.store.sources import FileSource

        return FileSource(Path(self.root))


class ObjectStorage(Storage):
    """The objects under an s3:// / gs:// prefix (canonical URL, no trailing '/')."""

    file_system = False
    orbax_can_open = False
    renames = False
    appends = False

    def check_sources(self, sources: Iterable[str | os.PathLike]) -> None:
        from bridge.store.remote import check_remote_sources

        check_remote_sources(self.root, [os.fspath(s) for s in sources])

    def claim(self, sources: Iterable[str | os.PathLike] = (), *, marker: str = "_METADATA"):
        from bridge.store.remote import claim_remote

        return claim_remote(self.root, sources=[os.fspath(s) for s in sources], marker=marker)

    def claimed(self, marker: str = "_METADATA"):
        from bridge.store.remote import resume_remote

        return resume_remote(self.root, marker)

    def handle(self, info, marker: str = "_METADATA"):
        from bridge.store.remote import RemoteDestination

        return RemoteDestination(self.root, info, marker)

    def visible(self) -> bool:
        return True

    def hold_claim(self):
        return contextlib.nullcontext()   # the claim object stays until the commit; nothing to hold

    def read_bytes(self, name: str) -> bytes | None:
        from bridge.store import kvstore

        return kvstore.read_bytes(self.root, name)

    def exists(self, name: str) -> bool:
        from bridge.store import kvstore

        return kvstore.exists(self.root, name)

    def replace_bytes(self, name: str, data: bytes) -> None:
        from bridge.store import kvstore

        kvstore.write_bytes(self.root, name, data)   # one PUT replaces an object atomically

    def list_keys(self, prefix: str = "") -> list[str]:
        from bridge.store import kvstore

        return kvstore.list_keys(self.root, prefix)

    def occupied(self) -> bool:
        return bool(self.list_keys())

    def make_dirs(self) -> bool:
        return False   # object stores have no directories

    def path(self):
        from bridge.store.kvstore import ObjectPath

        return ObjectPath(self.root)

    def holds_partial(self) -> bool:
        from bridge.store.remote import CLAIM_KEY

        return self.exists(CLAIM_KEY)

    def remove_published(self, marker: str = "_METADATA") -> None:
        from bridge.store.remote import remove_written

        remove_written(self.root, marker)

    def source(self):
        from bridge.store.sources import ObjectSource

        return ObjectSource(self.root)
