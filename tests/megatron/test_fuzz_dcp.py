"""Hostile and damaged sources (issue 17 items 1, 4, 5, 6, 10) and a bounded fuzz run of the parse path.

Every input must either parse or raise a one-line `BridgeError`: no other exception, no crash
(inputs run in a subprocess, so a SIGSEGV fails the test), no more memory than a bound
(`RLIMIT_AS` in that subprocess). The seeds in tests/fixtures/fuzz_seeds/ are the issue's crash
corpus (made by make_seeds.py there).
"""

from __future__ import annotations

import os
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SEEDS = ROOT / "tests" / "fixtures" / "fuzz_seeds"
FIXTURES = ROOT / "tests" / "fixtures" / "megatron"
BASE = FIXTURES / "tp1_buckets" / "fully_reshardable"  # the seeds were made from this save


# The code under test is the one this process imports (run from /work/main, or with its PYTHONPATH,
# to check a test against an older commit); subprocesses run the same code.
import bridge  # noqa: E402

CODE = Path(bridge.__file__).resolve().parent.parent


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=str(CODE), JAX_PLATFORMS="cpu")


def run_convert(src: Path, dst: Path, *extra: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """`gtp-bridge convert` in a subprocess (a crash is a negative return code, not a dead test run)."""
    return subprocess.run([sys.executable, "-m", "bridge.cli", "convert", str(src), str(dst), "--workers", "1", *extra],
                          env=_env(), capture_output=True, text=True, timeout=timeout, cwd=str(CODE))


def copy_base(tmp: Path, base: Path = BASE) -> Path:
    src = tmp / "src"
    shutil.copytree(base, src)
    return src


def replace_object(src: Path, fqn_prefix: str, blob: bytes) -> None:
    """Point the byte item `fqn_prefix*` at `blob`, appended to its .distcp file (the .metadata is ours: trusted)."""
    md = pickle.loads((src / ".metadata").read_bytes())
    for idx, info in md.storage_data.items():
        if idx.fqn.startswith(fqn_prefix):
            f = src / info.relative_path
            info.offset = f.stat().st_size
            info.length = len(blob)
            with open(f, "ab") as fh:
                fh.write(blob)
            break
    else:
        raise AssertionError(fqn_prefix)
    (src / ".metadata").write_bytes(pickle.dumps(md))


def assert_clean_refusal(r: subprocess.CompletedProcess, *words: str) -> None:
    """Exit 2 with one `error:` line naming what is wrong (no traceback, no signal)."""
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    for w in words:
        assert w in lines[0], (w, lines[0])


# ---------------------------------------------------------------------------------------------
# item 1: forged pointers (fails at e9efc35: convert dies with SIGSEGV)


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["relpath_array", "relpath_scalar", "args_array"])
def test_forged_object_pointer_refused(tmp_path, variant):
    src = copy_base(tmp_path)
    if variant.startswith("relpath"):
        shutil.copy(SEEDS / f"forged_{variant}.metadata", src / ".metadata")
        where = ".metadata"
    else:
        replace_object(src, "common_state", (SEEDS / "forged_args_array.common_state").read_bytes())
        where = "common_state"
    r = run_convert(src, tmp_path / "dst")
    assert r.returncode >= 0, f"convert crashed with signal {-r.returncode}"
    assert_clean_refusal(r, where, "numpy dtype")
    assert not (tmp_path / "dst").exists()


# ---------------------------------------------------------------------------------------------
# item 4: a few bytes must not cost gigabytes (fails at e9efc35: MemoryError under the limit)

_MEMORY_PROBE = r"""
import os, resource, sys
from pathlib import Path
import converters.megatron.read.dcp as R
from bridge.errors import BridgeError
import numpy, torch  # imported (and their thread pools started) before the limit
torch.ones(4096).sum()
vsz = int(open('/proc/self/statm').read().split()[0]) * os.sysconf('SC_PAGE_SIZE')
resource.setrlimit(resource.RLIMIT_AS, (vsz + (1 << 30), vsz + (1 << 30)))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    R.DcpCheckpoint(sys.argv[1])
    print("PARSED")
except BridgeError as e:
    print("BRIDGE", str(e).splitlines()[0])
except BaseException as e:
    print("OTHER", type(e).__name__, str(e)[:200])
print("GROWTH_MB", (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
"""


