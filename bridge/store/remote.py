"""Commit on object storage (s3://, gs://), where there is no rename.

Everything of a run is written under the final prefix itself; `_METADATA` is written last, and a
prefix counts as a checkpoint only once it has one (our readers check it; Orbax restores only
from `_METADATA` too). Orbax commits on GCS the same way (a marker written last instead of a
rename: `CommitFileTemporaryPath`).

    DST/_gtpb_claim.json        first: who writes DST (host, pid, run id); written only if absent
    DST/ocdbt.process_<w>/...   the writers' databases, then the merged root database, reports
    DST/_CHECKPOINT_METADATA, DST/commit_success.txt
    DST/_METADATA               last: from here on DST is a committed checkpoint
    (the claim object is then deleted)

A prefix with our claim and no `_METADATA` is a partial checkpoint: readers refuse it (`verify`,
`inspect`, `restore` name it as never completed), and a retry removes it when its writer is
provably gone (same host, process dead or machine rebooted); otherwise the retry is refused,
naming the writer.

A run deletes only objects it wrote. The claim records the kind of checkpoint the run writes (its
marker), and each kind has a fixed set of object names (`OWNED_NAMES`: the claim, the metadata
files, OCDBT's manifests and `d/<32 hex>` data files, `__<r>_<i>.distcp` ...); every cleanup, of a
run's own prefix or of a dead run's, deletes only listed keys of that set. A dead run's prefix that
also holds other objects (a user's notes) is refused in one line naming one of them, as a local
destination that exists is, and nothing there is removed.

>>> owned_name("ocdbt.process_1.2/d/4ba6e1e60f15508222a0c41b46ad6888", METADATA), owned_name("notes.txt", METADATA)
(True, False)
"""

from __future__ import annotations

import json
import os
import re
import socket
import sys
from dataclasses import asdict
from typing import Iterable, Sequence

from bridge.dist import wait_for_writers
from bridge.errors import BridgeError
from bridge.format.sharding_file import SHARDING_FILE
from bridge.location import is_remote, parse_url
from bridge.store import kvstore as kv
from bridge.store.claim_info import ClaimInfo, boot_id, process_alive
from bridge.store.held import HeldDestination, forget, hold

CLAIM_KEY = "_gtpb_claim.json"
METADATA = "_METADATA"

_HEX = "[0-9a-f]{32}"   # OCDBT names its data files by 128 random bits
#: The objects a run writes under its prefix, by the marker of the checkpoint kind (full matches).
OWNED_NAMES: dict[str, re.Pattern] = {
    # a logical checkpoint: writer databases (commit slots), the merged root database, writer reports
    METADATA: re.compile(rf"_gtpb_claim\.json|_METADATA|_CHECKPOINT_METADATA|commit_success\.txt|manifest\.ocdbt"
                         rf"|{re.escape(SHARDING_FILE)}"   # Orbax's sharding record (bridge.format.sharding_file)
                         rf"|d/{_HEX}|ocdbt\.process_\d+(\.\d+)?/(manifest\.ocdbt|d/{_HEX})"
                         rf"|_gtp_bridge_writers/writer_\d+\.json"),
    # a torch_dist iteration (to-megatron)
    ".metadata": re.compile(r"_gtpb_claim\.json|\.metadata|metadata\.json|common\.pt|__\d+_\d+\.distcp"),
}


def owned_name(key: str, marker: str) -> bool:
    """True when `key` (relative to a claimed prefix) is a name a run writing a `marker` checkpoint writes."""
    names = OWNED_NAMES.get(marker)
    return names is not None and names.fullmatch(key) is not None


def foreign_keys(keys: Iterable[str], marker: str) -> list[str]:
    """The keys among `keys` that no run writing a `marker` checkpoint writes."""
    return [k for k in keys if not owned_name(k, marker)]


def _load_claim(dst: str) -> ClaimInfo | None:
    return _parse_claim(kv.read_bytes(dst, CLAIM_KEY))


def _claim_marker(data: bytes | None, default: str) -> str:
    """The marker a claim object records (what kind of checkpoint its run writes); `default` for a
    claim written before claims recorded it."""
    try:
        marker = json.loads(data or b"{}").get("marker", default)
    except (ValueError, AttributeError):
        return default
    return marker if marker in OWNED_NAMES else default


def _parse_claim(data: bytes | None) -> ClaimInfo | None:
    """The claim object's content, or None when absent or not a gtp-bridge claim."""
    if data is None:
        return None
    try:
        return ClaimInfo.from_record(json.loads(data))
    except ValueError:
        return None


def _writer_gone(info: ClaimInfo) -> bool:
    """True only when the claiming process provably no longer exists (this host; dead or rebooted)."""
    if info.host != socket.gethostname():
        return False
    if info.boot_id and info.boot_id != boot_id():
        return True
    return not process_alive(info.pid, info.pid_start)


