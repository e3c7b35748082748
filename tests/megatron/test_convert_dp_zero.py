"""dp_zero_gather_scatter: each DistOpt group's optimizer state gathered into ONE pickled object.

At scale that object is the whole fp32 state of a TP x PP rank, far larger than a worker's budget:
`convert` must locate the tensors in the object's torch.save archive and read each copy's bytes,
never the object whole (`converters/megatron/read/object_layout.py`). Synthetic saves (real DCP from real
gloo ranks, `convert_synth.gathered`) are checked against the logical state they were made from; the
real ones (megatron-core 0.14.0 to 0.19.2) are in `test_convert_savers.py`.
"""

from __future__ import annotations

import pytest

import convert_synth as synth
from converters.megatron.convert import ConvertOptions
from converters.megatron.convert_entry import convert
from converters.megatron.read.dcp import DcpCheckpoint
from converters.megatron.plan.format import Hints
from converters.megatron.read.object_layout import ObjectTensor, object_tensors
from test_convert_megatron import assert_matches
from test_convert_memory import MIB, SLACK, peak_rss

torch = pytest.importorskip("torch")


def only(per_dtype: dict) -> dict:
    """The state tensors of the one (param, grad) dtype pair of a gathered buffer."""
    assert len(per_dtype) == 1 and "bfloat16" in str(next(iter(per_dtype)))
    return next(iter(per_dtype.values()))


@pytest.fixture(scope="module")
def zero_tp2_dp2(tmp_path_factory):
    d = tmp_path_factory.mktemp("zero") / "ck"
    st = synth.make_checkpoint(str(d), "dp_zero_gather_scatter", tp=2, dp=2, bucket_size=300)
    return d, st


@pytest.mark.slow
def test_object_tensors_located_without_reading(zero_tp2_dp2):
    """Every tensor of the object is found at the bytes torch.load reads for it."""
    d, _ = zero_tp2_dp2
    ck = DcpCheckpoint(str(d))
    name = "optimizer.distributed.dp_group_idx_1.param_state"
    located = only(object_tensors(ck, name)[0][0])
    whole = only(ck.read_object(name)[0][0])   # the object read whole: the reference
    assert set(located) == set(whole) == {"param", "exp_avg", "exp_avg_sq", "numel_unpadded"}
    for st in ("param", "exp_avg", "exp_avg_sq"):
        t = located[st]
        assert isinstance(t, ObjectTensor) and t.shape == tuple(whole[st].shape) and t.dtype == whole[st].dtype
        with open(t.layout.path, "rb") as f:
            f.seek(t.layout.data_offset)
            raw = f.read(t.numel * t.layout.itemsize)
        assert raw == whole[st].numpy().tobytes(), st


@pytest.mark.slow
@pytest.mark.parametrize("budget", [1 << 30, 64 << 10])
def test_synthetic_dp_zero_converts(zero_tp2_dp2, tmp_path, budget):
    """TP2 x DP2, several buckets: whole tensors read (large budget) or each copy's bytes (64 KiB:
    a gathered tensor is larger than the cache's whole-record share)."""
    d, st = zero_tp2_dp2
    res = convert(str(d), str(tmp_path / "out"), ConvertOptions(workers=1, budget=budget, min_worker_bytes=1,
                                                                hints=Hints(bucket_size=300)))
    assert res.source_format == "dp_zero_gather_scatter"
    assert_matches(str(tmp_path / "out"), {r: dict(v) for r, v in st.items()}, 3)


@pytest.mark.slow
def test_damaged_object_tensor_is_refused(zero_tp2_dp2, tmp_path):
    """A flipped bit inside a gathered tensor fails its zip member's CRC-32, also when read in ranges."""
    import shutil

    d, _ = zero_tp2_dp2
    bad = tmp_path / "bad"
    shutil.copytree(d, bad)
    t = object_tensors(DcpCheckpoint(str(bad)), "optimizer.distributed.dp_group_idx_0.param_state")
    lay = only(t[0][0])["exp_avg"].layout
    with open(lay.path, "r+b") as f:
        f.seek(lay.data_offset + 8)
        b = f.read(1)
        f.seek(lay.data_offset + 8)
        f.write(bytes([b[0] ^ 0x10]))
    from bridge.errors import BridgeError

    with pytest.raises(BridgeError, match="CRC-32 mismatch"):
        convert(str(bad), str(tmp_path / "out"), ConvertOptions(workers=1, budget=64 << 10, min_worker_bytes=1,
                                                                 hints=Hints(bucket_size=300)))
    assert not (tmp_path / "out").exists()


