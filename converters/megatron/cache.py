"""Reading the converters' source chunks: a byte-bounded LRU of whole chunks, and ranged reads of
records too large to hold (pure index math first, then I/O)."""

from __future__ import annotations

import io
import struct
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from math import prod
from typing import Hashable, Sequence

import numpy as np

from bridge.errors import BridgeError
from converters.megatron.dcp_reader import open_range


class ArrayLRU:
    """Arrays by key; the least recently used are dropped once the total exceeds `max_bytes`
    (the newest array is always kept, however large).

    >>> c = ArrayLRU(32); c.put("a", np.zeros(2)); c.put("b", np.zeros(2)); c.get("a") is not None
    True
    >>> c.put("c", np.zeros(1)); c.get("b") is None, c.get("a") is not None
    (True, True)
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._d: OrderedDict[Hashable, np.ndarray] = OrderedDict()
        self._bytes = 0

    def get(self, key: Hashable) -> np.ndarray | None:
        """The array under `key` (None when absent), marked most recently used."""
        a = self._d.get(key)
        if a is not None:
            self._d.move_to_end(key)
        return a

    def put(self, key: Hashable, a: np.ndarray) -> None:
        """Keep `a` under `key` (a key not yet held), then drop the oldest arrays over the budget."""
        self._d[key] = a
        self._bytes += a.nbytes
        while self._bytes > self.max_bytes and len(self._d) > 1:
            _, old = self._d.popitem(last=False)
            self._bytes -= old.nbytes


# ---------------------------------------------------------------------------------------------
# Pure index math for reading part of a stored (row-major) chunk


def c_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Row-major element strides.

    >>> c_strides((2, 3, 4))
    (12, 4, 1)
    """
    out, n = [], 1
    for s in reversed(tuple(shape)):
        out.append(n)
        n *= s
    return tuple(reversed(out))


def flat_span(shape: Sequence[int], start: Sequence[int], stop: Sequence[int]) -> tuple[int, int]:
    """Elements [lo, hi) of a row-major array of `shape` that enclose the box [start, stop).

    >>> flat_span((4, 6), (1, 2), (3, 4))     # rows 1-2, columns 2-3
    (8, 16)
    """
    st = c_strides(shape)
    lo = sum(a * s for a, s in zip(start, st))
    hi = sum((b - 1) * s for b, s in zip(stop, st)) + 1
    return lo, hi


