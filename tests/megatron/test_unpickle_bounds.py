"""The restricted unpickler is bounded in time as in memory (issue 29 item 5; offsets of item 6).

Hash flooding (distinct keys sharing one hash value) made building a dict quadratic: 1 MiB of
`.metadata` took 35 s. The refusal must come before the dict is built: the message counts the
colliding keys it admitted (MAX_SAME_HASH + 1), so the work done is bounded by that count, whatever
the file's size. The 4 MiB file would take hours if quadratic: inputs that could hang are parsed in a
child process that the test kills after HANG seconds (a dict build is one C call, which pytest-timeout
cannot interrupt).
"""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import bridge

from bridge.errors import BridgeError
from converters.megatron.read.dcp import DcpCheckpoint, safe_loads
from converters.megatron.read.unpickle_bounds import MAX_SAME_HASH

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "megatron" / "dp2" / "fully_reshardable"
M = 2**61 - 1   # hash(k * M) == 0 for every int k
CODE = Path(bridge.__file__).resolve().parent.parent
#: a quadratic dict build or an exponential hash is one C call holding the GIL, which neither of
#: pytest-timeout's methods can interrupt: such inputs are parsed in a child killed after this long
HANG = 120


def parse_in_child(path: Path, metadata: bool = False) -> str:
    """The one-line error parsing `path` gives (safe_loads, or DcpCheckpoint for a `.metadata`), in a
    child process that a hang cannot outlive (TimeoutExpired: the test fails)."""
    code = ("import sys\nfrom bridge.errors import BridgeError\n"
            "from converters.megatron.read.dcp import DcpCheckpoint, safe_loads\n"
            "try:\n"
            + ("    DcpCheckpoint(sys.argv[1])\n" if metadata else
               "    safe_loads(open(sys.argv[1], 'rb').read(), sys.argv[1])\n") +
            "except BridgeError as e:\n    print(e)\n")
    r = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=HANG,
                       env=dict(os.environ, PYTHONPATH=str(CODE)))
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
    return r.stdout.strip()


def _long(x: int) -> bytes:
    """LONG1 opcode for `x` (built by hand: pickling a flooded dict would itself be quadratic)."""
    b = pickle.encode_long(x)
    return pickle.LONG1 + bytes([len(b)]) + b


def flooded(n: int, shape: str) -> bytes:
    """A pickle of n colliding keys in a dict (SETITEMS or DICT), set, frozenset or as 1-tuples."""
    keys = [_long(k * M) for k in range(1, n + 1)]
    if shape == "tuple_keys":
        keys = [k + pickle.TUPLE1 for k in keys]
    if shape in ("setitems", "tuple_keys"):
        body = pickle.EMPTY_DICT + pickle.MARK + b"".join(k + pickle.NONE for k in keys) + pickle.SETITEMS
    elif shape == "dict":
        body = pickle.MARK + b"".join(k + pickle.NONE for k in keys) + pickle.DICT
    elif shape == "set":
        body = pickle.EMPTY_SET + pickle.MARK + b"".join(keys) + pickle.ADDITEMS
    else:
        body = pickle.MARK + b"".join(keys) + pickle.FROZENSET
    return pickle.PROTO + b"\x04" + body + pickle.STOP


