"""Storage behind a location: TensorStore kvstore specs for a local path, s3:// or gs:// URL, and
the few whole-object reads and writes the store does besides arrays (JSON metadata, markers,
writer reports), through TensorStore's kvstores for URLs so nothing is written locally for them.

The environment configures remote stores as the clouds' own tools do:
- S3: `AWS_ENDPOINT_URL_S3` / `AWS_ENDPOINT_URL` (S3-compatible stores), `AWS_REGION` /
  `AWS_DEFAULT_REGION`, credentials from `AWS_ACCESS_KEY_ID` / `AWS_SECRET_ACCESS_KEY` /
  `AWS_SESSION_TOKEN` or else the default AWS chain (profiles, instance metadata).
- GCS: application-default credentials; `TENSORSTORE_GCS_HTTP_URL`, or `STORAGE_EMULATOR_HOST` (what
  gcsfs and google-cloud-storage read), for an emulator.

>>> base_kvstore("/ckpt/a")
{'driver': 'file', 'path': '/ckpt/a/'}
>>> base_kvstore("gs://bkt/runs/a/")
{'driver': 'gcs', 'bucket': 'bkt', 'path': 'runs/a/', 'gcs_request_retries': {'max_retries': 8, 'initial_delay': '0.2s', 'max_delay': '8s'}}
"""

from __future__ import annotations

import json
import os
import re
import threading
from typing import Any, Sequence

from bridge.errors import BridgeError
from bridge.location import is_remote, parse_url

# TensorStore retries transient errors 32 times with up to 32 s between attempts by default: a
# stopped server would hang a command for many minutes. 8 attempts still ride out short outages.
_RETRIES = {"max_retries": 8, "initial_delay": "0.2s", "max_delay": "8s"}


def _s3_spec(bucket: str, key: str) -> dict:
    kv: dict[str, Any] = {"driver": "s3", "bucket": bucket, "path": key}
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if endpoint:
        kv["endpoint"] = endpoint
        # With an endpoint TensorStore cannot look the bucket's region up; S3-compatible stores
        # accept any region in the signature, us-east-1 being the conventional one.
        kv["aws_region"] = region or "us-east-1"
    elif region:
        kv["aws_region"] = region
    if os.environ.get("AWS_ACCESS_KEY_ID"):
        # Keys in the environment: use them without the default chain's probing of ~/.aws files
        # (which logs an error line per request when they do not exist).
        kv["aws_credentials"] = {"type": "environment"}
    kv["s3_request_retries"] = dict(_RETRIES)
    return kv


def _gcs_spec(bucket: str, key: str) -> dict:
    emulator = os.environ.get("STORAGE_EMULATOR_HOST")
    if emulator and not os.environ.get("TENSORSTORE_GCS_HTTP_URL"):
        # One variable for every client: TensorStore reads its own name for the same thing.
        os.environ["TENSORSTORE_GCS_HTTP_URL"] = emulator if "://" in emulator else f"http://{emulator}"
    return {"driver": "gcs", "bucket": bucket, "path": key, "gcs_request_retries": dict(_RETRIES)}


def base_kvstore(root: str) -> dict:
    """The kvstore holding everything under `root` (a local path or a URL from `bridge.location`),
    its path ending in '/'."""
    if not is_remote(root):
        return {"driver": "file", "path": root if root.endswith("/") else root + "/"}
    u = parse_url(root)
    key = u.key + "/"
    return _s3_spec(u.bucket, key) if u.scheme == "s3" else _gcs_spec(u.bucket, key)


def kvstore_spec(root: str) -> dict:
    """`base_kvstore(root)`, for `ts.KvStore.open` or a driver's "kvstore" member."""
    return base_kvstore(root)


# -- errors ----------------------------------------------------------------------------------------
_CODE = re.compile(r"<Code>([A-Za-z]+)</Code>")


def storage_error(exc: BaseException, where: str, doing: str = "access") -> BridgeError:
    """A TensorStore error on a remote location as one line saying what is wrong and what to do."""
    text = str(exc)
    code_m = _CODE.search(text)
    code = code_m.group(1) if code_m else ""
    head = text.split("[", 1)[0].strip().splitlines()[0] if text else type(exc).__name__
    s3 = where.startswith("s3://")
    if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken") or \
            "UNAUTHENTICATED" in text or "http_response_code='401'" in text:
        fix = ("check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or your AWS profile)" if s3
               else "check your Google credentials (gcloud auth application-default login)")
        return BridgeError(f"{where}: the storage server refused the credentials ({code or 'unauthenticated'}); {fix}")
    if code == "NoSuchBucket" or ("NOT_FOUND" in text and "bucket" in text.lower()) or \
            ("http_response_code='404'" in text and not s3):
        return BridgeError(f"{where}: bucket {parse_url(where).bucket!r} does not exist (or the endpoint is wrong); "
                           f"create it or fix the URL")
    if "PERMISSION_DENIED" in text or code == "AccessDenied" or "http_response_code='403'" in text:
        return BridgeError(f"{where}: permission denied to {doing} it ({code or '403'}); "
                           f"grant the credentials read/write/list/delete on the bucket")
    if "CURL error" in text or "retry attempts failed" in text or "UNAVAILABLE" in text:
        env = "AWS_ENDPOINT_URL" if s3 else "STORAGE_EMULATOR_HOST"
        return BridgeError(f"{where}: cannot reach the storage server ({head}); check the network, or {env} "
                           f"for an S3-compatible store / emulator")
    return BridgeError(f"{where}: storage error while trying to {doing} it: {head}")


