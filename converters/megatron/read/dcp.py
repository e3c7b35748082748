"""Safe reader for PyTorch DCP (`torch_dist`) checkpoint directories.

Checkpoints are untrusted input. Three things in a `torch_dist` directory are pickles:
`.metadata` (a plain pickle of `torch.distributed.checkpoint.metadata.Metadata`), and the byte
objects (`common_state`, `_extra_state`, optimizer param groups), each a `torch.save` zip of
`[obj]`. All of them go through `SafeUnpickler` (pure-Python pickle with every opcode that calls,
creates or mutates an object checked): an allow-list of torch / builtin / collections classes,
each callable's arguments validated, numpy only as plain numeric arrays and scalars (no object or
structured dtypes: a forged pointer cannot be built), inert stubs for `megatron.*`,
`transformer_engine.*`, `nvidia_resiliency_ext.*`, memory bounded by a constant times the input
size, and a one-line `BridgeError` naming the file for anything else, raised before it is built.

Integrity: DCP itself stores no checksum. Each `.distcp` record is a `torch.save` zip whose members
carry a CRC-32 (torch.load ignores it); every member of every record read is CRC-checked
(`zip_records`), so a flipped bit in any tensor or object record is refused naming the key and
file. `.metadata` and `metadata.json` carry no checksum: they are checked structurally (types,
ranges, chunks inside tensors, byte ranges inside files, paths inside the directory).
Tensor records are unpickled by the same reader (not `torch.load`), sharing the read buffer.

torch is never imported to read a checkpoint: torch's classes and rebuild functions are allow-listed
by name and build inert values (`converters.megatron.read.torch_archive`: a tensor is an `ArchiveTensor`
whose `.numpy()` views the record's bytes), so convert's processes stay hundreds of MiB smaller. The
functions named `*torch*` (`safe_torch_load_tensor`, `read_chunk`, `read_full`) convert to torch at
their edge, for callers that want tensors.

This module holds the unpickler (`SafeUnpickler`, `safe_loads`), torch.save archives read without
torch.load, and `DcpCheckpoint`; beside it: what a pickle may build (`read.unpickle_rules`), its time
bounds (`read.unpickle_bounds`), `.metadata` as data (`read.dcp_metadata`), where bytes come from
(`bridge.store.sources`).
"""

from __future__ import annotations

import _compat_pickle
import argparse
import io
import os
import pickle
import struct
import types
import zipfile
import zlib
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Any, Iterator

from bridge.errors import BridgeError
from bridge.store import open_range, open_storage, short_value, source_of
from converters.megatron.read.dcp_metadata import ChunkInfo, StorageRef, interpret_metadata
from converters.megatron.read.inert import InertStub
from converters.megatron.read.unpickle_bounds import MAX_NESTING, Immutables, KeyGuard, check_graph
from converters.megatron.read.unpickle_rules import (ALLOC_PER_INPUT_BYTE, ALLOC_SLACK, CALL_RULES, EMPTY_NEW,
                                                     RECORD_CLASSES, STORAGE_KINDS, STUB_PREFIXES, TORCH_NAMES,
                                                     StorageKind, allowed_globals, int_tuple, is_stub_class, make_stub,
                                                     plain_numeric_dtype)
from converters.megatron.read.torch_archive import ArchiveTensor, Storage, TorchDtype, to_torch

