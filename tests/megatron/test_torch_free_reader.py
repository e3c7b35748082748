"""convert reads torch_dist checkpoints without torch (converters.megatron.read.torch_archive).

- convert's processes (parent and spawned workers) never import torch: watched from inside each
  process by an import probe (sitecustomize), on a real Megatron-Core fixture, output bit-exact
  against the run's own reference dumps;
- every tensor record of every fixture (and of a torch DCP save of every dtype the store holds)
  reads bit-exactly as `torch.load(weights_only=True)` of the same bytes reads it, whole and
  through the layout-only parse used for ranged reads; objects too, value for value;
- records the new parse refuses (non-contiguous, out of range, foreign storage) give one line.
"""

from __future__ import annotations

import glob
import io
import os
import subprocess
import sys
import zipfile
import zlib
from pathlib import Path

import numpy as np
import pytest

import bridge
import convert_reference as cref
from bridge.errors import BridgeError

CODE = Path(bridge.__file__).resolve().parent.parent  # the code under test (subprocesses import it too)
FIXTURES = CODE / "tests" / "fixtures"
CHECKPOINTS = sorted(str(Path(p).parent) for p in glob.glob(str(FIXTURES / "megatron*" / "**" / ".metadata"),
                                                              recursive=True))

# Written into every Python process of the convert run (sitecustomize on PYTHONPATH): one START line
# per process, and the stack of any `import torch`.
_PROBE = '''
import os, sys, traceback
_LOG = os.environ.get("GTP_TORCH_PROBE")
if _LOG:
    class _TorchProbe:
        def find_spec(self, name, path=None, target=None):
            if name == "torch":
                with open(_LOG, "a") as f:
                    f.write(f"TORCH {os.getpid()} {sys.argv!r}\\n" + "".join(traceback.format_stack(limit=15)))
            return None
    sys.meta_path.insert(0, _TorchProbe())
    with open(_LOG, "a") as f:
        f.write(f"START {os.getpid()} {sys.argv!r}\\n")
'''

_CONVERT = """import sys
from converters.megatron.convert import ConvertOptions
from converters.megatron.convert_entry import convert
r = convert(sys.argv[1], sys.argv[2], ConvertOptions(workers=2, budget=int(sys.argv[3]), min_worker_bytes=1))
print("WORKERS", r.workers)
"""


@pytest.mark.slow
@pytest.mark.parametrize("budget", [256 << 10, 64 << 20])   # records read by byte ranges / whole
def test_convert_processes_never_import_torch(tmp_path, budget):
    run = "tp2"
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_PROBE)
    log, out = tmp_path / "imports.log", tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=f"{site}{os.pathsep}{CODE}", GTP_TORCH_PROBE=str(log), JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-c", _CONVERT, str(FIXTURES / "megatron" / run / "dp_reshardable"), str(out),
                        str(budget)], env=env, capture_output=True, text=True, timeout=600, cwd=str(CODE))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "WORKERS 2" in r.stdout, r.stdout
    text = log.read_text()
    workers = [ln for ln in text.splitlines() if ln.startswith("START") and "--multiprocessing-fork" in ln]
    assert len(workers) >= 2, text[:2000]   # the two writers (and multiprocessing's helpers) were watched
    assert "TORCH" not in text, text[:4000]
    # the conversion itself is right: every array equals the run's own dumps (tests/support/convert_reference.py)
    from bridge.store.reader import open_checkpoint
    from converters.megatron.plan.convert_plan import role_path

    ref, step = cref.load_reference(run)
    ck = open_checkpoint(str(out))
    n = 0
    for role, arrays in ref.items():
        for name, want in arrays.items():
            got = ck.read(role_path(role, name))
            assert got.dtype == want.dtype and np.array_equal(cref.bits(got), cref.bits(want)), (role, name)
            n += 1
    assert n > 0 and int(ck.read(("step",))) == step


# ---------------------------------------------------------------------------------------------
# Records and objects against torch.load


def _torch_bytes(t) -> bytes:
    import torch

    return t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _same(ours, theirs, seen: set, where: str = "") -> None:
    """`ours` (this reader's value) stands for `theirs` (torch.load's), element bits included."""
    import torch

    from converters.megatron.read.torch_archive import ArchiveTensor, TorchDevice, TorchDtype

    if isinstance(theirs, torch.Tensor):
        assert isinstance(ours, ArchiveTensor), (where, type(ours))
        assert ours.dtype == theirs.dtype and ours.shape == tuple(theirs.shape), where
        assert ours.parameter == isinstance(theirs, torch.nn.Parameter), where
        assert ours.numpy().tobytes() == _torch_bytes(theirs), where
        seen.add(str(theirs.dtype))
    elif isinstance(theirs, torch.dtype):
        assert isinstance(ours, TorchDtype) and ours == theirs, where
    elif isinstance(theirs, torch.device):
        assert isinstance(ours, TorchDevice) and repr(ours) == repr(theirs), where
    elif isinstance(theirs, io.BytesIO):
        assert type(ours) is io.BytesIO and ours.getvalue() == theirs.getvalue(), where
    elif isinstance(theirs, dict):
        assert type(ours) is type(theirs) and len(ours) == len(theirs), where
        for (ka, va), (kb, vb) in zip(ours.items(), theirs.items()):  # pickles keep insertion order
            _same(ka, kb, seen, f"{where}[key]")
            _same(va, vb, seen, f"{where}[{kb!r}]")
    elif isinstance(theirs, (list, tuple)):  # torch.Size is a tuple here
        assert isinstance(ours, (list, tuple)) and len(ours) == len(theirs), where
        assert type(ours) is type(theirs) or isinstance(theirs, torch.Size), where
        for i, (a, b) in enumerate(zip(ours, theirs)):
            _same(a, b, seen, f"{where}[{i}]")
    else:
        assert type(ours) is type(theirs) and ours == theirs, (where, ours, theirs)


