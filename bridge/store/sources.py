"""Byte sources: where the files of a checkpoint are read from (a local directory or an object
store prefix), by byte ranges (`bridge.store.ranged`), so a large record is never read whole; and
the check that a file name an untrusted checkpoint records stays inside its directory.

>>> check_relative_path(Path("/ck"), "__0_0.distcp", "x").name
'__0_0.distcp'
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from bridge.errors import BridgeError
from bridge.location import is_remote
from bridge.store.ranged import open_range


def short_value(x: Any) -> str:
    """A bounded description of an untrusted value for messages."""
    if isinstance(x, int) and x.bit_length() > 128:
        return f"an integer of {x.bit_length()} bits"   # repr would fail past 4300 digits
    if isinstance(x, (int, float, bool, type(None))):
        return repr(x)[:40]
    if isinstance(x, str):
        return repr(x[:40])
    return type(x).__name__


def check_relative_path(root: Path, rel: str, what: str) -> Path:
    """Resolve `rel` inside `root`, refusing absolute paths, `..` and symlink escapes.

    >>> check_relative_path(Path("/ck"), "__0_0.distcp", "x").name
    '__0_0.distcp'
    """
    if not isinstance(rel, str) or not rel or "\x00" in rel:
        raise BridgeError(f"{what}: invalid file name {short_value(rel)} in .metadata")
    p = Path(rel)
    if p.is_absolute() or ".." in p.parts or rel.startswith(("/", "\\")):
        raise BridgeError(f"{what}: file name {rel!r} escapes the checkpoint directory; refusing")
    if isinstance(root, str) and is_remote(root):
        if "\\" in rel or any(c in ("", ".") for c in rel.split("/")):
            raise BridgeError(f"{what}: file name {rel!r} is not a plain object name; refusing")
        return f"{root}/{rel}"  # an object key: no symlinks to follow
    full = root / p
    try:
        real_root = os.path.realpath(root)
        real = os.path.realpath(full)
    except OSError:
        return full
    if os.path.commonpath([real_root, real]) != real_root:
        raise BridgeError(f"{what}: file {rel!r} resolves outside the checkpoint directory; refusing")
    return full


class FileSource:
    """The files of a local checkpoint directory."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def location(self, rel: str) -> str:
        return str(check_relative_path(self.root, rel, str(self.root)))

    def read_whole(self, rel: str) -> bytes | None:
        p = self.root / rel
        return p.read_bytes() if p.is_file() else None

    def check_length(self, rel: str, end: int) -> None:
        """BridgeError when file `rel` is missing or shorter than `end` bytes."""
        p = self.root / rel
        if not p.is_file():
            raise BridgeError(f"missing shard file {p} (named in .metadata); copy the complete checkpoint")
        size = p.stat().st_size
        if size < end:
            raise BridgeError(f"truncated shard file {p}: {size} bytes, .metadata needs {end}; "
                              f"copy the complete checkpoint")


class ObjectSource:
    """The objects under an s3:// / gs:// prefix holding a torch_dist checkpoint."""

    def __init__(self, root: str) -> None:
        self.root = root

    def location(self, rel: str) -> str:
        return check_relative_path(self.root, rel, self.root)

    def read_whole(self, rel: str) -> bytes | None:
        from bridge.store import kvstore

        return kvstore.read_bytes(self.root, rel)

    def check_length(self, rel: str, end: int) -> None:
        """BridgeError when object `rel` is missing or shorter than `end` bytes (reads its last needed byte)."""
        where = self.location(rel)
        with open_range(where) as r:
            if end > 0 and len(r.pread(1, end - 1)) != 1:
                raise BridgeError(f"truncated shard file {where}: shorter than the {end} bytes .metadata needs; "
                                  f"copy the complete checkpoint")
            if end == 0 and self.read_whole(rel) is None:
                raise BridgeError(f"missing shard file {where} (named in .metadata); copy the complete checkpoint")


def source_of(root: Path | str) -> FileSource | ObjectSource:
    return ObjectSource(root) if isinstance(root, str) and is_remote(root) else FileSource(Path(root))