@pytest.mark.parametrize("seed,reason", [("memo_index.metadata", "memo index"),
                                         ("list_range.metadata", "builtins.range"),
                                         ("bytearray.metadata", "bytearray()"),
                                         ("bytearray8.metadata", "-byte bytearray in a 20-byte file")])
@pytest.mark.slow
def test_tiny_pickle_cannot_allocate_gigabytes(tmp_path, seed, reason):
    ck = tmp_path / "ck"
    ck.mkdir()
    shutil.copy(SEEDS / seed, ck / ".metadata")
    r = subprocess.run([sys.executable, "-c", _MEMORY_PROBE, str(ck)], env=_env(), capture_output=True, text=True,
                       timeout=300, cwd=str(CODE))
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    out = dict(line.split(" ", 1) for line in r.stdout.splitlines())
    assert "BRIDGE" in out and reason in out["BRIDGE"] and str(ck / ".metadata") in out["BRIDGE"], r.stdout
    assert "MemoryError" not in out["BRIDGE"]
    assert int(out["GROWTH_MB"]) < 64, r.stdout


# ---------------------------------------------------------------------------------------------
# item 5: one flipped bit in a record (fails at e9efc35: converted silently)


def _record_data_offset(blob: bytes) -> int:
    """Offset of the tensor bytes (`data/0`) inside one torch.save record."""
    import io
    import struct
    import zipfile

    info = next(i for i in zipfile.ZipFile(io.BytesIO(blob)).infolist() if i.filename.endswith("/data/0"))
    n, m = struct.unpack("<HH", blob[info.header_offset + 26:info.header_offset + 30])
    return info.header_offset + 30 + n + m


def flip_bit(src: Path, key: str, bit: int = 0) -> str:
    """Flip bit `bit` of the first element of `key`'s first chunk; returns the .distcp file name."""
    md = pickle.loads((src / ".metadata").read_bytes())
    info = next(v for k, v in md.storage_data.items() if k.fqn == key)
    f = src / info.relative_path
    data = bytearray(f.read_bytes())
    pos = info.offset + _record_data_offset(bytes(data[info.offset:info.offset + info.length]))
    data[pos] ^= 1 << bit
    f.write_bytes(bytes(data))
    return info.relative_path


CRC_BASE = FIXTURES / "tp2" / "fully_reshardable"


@pytest.mark.slow
def test_flipped_bit_in_exp_avg_fails_convert_naming_file_and_key(tmp_path):
    src = copy_base(tmp_path, CRC_BASE)
    key = "optimizer.state.exp_avg.decoder.layers.mlp.linear_fc2.weight"
    fname = flip_bit(src, key)
    r = run_convert(src, tmp_path / "dst")
    assert_clean_refusal(r, key, fname, "CRC-32")


@pytest.mark.parametrize("key", ["optimizer.state.exp_avg_sq.decoder.layers.self_attention.linear_qkv.weight",
                                 "optimizer.state.param.embedding.word_embeddings.weight",
                                 "decoder.layers.mlp.linear_fc1.weight"])
def test_flipped_bit_in_any_record_is_detected(tmp_path, key):
    from converters.megatron.read.dcp import DcpCheckpoint
    from bridge.errors import BridgeError

    src = copy_base(tmp_path, CRC_BASE)
    ck0 = DcpCheckpoint(src)
    if key not in ck0.tensors:  # keys differ between fixture runs only by name; fail loudly if renamed
        pytest.fail(f"{key} not in {sorted(ck0.tensors)[:5]}...")
    fname = flip_bit(src, key, bit=0)  # the lowest mantissa bit of the first element
    ck = DcpCheckpoint(src)
    with pytest.raises(BridgeError, match=rf"{key}.*{fname}.*CRC-32"):
        for c in ck.tensors[key].chunks:
            ck.read_chunk(key, c)


# ---------------------------------------------------------------------------------------------
# item 10: malformed structures are one clean line (fails at e9efc35: "unexpected TypeError/BadZipFile")