def _torch_load(data: bytes):
    """torch's own reading of a record: weights_only, nested BytesIO unwrapped as DCP stores objects."""
    import torch

    with torch.serialization.safe_globals([io.BytesIO]):   # DCP's byte items: torch.save(BytesIO)
        obj = torch.load(io.BytesIO(data), weights_only=True)
    if isinstance(obj, io.BytesIO) and obj.getvalue()[:4] == b"PK\x03\x04":
        obj = torch.load(io.BytesIO(obj.getvalue()), weights_only=True)
    return obj


def _check_checkpoint(path: str, seen: set) -> tuple[int, int]:
    """Every tensor record of `path`, whole and by layout, and every object torch reads weights-only."""
    from converters.megatron.cache import record_layout
    from bridge.store.ranged import open_range
    from converters.megatron.read.dcp import DcpCheckpoint

    ck = DcpCheckpoint(path)
    records = objects = 0
    for fqn, info in ck.tensors.items():
        for c in info.chunks:
            raw = bytes(ck.read_bytes(c.storage))
            want = _torch_load(raw)
            got = ck.read_array(fqn, c)
            assert got.dtype == info.dtype.numpy() and got.shape == tuple(c.sizes), (path, fqn)
            assert got.tobytes() == _torch_bytes(want), (path, fqn, c.offsets)
            lay = record_layout(ck, fqn, c)   # the parse of ranged reads: no data read, no torch
            with open_range(lay.path) as f:
                assert f.pread(got.nbytes, lay.data_offset) == got.tobytes(), (path, fqn, c.offsets)
                assert zlib.crc32(f.pread(lay.member_size, lay.member_offset)) == lay.crc, (path, fqn)
            seen.add(str(want.dtype))
            records += 1
    for fqn, info in ck.objects.items():
        raw = bytes(ck.read_bytes(info.items[0][1]))
        try:
            want = _torch_load(raw)
        except Exception:  # noqa: BLE001 - argparse / Megatron classes: torch's weights-only load refuses them
            continue
        _same(ck.read_object(fqn), want, seen, f"{path}:{fqn}")
        objects += 1
    return records, objects


@pytest.mark.slow
def test_fixture_records_and_objects_equal_torch_load():
    seen: set = set()
    records = objects = 0
    for path in CHECKPOINTS:
        r, o = _check_checkpoint(path, seen)
        records, objects = records + r, objects + o
    assert len(CHECKPOINTS) >= 20 and records > 1000 and objects > 100, (len(CHECKPOINTS), records, objects)
    assert {"torch.float32", "torch.bfloat16", "torch.uint8"} <= seen, seen


def test_torch_dcp_save_of_every_dtype_reads_as_torch_load(tmp_path):
    """A plain torch DCP save (one writer, no Megatron) of every dtype the store holds, plus a step
    scalar, a Parameter and tensors inside an object."""
    import torch
    import torch.distributed.checkpoint as dcp

    g = torch.Generator().manual_seed(3)
    state = {}
    for name in ("float64", "float32", "bfloat16", "float16", "int64", "int32", "int16", "int8", "uint8", "bool"):
        dt = getattr(torch, name)
        x = torch.randn(5, 7, generator=g) * 1000
        state[f"t_{name}"] = x.to(dt) if name != "bool" else x > 0
    state["step"] = torch.tensor(12, dtype=torch.int64)
    state["param"] = torch.nn.Parameter(torch.randn(3, generator=g))
    buf = io.BytesIO()
    torch.save({"rng": torch.randint(0, 255, (16,), dtype=torch.uint8), "steps": [torch.tensor(3.0), 4],
                "dtype": torch.bfloat16, "size": torch.Size([2, 3]), "device": torch.device("cpu")}, buf)
    state["obj"] = buf
    dcp.save(state, checkpoint_id=str(tmp_path / "ck"))
    seen: set = set()
    records, objects = _check_checkpoint(str(tmp_path / "ck"), seen)
    assert records == 12 and objects == 1
    want = {str(getattr(torch, n)) for n in ("float64", "float32", "bfloat16", "float16", "int64", "int32", "int16",
                                             "int8", "uint8", "bool")}
    assert want <= seen, want - seen


# ---------------------------------------------------------------------------------------------
# Values and refusals of the torch-free parse