def check_remote_sources(dst: str, sources: Iterable[str]) -> None:
    """A destination prefix may not contain a source, nor lie inside one."""
    d = parse_url(dst)
    for s in sources:
        s = str(s)
        if not is_remote(s):
            continue
        u = parse_url(s)
        if u.scheme == d.scheme and u.bucket == d.bucket and (
                (u.key + "/").startswith(d.key + "/") or (d.key + "/").startswith(u.key + "/")):
            raise BridgeError(f"destination {dst} overlaps the source {s}; choose a destination outside it")


class RemoteDestination(HeldDestination):
    """This run's hold on an object-storage prefix: writers write under `tmp` (= `dst`), `publish()`
    writes the metadata files, `_METADATA` last; `release()` removes what this run wrote.

    The `bridge.store.claim.Destination` of locations without rename."""

    def __init__(self, dst: str, info: ClaimInfo, marker: str = METADATA) -> None:
        self.marker = marker
        self.dst = dst.rstrip("/")
        self.tmp = self.dst
        self.info = info
        self.published = False
        self.released = False

    def owned(self) -> bool:
        return self._holds(_load_claim(self.dst))

    def _holds(self, claim: ClaimInfo | None) -> bool:
        return claim is not None and claim.run_id == self.run_id

    def _lost(self) -> BridgeError:
        return BridgeError(f"{self.dst} no longer holds this run's claim (removed or taken over by another run); "
                           f"nothing was committed, rerun")

    def check_owned(self) -> None:
        """BridgeError unless DST still holds this run's claim and no marker yet (another run may have
        committed there, e.g. a writer that takes no claim): the two reads issued at once (one round
        trip). Checked before the merge too, which writes DST's root database."""
        claim, marker = kv.read_bytes_many(self.dst, [CLAIM_KEY, self.marker])
        if not self._holds(_parse_claim(claim)):
            raise self._lost()
        if marker is not None:
            raise self._committed_by_another()

    def _committed_by_another(self) -> BridgeError:
        return BridgeError(f"destination {self.dst} already exists: another run committed a checkpoint there while "
                           f"this run wrote it; nothing of this run was committed and nothing there was removed; "
                           f"write to a new directory")

    def publish(self, payload: str | None = None, *, files: Sequence[tuple[str, bytes]] = (),
                fsync: bool = True) -> str:
        """Write `files` (name, bytes), the marker (`_METADATA`) after all others have landed, then
        drop the claim. Returns DST.

        `payload` must be DST itself (there is no temporary directory to publish from); `fsync` has
        no meaning here: an object is durable once its PUT returned."""
        if payload is not None and payload.rstrip("/") != self.dst:
            raise BridgeError(f"publish: {payload} is not this run's destination {self.dst}")
        try:
            self.check_owned()
            # the other files at once, then the marker alone: it must be the last object to land
            kv.write_bytes_many(self.dst, [f for f in files if f[0] != self.marker])
            for name, data in [f for f in files if f[0] == self.marker]:
                # only if absent: a marker another run wrote since the check is never replaced
                if not kv.write_bytes(self.dst, name, data, if_absent=True):
                    raise self._committed_by_another()
            self.published = True
        except BaseException:
            self.release()
            raise
        # Committed. The claim object is only bookkeeping now; a failure to delete it is harmless.
        try:
            kv.delete_keys(self.dst, [CLAIM_KEY])
        except BridgeError:
            pass
        self._forget()
        return self.dst

    def release(self, reason: str = "") -> None:
        """Delete the objects under DST if DST still holds this run's claim and no other run committed
        there (never anyone else's)."""
        if self.released or self.published:
            return
        self.released = True
        self._forget()
        if not self.made_here():
            return  # a child process, or another rank's handle on this claim, never cleans it
        if self.remove_objects() and reason:
            print(f"gtp-bridge: {reason}; removed this run's objects under {self.dst}", file=sys.stderr)

    def remove_objects(self) -> bool:
        """Delete the objects under DST that this claim's run writes (`OWNED_NAMES`) if DST still
        holds this claim; True when it did. Any other object there is left in place (and named).

        A marker this run did not publish means another writer committed a checkpoint at DST
        meanwhile: its objects cannot be told apart from ours, so only our claim object goes."""
        try:
            if not self.owned():
                return False
            keys = kv.list_keys(self.dst)
            if self.marker in keys:
                kv.delete_keys(self.dst, [CLAIM_KEY])
                print(f"gtp-bridge: another run committed a checkpoint at {self.dst} while this run wrote there; "
                      f"left every object there in place", file=sys.stderr)
                return False
            # Only what the listing saw and this run writes, everything but the claim first: until the
            # claim goes, a later run knows whose leftovers these are.
            kv.delete_keys(self.dst, [k for k in keys if k != CLAIM_KEY and owned_name(k, self.marker)])
            kv.delete_keys(self.dst, [CLAIM_KEY])
            foreign = foreign_keys(keys, self.marker)
            if foreign:
                print(f"gtp-bridge: left {len(foreign)} object(s) under {self.dst} that this run did not write "
                      f"({foreign[0]}{', ...' if len(foreign) > 1 else ''})", file=sys.stderr)
        except BridgeError as e:
            print(f"gtp-bridge: could not remove the objects under {self.dst}: {e}", file=sys.stderr)
            return False
        return True

    def _forget(self) -> None:
        forget(self)