def _raise(exc: BaseException, root: str, doing: str):
    if is_remote(root):
        raise storage_error(exc, root, doing) from None
    raise BridgeError(f"{root}: {doing} failed: {str(exc).splitlines()[0]}") from None


# -- whole objects ---------------------------------------------------------------------------------
_CREDENTIAL_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
                   "GOOGLE_APPLICATION_CREDENTIALS", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3",
                   "TENSORSTORE_GCS_HTTP_URL", "STORAGE_EMULATOR_HOST")
_contexts: dict[tuple, object] = {}
_contexts_lock = threading.Lock()


def context():
    """The ts.Context for object I/O of this process, one per storage environment: shared, so
    connections are reused across the many small and ranged reads; keyed by the credential and
    endpoint variables, because a Context keeps what it first resolved."""
    import tensorstore as ts

    key = tuple(os.environ.get(k) for k in _CREDENTIAL_ENV)
    with _contexts_lock:
        ctx = _contexts.get(key)
        if ctx is None:
            ctx = _contexts[key] = ts.Context()
        return ctx


def open_store(root: str):
    """The kvstore under `root` (TensorStore KvStore)."""
    import tensorstore as ts

    try:
        return ts.KvStore.open(kvstore_spec(root), context=context()).result()
    except ValueError as e:
        _raise(e, root, "open")


def read_bytes(root: str, key: str) -> bytes | None:
    """Object `key` under `root`, or None when it does not exist."""
    try:
        r = open_store(root).read(key).result()
    except ValueError as e:
        _raise(e, root, f"read {key} of")
    return bytes(r.value) if r.state == "value" else None


def read_bytes_many(root: str, keys: Sequence[str]) -> list[bytes | None]:
    """`read_bytes` of every key in `keys`, the reads issued at once (None for a missing object)."""
    store = open_store(root)
    try:
        got = [f.result() for f in [store.read(k) for k in keys]]
    except ValueError as e:
        _raise(e, root, "read objects of")
    return [bytes(r.value) if r.state == "value" else None for r in got]


def read_json_many(root: str, keys: Sequence[str]) -> list:
    """`read_json` of every key in `keys`, the reads issued at once (None for a missing object)."""
    return [None if d is None else json.loads(d) for d in read_bytes_many(root, keys)]


def exists(root: str, key: str) -> bool:
    return read_bytes(root, key) is not None


def read_json(root: str, key: str) -> Any:
    data = read_bytes(root, key)
    return None if data is None else json.loads(data)


def write_bytes(root: str, key: str, data: bytes, *, if_absent: bool = False) -> bool:
    """Write object `key` under `root` (a whole-object PUT, atomic on object stores).

    `if_absent`: only if no object `key` exists (a conditional write); returns False when one did."""
    kwargs = {"if_equal": _NO_VALUE} if if_absent else {}
    try:
        gen = open_store(root).write(key, data, **kwargs).result()
    except ValueError as e:
        _raise(e, root, f"write {key} to")
    return bool(gen.generation)


def write_bytes_many(root: str, items: Sequence[tuple[str, bytes]]) -> None:
    """`write_bytes` of every (key, data) in `items`, the writes issued at once (no order among them)."""
    store = open_store(root)
    try:
        for f in [store.write(k, d) for k, d in items]:
            f.result()
    except ValueError as e:
        _raise(e, root, "write objects to")


def write_json(root: str, key: str, obj: Any, *, if_absent: bool = False) -> bool:
    return write_bytes(root, key, json.dumps(obj, indent=1).encode(), if_absent=if_absent)


def list_keys(root: str, prefix: str = "") -> list[str]:
    """Keys under `root` (relative to it), optionally only those starting with `prefix`."""
    import tensorstore as ts

    store = open_store(root)
    try:
        rng = ts.KvStore.KeyRange(prefix, prefix[:-1] + chr(ord(prefix[-1]) + 1)) if prefix else ts.KvStore.KeyRange()
        keys = store.list(rng).result()
    except ValueError as e:
        _raise(e, root, "list")
    return sorted(k.decode() for k in keys)