@pytest.mark.slow
def test_chunk_offsets_none_refused_naming_file(tmp_path):
    src = copy_base(tmp_path, CRC_BASE)
    md = pickle.loads((src / ".metadata").read_bytes())
    key = next(k for k, v in md.state_dict_metadata.items() if hasattr(v, "chunks"))
    md.state_dict_metadata[key].chunks[0].offsets = None
    (src / ".metadata").write_bytes(pickle.dumps(md))
    r = run_convert(src, tmp_path / "dst")
    assert_clean_refusal(r, ".metadata", key, "chunk offsets")


def _multi_disk(blob: bytes, zip64: bool) -> bytes:
    """The zip claiming to span disks: its zip64 locator says 2 disks, or its end record says disk 1."""
    if zip64:
        i = blob.rindex(b"PK\x06\x07")
        return blob[:i + 16] + (2).to_bytes(4, "little") + blob[i + 20:]
    i = blob.rindex(b"PK\x05\x06")
    return blob[:i + 4] + b"\x01\x00" + blob[i + 6:]


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["multi_disk", "multi_disk64", "not_zip", "truncated_directory"])
def test_bad_common_state_zip_refused_naming_file(tmp_path, damage):
    from converters.megatron.read.dcp import DcpCheckpoint

    src = copy_base(tmp_path, CRC_BASE)
    ck = DcpCheckpoint(src)
    ref = ck.objects[ck.object_key("common_state")].items[0][1]
    blob = bytes(ck.read_bytes(ref))
    bad = {"multi_disk": _multi_disk(blob, False), "multi_disk64": _multi_disk(blob, True), "not_zip": b"PK\x03\x04" + blob[40:],
           "truncated_directory": blob[:-30]}[damage]
    replace_object(src, "common_state", bad)
    r = run_convert(src, tmp_path / "dst")
    assert_clean_refusal(r, "common_state", ref.relative_path)


# ---------------------------------------------------------------------------------------------
# item 6: incomplete optimizer state (fails at e9efc35: converted, exit 0)


def drop_entries(src: Path, keep) -> None:
    """Remove the .metadata entries (and their storage) whose fqn `keep` rejects (ours: trusted pickle)."""
    md = pickle.loads((src / ".metadata").read_bytes())
    md.state_dict_metadata = {k: v for k, v in md.state_dict_metadata.items() if keep(k)}
    md.storage_data = {k: v for k, v in md.storage_data.items() if keep(k.fqn)}
    (src / ".metadata").write_bytes(pickle.dumps(md))


@pytest.mark.slow
def test_missing_exp_avg_entry_fails_convert(tmp_path):
    src = copy_base(tmp_path, CRC_BASE)
    key = "optimizer.state.exp_avg.decoder.layers.mlp.linear_fc2.weight"
    drop_entries(src, lambda k: k != key)
    r = run_convert(src, tmp_path / "dst")
    assert_clean_refusal(r, "decoder.layers.mlp.linear_fc2.weight", "exp_avg", "incomplete")
    assert not (tmp_path / "dst").exists()


@pytest.mark.parametrize("key,what", [
    ("optimizer.state.param.decoder.final_layernorm.weight", "fp32 master"),
    ("optimizer.state.exp_avg_sq.embedding.word_embeddings.weight", "exp_avg_sq"),
])
def test_missing_fully_reshardable_role_refused(tmp_path, key, what):
    from converters.megatron.read.dcp import DcpCheckpoint
    from converters.megatron.plan.format import describe
    from bridge.errors import BridgeError

    src = copy_base(tmp_path, CRC_BASE)
    drop_entries(src, lambda k: k != key)
    with pytest.raises(BridgeError, match=rf"{key.split('.', 3)[3]} has no {what}.*incomplete"):
        describe(DcpCheckpoint(src))


def test_missing_dp_reshardable_bucket_state_refused(tmp_path):
    from converters.megatron.read.dcp import DcpCheckpoint
    from converters.megatron.plan.format import describe
    from bridge.errors import BridgeError

    src = copy_base(tmp_path, FIXTURES / "tp2" / "dp_reshardable")
    drop_entries(src, lambda k: not (k.startswith("optimizer.distributed.dp_group_idx_1.") and k.endswith(".exp_avg")))
    with pytest.raises(BridgeError, match=r"bucket 0 .*dp_group_idx 1.* has no exp_avg entry.*incomplete"):
        describe(DcpCheckpoint(src))