class SafeUnpickler(pickle._Unpickler):
    """A pickle reader that can only build what DCP metadata and Megatron objects hold.

    The pure-Python unpickler with every opcode that creates, calls or mutates an object checked:
    only allow-listed globals (Megatron/TE classes become `InertStub`s), each callable's arguments
    validated (`_call_rules`), numpy arrays only of plain numeric dtypes with exactly their bytes
    (checked BEFORE `ndarray.__setstate__`), memo indices no larger than the file, copies charged
    to a budget proportional to the input, nesting bounded, no cycles. Its memo is a dict, so a
    huge memo index costs nothing (the C unpickler allocates an array up to the index).
    Anything else raises `BridgeError` naming `what`.
    """

    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, file: io.BytesIO, what: str, size: int,
                 records: dict[str, memoryview | int] | None = None) -> None:
        super().__init__(file)
        self._file = file
        self.what = what
        self.size = size
        self.budget = ALLOC_PER_INPUT_BYTE * size + ALLOC_SLACK
        self.records = records
        self.storages: dict[str, Storage] = {}
        self._open_arrays: dict[int, Any] = {}   # id -> array from _reconstruct awaiting its one BUILD
        self._open_dtypes: dict[int, Any] = {}   # id -> dtype copy that one BUILD may still adjust
        self.immutables = Immutables()   # nesting and unfolded size of tuples / frozensets (hash costs)
        self.keys = KeyGuard(self.refuse, self.charge, self.immutables)   # hash flooding refused

    def load(self) -> Any:  # noqa: D102 - pickle API
        # The input is one in-memory buffer, so frames need no unframer: reading opcodes straight from
        # the BytesIO (C calls) saves a Python-level call per opcode through pickle._Unframer.
        f = self._file
        self.read, self.readline, self.readinto = f.read, f.readline, f.readinto
        self.metastack = []
        self.stack = []
        self.append = self.stack.append
        self.proto = 0
        read, dispatch = f.read, self.dispatch
        try:
            while True:
                key = read(1)
                if not key:
                    raise EOFError
                dispatch[key[0]](self)
        except pickle._Stop as stop:
            return stop.value

    def load_frame(self) -> None:
        self.read(8)  # a frame only announces how many of the following bytes belong together

    def load_bytearray8(self) -> None:
        n = int.from_bytes(self.read(8), "little")
        if n > self.size:  # pickle._Unpickler would allocate n bytes before reading them
            self.refuse(f"a {n}-byte bytearray in a {self.size}-byte file")
        data = self.read(n)
        if len(data) != n:
            raise EOFError
        self.append(bytearray(data))

    # -- bookkeeping ----------------------------------------------------------------------------

    def refuse(self, why: str) -> None:
        raise BridgeError(f"{self.what}: {why}; the file is damaged or hostile (refused before building it)")

    def charge(self, n: int) -> None:
        self.budget -= n
        if self.budget < 0:
            self.refuse(f"it would build more than {ALLOC_PER_INPUT_BYTE} objects per byte of its "
                        f"{self.size} bytes")

    def open_array(self, arr: Any) -> None:
        self._open_arrays[id(arr)] = arr

    def open_dtype(self, d: Any) -> None:
        self._open_dtypes[id(d)] = d

    def close_dtype(self, d: Any) -> None:
        # once a dtype describes data, a later BUILD must not change what that data means
        self._open_dtypes.pop(id(d), None)

    def note_immutable(self, obj: Any, items: Any) -> None:
        """Record a tuple/frozenset's nesting and size; deep ones are refused (hashing them recurses in C)."""
        if self.immutables.note(obj, items) > MAX_NESTING:
            self.refuse(f"tuples nested more than {MAX_NESTING} deep")

    # -- globals ----------------------------------------------------------------------------------

    def find_class(self, module: str, name: str) -> Any:  # noqa: D102 - pickle API
        module, name = str(module), str(name)
        if self.proto < 3:  # Python 2 names in protocol 0-2 pickles (as pickle.Unpickler's fix_imports)
            module, name = _compat_pickle.NAME_MAPPING.get((module, name), (module, name))
            module = _compat_pickle.IMPORT_MAPPING.get(module, module)
        if any(module == p.rstrip(".") or module.startswith(p) for p in STUB_PREFIXES) or (module, name) in RECORD_CLASSES:
            return make_stub(module, name)
        g = allowed_globals()
        if (module, name) in g:
            return g[(module, name)]
        if module == "torch":
            if self.records is not None and name in STORAGE_KINDS:
                return STORAGE_KINDS[name]
            if name in TORCH_NAMES:  # a dtype, layout or memory format
                return TORCH_NAMES[name]
        raise BridgeError(f"refusing to unpickle {module}.{name} in {self.what}: not an allowed class "
                          f"(the checkpoint may be malicious or from an unsupported writer)")

    def persistent_load(self, pid: Any) -> Any:  # noqa: D102 - pickle API
        if self.records is None:
            self.refuse("a persistent reference outside a torch.save archive")
        if not (type(pid) is tuple and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], StorageKind)
                and type(pid[2]) is str and type(pid[4]) is int and pid[4] >= 0):
            self.refuse(f"an invalid tensor storage reference {short_value(pid)}")
        _, kind, key, _loc, numel = pid
        if key in self.storages:
            return self.storages[key]
        rec = self.records.get(f"data/{key}")
        if rec is None:
            self.refuse(f"tensor storage {key!r} has no data/{key} record")
        nbytes = numel * kind.dtype.itemsize
        size = rec if type(rec) is int else len(rec)  # an int: only the archive's layout is read
        if size != nbytes:
            self.refuse(f"tensor storage {key!r}: record has {size} bytes, the pickle says {nbytes}")
        st = Storage(key, kind.dtype, nbytes, None if type(rec) is int else rec)
        self.storages[key] = st
        return st

    # -- opcodes that call, create or mutate ------------------------------------------------------

    def call(self, func: Any, args: Any, kw: dict | None = None) -> Any:
        if type(args) is not tuple or (kw is not None and type(kw) is not dict):
            self.refuse("a call with arguments that are not a tuple")
        if type(func) in (tuple, frozenset):   # looking it up would hash it: 2**48 steps for a shared one
            self.refuse(f"calling a {type(func).__name__}")
        if is_stub_class(func):
            return func(*args, **(kw or {}))
        try:
            rule = CALL_RULES.get(func)
        except TypeError:
            rule = None
        if rule is None:
            name = func.__name__ if hasattr(func, "__name__") else short_value(func)
            self.refuse(f"calling {name} is not allowed")
        return rule(self, args, kw or {})

    def new(self, cls: Any, args: Any, kw: dict | None = None) -> Any:
        if is_stub_class(cls) or type(cls) in (tuple, frozenset):
            return self.call(cls, args, kw)
        try:
            empty = cls in EMPTY_NEW
        except TypeError:
            empty = False
        if empty:  # __new__ ignores the arguments of these; their content comes from BUILD/SETITEMS
            if cls is object and (args or kw):
                self.refuse("object() with arguments")
            return cls.__new__(cls)
        return self.call(cls, args, kw)

    def load_reduce(self) -> None:
        args = self.stack.pop()
        self.stack[-1] = self.call(self.stack[-1], args)

    def load_newobj(self) -> None:
        args = self.stack.pop()
        cls = self.stack.pop()
        self.append(self.new(cls, args))

    def load_newobj_ex(self) -> None:
        kwargs = self.stack.pop()
        args = self.stack.pop()
        cls = self.stack.pop()
        self.append(self.new(cls, args, kwargs))

    def _instantiate(self, klass: Any, args: list) -> None:
        self.append(self.call(klass, tuple(args)))

    def load_obj(self) -> None:
        args = self.pop_mark()
        cls = args.pop(0)
        self._instantiate(cls, args)

    def load_build(self) -> None:
        import numpy as np

        state = self.stack.pop()
        inst = self.stack[-1]
        if isinstance(inst, InertStub):
            inst.__setstate__(state)
        elif type(inst) is np.ndarray:
            self._build_array(inst, state)
        elif type(inst) is np.dtype or isinstance(inst, np.dtype):
            self._build_dtype(inst, state)
        elif type(inst) in (argparse.Namespace, types.SimpleNamespace):
            if isinstance(state, tuple) and len(state) == 2 and state[1] is None:
                state = state[0]
            if type(state) is not dict or not all(type(k) is str for k in state):
                self.refuse(f"{type(inst).__name__} state that is not a dict of names")
            self.charge(len(state))
            inst.__dict__.update(state)
        elif type(inst) is io.BytesIO:
            if not (type(state) is tuple and len(state) == 3 and type(state[0]) in (bytes, bytearray)
                    and type(state[1]) is int and 0 <= state[1] <= len(state[0]) and state[2] in (None, {})):
                self.refuse("a BytesIO with an invalid state")
            self.charge(len(state[0]))
            inst.__setstate__(state)
        elif state is None or (type(state) is dict and not state):
            pass
        else:
            self.refuse(f"setting the state of a {type(inst).__name__}")

    def _build_array(self, arr: Any, state: Any) -> None:
        import numpy as np

        if self._open_arrays.pop(id(arr), None) is not arr:
            self.refuse("setting the state of a numpy array twice or one not made by _reconstruct")
        if type(state) is not tuple or len(state) != 5 or state[0] != 1 or type(state[0]) is not int:
            self.refuse("a numpy array state that is not (1, shape, dtype, fortran, bytes)")
        _, shape, dtype, fortran, raw = state
        shape = int_tuple(shape, f"{self.what}: numpy array shape", 32)
        if not plain_numeric_dtype(dtype):
            shown = short_value(str(dtype)) if isinstance(dtype, np.dtype) else short_value(dtype)
            self.refuse(f"a numpy array of dtype {shown}: only bool/integer/float/complex arrays (no object or "
                        f"structured dtypes)")
        if type(fortran) is not bool or type(raw) not in (bytes, bytearray):
            self.refuse("a numpy array whose data is not raw bytes")
        n = prod(shape) * dtype.itemsize
        if len(raw) != n:
            self.refuse(f"a numpy array of shape {shape} {dtype} with {len(raw)} data bytes (needs {n})")
        self.close_dtype(dtype)
        self.charge(n)
        arr.__setstate__(state)

    def _build_dtype(self, d: Any, state: Any) -> None:
        if self._open_dtypes.pop(id(d), None) is not d:
            self.refuse("changing a numpy dtype that is already in use or was not made by dtype()")
        if not (type(state) is tuple and len(state) in (8, 9) and state[0] in (3, 4) and state[1] in ("<", ">", "|", "=")
                and state[2] is None and state[3] is None and state[4] is None
                and state[5] in (-1, d.itemsize) and state[6] in (-1, d.alignment) and state[7] == d.flags
                and (len(state) == 8 or state[8] is None)):
            self.refuse("a numpy dtype state with fields, sub-arrays or flags (only a byte order may be set)")
        d.__setstate__(state)
        if not plain_numeric_dtype(d):
            self.refuse("a numpy dtype that is not plain numeric after its state was set")

    def load_setitem(self) -> None:
        value = self.stack.pop()
        key = self.stack.pop()
        self._setitems(self.stack[-1], [(key, value)])

    def load_setitems(self) -> None:
        items = self.pop_mark()
        self._setitems(self.stack[-1], zip(items[::2], items[1::2]))

    def _setitems(self, target: Any, pairs: Any) -> None:
        pairs = self.keys.pairs(pairs)
        if type(target) is dict:
            target.update(pairs)
        elif isinstance(target, (dict, InertStub)):  # OrderedDict, Counter...: their own __setitem__
            for k, v in pairs:
                target[k] = v
        else:
            self.refuse(f"setting items of a {type(target).__name__}")

    def load_append(self) -> None:
        value = self.stack.pop()
        self._appends(self.stack[-1], [value])

    def load_appends(self) -> None:
        items = self.pop_mark()
        self._appends(self.stack[-1], items)

    def _appends(self, target: Any, items: list) -> None:
        import collections

        if type(target) is list or type(target) is collections.deque or isinstance(target, InertStub):
            target.extend(items)
        else:
            self.refuse(f"appending to a {type(target).__name__}")

    def load_additems(self) -> None:
        items = self.pop_mark()
        target = self.stack[-1]
        if type(target) is not set:
            self.refuse(f"adding items to a {type(target).__name__}")
        self.keys.admit_all(items)
        target.update(items)

    def load_frozenset(self) -> None:
        items = self.pop_mark()
        self.keys.admit_all(items)
        out = frozenset(items)
        self.note_immutable(out, items)
        self.append(out)

    def load_tuple(self) -> None:
        items = self.pop_mark()
        out = tuple(items)
        self.note_immutable(out, items)
        self.append(out)

    def load_tuple1(self) -> None:
        self.stack[-1] = t = (self.stack[-1],)
        self.note_immutable(t, t)

    def load_tuple2(self) -> None:
        t = (self.stack[-2], self.stack[-1])
        self.stack[-2:] = [t]
        self.note_immutable(t, t)

    def load_tuple3(self) -> None:
        t = (self.stack[-3], self.stack[-2], self.stack[-1])
        self.stack[-3:] = [t]
        self.note_immutable(t, t)

    def load_dict(self) -> None:
        items = self.pop_mark()
        self.append(dict(self.keys.pairs(zip(items[::2], items[1::2]))))

    def load_next_buffer(self) -> None:
        self.refuse("an out-of-band buffer (pickle protocol 5 buffers are not used by checkpoints)")

    def load_ext(self) -> None:
        self.refuse("a copyreg extension code")

    # memo: indices are dict keys here, but no real file numbers them beyond its own length
    def _memo_put(self, i: int) -> None:
        if i < 0 or i > self.size:
            self.refuse(f"memo index {i} beyond the file's {self.size} bytes")
        if not self.stack:
            self.refuse("a memo store with an empty stack")
        self.memo[i] = self.stack[-1]

    def load_put(self) -> None:
        line = self.readline()[:-1]
        if len(line) > 20 or not line.isdigit():
            self.refuse("an invalid memo index")
        self._memo_put(int(line))

    def load_binput(self) -> None:
        self._memo_put(self.read(1)[0])

    def load_long_binput(self) -> None:
        self._memo_put(int.from_bytes(self.read(4), "little"))