def split_box_reads(shape: Sequence[int], start: Sequence[int], stop: Sequence[int],
                    slack: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Cut a box of a row-major array into sub-boxes whose enclosing spans waste at most `slack`
    elements each (or are single rows of the last axis): what to read to get the box.

    >>> split_box_reads((4, 6), (0, 2), (4, 4), 4)        # a column band: one read per row
    [((0, 2), (1, 4)), ((1, 2), (2, 4)), ((2, 2), (3, 4)), ((3, 2), (4, 4))]
    >>> split_box_reads((4, 6), (1, 0), (3, 6), 0)        # whole rows: one contiguous read
    [((1, 0), (3, 6))]
    """
    start, stop = tuple(start), tuple(stop)
    lo, hi = flat_span(shape, start, stop)
    size = 1
    for a, b in zip(start, stop):
        size *= b - a
    if hi - lo - size <= slack or len(shape) <= 1:
        return [(start, stop)]
    k = next((i for i, (a, b) in enumerate(zip(start, stop)) if b - a > 1), len(shape) - 1)
    if k == len(shape) - 1:
        return [(start, stop)]
    out = []
    for i in range(start[k], stop[k]):
        out += split_box_reads(shape, start[:k] + (i,) + start[k + 1:], stop[:k] + (i + 1,) + stop[k + 1:], slack)
    return out


# ---------------------------------------------------------------------------------------------
# Reading stored chunks


class _Window(io.RawIOBase):
    """Bytes [offset, offset + length) of a file as a read-only seekable file (pread, no buffering);
    `fd` is a `dcp_reader.RangeReader` (a local file or an object)."""

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
    `data_offset + i * itemsize`; `crc` is the zip member's CRC-32 over `member_offset..+member_size`."""

    path: str
    data_offset: int
    itemsize: int
    dtype: np.dtype
    member_offset: int
    member_size: int
    crc: int


def record_layout(ck, key: str, chunk) -> RecordLayout:
    """Parse a DCP tensor record's torch.save zip without reading its data: the tensor's metadata
    through torch's weights-only unpickler onto the meta device, the member's CRC from the zip
    directory. Refuses anything but one contiguous, stored (uncompressed) tensor of the chunk's
    dtype and size."""
    import zipfile

    import torch

    from bridge.dtypes import numpy_dtype_of_torch
    from converters.megatron.dcp_reader import check_relative_path, open_range

    ref = chunk.storage
    what = f"{key} chunk {chunk.offsets} in {ref.relative_path}"
    path = check_relative_path(ck.root, ref.relative_path, str(ck.root))
    fd = open_range(path)
    try:
        try:
            t = torch.load(_Window(fd, ref.offset, ref.length), map_location="meta", weights_only=True)
            infos = [i for i in zipfile.ZipFile(_Window(fd, ref.offset, ref.length)).infolist()
                     if i.filename.split("/")[-2:-1] == ["data"]]
        except Exception as e:  # noqa: BLE001 - any parse failure is a damaged record
            raise BridgeError(f"cannot read {what}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''} "
                              f"(damaged chunk?)") from None
        if not isinstance(t, torch.Tensor) or len(infos) != 1:
            raise BridgeError(f"cannot read {what}: expected one tensor in the record; damaged checkpoint")
        info = infos[0]
        ti = ck.tensors[key]
        item = t.element_size()
        data = getattr(t.untyped_storage(), "_checkpoint_offset", None)
        if t.dtype != ti.dtype or t.numel() != chunk.numel or not t.is_contiguous() or data is None:
            raise BridgeError(f"cannot read {what}: stored tensor {t.dtype} {tuple(t.shape)} (contiguous: "
                              f"{t.is_contiguous()}) does not match .metadata's {ti.dtype} {chunk.sizes}; damaged")
        head = fd.pread(30, ref.offset + info.header_offset)
        if len(head) < 30 or head[:4] != b"PK\x03\x04" or info.compress_type != zipfile.ZIP_STORED:
            raise BridgeError(f"cannot read {what}: the tensor's zip member is damaged or compressed")
        n, m = struct.unpack("<HH", head[26:30])
        member = info.header_offset + 30 + n + m
        nbytes = t.untyped_storage().nbytes()
        if member != data or info.file_size != nbytes or data + nbytes > ref.length \
                or (t.storage_offset() + t.numel()) * item > nbytes:
            raise BridgeError(f"cannot read {what}: the tensor's bytes are not where its zip member says; damaged")
    finally:
        fd.close()
    return RecordLayout(str(path), ref.offset + data + t.storage_offset() * item, item, numpy_dtype_of_torch(t.dtype),
                        ref.offset + member, info.file_size, info.CRC)


def check_record_crc(lay: RecordLayout, what: str, window: int) -> None:
    """Stream the member through `window`-byte reads and compare its CRC-32 (bounded memory)."""
    crc, pos, end = 0, lay.member_offset, lay.member_offset + lay.member_size
    with open_range(lay.path) as f:
        buf = bytearray(max(1 << 16, min(window, lay.member_size)))
        mv = memoryview(buf)
        while pos < end:
            n = f.readinto(mv[:min(len(buf), end - pos)], pos)
            if n <= 0:
                raise BridgeError(f"{what}: truncated while reading at byte {pos}")
            crc = zlib.crc32(mv[:n], crc)
            pos += n
    if crc != lay.crc:
        raise BridgeError(f"{what}: CRC-32 mismatch (stored {lay.crc:08x}, computed {crc:08x}): the bytes are damaged")


class ChunkCache:
    """Stored chunks of one DCP checkpoint, read for copies (`megatron_plan.Copy`).

    A chunk whose record fits `max_bytes` is read whole, once, and kept (least recently used out);
    a larger one is never held whole: its CRC-32 is checked by one streamed pass, then each copy
    reads only the bytes of its region (`split_box_reads`), so memory stays within the budget
    whatever the size of the source's records.
    """

    def __init__(self, ck, max_bytes: int) -> None:
        self.ck = ck
        self.max_bytes = max(1, max_bytes)
        self._lru = ArrayLRU(self.max_bytes)
        self._layouts: dict[tuple[str, int], RecordLayout] = {}
        self.bytes_read = 0

    def get(self, key: str, index: int) -> np.ndarray:
        """Stored chunk `index` of tensor `key`, shaped as stored."""
        a = self._lru.get((key, index))
        if a is None:
            from bridge.dtypes import to_numpy

            info = self.ck.tensors[key]
            a = to_numpy(self.ck.read_chunk(key, info.chunks[index]))
            self.bytes_read += info.chunks[index].storage.length
            self._lru.put((key, index), a)
        return a

    def object_tensor(self, key: str) -> np.ndarray:
        """A state tensor inside a pickled object (dp_zero_gather_scatter; `plan.object_tensor_key`):
        the object is read once and all its tensors kept, as it holds them together."""
        from bridge.dtypes import to_numpy
        from converters.megatron.plan import object_tensor_key, parse_object_tensor_key

        a = self._lru.get((key, 0))
        if a is None:
            name, _gbuf, _dtype, _state = parse_object_tensor_key(key)
            state = self.ck.read_object(name)
            state = state[0] if isinstance(state, list) and len(state) == 1 else state
            self.bytes_read += sum(r.length for _o, r in self.ck.objects[self.ck.object_key(name)].items)
            for j, per_dtype in state.items():
                if not isinstance(j, int):
                    continue
                for dt, tensors in per_dtype.items():
                    dkey = "(" + ", ".join(str(x) for x in dt) + ")" if isinstance(dt, tuple) else str(dt)
                    for st, t in tensors.items():
                        if hasattr(t, "numel"):
                            k = object_tensor_key(name, j, dkey, st)
                            if self._lru.get((k, 0)) is None:
                                self._lru.put((k, 0), to_numpy(t))
            a = self._lru.get((key, 0))
            if a is None:
                raise BridgeError(f"{key}: no such tensor in the object; the checkpoint changed while converting")
        return a

    def region(self, c) -> np.ndarray:
        """The source data of copy `c` (a `megatron_plan.Copy`), shaped like its logical box."""
        if c.key not in self.ck.tensors:
            a = self.object_tensor(c.key)
        else:
            chunk = self.ck.tensors[c.key].chunks[c.chunk]
            if chunk.storage.length > self.max_bytes:
                return self._ranged(c, chunk)
            a = self.get(c.key, c.chunk)
        if c.flat:
            view = c.view or c.dst.shape
            a = a.reshape(-1)[c.flat_start:c.flat_start + prod(view)].reshape(view)
            if not c.src:
                return a
        return a[tuple(slice(x, y) for x, y in c.src)].reshape(c.dst.shape)

    def _layout(self, key: str, index: int, chunk) -> RecordLayout:
        lay = self._layouts.get((key, index))
        if lay is None:
            lay = record_layout(self.ck, key, chunk)
            check_record_crc(lay, f"{key} chunk {chunk.offsets} in {chunk.storage.relative_path}",
                             min(self.max_bytes, 8 << 20))
            self.bytes_read += lay.member_size
            self._layouts[(key, index)] = lay
        return lay

    def _ranged(self, c, chunk) -> np.ndarray:
        lay = self._layout(c.key, c.chunk, chunk)
        # The region as a box of a row-major array: the chunk itself, or the flat copy's view
        if c.flat:
            shape, base = (c.view or c.dst.shape), c.flat_start
        else:
            shape, base = tuple(chunk.sizes), 0
        box = c.src_box()
        out = np.empty(box.shape, dtype=lay.dtype)
        slack = max(1, (1 << 20) // lay.itemsize)   # read up to 1 MiB of unneeded bytes rather than split
        with open_range(lay.path) as f:
            for start, stop in split_box_reads(shape, box.start, box.stop, slack):
                lo, hi = flat_span(shape, start, stop)
                span = np.empty(hi - lo, dtype=lay.dtype)
                got = f.readinto(span.view(np.uint8), lay.data_offset + (base + lo) * lay.itemsize)
                if got != span.nbytes:
                    raise BridgeError(f"{c.key}: truncated record in {chunk.storage.relative_path}")
                self.bytes_read += span.nbytes
                sub = tuple(b - a for a, b in zip(start, stop))
                view = np.lib.stride_tricks.as_strided(
                    span, sub, tuple(s * lay.itemsize for s in c_strides(shape)), writeable=False)
                rel = tuple(slice(a - s, b - s) for a, b, s in zip(start, stop, box.start))
                out[rel] = view
        return out.reshape(c.dst.shape)