def test_missing_step_refused(tmp_path):
    from converters.megatron.read.dcp import DcpCheckpoint
    from converters.megatron.plan.format import describe
    from bridge.errors import BridgeError
    import io
    import torch

    from converters.megatron.read.torch_archive import to_torch

    src = copy_base(tmp_path, CRC_BASE)
    cs = to_torch(DcpCheckpoint(src).common_state())  # torch values again, to torch.save it
    for g in cs["optimizer"]["optimizer"]["param_groups"]:
        del g["step"]
    buf = io.BytesIO()
    torch.save([cs], buf)
    replace_object(src, "common_state", buf.getvalue())
    with pytest.raises(BridgeError, match=r"param group 0 of optimizer 0 has no 'step'"):
        describe(DcpCheckpoint(src))


def test_model_only_is_reported_and_hidden_optimizer_refused(tmp_path):
    from converters.megatron.read.dcp import DcpCheckpoint
    from converters.megatron.plan.format import describe
    from bridge.errors import BridgeError

    src = copy_base(tmp_path, CRC_BASE)
    drop_entries(src, lambda k: not k.startswith("optimizer."))
    # the optimizer tensors are gone but common_state still carries the optimizer's param groups
    with pytest.raises(BridgeError, match=r"holds optimizer state \(common_state\['optimizer'\]\).*refusing"):
        describe(DcpCheckpoint(src))
    import io
    import torch

    from converters.megatron.read.torch_archive import to_torch

    cs = to_torch(DcpCheckpoint(src).common_state())  # torch values again, to torch.save it
    del cs["optimizer"]
    buf = io.BytesIO()
    torch.save([cs], buf)
    replace_object(src, "common_state", buf.getvalue())
    got = describe(DcpCheckpoint(src))
    assert got.fmt == "model_only" and any("model_only" in s for s in got.inferred)


# ---------------------------------------------------------------------------------------------
# fuzzing: mutated real .metadata / common_state / tensor records and the seeds above, in a
# subprocess with an address-space limit; every input must parse or raise BridgeError


def _fuzz_inputs(tmp: Path) -> dict[str, list[bytes]]:
    """Seed corpus per target: real files of every fixture run plus the hostile seeds."""
    import io
    import zipfile

    from converters.megatron.read.dcp import DcpCheckpoint

    # the first 18: plain DCP Metadata of the 0.19.2 runs (mutate_structure re-pickles them); the
    # release_* saves (0.15-0.16 pickle megatron's MCoreMetadata) are byte-mutated seeds, last
    runs = sorted(FIXTURES.glob("*/*/.metadata"))
    meta = [p.read_bytes() for p in runs if not p.parts[-3].startswith("release_")]
    meta += [p.read_bytes() for p in sorted(SEEDS.glob("*.metadata"))]
    meta += [p.read_bytes() for p in runs if p.parts[-3].startswith("release_")]
    objects, tensors = [(SEEDS / "forged_args_array.common_state").read_bytes()], []
    for run in ("tp2", "moe_ep2", "gtp2_te"):
        for fmt in ("fully_reshardable", "dp_reshardable"):
            ck = DcpCheckpoint(FIXTURES / run / fmt)
            names = [ck.object_key("common_state")] + [k for k in ck.objects if "optimizer" in k or "extra" in k][:3]
            objects += [bytes(ck.read_bytes(ck.objects[k].items[0][1])) for k in names if k]
            key = sorted(ck.tensors)[0]
            tensors.append(bytes(ck.read_bytes(ck.tensors[key].chunks[0].storage)))
    pickles = []  # the data.pkl of the object archives: mutated inside a re-zipped archive (valid CRCs)
    for blob in objects:
        z = zipfile.ZipFile(io.BytesIO(blob))
        pickles += [(blob, n) for n in z.namelist() if n.endswith("data.pkl")]
    tensor_pickles = [(blob, n) for blob in tensors for n in zipfile.ZipFile(io.BytesIO(blob)).namelist()
                      if n.endswith("data.pkl")]   # the same for tensor records (both of their parses)
    return {"metadata": meta, "object": objects, "tensor": tensors, "pickle_in_zip": pickles,
            "tensor_pickle_in_zip": tensor_pickles}