for _op, _fn in ((pickle.REDUCE, SafeUnpickler.load_reduce), (pickle.NEWOBJ, SafeUnpickler.load_newobj),
                 (pickle.NEWOBJ_EX, SafeUnpickler.load_newobj_ex), (pickle.OBJ, SafeUnpickler.load_obj),
                 (pickle.BUILD, SafeUnpickler.load_build), (pickle.SETITEM, SafeUnpickler.load_setitem),
                 (pickle.SETITEMS, SafeUnpickler.load_setitems), (pickle.APPEND, SafeUnpickler.load_append),
                 (pickle.APPENDS, SafeUnpickler.load_appends), (pickle.ADDITEMS, SafeUnpickler.load_additems),
                 (pickle.FROZENSET, SafeUnpickler.load_frozenset), (pickle.TUPLE, SafeUnpickler.load_tuple),
                 (pickle.TUPLE1, SafeUnpickler.load_tuple1), (pickle.TUPLE2, SafeUnpickler.load_tuple2),
                 (pickle.TUPLE3, SafeUnpickler.load_tuple3), (pickle.DICT, SafeUnpickler.load_dict),
                 (pickle.NEXT_BUFFER, SafeUnpickler.load_next_buffer), (pickle.EXT1, SafeUnpickler.load_ext),
                 (pickle.EXT2, SafeUnpickler.load_ext), (pickle.EXT4, SafeUnpickler.load_ext),
                 (pickle.FRAME, SafeUnpickler.load_frame), (pickle.BYTEARRAY8, SafeUnpickler.load_bytearray8),
                 (pickle.PUT, SafeUnpickler.load_put), (pickle.BINPUT, SafeUnpickler.load_binput),
                 (pickle.LONG_BINPUT, SafeUnpickler.load_long_binput)):
    SafeUnpickler.dispatch[_op[0]] = _fn
