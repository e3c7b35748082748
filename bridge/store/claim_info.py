"""Who holds a destination claim: the record a run leaves in its claim, and the proofs that its process is gone.

The same record serves both kinds of claim: the claim file of a local destination
(`bridge.store.claim`) and the claim object of an object-storage prefix (`bridge.store.remote`).
A claim is taken for stale only when it provably belongs to a process that no longer exists on this
host (`ClaimInfo.dead_here`).
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
import uuid
from dataclasses import asdict, dataclass, fields
from typing import Any

CLAIM_FILE = ".gtpb-claim.json"
TOOL = "gtp-bridge"


@dataclass(frozen=True)
class ClaimInfo:
    """Who holds a claim: enough to prove, on this host, that its process is gone."""

    run_id: str
    pid: int
    host: str
    boot_id: str
    pid_start: str      # the process's start time (/proc/<pid>/stat field 22): tells a reused pid apart
    created: float
    dst: str
    tool: str = TOOL

    @classmethod
    def mine(cls, dst: str) -> "ClaimInfo":
        pid = os.getpid()
        return cls(uuid.uuid4().hex, pid, socket.gethostname(), boot_id(), _start_time(pid), time.time(), dst)

    @classmethod
    def load(cls, tmp: str) -> "ClaimInfo | None":
        """The claim in `tmp`, or None when there is none or it is not a gtp-bridge claim."""
        try:
            with open(os.path.join(tmp, CLAIM_FILE)) as f:
                return cls.from_record(json.load(f))
        except (OSError, ValueError):
            return None

    def record(self) -> dict:
        """The claim as JSON, as its claim file holds it and as it is sent to the other processes of
        its run (`from_record` reads it back)."""
        return asdict(self)

    @classmethod
    def from_record(cls, record: Any) -> "ClaimInfo | None":
        """The claim `record` describes, or None when it is no gtp-bridge claim: not a mapping, a field
        missing or of another type (untrusted: a claim file, a claim object, what another rank sent).

        >>> ClaimInfo.from_record(ClaimInfo("r", 1, "h", "b", "9", 2.0, "/d").record())
        ClaimInfo(run_id='r', pid=1, host='h', boot_id='b', pid_start='9', created=2.0, dst='/d', tool='gtp-bridge')
        >>> ClaimInfo.from_record({"run_id": "r"}), ClaimInfo.from_record([1])
        (None, None)
        """
        if not isinstance(record, dict):
            return None
        kinds = {"int": (int,), "float": (int, float), "str": (str,)}
        values = {}
        for f in fields(cls):
            v = record.get(f.name)
            if isinstance(v, bool) or not isinstance(v, kinds[str(f.type)]):
                return None
            values[f.name] = float(v) if f.type == "float" else v
        info = cls(**values)
        return info if info.tool == TOOL else None

    def describe(self) -> str:
        return f"pid {self.pid} on host {self.host}, started {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(self.created))}"

    def dead_here(self, tmp: str) -> bool:
        """True only when the claiming process provably no longer exists (same host, same boot or a
        reboot) and no process holds the claim file's lock (see `hold_claim`)."""
        if self.host != socket.gethostname():
            return False
        if self.boot_id and self.boot_id != boot_id():
            return True  # the machine rebooted since: every process of that boot is gone
        # The kernel may drop a killed process's locks a moment after it is gone: allow a short grace.
        return not process_alive(self.pid, self.pid_start) and not lock_held(os.path.join(tmp, CLAIM_FILE), grace=1.0)


def boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _proc_stat(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    return text[text.rfind(")") + 2:].split()  # fields after "(comm)", which may hold spaces


def _start_time(pid: int) -> str:
    st = _proc_stat(pid)
    return st[19] if st and len(st) > 19 else ""


def process_alive(pid: int, start: str) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: not provably dead
    st = _proc_stat(pid)
    if st is None:
        return not os.path.isdir("/proc")  # no procfs: kill(0) said it exists
    if st[0] == "Z":
        return False  # killed, waiting to be reaped
    return not start or st[19] == start  # a different start time: the pid was reused


def lock_held(path: str, grace: float = 0.0) -> bool:
    """True when some process holds a flock on `path` (a process of the run that claimed it),
    still after `grace` seconds."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    deadline = time.monotonic() + grace
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return False
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    return True
                time.sleep(0.02)
    finally:
        os.close(fd)