def test_hash_flooded_metadata_is_refused_before_the_dict_is_built(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(FIXTURE, src)
    raw = flooded(300_000, "setitems")
    assert 1 << 20 < len(raw) < 4 << 20
    (src / ".metadata").write_bytes(raw)
    msg = parse_in_child(src, metadata=True)
    assert ".metadata" in msg and "hash flooding" in msg, msg
    # refused at the first key past the bound: at most MAX_SAME_HASH equality tests per insertion
    assert f"{MAX_SAME_HASH + 1} distinct dict/set keys with one hash value" in msg, msg


@pytest.mark.parametrize("shape", ["dict", "set", "frozenset", "tuple_keys"])
def test_every_way_to_build_a_hashed_container_is_guarded(shape, tmp_path):
    (tmp_path / "f").write_bytes(flooded(20_000, shape))
    assert f"{MAX_SAME_HASH + 1} distinct dict/set keys" in parse_in_child(tmp_path / "f")


def test_distinct_and_repeated_keys_still_load():
    """What real files hold: many distinct int keys, the same keys in many dicts, -1 and -2 (one hash)."""
    obj = {"state": {i: {"step": i} for i in range(50_000)}, "groups": [{0: "a", -1: "b", -2: "c"}] * 3,
           "set": set(range(1000)), "frozen": frozenset((i, i) for i in range(1000))}
    assert safe_loads(pickle.dumps(obj), "f") == obj


def _shared_tuple(levels: int, use: bytes) -> bytes:
    """t = (t', t') nested `levels` deep through the memo, then `use` (opcodes that hash it): hashing t
    visits 2**levels tuples."""
    t: tuple = (0,)
    for _ in range(levels):
        t = (t, t)
    body = pickle.dumps(t, protocol=2)[2:-1]   # the tuple's opcodes, memo shared (never hashed here)
    return b"\x80\x04" + (pickle.EMPTY_DICT if use.endswith(pickle.SETITEM) else b"") + body + use + pickle.STOP


@pytest.mark.parametrize("use,refusal", [
    (pickle.NONE + pickle.SETITEM, "objects per byte"),                # a dict key: {t: None}
    (pickle.EMPTY_TUPLE + pickle.REDUCE, "calling a tuple"),           # looked up as a callable
    (pickle.EMPTY_TUPLE + pickle.NEWOBJ, "calling a tuple")], ids=["dict_key", "reduce", "newobj"])
def test_a_tuple_whose_hash_unfolds_exponentially_is_refused(use, refusal, tmp_path):
    raw = _shared_tuple(48, use)   # under MAX_NESTING; hashing it once would take days
    assert len(raw) < 2000
    (tmp_path / "f").write_bytes(raw)
    assert refusal in parse_in_child(tmp_path / "f")


def test_a_list_shared_at_every_level_is_refused():
    """Tiny as a pickle, 2**60 nodes for the recursive walks that read common_state."""
    x: list = [0]
    for _ in range(60):
        x = [x, x]
    with pytest.raises(BridgeError, match="unfolds into more than"):
        safe_loads(pickle.dumps(x), "common_state")


def test_offsets_of_huge_integers_are_refused_naming_the_entry(tmp_path):
    """Offsets of 2**20000: a one-line refusal, not `ValueError ... 4300 digits` (item 6)."""
    src = tmp_path / "src"
    shutil.copytree(FIXTURE, src)
    md = pickle.loads((src / ".metadata").read_bytes())   # our own copy of a real save: trusted
    fqn, entry = next((k, v) for k, v in md.state_dict_metadata.items() if hasattr(v, "chunks"))
    entry.chunks[0].offsets = (2**20000,) + tuple(entry.chunks[0].offsets[1:])
    (src / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(BridgeError) as e:
        DcpCheckpoint(str(src))
    assert fqn in str(e.value) and "2**63" in str(e.value), str(e.value)


def colliding_pairs(n: int) -> list[tuple[int, int]]:
    """n pairs (a, b) of ints in [0, 2**61) whose tuples share one hash: CPython's tuple hash (xxHash's
    rounds over the items' hashes) solved for b, given a (an int's hash is itself below 2**61 - 1)."""
    mask, p1, p2, p5 = (1 << 64) - 1, 11400714785074694791, 14029467366897019727, 2870177450012600261

    def rot(x: int, r: int) -> int:
        return ((x << r) | (x >> (64 - r))) & mask

    def after(acc: int, lane: int) -> int:
        return rot((acc + lane * p2) & mask, 31) * p1 & mask

    target = after(after(p5, 0), 0)   # the hash state of (0, 0) before its length is mixed in
    out, a = [], 0
    while len(out) < n:
        acc1 = after(p5, a)
        b = (rot(target * pow(p1, -1, 1 << 64) & mask, 33) - acc1) * pow(p2, -1, 1 << 64) & mask
        if b < M:
            out.append((a, b))
        a += 1
    return out


def test_chunk_offsets_chosen_to_collide_are_refused(tmp_path):
    """The flood moved past the unpickler: `.metadata` chunk offsets (a, b) whose tuples share one hash
    made the storage lookup quadratic. Refused at the first key past the bound."""
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex,
                                                       TensorProperties, TensorStorageMetadata)

    pairs = colliding_pairs(64)
    assert len({hash(p) for p in pairs}) == 1 and len(set(pairs)) == 64   # the reference: Python's own hash
    big = torch.Size([2**62, 2**62])
    chunks = [ChunkStorageMetadata(torch.Size(p), torch.Size([1, 1])) for p in pairs]
    storage = {MetadataIndex("w", torch.Size(p)): _StorageInfo("__0_0.distcp", 0, 1) for p in pairs}
    md = Metadata({"w": TensorStorageMetadata(TensorProperties(dtype=torch.float32), big, chunks)}, None, storage)
    src = tmp_path / "src"
    src.mkdir()
    (src / ".metadata").write_bytes(pickle.dumps(md))
    (src / "__0_0.distcp").write_bytes(b"\0")
    with pytest.raises(BridgeError, match=f"{MAX_SAME_HASH + 1} distinct dict/set keys with one hash value"):
        DcpCheckpoint(str(src))