# INST reads "module\nname\n" then calls _instantiate (checked above); READONLY_BUFFER/BYTEARRAY8 etc. are inert.


def safe_loads(data: bytes | memoryview, what: str, records: dict[str, memoryview | int] | None = None,
               check: bool = True) -> Any:
    """Unpickle untrusted bytes with the allow-list and limits of `SafeUnpickler`.

    `records`: a torch.save archive's `data/<key>` members (their bytes, or only their sizes when
    just the archive's layout is wanted), which tensor storages refer to.

    >>> safe_loads(pickle.dumps({"a": [1, 2]}), "test")
    {'a': [1, 2]}
    """
    try:
        obj = SafeUnpickler(io.BytesIO(data), what, len(data), records).load()
        if check:
            check_graph(obj, what, max_size=ALLOC_PER_INPUT_BYTE * len(data) + ALLOC_SLACK)
        return obj
    except BridgeError:
        raise
    except RecursionError:
        raise BridgeError(f"cannot read {what}: nested too deep; the file is damaged or hostile") from None
    except MemoryError:
        raise BridgeError(f"cannot read {what}: out of memory while unpickling; the file is damaged or hostile") from None
    except Exception as e:  # corrupt pickle bytes
        raise BridgeError(f"cannot read {what}: damaged pickle ({type(e).__name__}: {str(e)[:200]}); "
                          f"the file is truncated or not a torch_dist checkpoint") from None