def nested_copy(src, dst, name: str):
    """`src` with object `name` re-stored as DCP's default planner stores a BytesIO value: torch.save of
    the BytesIO (the archive's bytes re-encoded inside a pickle), appended and re-pointed in .metadata."""
    import dataclasses
    import io
    import pickle
    import shutil

    from torch.distributed.checkpoint import FileSystemReader

    shutil.copytree(src, dst)
    md = FileSystemReader(str(dst)).read_metadata()
    idx = next(k for k in md.storage_data if k.fqn.split("/")[0] == name)
    info = md.storage_data[idx]
    f = dst / info.relative_path
    raw = f.read_bytes()[info.offset:info.offset + info.length]
    buf = io.BytesIO()
    torch.save(io.BytesIO(raw), buf)
    off = f.stat().st_size
    with open(f, "ab") as fh:
        fh.write(buf.getvalue())
    md.storage_data[idx] = dataclasses.replace(info, offset=off, length=len(buf.getvalue()))
    with open(dst / ".metadata", "wb") as fh:
        pickle.dump(md, fh)
    return dst


@pytest.mark.slow
def test_nested_object_is_read_whole(zero_tp2_dp2, tmp_path):
    """An object stored the DCP default planner's way cannot be located: it is read whole, as before."""
    d, st = zero_tp2_dp2
    name = "optimizer.distributed.dp_group_idx_0.param_state"
    src = nested_copy(d, tmp_path / "nested", name)
    assert object_tensors(DcpCheckpoint(str(src)), name) is None
    convert(str(src), str(tmp_path / "out"), ConvertOptions(workers=1, budget=64 << 10, min_worker_bytes=1,
                                                            hints=Hints(bucket_size=300)))
    assert_matches(str(tmp_path / "out"), {r: dict(v) for r, v in st.items()}, 3)


@pytest.mark.slow
def test_gathered_object_larger_than_the_budget_is_streamed(tmp_path_factory, tmp_path):
    """A ~100 MB gathered object converted at an 8 MiB budget: the largest process stays within the
    budget above the fixed cost (before object_layout, every worker and the planner unpickled it whole)."""
    d = tmp_path_factory.mktemp("zero_big")
    with synth.dims(L=2, H=512, NQ=8, NG=2, HD=64, F=1024, V=4096):   # ~8.4 M parameters
        synth.make_checkpoint(str(d / "big"), "dp_zero_gather_scatter", tp=1, dp=1)
    synth.make_checkpoint(str(d / "tiny"), "dp_zero_gather_scatter", tp=1, dp=1)
    budget = 8 * MIB
    ck = DcpCheckpoint(str(d / "big"))
    obj = ck.objects[ck.object_key("optimizer.distributed.dp_group_idx_0.param_state")]
    assert sum(r.length for _o, r in obj.items) > 8 * budget   # the object alone: far beyond the budget
    fixed = peak_rss(str(d / "tiny"), str(tmp_path / "tiny"), 1, budget)
    peak = peak_rss(str(d / "big"), str(tmp_path / "big"), 1, budget)
    assert peak - fixed <= budget + SLACK, (f"largest process peaked {(peak - fixed) / MIB:.0f} MiB above the fixed "
                                            f"cost, budget {budget / MIB:.0f} MiB")


@pytest.mark.parametrize("budget", [64 << 10, 64 << 20])   # object tensors read by byte ranges / whole
def test_dp_zero_convert_never_imports_torch(tmp_path, budget):
    """A real megatron-core 0.16.1 dp_zero_gather_scatter save: the object's tensors are located and
    read without torch in any of convert's processes (as the other formats, test_torch_free_reader),
    and the conversion equals the run's live dump."""
    import os
    import subprocess
    import sys

    import convert_reference as cref
    from test_convert_megatron import assert_matches as matches
    from test_torch_free_reader import _CONVERT, _PROBE, CODE, FIXTURES

    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_PROBE)
    log, out = tmp_path / "imports.log", tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=f"{site}{os.pathsep}{CODE}", GTP_TORCH_PROBE=str(log), JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-c", _CONVERT, str(FIXTURES / "megatron" / "release_0_16_1" /
                        "dp_zero_gather_scatter"), str(out), str(budget)],
                       env=env, capture_output=True, text=True, timeout=600, cwd=str(CODE))
    assert r.returncode == 0, r.stderr[-3000:]
    text = log.read_text()
    assert "START" in text and "TORCH" not in text, text[:4000]
    ref, step = cref.load_reference("release_0_16_1")
    matches(str(out), ref, step)