def delete_prefix(root: str, prefix: str = "") -> None:
    """Delete every object under `root` (or under `root`/`prefix`)."""
    import tensorstore as ts

    store = open_store(root)
    try:
        rng = ts.KvStore.KeyRange(prefix, prefix[:-1] + chr(ord(prefix[-1]) + 1)) if prefix else ts.KvStore.KeyRange()
        store.delete_range(rng).result()
    except ValueError as e:
        _raise(e, root, "delete objects under")


def delete_keys(root: str, keys: Sequence[str]) -> None:
    """Delete the objects `keys` under `root` (absent ones are no error): one DELETE each, issued
    at once, where `delete_prefix` would list first."""
    store = open_store(root)
    try:
        for f in [store.write(k, None) for k in keys]:
            f.result()
    except ValueError as e:
        _raise(e, root, "delete objects under")


# The encoded StorageGeneration meaning "no value": a write conditioned on it creates, never replaces.
_NO_VALUE = b"\x02"


# -- objects as paths ------------------------------------------------------------------------------
def _object(url: str):
    """(the kvstore of `url`'s bucket, the object's key) for an s3:// / gs:// object URL."""
    import tensorstore as ts

    from bridge.location import scheme_of

    scheme = scheme_of(url)
    bucket, _, key = url[len(scheme) + 3:].partition("/")
    spec = _s3_spec(bucket, "") if scheme == "s3" else _gcs_spec(bucket, "")
    try:
        return ts.KvStore.open(spec, context=context()).result(), key
    except ValueError as e:
        _raise(e, url, "open")


class _Stat:
    def __init__(self, size: int) -> None:
        self.st_size = size


class ObjectPath(str):
    """An s3:// / gs:// URL with the few `pathlib.Path` methods checkpoint readers use on a
    directory (`/`, `name`, `parent`, `is_file`, `is_dir`, `exists`, `read_bytes`, `read_text`,
    `stat`, `glob`), so code written for local directories reads objects unchanged.

    >>> p = ObjectPath("s3://bkt/runs/iter_0000003")
    >>> p / "common.pt", p.name, p.parent
    ('s3://bkt/runs/iter_0000003/common.pt', 'iter_0000003', 's3://bkt/runs')
    """

    def __truediv__(self, name) -> "ObjectPath":
        return ObjectPath(f"{self.rstrip('/')}/{str(name).strip('/')}")

    @property
    def name(self) -> str:
        return self.rstrip("/").rsplit("/", 1)[-1]

    @property
    def parent(self) -> "ObjectPath":
        head = self.rstrip("/").rsplit("/", 1)[0]
        return ObjectPath(head) if "://" in head and head.split("://", 1)[1] else self

    def _read(self, lo: int | None = None, hi: int | None = None):
        store, key = _object(self)
        try:
            r = store.read(key, byte_range=slice(lo, hi)).result() if lo is not None else store.read(key).result()
        except ValueError as e:
            if "OUT_OF_RANGE" in str(e) or "InvalidRange" in str(e) or "416" in str(e):
                return b""
            _raise(e, str(self), "read")
        return bytes(r.value) if r.state == "value" else None

    def is_file(self) -> bool:
        return self._read(0, 0) is not None

    def exists(self) -> bool:
        return self.is_file() or self.is_dir()

    def is_dir(self) -> bool:
        return bool(self._below()[1])

    def _below(self) -> tuple[str, list[bytes]]:
        """(this path as a key prefix, ending in "/"; the keys of every object below it)."""
        store, key = _object(self)
        import tensorstore as ts

        prefix = key.rstrip("/") + "/"
        try:
            return prefix, store.list(ts.KvStore.KeyRange(prefix, prefix[:-1] + "0")).result()
        except ValueError as e:
            _raise(e, str(self), "list")

    def read_bytes(self) -> bytes:
        data = self._read()
        if data is None:
            raise FileNotFoundError(str(self))
        return data

    def read_text(self, encoding: str = "utf-8", errors: str = "strict") -> str:
        return self.read_bytes().decode(encoding, errors)

    def stat(self) -> _Stat:
        """The object's size, found by ranged one-byte reads (no download): ~2 log2(size) requests."""
        if self._read(0, 0) is None:
            raise FileNotFoundError(str(self))
        hi = 1
        while self._read(hi - 1, hi):
            hi *= 2
        lo = hi // 2  # byte lo-1 exists (or lo == 0), byte hi-1 does not
        while lo < hi:
            mid = (lo + hi) // 2
            if self._read(mid, mid + 1):
                lo = mid + 1
            else:
                hi = mid
        return _Stat(lo)

    def glob(self, pattern: str) -> list["ObjectPath"]:
        """Direct children (objects or prefixes) whose name matches `pattern` (fnmatch)."""
        import fnmatch

        prefix, keys = self._below()
        names = sorted({k.decode()[len(prefix):].split("/", 1)[0] for k in keys})
        return [self / n for n in names if fnmatch.fnmatch(n, pattern)]