# ---------------------------------------------------------------------------------------------
# torch.save archives (DCP records and byte objects), read without torch.load
# ---------------------------------------------------------------------------------------------


class _MemFile(io.RawIOBase):
    """A read-only file over a buffer, without copying it (zipfile reads only headers from it)."""

    def __init__(self, buf: memoryview) -> None:
        self.buf, self.pos = buf, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, off: int, whence: int = 0) -> int:
        self.pos = max(0, off if whence == 0 else self.pos + off if whence == 1 else len(self.buf) + off)
        return self.pos

    def tell(self) -> int:
        return self.pos

    def read(self, n: int = -1) -> bytes:
        end = len(self.buf) if n is None or n < 0 else min(len(self.buf), self.pos + n)
        out = bytes(self.buf[self.pos:end])
        self.pos = max(self.pos, end)
        return out

    def readinto(self, b: Any) -> int:
        data = self.read(len(b))
        b[:len(data)] = data
        return len(data)


def _zip_members(f: Any, size: int, tail: bytes, what: str) -> dict[str, tuple[int, int, int, str]]:
    """The members of the torch.save archive in file `f` (seekable, `size` bytes; `tail`: its last
    bytes, up to 64 KiB + 22) as key -> (data offset, size, recorded CRC-32, name), every structural check
    done (one disk, stored members, local headers matching the directory, inside the file) and no
    data read. Keys drop the archive's top folder (`data.pkl`, `data/0`, `byteorder`, ...)."""
    try:
        zf = zipfile.ZipFile(f)
        infos = zf.infolist()
    except Exception as e:  # zipfile raises BadZipFile, NotImplementedError, ValueError, struct.error...
        raise BridgeError(f"cannot read {what}: not a valid torch.save zip archive ({type(e).__name__}: {str(e)[:120]}); "
                          f"the file is damaged") from None
    e = tail.rfind(b"PK\x05\x06")
    if e < 0 or len(tail) < e + 22 or struct.unpack("<HHHH", tail[e + 4:e + 12]) not in \
            ((0, 0, len(infos), len(infos)), (0, 0, 0xFFFF, 0xFFFF)):
        raise BridgeError(f"cannot read {what}: the zip archive claims several disks or a different member count "
                          f"(torch.save writes one); the file is damaged")
    out: dict[str, tuple[int, int, int, str]] = {}
    for info in infos:
        h = info.header_offset
        f.seek(h)
        head = f.read(30)
        if len(head) < 30 or head[:4] != b"PK\x03\x04":
            raise BridgeError(f"cannot read {what}: zip member {info.filename[:80]!r} has no local header; damaged")
        n, m = struct.unpack("<HH", head[26:30])
        start = h + 30 + n + m
        name = f.read(n)
        if name != info.orig_filename.encode("utf-8", "surrogateescape") and name.decode("cp437") != info.orig_filename:
            raise BridgeError(f"cannot read {what}: zip member {info.filename[:80]!r} names differ; damaged")
        if info.compress_type != zipfile.ZIP_STORED or info.flag_bits & 1 or info.compress_size != info.file_size:
            raise BridgeError(f"cannot read {what}: zip member {info.filename[:80]!r} is compressed or encrypted "
                              f"(torch.save stores members); damaged or not written by torch")
        if start + info.file_size > size:
            raise BridgeError(f"cannot read {what}: zip member {info.filename[:80]!r} runs past the end; truncated")
        key = info.filename.split("/", 1)[1] if "/" in info.filename else info.filename
        if key in out:
            raise BridgeError(f"cannot read {what}: two zip members named {key[:80]!r}; damaged")
        out[key] = (start, info.file_size, info.CRC, info.filename)
    return out


def _check_crc(data: Any, crc: int, name: str, what: str) -> None:
    if zlib.crc32(data) != crc:
        raise BridgeError(f"{what}: CRC-32 mismatch in zip member {name[:80]!r} "
                          f"(stored {crc:08x}, computed {zlib.crc32(data):08x}): the bytes are damaged")


def zip_records(buf: bytes | bytearray | memoryview, what: str) -> dict[str, memoryview]:
    """The members of a torch.save archive, each CRC-32-checked, as views into `buf` (no copies).

    torch.save writes every member stored (uncompressed) with its CRC-32 in the zip directory;
    torch.load does not check it, so a flipped bit would pass silently. (A save made with
    `torch.serialization.set_crc32_options(False)` has 0 for every member and cannot be checked.)
    Keys drop the archive's top folder (`data.pkl`, `data/0`, `byteorder`, ...).
    """
    mv = memoryview(buf).cast("B")
    members = _zip_members(_MemFile(mv), len(mv), bytes(mv[-(1 << 16) - 22:]), what)
    # torch.serialization.set_crc32_options(False) writes 0 for every member: nothing to check then
    crc_recorded = any(m[2] for m in members.values())
    out: dict[str, memoryview] = {}
    for key, (start, n, crc, name) in members.items():
        out[key] = mv[start:start + n]
        if crc_recorded:
            _check_crc(out[key], crc, name, what)
    return out


