"""Reading the converters' source chunks: a byte-bounded LRU of whole chunks, and ranged reads of
records too large to hold (pure index math first, then I/O)."""

from __future__ import annotations

import zlib
from collections import OrderedDict
from math import prod
from typing import Any, Hashable, Sequence

import numpy as np

from bridge.errors import BridgeError
from bridge.store import open_range
from converters.megatron.read.records import RecordLayout, record_layout


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


def crc_of_range(path: str, lo: int, hi: int, window: int, what: str) -> int:
    """CRC-32 of bytes [lo, hi) of a file (local or object storage), read `window` bytes at a time."""
    crc, pos = 0, lo
    with open_range(path) as f:
        buf = bytearray(max(1 << 16, min(window, hi - lo)))
        mv = memoryview(buf)
        while pos < hi:
            n = f.readinto(mv[:min(len(buf), hi - pos)], pos)
            if n <= 0:
                raise BridgeError(f"{what}: truncated while reading at byte {pos}")
            crc = zlib.crc32(mv[:n], crc)
            pos += n
    return crc


# ---------------------------------------------------------------------------------------------
# CRC-32 of a record assembled from the ranged reads that bring its bytes in anyway: each read's
# new bytes are CRC'd as a span, spans are combined in file order (zlib's crc32_combine, GF(2)
# arithmetic modulo the CRC polynomial), and only bytes no copy needed are read for the check.

_CRC_POLY = 0xEDB88320  # reflected CRC-32 polynomial (zlib)


def _multmodp(a: int, b: int) -> int:
    """a * b modulo the CRC-32 polynomial (reflected bit order; x^0 is bit 31)."""
    m, p = 1 << 31, 0
    while m:
        if a & m:
            p ^= b
            if not a & (m - 1):
                break
        m >>= 1
        b = (b >> 1) ^ _CRC_POLY if b & 1 else b >> 1
    return p