INTERESTING = [0, 1, 0x7F, 0x80, 0xFF, 0xFE] + list(b"(.0NRTXbcehijqrsu}\x80\x81\x85\x86\x87\x88\x89\x8a\x8c\x8d\x8e\x93\x94\x95\x96\x97")


def mutate(rng, data: bytes, corpus: list[bytes]) -> bytes:
    """1-8 random edits: bit flips, interesting bytes (pickle opcodes among them), inserts, deletes, splices."""
    b = bytearray(data)
    for _ in range(rng.randint(1, 8)):
        op = rng.randrange(7)
        i = rng.randrange(len(b) + 1)
        if op == 0 and b:
            b[min(i, len(b) - 1)] ^= 1 << rng.randrange(8)
        elif op == 1 and b:
            b[min(i, len(b) - 1)] = rng.choice(INTERESTING)
        elif op == 2:
            b[i:i] = bytes([rng.choice(INTERESTING)]) * rng.randint(1, 4)
        elif op == 3:
            del b[i:i + rng.randint(1, 16)]
        elif op == 4 and b:
            j = rng.randrange(len(b))
            b[i:i] = b[j:j + rng.randint(1, 64)]
        elif op == 5:
            other = rng.choice(corpus)
            j = rng.randrange(len(other) + 1)
            b[i:] = other[j:j + rng.randint(1, 4096)]
        elif op == 6 and len(b) > 4:
            k = rng.randrange(len(b) - 4)
            b[k:k + 4] = rng.choice([b"\xff\xff\xff\x7f", b"\x00\x00\x00\x80", b"\x00\xc2\xeb\x0b", b"\x01\x00\x00\x00"])
            if rng.random() < 0.3:  # an 8-byte length operand (FRAME, BINBYTES8, BYTEARRAY8, ...)
                b[k:k] = rng.choice([b"\x96", b"\x8e", b"\x8d", b"\x95"]) + (rng.choice([3 * 10 ** 9, 2 ** 62, 2 ** 40])).to_bytes(8, "little")
    return bytes(b)


def mutate_structure(rng, md_bytes: bytes) -> bytes:
    """Re-pickle a real DCP Metadata (ours: trusted) with 1-3 fields of its records set to odd values."""
    import torch

    md = pickle.loads(md_bytes)
    odd = [None, -1, 0, 2 ** 70, "x", "../x", [], [None], (), torch.Size([1, 2, 3]), float("nan"), {}, {"a": 1},
           torch.float32, b"\x00", True]
    for _ in range(rng.randint(1, 3)):
        where = rng.randrange(4)
        if where == 0:
            md.state_dict_metadata[rng.choice(list(md.state_dict_metadata))] = rng.choice(odd)
        elif where == 1:
            entry = md.state_dict_metadata[rng.choice(list(md.state_dict_metadata))]
            if hasattr(entry, "chunks") and entry.chunks and rng.random() < 0.7:
                ch = rng.choice(entry.chunks)
                setattr(ch, rng.choice(["offsets", "sizes"]), rng.choice(odd))
            else:
                for f in ("properties", "size", "chunks"):
                    if hasattr(entry, f) and rng.random() < 0.5:
                        setattr(entry, f, rng.choice(odd))
        elif where == 2:
            info = md.storage_data[rng.choice(list(md.storage_data))]
            if hasattr(info, "relative_path"):  # an earlier edit may have put an odd value there
                setattr(info, rng.choice(["relative_path", "offset", "length", "transform_descriptors"]), rng.choice(odd))
        else:
            k = rng.choice(list(md.storage_data))
            md.storage_data[rng.choice([-1, 0, 2 ** 70, "x", None, ()]) if rng.random() < 0.3 else k] = rng.choice([md.storage_data[k]] + odd)
    return pickle.dumps(md)


def _rezip(blob: bytes, member: str, payload: bytes) -> bytes:
    import io
    import zipfile

    src = zipfile.ZipFile(io.BytesIO(blob))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
        for n in src.namelist():
            z.writestr(n, payload if n == member else src.read(n))
    return out.getvalue()