def _check_byteorder(order: Any, what: str) -> None:
    if order is not None and bytes(order) != b"little":
        raise BridgeError(f"cannot read {what}: byte order {bytes(order[:16])!r}; only little-endian saves are supported")


def load_torch_archive(buf: bytes | bytearray | memoryview, what: str) -> Any:
    """Unpickle a torch.save archive with SafeUnpickler; tensors (`ArchiveTensor`) share `buf`'s memory."""
    if isinstance(buf, bytes):  # tensors stay writable views (DcpCheckpoint reads bytearrays)
        buf = bytearray(buf)
    recs = zip_records(buf, what)
    if "data.pkl" not in recs:
        raise BridgeError(f"cannot read {what}: the zip archive has no data.pkl (not a torch.save archive)")
    _check_byteorder(recs.get("byteorder"), what)
    return safe_loads(recs["data.pkl"], what, recs)


@dataclass(frozen=True)
class TensorMember:
    """Where a `torch.save(tensor)` archive keeps its one tensor's bytes, without reading them:
    element i (row-major) is at archive byte `data_offset + i * dtype.itemsize`; the data member is
    `member_size` bytes at `member_offset` with CRC-32 `crc` (checked by whoever reads them)."""

    dtype: TorchDtype
    shape: tuple[int, ...]
    data_offset: int
    member_offset: int
    member_size: int
    crc: int


#: a tensor record's pickle is a few hundred bytes; more is not a tensor record
MAX_TENSOR_PICKLE = 1 << 20


def archive_members(f: Any, size: int, what: str) -> dict[str, tuple[int, int, int, str]]:
    """The zip members of a `torch.save` archive of `size` bytes in the seekable file `f`, read from
    its directory alone: member name -> (data start, size, CRC-32 or 0, stored name)."""
    f.seek(max(0, size - (1 << 16) - 22))
    return _zip_members(f, size, f.read((1 << 16) + 22), what)


def read_small_members(f: Any, members: dict[str, tuple[int, int, int, str]], what: str, limit: int,
                       too_big: str) -> dict[str, bytes]:
    """`data.pkl` and `byteorder` of an archive (`archive_members`), each at most `limit` bytes
    (else BridgeError ending in `too_big`), CRC-checked where the archive records CRCs, byte order checked."""
    crc_recorded = any(m[2] for m in members.values())  # as zip_records
    small = {}
    for key in ("data.pkl", "byteorder"):
        if key in members:
            start, n, crc, name = members[key]
            if n > limit:
                raise BridgeError(f"cannot read {what}: a {n}-byte {key}{too_big}")
            f.seek(start)
            small[key] = f.read(n)
            if len(small[key]) != n:
                raise BridgeError(f"cannot read {what}: zip member {name[:80]!r} runs past the end; truncated")
            if crc_recorded:
                _check_crc(small[key], crc, name, what)
    _check_byteorder(small.get("byteorder"), what)
    return small


def tensor_member(f: Any, size: int, what: str) -> TensorMember:
    """Parse a tensor record (`torch.save(tensor)`, `size` bytes in the seekable file `f`) reading
    only its zip directory, headers and pickle (CRC-checked): the tensor must be contiguous, of a
    numpy dtype, and lie inside its one data member."""
    members = archive_members(f, size, what)
    small = read_small_members(f, members, what, MAX_TENSOR_PICKLE, " (a tensor record's is small); damaged")
    if "data.pkl" not in small:
        raise BridgeError(f"cannot read {what}: the zip archive has no data.pkl (not a torch.save archive)")
    data = {k: m[1] for k, m in members.items() if k.startswith("data/")}
    t = safe_loads(small["data.pkl"], what, data)
    if not isinstance(t, ArchiveTensor) or len(data) != 1:
        raise BridgeError(f"cannot read {what}: expected one tensor in the record, found {short_value(t)} and "
                          f"{len(data)} data members; damaged checkpoint")
    if not t.is_contiguous() or t.dtype.itemsize is None:
        raise BridgeError(f"cannot read {what}: a {t.dtype} tensor of shape {t.shape} with strides {t.stride} "
                          f"(a torch_dist record is one contiguous tensor of a supported dtype); damaged")
    start, n, crc, _name = members[f"data/{t.storage.key}"]
    return TensorMember(t.dtype, t.shape, start + t.offset * t.dtype.itemsize, start, n, crc)


#: `common.pt` holds args, param groups and scheduler state: kilobytes, never gigabytes
MAX_COMMON_BYTES = 1 << 30


def safe_torch_load_object(data: bytes | bytearray, what: str, _depth: int = 0) -> Any:
    """Load a `torch.save` zip holding arbitrary objects (a DCP byte item) with the allow-list.

    DCP's planner `torch.save`s every byte item, and Megatron hands it a BytesIO that already holds
    a `torch.save` of the object, so real items are nested: a BytesIO is unwrapped (bounded depth).
    """
    obj = load_torch_archive(data, what)
    if isinstance(obj, io.BytesIO) and _depth < 3:
        inner = obj.getvalue()
        if inner[:4] == b"PK\x03\x04":
            return safe_torch_load_object(inner, what, _depth + 1)
    return obj