def remove_written(dst: str, marker: str) -> None:
    """Delete the objects under DST that a run writing a `marker` checkpoint writes (`OWNED_NAMES`),
    e.g. a committed iteration taken back out when the command fails after its commit; others stay."""
    kv.delete_keys(dst, [k for k in kv.list_keys(dst) if owned_name(k, marker)])


def check_remote_free(dst: str) -> None:
    """BridgeError when DST holds a committed checkpoint (same wording as a local destination)."""
    if kv.exists(dst, METADATA):
        raise BridgeError(f"destination {dst} already exists; choose a new directory or remove it")


def claim_remote(dst: str, *, sources: Iterable[str] = (), marker: str = METADATA) -> RemoteDestination:
    """Claim the prefix `dst` for this run; BridgeError (one line) when that is not safe.

    `marker` is the object whose presence makes the prefix complete: `_METADATA` for a logical
    checkpoint, `.metadata` for a torch_dist one (written last by `publish`).

    Refuses a committed checkpoint at DST, a prefix holding objects that are not a gtp-bridge
    partial checkpoint, and a partial checkpoint whose writer may still run. Removes (and says so
    on stderr) a partial checkpoint whose writer is provably gone."""
    dst = dst.rstrip("/")
    check_remote_sources(dst, sources)
    keys = kv.list_keys(dst)  # the first request: bad credentials / bucket / permission fail here
    if marker in keys:
        raise BridgeError(f"destination {dst} already exists; choose a new directory or remove it")
    if keys:
        raw = kv.read_bytes(dst, CLAIM_KEY)
        info = _parse_claim(raw)
        if info is None:
            raise BridgeError(f"destination {dst} holds {len(keys)} objects that are not a gtp-bridge checkpoint; "
                              f"choose an empty prefix or remove them")
        if not _writer_gone(info):
            raise BridgeError(f"destination {dst} is being written by {info.describe()} (or that run was killed "
                              f"on another host); wait for it, or remove the prefix if no run is writing it")
        theirs = _claim_marker(raw, marker)
        foreign = foreign_keys(keys, theirs)
        if foreign:   # as a local destination that exists: refused, nothing removed
            raise BridgeError(f"destination {dst} holds {dst}/{foreign[0]}" +
                              (f" and {len(foreign) - 1} more object(s)" if len(foreign) > 1 else "") +
                              f" that gtp-bridge did not write, beside a partial checkpoint of a killed run "
                              f"({info.describe()}); nothing was removed: move your objects out of the prefix and "
                              f"rerun, or choose another destination")
        print(f"gtp-bridge: removing the partial checkpoint left at {dst} by a killed run ({info.describe()})",
              file=sys.stderr)
        if not RemoteDestination(dst, info, theirs).remove_objects():
            raise BridgeError(f"could not remove the partial checkpoint at {dst}; remove the prefix and rerun")
    info = ClaimInfo.mine(dst)
    # the claim records what kind of checkpoint this run writes: a later run cleaning up after it
    # deletes only the names that kind has (`OWNED_NAMES`)
    if not kv.write_bytes(dst, CLAIM_KEY, json.dumps({**asdict(info), "marker": marker}).encode(), if_absent=True):
        raise BridgeError(f"destination {dst} is being claimed by another run at the same time; "
                          f"choose another destination")
    held = _load_claim(dst)  # read back: a store that ignores the create's precondition lets the last PUT win
    if held is None or held.run_id != info.run_id:
        raise BridgeError(f"destination {dst} was claimed by another run at the same time; choose another destination")
    dest = RemoteDestination(dst, info, marker)
    hold(dest)  # SIGTERM raises, so the `with` block's release runs
    return dest


def resume_remote(dst: str, marker: str = METADATA) -> RemoteDestination:
    """A handle on the claim another process of this run made on the prefix `dst` (read from its
    claim object); BridgeError when there is none."""
    dst = dst.rstrip("/")
    info = _load_claim(dst)
    if info is None:
        raise BridgeError(f"{dst} holds no gtp-bridge claim; call begin_checkpoint(dst) and run the writers first")
    return RemoteDestination(dst, info, marker)


def wait_for_objects(root: str, keys: Sequence[str], timeout: float, what: str) -> None:
    """Poll until every object in `keys` exists under `root` (the writers' barrier without a shared
    file system); BridgeError naming the missing ones after `timeout` seconds."""
    def missing_of(left: list) -> list:
        have = set(kv.list_keys(root, _common_prefix(left)))
        return [k for k in left if k not in have]

    wait_for_writers(missing_of, keys, timeout, what, 0.01, 0.5)


def _common_prefix(keys: Sequence[str]) -> str:
    """Longest common leading directory of `keys` ('' if none).

    >>> _common_prefix(["r/writer_0.json", "r/writer_1.json"])
    'r/'
    """
    if not keys:
        return ""
    first = keys[0]
    n = len(first)
    for k in keys[1:]:
        n = min(n, len(k))
        while first[:n] != k[:n]:
            n -= 1
    return first[:first[:n].rfind("/") + 1]