_X2N = [1 << 30]  # x^(2^k) modulo the polynomial, k = 0..31
for _ in range(31):
    _X2N.append(_multmodp(_X2N[-1], _X2N[-1]))


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC-32 of A + B from crc32(A), crc32(B) and len(B) (zlib's crc32_combine).

    >>> crc32_combine(zlib.crc32(b"hello "), zlib.crc32(b"world"), 5) == zlib.crc32(b"hello world")
    True
    >>> crc32_combine(zlib.crc32(b"x"), 0, 0) == zlib.crc32(b"x")
    True
    """
    p, k, n = 1 << 31, 3, len2          # x^(8 * len2): a byte is 8 bits
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return _multmodp(p, crc1) ^ crc2


Span = tuple[int, int, int]   # [lo, hi) file bytes and their CRC-32


def uncovered(spans: Sequence[Span], lo: int, hi: int) -> list[tuple[int, int]]:
    """The parts of [lo, hi) that no span of the sorted, disjoint `spans` covers.

    >>> uncovered([(0, 4, 0), (6, 8, 0)], 2, 10)
    [(4, 6), (8, 10)]
    >>> uncovered([], 3, 5), uncovered([(0, 9, 0)], 3, 5)
    ([(3, 5)], [])
    """
    out, pos = [], lo
    for a, b, _ in spans:
        if b <= pos:
            continue
        if a >= hi:
            break
        if a > pos:
            out.append((pos, a))
        pos = max(pos, b)
    if pos < hi:
        out.append((pos, hi))
    return out


def disjoint_spans(spans: Sequence[Span]) -> list[Span]:
    """Spans sorted by start, each kept only if it starts at or after the end of the last kept one
    (spans of several readers may overlap; an overlapped one's bytes are simply read again).

    >>> disjoint_spans([(4, 8, 1), (0, 4, 2), (2, 6, 3), (8, 9, 4)])
    [(0, 4, 2), (4, 8, 1), (8, 9, 4)]
    """
    out: list[Span] = []
    for s in sorted(spans):
        if not out or s[0] >= out[-1][1]:
            out.append(s)
    return out


def merge_adjacent(spans: Sequence[Span]) -> list[Span]:
    """Sorted disjoint spans with each run of touching ones combined into one (shorter lists).

    >>> a, b = zlib.crc32(b"ab"), zlib.crc32(b"cd")
    >>> merge_adjacent([(0, 2, a), (2, 4, b), (9, 10, 7)]) == [(0, 4, zlib.crc32(b"abcd")), (9, 10, 7)]
    True
    """
    out: list[Span] = []
    for a, b, c in spans:
        if out and out[-1][1] == a:
            a0, _, c0 = out.pop()
            a, c = a0, crc32_combine(c0, c, b - a)
        out.append((a, b, c))
    return out


class RecordCrcs:
    """CRC-32 spans of the large records read by byte ranges, per record (its `RecordLayout`).

    `add` takes bytes a ranged read brought in; `spans()` is what one process hands on (picklable);
    `check_records` (any process) fills the gaps and compares each record's CRC-32. A record's bytes
    are thus read once, and still every byte of it is checked before the output is committed.
    """

    def __init__(self) -> None:
        self._spans: dict[RecordLayout, list[Span]] = {}

    def add(self, lay: RecordLayout, lo: int, data) -> None:
        """Bytes `data` (a buffer) read at file offset `lo` of record `lay`: CRC the new ones."""
        mv = memoryview(np.ascontiguousarray(data).reshape(-1).view(np.uint8))
        spans = self._spans.setdefault(lay, [])
        lo_m, hi_m = lay.member_offset, lay.member_offset + lay.member_size
        for a, b in uncovered(spans, max(lo, lo_m), min(lo + len(mv), hi_m)):
            spans.append((a, b, zlib.crc32(mv[a - lo:b - lo])))
        spans.sort()
        self._spans[lay] = merge_adjacent(spans)

    def spans(self) -> dict[RecordLayout, list[Span]]:
        return {lay: list(s) for lay, s in self._spans.items()}


def check_records(parts: Sequence[dict[RecordLayout, list[Span]]], window: int = 8 << 20) -> int:
    """Every record's CRC-32 from the spans of all readers (`RecordCrcs.spans()`), the bytes no
    reader covered read here; raises BridgeError naming the first damaged record. Returns the
    bytes read here."""
    merged: dict[RecordLayout, list[Span]] = {}
    for part in parts:
        for lay, spans in part.items():
            merged.setdefault(lay, []).extend(spans)
    nread = 0
    for lay in sorted(merged, key=lambda r: (r.path, r.member_offset)):
        what = lay.what or f"record at byte {lay.member_offset} of {lay.path}"
        spans = disjoint_spans(merged[lay])
        lo, hi = lay.member_offset, lay.member_offset + lay.member_size
        for a, b in uncovered(spans, lo, hi):
            spans.append((a, b, crc_of_range(lay.path, a, b, window, what)))
            nread += b - a
        crc = 0
        for a, b, c in disjoint_spans(spans):
            crc = crc32_combine(crc, c, b - a)
        if crc != lay.crc:
            raise BridgeError(f"{what}: CRC-32 mismatch (stored {lay.crc:08x}, computed {crc:08x}): "
                              f"the bytes are damaged")
    return nread


# A block is filled from up to four records at once (model, params, mu, nu: the optimizer's three
# come from three bucket records): a record is read whole only when that many fit the cache
# together, else the blocks taking turns evict each other's records and every block re-reads them
# whole (several times the state read with bucket-sized records; README, tuning constants).
WHOLE_RECORDS = 16


class ChunkCache:
    """Stored chunks of one DCP checkpoint, read for copies (`converters.megatron.plan.convert_plan.Copy`).

    A chunk whose record fits a quarter of `max_bytes` (`WHOLE_RECORDS`) is read whole, once,
    CRC-checked, and kept (least recently used out); a larger one is never held whole: each copy reads only the bytes of its
    region (`split_box_reads`), so memory stays within the budget whatever the size of the source's
    records, and the CRC-32 of what those reads bring in is kept (`crcs`) for `check_records`, which
    the caller must pass before committing anything made from them.
    """

    def __init__(self, ck, max_bytes: int) -> None:
        self.ck = ck
        self.max_bytes = max(1, max_bytes)
        self._lru = ArrayLRU(self.max_bytes)
        self._layouts: dict[tuple[str, int], RecordLayout] = {}
        self._objects: dict[str, Any] = {}   # object name -> locatable; object tensor key -> (ObjectTensor, chunk)
        self.crcs = RecordCrcs()
        self.bytes_read = 0

    def get(self, key: str, index: int) -> np.ndarray:
        """Stored chunk `index` of tensor `key`, shaped as stored."""
        a = self._lru.get((key, index))
        if a is None:
            info = self.ck.tensors[key]
            a = self.ck.read_array(key, info.chunks[index])
            self.bytes_read += info.chunks[index].storage.length
            self._lru.put((key, index), a)
        return a

    def object_tensor(self, key: str) -> np.ndarray:
        """A state tensor inside a pickled object (dp_zero_gather_scatter; `plan.object_tensor_key`):
        the object is read once and all its tensors kept, as it holds them together."""
        from converters.megatron.plan.convert_plan import object_tensor_key, parse_object_tensor_key

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
                            if k == key:  # kept here: its siblings may evict it from a small cache
                                a = t.numpy()
                            if self._lru.get((k, 0)) is None:
                                self._lru.put((k, 0), t.numpy())
            if a is None:
                raise BridgeError(f"{key}: no such tensor in the object; the checkpoint changed while converting")
        return a

    def region_into(self, c, dst: np.ndarray) -> None:
        """Copy `c`'s source data into `dst` (shaped like `c.dst`, e.g. the part of a block it fills).

        A record read by ranges is read straight into `dst` wherever a read's span is exactly a
        contiguous piece of it (whole rows of a block: the common case), so its bytes are copied once,
        by the kernel, instead of into a temporary, then a region, then the block."""
        if c.key in self.ck.tensors:
            chunk = self.ck.tensors[c.key].chunks[c.chunk]
            if chunk.storage.length > self.max_bytes // WHOLE_RECORDS:
                self._ranged(c, chunk, dst)
                return
        data = self.region(c)
        _same_dtype(c, data.dtype, dst.dtype)
        dst[...] = data

    def located_object_tensor(self, key: str) -> tuple | None:
        """A state tensor inside a pickled object, located (`object_layout.ObjectTensor`) with a one-chunk
        view of it for `_ranged`; None when the object's archive cannot be located (an archive nested
        in a pickle: DCP's default planner), which `object_tensor` then reads whole. Each object's
        pickle is parsed once, no tensor data read: at scale dp_zero_gather_scatter's object is the
        whole optimizer state of a TP x PP rank."""
        from converters.megatron.read.dcp_metadata import ChunkInfo, StorageRef
        from converters.megatron.read.object_layout import ObjectTensor, object_tensors
        from converters.megatron.plan.convert_plan import object_tensor_key, parse_object_tensor_key

        name, _gbuf, _dtype, _state = parse_object_tensor_key(key)
        if name not in self._objects:
            state = object_tensors(self.ck, name)
            self._objects[name] = state is not None
            state = state[0] if isinstance(state, list) and len(state) == 1 else state
            for j, per_dtype in (state.items() if isinstance(state, dict) else ()):
                for dt, tensors in (per_dtype.items() if isinstance(j, int) and isinstance(per_dtype, dict) else ()):
                    dkey = "(" + ", ".join(str(x) for x in dt) + ")" if isinstance(dt, tuple) else str(dt)
                    for st, t in (tensors.items() if isinstance(tensors, dict) else ()):
                        if isinstance(t, ObjectTensor):
                            ref = StorageRef(t.layout.path, t.layout.member_offset, t.layout.member_size)
                            self._objects[object_tensor_key(name, j, dkey, st)] = (t, ChunkInfo((0,), (t.numel,), ref))
        if not self._objects[name]:
            return None
        got = self._objects.get(key)
        if got is None:
            raise BridgeError(f"{key}: no such tensor in the object; the checkpoint changed while converting")
        self._layouts[(key, 0)] = got[0].layout
        return got

    def _object_region(self, c) -> np.ndarray:
        """`region` of a copy from a tensor inside a pickled object: a large tensor's bytes read for
        this copy only, a small one read alone once and kept."""
        from bridge.layout.boxes import Box
        from converters.megatron.plan.convert_plan import Copy

        got = self.located_object_tensor(c.key)
        if got is None:
            a = self.object_tensor(c.key)
        else:
            t, chunk = got
            if t.numel * t.layout.itemsize > self.max_bytes // WHOLE_RECORDS:
                return self._ranged(c, chunk)
            a = self._lru.get((c.key, 0))
            if a is None:
                a = self._ranged(Copy(c.key, 0, c.array, Box((0,), (t.numel,)), flat_start=0), chunk)
                self._lru.put((c.key, 0), a)
        view = c.view or c.dst.shape
        a = a.reshape(-1)[c.flat_start:c.flat_start + prod(view)].reshape(view)
        return a if not c.src else a[tuple(slice(x, y) for x, y in c.src)].reshape(c.dst.shape)

    def region(self, c) -> np.ndarray:
        """The source data of copy `c` (a `converters.megatron.plan.convert_plan.Copy`), shaped like its logical box."""
        if c.key not in self.ck.tensors:
            return self._object_region(c)
        else:
            chunk = self.ck.tensors[c.key].chunks[c.chunk]
            if chunk.storage.length > self.max_bytes // WHOLE_RECORDS:
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
            self._layouts[(key, index)] = lay
        return lay

    def _ranged(self, c, chunk, dst: np.ndarray | None = None) -> np.ndarray:
        """Copy `c`'s region by byte ranges of its record, into `dst` when given (else a new array)."""
        lay = self._layout(c.key, c.chunk, chunk)
        # The region as a box of a row-major array: the chunk itself, or the flat copy's view
        if c.flat:
            shape, base = (c.view or c.dst.shape), c.flat_start
        else:
            shape, base = tuple(chunk.sizes), 0
        box = c.src_box()
        if dst is not None:
            _same_dtype(c, lay.dtype, dst.dtype)
        # `dst` seen in the region's shape (a view: only when no copy is needed to reshape it)
        in_dst = dst is not None and (dst.shape == box.shape or dst.flags.c_contiguous)
        out = (dst if dst.shape == box.shape else dst.reshape(box.shape)) if in_dst else \
            np.empty(box.shape, dtype=lay.dtype)
        slack = max(1, (1 << 20) // lay.itemsize)   # read up to 1 MiB of unneeded bytes rather than split
        with open_range(lay.path) as f:
            for start, stop in split_box_reads(shape, box.start, box.stop, slack):
                lo, hi = flat_span(shape, start, stop)
                pos = lay.data_offset + (base + lo) * lay.itemsize
                rel = tuple(slice(a - s, b - s) for a, b, s in zip(start, stop, box.start))
                sub = tuple(b - a for a, b in zip(start, stop))
                target = out[rel]
                direct = hi - lo == prod(sub) and target.flags.c_contiguous
                # direct: the read lands in place (no temporary, no copy)
                span = target.reshape(-1) if direct else np.empty(hi - lo, dtype=lay.dtype)
                got = f.readinto(span.view(np.uint8), pos)
                if got != span.nbytes:
                    raise BridgeError(f"{c.key}: truncated record in {chunk.storage.relative_path}")
                self.crcs.add(lay, pos, span.view(np.uint8))
                self.bytes_read += span.nbytes
                if direct:
                    continue
                view = np.lib.stride_tricks.as_strided(
                    span, sub, tuple(s * lay.itemsize for s in c_strides(shape)), writeable=False)
                target[...] = view
        if dst is not None and not in_dst:
            dst[...] = out.reshape(dst.shape)
        return out.reshape(c.dst.shape)


def _same_dtype(c, stored: np.dtype, want: np.dtype) -> None:
    if stored != want:
        raise BridgeError(f"{c.key}: stored dtype {stored} differs from {want} of {c.array}; unknown format")