def load_tensor_record(data: bytes | bytearray, what: str) -> ArchiveTensor:
    """A tensor record (`torch.save(tensor)`), CRC-checked, with the allow-list, without torch: an
    `ArchiveTensor` sharing `data` (`.numpy()` views it)."""
    t = load_torch_archive(data, what)
    if not isinstance(t, ArchiveTensor):
        raise BridgeError(f"cannot read {what}: expected a tensor, found {type(t).__name__}")
    return t


def safe_torch_load_tensor(data: bytes | bytearray, what: str) -> "Any":
    """`load_tensor_record` as a torch tensor sharing `data` (imports torch)."""
    return to_torch(load_tensor_record(data, what))


def resolve_checkpoint_dir(path: str | os.PathLike) -> Path | str:
    """The directory holding `.metadata`: SRC itself, or SRC's latest `iter_*` (Megatron save dir).
    For an s3:// / gs:// SRC, the prefix found the same way, as a str with the `Path` methods used
    here (`bridge.store.Storage.path`)."""
    storage = open_storage(path, "source")
    root = storage.path()
    if (root / ".metadata").is_file():
        return root
    tracker = root / "latest_checkpointed_iteration.txt"
    if tracker.is_file():
        text = tracker.read_text(errors="replace").strip()
        if text.isdigit():
            cand = root / f"iter_{int(text):07d}"
            if (cand / ".metadata").is_file():
                return cand
        elif text == "release" and (root / "release" / ".metadata").is_file():
            return root / "release"
    raise _not_a_checkpoint(storage, root)


def _not_a_checkpoint(storage, root: Path | str) -> BridgeError:
    """Why `root` (of `storage`, a `bridge.store.Storage`) holds no torch_dist checkpoint, most specific first."""
    if storage.holds_partial():
        return BridgeError(f"{root} is a partial checkpoint (its writer never committed: no .metadata); "
                           f"rerun the write, which removes it")
    if not root.exists():
        return BridgeError(f"{root}: no such directory; give the torch_dist checkpoint directory (iter_<N>)")
    if not root.is_dir():
        return BridgeError(f"{root}: not a directory; give the torch_dist checkpoint directory (iter_<N>)")
    if (root / "common.pt").exists() or list(root.glob("mp_rank_*")):
        return BridgeError(f"{root}: this is a legacy 'torch' format checkpoint (mp_rank_*/common.pt), "
                           f"not torch_dist; re-save it with --ckpt-format torch_dist")
    return BridgeError(f"{root}: not a torch_dist checkpoint (no .metadata file); point SRC at the "
                       f"iter_<N> directory that Megatron-Core wrote")