def _saved(obj) -> bytes:
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _rezip(blob: bytes, edit) -> bytes:
    """The archive with its data.pkl replaced by edit(data.pkl) (CRCs recomputed, as a forger would)."""
    src, out = zipfile.ZipFile(io.BytesIO(blob)), io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
        for n in src.namelist():
            z.writestr(n, edit(src.read(n)) if n.endswith("data.pkl") else src.read(n))
    return out.getvalue()


def _layout(blob: bytes):
    from converters.megatron.read.dcp import _MemFile, tensor_member

    return tensor_member(_MemFile(memoryview(blob)), len(blob), "rec")


def test_values_and_to_torch_round_trip():
    import torch

    from converters.megatron.read.dcp import load_tensor_record, safe_torch_load_object
    from converters.megatron.read.torch_archive import to_torch

    p = torch.nn.Parameter(torch.arange(6.0).reshape(2, 3).to(torch.bfloat16), requires_grad=False)
    t = load_tensor_record(bytearray(_saved(p)), "rec")
    assert t.parameter and not t.requires_grad and t.shape == (2, 3) and str(t.dtype) == "torch.bfloat16"
    assert t.numpy().tobytes() == _torch_bytes(p)
    back = to_torch(t)
    assert isinstance(back, torch.nn.Parameter) and torch.equal(back.view(torch.int16), p.view(torch.int16))
    view = torch.arange(10, dtype=torch.int64)[4:7]   # a storage offset: the saved storage is all 10
    v = load_tensor_record(bytearray(_saved(view)), "rec")
    assert v.offset == 4 and v.numpy().tolist() == [4, 5, 6] and to_torch(v).tolist() == [4, 5, 6]
    m = _layout(_saved(view))
    assert m.data_offset == m.member_offset + 4 * 8 and m.shape == (3,) and m.member_size == 80
    obj = safe_torch_load_object(bytearray(_saved({"step": torch.tensor(7), "lr": torch.tensor(0.5)})), "obj")
    assert obj["step"].item() == 7 and type(obj["step"].item()) is int and obj["lr"].item() == 0.5
    assert repr(obj["step"].dtype) == "torch.int64" and obj["step"].dtype == torch.int64


def test_non_contiguous_record_refused_in_one_line():
    import torch

    from converters.megatron.read.dcp import load_tensor_record

    blob = _saved(torch.arange(6.0).reshape(2, 3).t())   # strides (1, 3)
    t = load_tensor_record(bytearray(blob), "rec")   # parses: objects may hold such tensors
    with pytest.raises(BridgeError, match=r"strides \(1, 3\) \(not row-major contiguous\)") as e:
        t.numpy()
    assert "\n" not in str(e.value)
    with pytest.raises(BridgeError, match=r"rec: a torch.float32 tensor of shape \(3, 2\) with strides \(1, 3\)"):
        _layout(blob)


def test_out_of_range_offset_and_foreign_storage_refused():
    import torch

    from converters.megatron.read.dcp import load_tensor_record

    blob = _saved(torch.arange(6.0)[4:])              # offset 4, 2 elements of a 6-element storage
    forged = _rezip(blob, lambda pkl: pkl.replace(b"QK\x04", b"QK\x05", 1))   # offset 5: one element past the end
    assert forged != blob
    for parse in (lambda b: load_tensor_record(bytearray(b), "rec"), _layout):
        with pytest.raises(BridgeError, match=r"rec: tensor of shape \(2,\) \(stride \(1,\), offset 5\) needs 28 bytes "
                                              r"of a 24-byte record"):
            parse(forged)
    complex_blob = _saved(torch.zeros(2, dtype=torch.complex64))
    with pytest.raises(BridgeError, match=r"refusing to unpickle torch\.ComplexFloatStorage in rec"):
        load_tensor_record(bytearray(complex_blob), "rec")
    pkl_flip = bytearray(blob)
    i = pkl_flip.index(b"_rebuild_tensor_v2")
    pkl_flip[i] ^= 0x20   # one bit of the pickle: its CRC-32 no longer matches
    with pytest.raises(BridgeError, match=r"rec: CRC-32 mismatch in zip member '.*data\.pkl'"):
        _layout(bytes(pkl_flip))


def test_dp_zero_object_larger_than_the_cache_converts(tmp_path):
    """dp_zero_gather_scatter keeps a group's state in one pickled object, read whole (as ArchiveTensors)
    then cut into the cache: at a budget whose cache holds fewer of its tensors than it has, the one
    asked for was evicted by its siblings ("no such tensor in the object"). Now equal to a roomy run."""
    from converters.megatron.convert import ConvertOptions
    from converters.megatron.convert_entry import convert

    src = str(FIXTURES / "megatron" / "release_0_15_3" / "dp_zero_gather_scatter")
    roomy, tight = str(tmp_path / "roomy"), str(tmp_path / "tight")
    convert(src, roomy, ConvertOptions(workers=1))
    convert(src, tight, ConvertOptions(workers=1, budget=256 << 10))
    cref.assert_same_checkpoint(tight, roomy)
