"""Checkpoint locations: what a user may name as a checkpoint, checked once at every entry point.

Only local paths are supported. A URL (`s3://bucket/x`, `gs://...`) is refused in one line instead of
being taken for a relative path (which would write a local directory `./s3:/bucket/x`), and a path
that is not valid UTF-8 is refused before TensorStore (which needs UTF-8 paths) fails obscurely.

>>> local_path("runs/gpt")
'runs/gpt'
>>> local_path("file:///ckpt/a")
'/ckpt/a'
>>> scheme_of("s3://bucket/x"), scheme_of("/a/b"), scheme_of("c:/x")
('s3', None, None)
"""

from __future__ import annotations

import os
import re
from typing import Union

from bridge.errors import BridgeError

Location = Union[str, bytes, "os.PathLike[str]", "os.PathLike[bytes]"]

# RFC 3986 scheme followed by "://"; a one-letter scheme would be a Windows drive and has no "//".
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")


def scheme_of(location: str) -> str | None:
    """The URL scheme of `location` (lower case), or None for a plain path."""
    m = _SCHEME.match(location)
    return m.group(1).lower() if m else None


def local_path(location: Location, what: str = "checkpoint") -> str:
    """`location` as a local path string; BridgeError for a URL or a path that is not valid UTF-8.

    `file:///abs/path` is the same as `/abs/path`. `what` names the location in messages
    ("destination", "source", "--workdir", ...).
    """
    try:
        raw = os.fspath(location)
    except TypeError:
        raise BridgeError(f"{what} must be a path (str or os.PathLike), got {type(location).__name__}") from None
    if isinstance(raw, bytes):
        try:
            raw = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise BridgeError(f"{what} path {raw!r} is not valid UTF-8; rename it (or use a UTF-8 path)") from None
    try:
        raw.encode("utf-8")  # argv bytes that are not UTF-8 arrive as lone surrogates
    except UnicodeEncodeError:
        shown = raw.encode("utf-8", "surrogateescape") if _escapable(raw) else raw.encode("utf-8", "replace")
        raise BridgeError(f"{what} path {shown!r} is not valid UTF-8; rename it (or use a UTF-8 path)") from None
    if "\x00" in raw:
        raise BridgeError(f"{what} path {raw!r} contains a NUL byte; pass a real path")
    if not raw:
        raise BridgeError(f"{what} path is empty; pass a directory")
    scheme = scheme_of(raw)
    if scheme == "file":
        rest = raw[len("file://"):]
        if not rest.startswith("/"):
            raise BridgeError(f"{what} {raw!r}: a file:// URL must name an absolute local path (file:///path)")
        return rest
    if scheme is not None:
        raise BridgeError(f"{what} {raw}: remote storage ({scheme}://) is not supported yet; "
                          f"copy the checkpoint to a local path")
    return raw


def _escapable(text: str) -> bool:
    try:
        text.encode("utf-8", "surrogateescape")
        return True
    except UnicodeEncodeError:
        return False