class DcpCheckpoint:
    """A read-only view of a `torch_dist` directory: entries, chunks, safe reads.

    Opening validates everything the metadata references (paths stay inside, files exist and are
    long enough), so later reads fail only on damaged bytes, with the file named.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.root = resolve_checkpoint_dir(open_storage(path, "source").root)
        self.source = source_of(self.root)
        meta_path = f"{self.root}/.metadata"
        raw = self.source.read_whole(".metadata")
        if raw is None:
            raise BridgeError(f"{meta_path} is missing; the checkpoint is incomplete")
        # the walk for cycles/deep nesting is skipped: every field used below is type-checked instead
        self.metadata = safe_loads(raw, f"{meta_path}", check=False)
        self.backend = self._read_backend()
        try:
            self.tensors, self.objects = interpret_metadata(self.metadata, self.root, str(meta_path))
        except BridgeError:
            raise
        except (TypeError, ValueError, AttributeError, KeyError, IndexError, OverflowError, RecursionError) as e:
            # a structure the checks above did not foresee: still one line naming the file
            raise BridgeError(f"{meta_path}: malformed DCP metadata ({type(e).__name__}: {str(e)[:160]}); "
                              f"the file is damaged or not written by torch.distributed.checkpoint") from None
        self._check_files()

    # -- validation ----------------------------------------------------------------------------

    def _read_backend(self) -> str:
        mj = f"{self.root}/metadata.json"
        text = self.source.read_whole("metadata.json")
        if text is None:
            return "torch_dist"  # dcp.save without megatron writes no metadata.json
        import json

        try:
            backend = json.loads(text).get("sharded_backend", "torch_dist")
        except (ValueError, AttributeError):
            raise BridgeError(f"{mj}: not valid JSON; the checkpoint is damaged") from None
        if backend != "torch_dist":
            raise BridgeError(f"{self.root}: sharded_backend is {backend!r}; only torch_dist checkpoints "
                              f"can be converted (re-save with --ckpt-format torch_dist)")
        return backend

    def _check_files(self) -> None:
        need: dict[str, int] = {}
        for ref in self.all_refs():
            need[ref.relative_path] = max(need.get(ref.relative_path, 0), ref.offset + ref.length)
        for rel, end in sorted(need.items()):
            self.source.check_length(rel, end)
        self.files = sorted(need)

    def has_file(self, rel: str) -> bool:
        """True when the checkpoint holds file `rel` (e.g. Megatron's metadata.json)."""
        return self.source.read_whole(rel) is not None

    def all_refs(self) -> Iterator[StorageRef]:
        for t in self.tensors.values():
            for c in t.chunks:
                yield c.storage
        for o in self.objects.values():
            for _, ref in o.items:
                yield ref

    # -- reads ---------------------------------------------------------------------------------

    def read_bytes(self, ref: StorageRef) -> bytearray:
        """The raw bytes of one stored item."""
        p = self.source.location(ref.relative_path)
        data = bytearray(ref.length)  # writable, so tensors can share it without a copy
        try:
            with open_range(p) as f:
                got = f.readinto(data, ref.offset) if ref.length else 0
        except FileNotFoundError:
            raise BridgeError(f"missing shard file {p}; copy the complete checkpoint") from None
        if got != ref.length:
            raise BridgeError(f"truncated shard file {p}: item at byte {ref.offset} needs {ref.length} bytes, "
                              f"got {got}")
        return data

    def read_array(self, fqn: str, chunk: ChunkInfo) -> "Any":
        """One stored chunk as a numpy array of shape `chunk.sizes` (dtype and size checked against
        .metadata), a view of the bytes read (no torch)."""
        what = f"{fqn} chunk {chunk.offsets} in {chunk.storage.relative_path}"
        t = load_tensor_record(self.read_bytes(chunk.storage), what)
        ti = self.tensors[fqn]
        if t.dtype != ti.dtype:
            raise BridgeError(f"{what}: stored dtype {t.dtype} differs from .metadata's {ti.dtype}; damaged checkpoint")
        if t.numel() != chunk.numel:
            raise BridgeError(f"{what}: {t.numel()} elements, .metadata says {chunk.numel}; damaged checkpoint")
        try:
            return t.numpy().reshape(chunk.sizes)
        except BridgeError as e:
            raise BridgeError(f"cannot read {what}: {e}") from None

    def read_chunk(self, fqn: str, chunk: ChunkInfo) -> "Any":
        """`read_array` as a torch tensor (imports torch)."""
        from bridge.dtypes import from_numpy

        return from_numpy(self.read_array(fqn, chunk))

    def object_key(self, name: str) -> str | None:
        """The stored fqn of object `name`: itself, or Megatron's `name/shard_<offset>_<shape>` form."""
        if name in self.objects:
            return name
        for k in self.objects:
            if k.split("/", 1)[0] == name:
                return k
        return None

    def object_names(self) -> list[str]:
        """Object names without Megatron's `/shard_...` suffix."""
        return [k.split("/", 1)[0] for k in self.objects]

    def read_object(self, fqn: str) -> Any:
        """A byte entry unpickled with the allow-list (first blob; MCore wraps objects in a list);
        torch values are `converters.megatron.read.torch_archive` stand-ins (`to_torch` converts)."""
        fqn = self.object_key(fqn) or fqn
        if fqn not in self.objects:
            raise BridgeError(f"{self.root}: no object {fqn!r} in the checkpoint")
        out = []
        for off, ref in self.objects[fqn].items:
            out.append(safe_torch_load_object(self.read_bytes(ref), f"{fqn} in {ref.relative_path}"))
        obj = out[0]
        return obj

    def read_full(self, fqn: str) -> "Any":
        """A whole tensor entry assembled from its chunks, as a torch tensor (small tensors / tests)."""
        import numpy as np

        from bridge.dtypes import from_numpy

        ti = self.tensors[fqn]
        out = np.empty(ti.shape, dtype=ti.dtype.numpy())
        for c in ti.chunks:
            out[tuple(slice(o, o + s) for o, s in zip(c.offsets, c.sizes))] = self.read_array(fqn, c)
        return from_numpy(out)

    def common_state(self) -> dict:
        """Megatron's `common_state` object (args, iteration, optimizer groups...), or {} when absent.

        megatron-core 0.19 stores it as a DCP object; releases up to 0.16 `torch.save` it to `common.pt`
        next to the `.distcp` files.
        """
        obj: Any = None
        fqn = self.object_key("common_state")
        if fqn is not None:
            obj = self.read_object(fqn)
        else:
            path = self.root / "common.pt"
            if not path.is_file():
                return {}
            if path.stat().st_size > MAX_COMMON_BYTES:
                raise BridgeError(f"{path}: {path.stat().st_size} bytes, more than a common state holds; "
                                  f"the checkpoint is damaged")
            obj = safe_torch_load_object(path.read_bytes(), str(path))
        if isinstance(obj, list) and obj:
            obj = obj[0]
        if not isinstance(obj, dict):
            raise BridgeError(f"{self.root}: common_state is a {type(obj).__name__}, expected a dict")
        return obj

    def writer_ranks(self) -> list[int]:
        """Ranks that wrote `.distcp` files (`__<rank>_<i>.distcp`), ascending."""
        ranks = set()
        for rel in self.files:
            name = Path(rel).name
            if name.startswith("__") and name.endswith(".distcp"):
                try:
                    ranks.add(int(name[2:].split("_")[0]))
                except ValueError:
                    pass
        return sorted(ranks)

    @property
    def total_bytes(self) -> int:
        return sum(r.length for r in self.all_refs())
