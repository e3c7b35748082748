"""Where a stored DCP record's bytes lie in its file, found without reading its data.

`record_layout` parses a tensor record's torch.save zip through a `Window` on its byte range; the
chunk cache (`cache.ChunkCache`) and the pickled-object locator (`object_layout`) both build on
these, so they live below both.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from math import prod

import numpy as np

from bridge.errors import BridgeError


class Window(io.RawIOBase):
    """Bytes [offset, offset + length) of a file as a read-only seekable file (pread, no buffering);
    `fd` is a `bridge.store.ranged.RangeReader` (a local file or an object)."""

    def __init__(self, fd, offset: int, length: int) -> None:
        self.fd, self.base, self.length, self.pos = fd, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, off: int, whence: int = 0) -> int:
        self.pos = max(0, off if whence == 0 else self.pos + off if whence == 1 else self.length + off)
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, b) -> int:
        n = max(0, min(len(b), self.length - self.pos))
        data = self.fd.pread(n, self.base + self.pos) if n else b""
        b[:len(data)] = data
        self.pos += len(data)
        return len(data)


@dataclass(frozen=True)
class RecordLayout:
    """Where a stored chunk's elements lie in its file: element i (row-major) is at byte
    `data_offset + i * itemsize`; `crc` is the zip member's CRC-32 over `member_offset..+member_size`;
    `what` names it in errors (tensor key, chunk, file)."""

    path: str
    data_offset: int
    itemsize: int
    dtype: np.dtype
    member_offset: int
    member_size: int
    crc: int
    what: str = ""


def record_layout(ck, key: str, chunk) -> RecordLayout:
    """Parse a DCP tensor record's torch.save zip without reading its data (torch-free:
    `read.dcp.tensor_member`), the member's CRC from the zip directory. Refuses anything but one
    contiguous, stored (uncompressed) tensor of the chunk's dtype and size."""
    from bridge.store import check_relative_path, open_range
    from converters.megatron.read.dcp import tensor_member

    ref = chunk.storage
    what = f"{key} chunk {chunk.offsets} in {ref.relative_path}"
    path = check_relative_path(ck.root, ref.relative_path, str(ck.root))
    with open_range(path) as fd:
        m = tensor_member(Window(fd, ref.offset, ref.length), ref.length, what)
    ti = ck.tensors[key]
    if m.dtype != ti.dtype or prod(m.shape) != chunk.numel:
        raise BridgeError(f"cannot read {what}: stored tensor {m.dtype} {m.shape} does not match .metadata's "
                          f"{ti.dtype} {chunk.sizes}; damaged")
    return RecordLayout(str(path), ref.offset + m.data_offset, m.dtype.itemsize, m.dtype.numpy(),
                        ref.offset + m.member_offset, m.member_size, m.crc, what)
