"""Byte ranges of one file or object: a local path through `pread`, an s3:// / gs:// object
through TensorStore's kvstore, one ranged GET per read (small reads share a read-ahead window).

A read returns exactly the bytes asked for, as `os.pread` does: fewer only where the file or
object ends, whatever the size of the read and whatever the window holds.

>>> import os, tempfile
>>> with tempfile.NamedTemporaryFile() as f:
...     _ = f.write(bytes(range(10))); f.flush()
...     with open_range(f.name) as r:
...         r.pread(3, 4), r.pread(5, 8)
(b'\\x04\\x05\\x06', b'\\x08\\t')
"""

from __future__ import annotations

import os

from bridge.errors import BridgeError
from bridge.location import is_remote

#: Remote reads smaller than this fetch this much around their offset (one request instead of many).
READ_AHEAD = 64 << 10


def window_start(offset: int, n: int, window: int = READ_AHEAD) -> int:
    """Where a read-ahead window of `window` bytes starts so that it holds [offset, offset + n)
    (n <= window) with the slack split before and after it (a zip is parsed backwards and forwards
    from its end record).

    >>> window_start(100_000, 40_000), window_start(10, 40_000)
    (87232, 0)
    """
    return max(0, offset - (window - n) // 2)


class RangeReader:
    """Byte ranges of one file or object: `pread(n, offset)`, `readinto(buffer, offset)` (fewer
    bytes only at the end), `close()`."""

    def __init__(self, location: str) -> None:
        self.location = location
        self.remote = is_remote(location)
        if self.remote:
            from bridge.store import kvstore

            parent, _, self.key = location.rpartition("/")
            self._store = kvstore.open_store(parent)
            self._window: tuple[int, bytes] = (0, b"")   # (offset, bytes) of the last read-ahead
            self._size: int | None = None                 # the object's size, once a read met its end
            self.fd = -1
        else:
            self.fd = os.open(location, os.O_RDONLY)

    def pread(self, n: int, offset: int) -> bytes:
        """Bytes [offset, offset + n): all of them, or those before the end of the file."""
        if not self.remote:
            return os.pread(self.fd, n, offset)
        if n <= 0:
            return b""
        if n < READ_AHEAD:
            # Parsing a record's zip (torch.load) makes ~25 small reads around it (end record,
            # directory, header, pickle), each a request on an object store: one window around the
            # first serves the rest.
            w_off, w = self._window
            if not (w_off <= offset and offset + n <= w_off + len(w)):
                w_off = window_start(offset, n)
                w = self._exact(w_off, READ_AHEAD)
                self._window = (w_off, w)
            return w[offset - w_off:offset - w_off + n]   # shorter only past the object's end
        return self._exact(offset, n)

    def readinto(self, buf, offset: int) -> int:
        """Fill `buf` from byte `offset`; returns how many bytes were read (fewer only at the end)."""
        mv = memoryview(buf).cast("B")
        got = 0
        if not self.remote:
            while got < len(mv):  # one pread moves at most ~2 GiB
                n = os.preadv(self.fd, [mv[got:]], offset + got)
                if n <= 0:
                    break
                got += n
            return got
        data = self.pread(len(mv), offset)
        mv[:len(data)] = data
        return len(data)

    def _exact(self, offset: int, n: int) -> bytes:
        """Bytes [offset, offset + n) of the object, asking again for what a response left out."""
        parts, got = [], 0
        while got < n:
            part = self._range(offset + got, offset + n)
            if not part:
                break   # the object's end
            parts.append(part)
            got += len(part)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def _range(self, lo: int, hi: int) -> bytes:
        """One ranged GET of [lo, hi), clipped to the object's end once that is known: the store refuses
        a range past the end (OUT_OF_RANGE), so then the rest of the object from `lo` is asked for
        (fewer than hi - lo bytes, since the range was refused), and b"" when `lo` is at or past it."""
        if self._size is not None:
            hi = min(hi, self._size)
            if hi <= lo:
                return b""
        value = self._get(slice(lo, hi))
        if value is None:
            value = self._get(slice(lo, None))
            if value is None:
                return b""
            self._size = lo + len(value)
        return value[:hi - lo]

    def _get(self, byte_range: slice) -> bytes | None:
        """The object's bytes in `byte_range`, None when the store says the range is past its end."""
        try:
            r = self._store.read(self.key, byte_range=byte_range).result()
        except ValueError as e:
            if "OUT_OF_RANGE" in str(e) or "InvalidRange" in str(e) or "416" in str(e):
                return None
            from bridge.store.kvstore import storage_error

            raise storage_error(e, self.location, "read") from None
        if r.state != "value":
            raise BridgeError(f"missing shard file {self.location}; copy the complete checkpoint")
        return r.value

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> "RangeReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_range(location: str | os.PathLike) -> RangeReader:
    """A RangeReader over a local file path or an s3:// / gs:// object URL."""
    return RangeReader(os.fspath(location))