def fuzz_main(seconds: float, outdir: str) -> None:  # pragma: no cover - runs in the fuzz subprocess
    import copy
    import io
    import json
    import random
    import resource
    import zipfile
    import tempfile
    import time
    import traceback

    import numpy  # noqa: F401  (imported, with torch's thread pool started, before the memory limit)
    import torch
    import torch.distributed.checkpoint  # noqa: F401  (to re-pickle real Metadata in mutate_structure)

    import converters.megatron.read.dcp as R
    from converters.megatron.read.dcp_metadata import interpret_metadata
    from converters.megatron.read.unpickle_rules import allowed_globals
    from bridge.errors import BridgeError
    from converters.megatron.plan.format import describe
    from converters.megatron.read.torch_archive import to_torch

    torch.ones(4096).sum()
    allowed_globals()
    out = Path(outdir)
    with tempfile.TemporaryDirectory() as tmpd:
        tmp = Path(tmpd)
        inputs = _fuzz_inputs(tmp)
        full = copy_base(tmp, CRC_BASE)  # a real directory for whole-checkpoint runs
        real_meta = (full / ".metadata").read_bytes()
        vsz = int(open("/proc/self/statm").read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        limit = vsz + (1 << 30)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        rng = random.Random(int(os.environ.get("GTP_FUZZ_SEED", "17")))
        stats = {"executions": 0, "parsed": 0, "refused": 0, "failures": [], "by_target": {},
                 "address_space_limit_mib": limit >> 20}

        reasons: dict[str, int] = {}

        def run(target: str, data: bytes) -> None:
            (out / "current.bin").write_bytes(data)
            (out / "current.target").write_text(target)
            stats["executions"] += 1
            stats["by_target"][target] = stats["by_target"].get(target, 0) + 1
            try:
                if target == "metadata":
                    obj = R.safe_loads(data, "fuzz .metadata", check=False)
                    interpret_metadata(obj, full, "fuzz .metadata")
                elif target == "checkpoint":
                    (full / ".metadata").write_bytes(data)
                    try:
                        describe(R.DcpCheckpoint(full))
                    finally:
                        (full / ".metadata").write_bytes(real_meta)
                elif target == "common_state":
                    base_ck.blob = data
                    describe(base_ck)
                elif target == "tensor":
                    R.safe_torch_load_tensor(bytearray(data), "fuzz tensor")
                elif target == "tensor_layout":  # the layout-only parse of ranged reads (no data read)
                    R.tensor_member(R._MemFile(memoryview(data)), len(data), "fuzz tensor layout")
                else:
                    R.safe_torch_load_object(bytearray(data), "fuzz object")
                stats["parsed"] += 1
            except BridgeError as e:
                if "\n" in str(e):
                    raise AssertionError(f"multi-line BridgeError: {str(e)[:300]!r}") from None
                stats["refused"] += 1
                why = re.sub(r"[0-9]+|'[^']*'|/\S*", "#", str(e).split(": ", 1)[-1])[:60]
                reasons[why] = reasons.get(why, 0) + 1
            except BaseException as e:  # noqa: BLE001 - anything else is a finding
                n = len(stats["failures"])
                (out / f"failure_{n}.bin").write_bytes(data)
                stats["failures"].append({"target": target, "error": f"{type(e).__name__}: {str(e)[:200]}",
                                          "where": traceback.format_exc().splitlines()[-3][:200]})

        class _Patched(R.DcpCheckpoint):
            """The real checkpoint, its common_state bytes replaced by the input under test."""

            blob = b""

            def read_bytes(self, ref):
                return bytearray(self.blob) if ref == cs_ref else super().read_bytes(ref)

        base_ck = _Patched(full)
        cs_ref = base_ck.objects[base_ck.object_key("common_state")].items[0][1]
        cs_blob = bytes(R.DcpCheckpoint(full).read_bytes(cs_ref))
        cs_member = next(n for n in zipfile.ZipFile(io.BytesIO(cs_blob)).namelist() if n.endswith("data.pkl"))
        cs_pkl = zipfile.ZipFile(io.BytesIO(cs_blob)).read(cs_member)
        cs_odd = [None, -1, 2 ** 70, "x", [], 1.5, True, {}, torch.float32, numpy.float64(2.0), numpy.arange(3)]

        cs0 = to_torch(R.DcpCheckpoint(full).common_state())

        def odd_common_state() -> bytes:
            cs = copy.deepcopy(cs0)
            for _ in range(rng.randint(1, 3)):
                r = rng.random()
                if r < 0.5 and hasattr(cs.get("args"), "__dict__"):
                    setattr(cs["args"], rng.choice(sorted(vars(cs["args"]))), rng.choice(cs_odd))
                elif r < 0.8:
                    try:
                        g = rng.choice(cs["optimizer"]["optimizer"]["param_groups"])
                        g[rng.choice(sorted(g))] = rng.choice(cs_odd)
                    except (KeyError, TypeError, IndexError):  # an earlier edit replaced the optimizer
                        pass
                else:
                    cs[rng.choice(sorted(cs))] = rng.choice(cs_odd)
            buf = io.BytesIO()
            torch.save([cs], buf)
            return buf.getvalue()

        for data in inputs["metadata"]:  # the seeds themselves first
            run("metadata", data)
        for data in inputs["object"]:
            run("object", data)
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            kind = rng.choices(["metadata", "object", "tensor", "pickle_in_zip", "checkpoint", "structure",
                                "common_state", "odd_common_state", "tensor_pickle_in_zip"],
                               [5, 2, 1, 4, 1, 2, 2, 1, 2])[0]
            if kind == "common_state":
                run("common_state", _rezip(cs_blob, cs_member, mutate(rng, cs_pkl, [cs_pkl])))
            elif kind == "odd_common_state":
                run("common_state", odd_common_state())
            elif kind == "structure":
                data = mutate_structure(rng, rng.choice(inputs["metadata"][:18]))
                run("checkpoint" if rng.random() < 0.3 else "metadata", data)
            elif kind == "pickle_in_zip":
                blob, member = rng.choice(inputs["pickle_in_zip"])
                pkl = zipfile.ZipFile(io.BytesIO(blob)).read(member)
                run("object", _rezip(blob, member, mutate(rng, pkl, [pkl])))
            elif kind == "tensor_pickle_in_zip":
                blob, member = rng.choice(inputs["tensor_pickle_in_zip"])
                pkl = zipfile.ZipFile(io.BytesIO(blob)).read(member)
                data = _rezip(blob, member, mutate(rng, pkl, [pkl]))
                run("tensor", data)
                run("tensor_layout", data)
            elif kind == "checkpoint":
                run("checkpoint", mutate(rng, real_meta, inputs["metadata"]))
            else:
                corpus = inputs[kind]
                data = mutate(rng, rng.choice(corpus), corpus)
                run(kind, data)
                if kind == "tensor":
                    run("tensor_layout", data)
        (full / ".metadata").write_bytes(real_meta)
        stats["top_refusals"] = sorted(reasons.items(), key=lambda kv: -kv[1])[:25]
    (out / "current.bin").unlink(missing_ok=True)
    (out / "stats.json").write_text(json.dumps(stats, indent=1))
    print(json.dumps({k: v for k, v in stats.items() if k not in ("failures", "top_refusals")}
                     | {"failures": len(stats["failures"])}))


@pytest.mark.slow
def test_fuzz_parse_path(tmp_path):
    """A bounded fuzz run (GTP_FUZZ_SECONDS, default 30): no crash, no other exception, memory bounded."""
    import json

    seconds = float(os.environ.get("GTP_FUZZ_SECONDS", "30"))
    r = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--fuzz", str(seconds), str(tmp_path)],
                       env=_env(), capture_output=True, text=True, timeout=seconds + 600, cwd=str(CODE))
    current = tmp_path / "current.bin"
    assert r.returncode == 0, (f"fuzz worker died (rc {r.returncode}) on the input kept in {current} "
                               f"({(tmp_path / 'current.target').read_text() if current.exists() else '?'}):"
                               f" {r.stderr[-3000:]}")
    stats = json.loads((tmp_path / "stats.json").read_text())
    print(r.stdout)
    assert not stats["failures"], stats["failures"][:5]
    assert stats["executions"] > len(_fuzz_inputs(tmp_path)["metadata"]) and stats["refused"] > 0 and stats["parsed"] > 0


if __name__ == "__main__" and len(sys.argv) == 4 and sys.argv[1] == "--fuzz":
    sys.path.insert(0, str(ROOT))
    fuzz_main(float(sys.argv[2]), sys.argv[3])
