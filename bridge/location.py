"""Checkpoint locations: what a user may name as a checkpoint, checked once at every entry point.

A location is a local path or an object-storage URL: `s3://bucket/prefix` (Amazon S3 or any
S3-compatible store) or `gs://bucket/prefix` (Google Cloud Storage). `location()` checks one and
returns it as a string every layer passes on: a local path unchanged, a URL in canonical form
(lower-case scheme, no trailing slash). An unknown scheme is refused in one line instead of being
taken for a relative path (which would write a local directory `./hdfs:/nn/x`), and a path that is
not valid UTF-8 is refused before TensorStore (which needs UTF-8 paths) fails obscurely.

>>> location("runs/gpt"), location("file:///ckpt/a"), location("S3://bkt/runs/step_1/")
('runs/gpt', '/ckpt/a', 's3://bkt/runs/step_1')
>>> scheme_of("s3://bucket/x"), scheme_of("/a/b"), scheme_of("c:/x")
('s3', None, None)
>>> parse_url("gs://bkt/a/b")
ObjectUrl(scheme='gs', bucket='bkt', key='a/b')
>>> join("s3://bkt/a", "_METADATA"), join("/ckpt/a", "_METADATA")
('s3://bkt/a/_METADATA', '/ckpt/a/_METADATA')
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Union

from bridge.errors import BridgeError

Location = Union[str, bytes, "os.PathLike[str]", "os.PathLike[bytes]"]

REMOTE_SCHEMES = ("s3", "gs")
# RFC 3986 scheme followed by "://"; a one-letter scheme would be a Windows drive and has no "//".
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")
# Bucket names of both stores: lower-case letters, digits, '-', '_' and '.', 3 to 222 characters
# (GCS allows dotted names up to 222); the store itself enforces its finer rules.
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9._\-]{1,220}[a-z0-9]$")
# What Megatron users type for object storage (multi-storage-client): its profiles live in MSC's
# own config, which we do not read; they name the bucket URL instead.
_MSC_HINT = ("msc:// names a multi-storage-client profile; pass the bucket URL its profile points at "
             "(s3://bucket/prefix or gs://bucket/prefix)")


@dataclass(frozen=True)
class ObjectUrl:
    """An object-storage location: scheme ('s3' | 'gs'), bucket, key prefix (no leading/trailing '/')."""

    scheme: str
    bucket: str
    key: str

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.bucket}/{self.key}"


def scheme_of(location: str) -> str | None:
    """The URL scheme of `location` (lower case), or None for a plain path."""
    m = _SCHEME.match(location)
    return m.group(1).lower() if m else None


def is_remote(location) -> bool:
    """True for an object-storage URL (a string; a Path or bytes is always local)."""
    return isinstance(location, str) and scheme_of(location) in REMOTE_SCHEMES


def _text(location: Location, what: str) -> str:
    try:
        raw = os.fspath(location)
    except TypeError:
        raise BridgeError(f"{what} must be a path or URL (str or os.PathLike), got {type(location).__name__}") from None
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
    return raw


def parse_url(url: str, what: str = "checkpoint") -> ObjectUrl:
    """Split and check an s3:// or gs:// URL; BridgeError naming what is wrong.

    A key prefix is required (a checkpoint never owns a whole bucket), and `.`/`..`/empty
    components are refused: object stores would keep them literally, other tools would not.

    >>> parse_url("s3://bkt/a/b/").key
    'a/b'
    """
    scheme = scheme_of(url)
    if scheme not in REMOTE_SCHEMES:
        raise BridgeError(f"{what} {url}: not an s3:// or gs:// URL")
    rest = url[len(scheme) + 3:]
    bucket, _, key = rest.partition("/")
    key = key.rstrip("/")
    if not _BUCKET.match(bucket):
        raise BridgeError(f"{what} {url}: {bucket!r} is not a valid bucket name "
                          f"(lower-case letters, digits, '-', '.', 3 or more characters)")
    if not key:
        raise BridgeError(f"{what} {url}: name a prefix inside the bucket ({scheme}://{bucket}/path), "
                          f"not the bucket itself")
    parts = key.split("/")
    if any(p in ("", ".", "..") for p in parts) or "\\" in key:
        raise BridgeError(f"{what} {url}: empty, '.' or '..' components are not allowed in an object key")
    return ObjectUrl(scheme, bucket, key)


def location(location: Location, what: str = "checkpoint") -> str:
    """`location` checked: a local path as given (`file:///p` -> `/p`) or a canonical s3:// / gs:// URL.

    `what` names the location in messages ("destination", "source", "--workdir", ...).
    """
    raw = _text(location, what)
    scheme = scheme_of(raw)
    if scheme is None:
        return raw
    if scheme == "file":
        rest = raw[len("file://"):]
        if not rest.startswith("/"):
            raise BridgeError(f"{what} {raw!r}: a file:// URL must name an absolute local path (file:///path)")
        return rest
    if scheme in REMOTE_SCHEMES:
        return parse_url(scheme + raw[len(scheme):], what).url
    if scheme == "msc":
        raise BridgeError(f"{what} {raw}: {_MSC_HINT}")
    raise BridgeError(f"{what} {raw}: unknown storage scheme {scheme}://; use a local path, s3:// or gs://")


def local_path(location_: Location, what: str = "checkpoint") -> str:
    """`location_` as a local path string, for the places that need one; BridgeError for a URL or a
    path that is not valid UTF-8. `file:///abs/path` is the same as `/abs/path`."""
    raw = _text(location_, what)
    scheme = scheme_of(raw)
    if scheme in REMOTE_SCHEMES:
        raise BridgeError(f"{what} {raw}: remote storage ({scheme}://) is not supported here; "
                          f"copy the checkpoint to a local path")
    return location(raw, what)


def join(root: str, *names: str) -> str:
    """`root` (a path or a URL from `location()`) joined with `names` by '/'."""
    out = root.rstrip("/") if root.rstrip("/") else root
    for n in names:
        out = f"{out}/{n.strip('/')}" if out != "/" else f"/{n.strip('/')}"
    return out


def absolute(root: str) -> str:
    """A local path made absolute; a URL unchanged."""
    return root if is_remote(root) else os.path.abspath(root)


def basename(root: str) -> str:
    """The last component of a path or URL (for progress labels).

    >>> basename("s3://bkt/runs/ck"), basename("/a/b/")
    ('ck', 'b')
    """
    return root.rstrip("/").rsplit("/", 1)[-1]


def _escapable(text: str) -> bool:
    try:
        text.encode("utf-8", "surrogateescape")
        return True
    except UnicodeEncodeError:
        return False
