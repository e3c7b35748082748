"""Safe DCP reader: real torch DCP checkpoints read back bit-exactly; malicious or damaged input refused."""

from __future__ import annotations

import argparse
import io
import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

from bridge.errors import BridgeError
from converters.megatron.read.dcp import DcpCheckpoint, safe_loads, safe_torch_load_object
from converters.megatron.read.inert import InertStub
from servers import free_port



def _save_worker(rank: int, world: int, port: int, path: str) -> None:
    """Each rank saves its row block of a DTensor-free sharded state (real gloo group, real dcp.save)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed._shard.sharded_tensor import init_from_local_shards, Shard, ShardMetadata

    g = torch.Generator().manual_seed(0)
    full = torch.randn(6, 4, generator=g)
    fullb = torch.randn(8, generator=g).to(torch.bfloat16)
    rows = 6 // world
    shard = Shard(full[rank * rows:(rank + 1) * rows].clone(),
                  ShardMetadata([rank * rows, 0], [rows, 4], f"rank:{rank}/cpu"))
    st = init_from_local_shards([shard], [6, 4])
    n = 8 // world
    shardb = Shard(fullb[rank * n:(rank + 1) * n].clone(), ShardMetadata([rank * n], [n], f"rank:{rank}/cpu"))
    stb = init_from_local_shards([shardb], [8])
    sd = {"w": st, "b": stb}
    if rank == 0:
        buf = io.BytesIO()
        torch.save([{"args": argparse.Namespace(tensor_model_parallel_size=2, params_dtype=torch.bfloat16),
                     "iteration": 7}], buf)
        sd["common_state"] = buf
    dcp.save(sd, checkpoint_id=path)
    dist.barrier()  # no rank tears gloo down while a peer is still in DCP's last collective
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_rank_ckpt(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("dcp2") / "ckpt"
    mp.start_processes(_save_worker, args=(2, free_port(), str(path)), nprocs=2, start_method="spawn")
    return path


def _reference():
    g = torch.Generator().manual_seed(0)
    return torch.randn(6, 4, generator=g), torch.randn(8, generator=g).to(torch.bfloat16)


@pytest.mark.slow
def test_reads_real_two_rank_dcp_bit_exact(two_rank_ckpt):
    ck = DcpCheckpoint(two_rank_ckpt)
    full, fullb = _reference()
    assert set(ck.tensors) == {"w", "b"}
    assert ck.writer_ranks() == [0, 1]
    assert len(ck.tensors["w"].chunks) == 2
    assert torch.equal(ck.read_full("w"), full)
    got_b = ck.read_full("b")
    assert got_b.dtype == torch.bfloat16
    assert torch.equal(got_b.view(torch.int16), fullb.view(torch.int16))
    cs = ck.common_state()
    assert cs["iteration"] == 7
    assert cs["args"].tensor_model_parallel_size == 2 and cs["args"].params_dtype == torch.bfloat16


def test_reader_agrees_with_dcp_load(two_rank_ckpt):
    ck = DcpCheckpoint(two_rank_ckpt)
    target = {"w": torch.zeros(6, 4), "b": torch.zeros(8, dtype=torch.bfloat16)}
    dcp.load(target, checkpoint_id=str(two_rank_ckpt))
    assert torch.equal(ck.read_full("w"), target["w"])
    assert torch.equal(ck.read_full("b"), target["b"])


class _Evil:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_malicious_metadata_refused_without_running(tmp_path):
    marker = tmp_path / "pwned"
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / ".metadata").write_bytes(pickle.dumps(_Evil(str(marker))))
    with pytest.raises(BridgeError, match=r"refusing to unpickle (posix|os)\.system"):
        DcpCheckpoint(ck)
    assert not marker.exists()


def test_malicious_common_state_refused_without_running(tmp_path):
    marker = tmp_path / "pwned2"
    buf = io.BytesIO()
    torch.save([{"args": _Evil(str(marker))}], buf)
    dcp.save({"common_state": buf, "x": torch.ones(2)}, checkpoint_id=str(tmp_path / "ck"))
    ck = DcpCheckpoint(tmp_path / "ck")  # .metadata itself is clean
    with pytest.raises(BridgeError, match="refusing to unpickle"):
        ck.common_state()
    assert not marker.exists()


@pytest.mark.parametrize("payload", [
    b"cbuiltins\neval\n(S'__import__(\"os\").system(\"true\")'\ntR.",   # GLOBAL eval
    b"\x80\x04\x8c\x08builtins\x8c\x07getattr\x93.",                        # STACK_GLOBAL getattr
    b"cposix\nsystem\n(S'true'\ntR.",
    b"csubprocess\nPopen\n.",
    b"ctorch\nload\n.",
])
def test_dangerous_globals_refused(payload):
    with pytest.raises(BridgeError, match="refusing to unpickle"):
        safe_loads(payload, "crafted")


def test_megatron_classes_become_inert_stubs():
    # A pickle naming megatron / TE classes (as common_state does) loads without those packages.
    data = (b"\x80\x02cmegatron.core.enums\nModelType\nq\x00K\x01\x85q\x01Rq\x02."
            )
    obj = safe_loads(data, "x")
    assert isinstance(obj, InertStub) and obj.stub_name == "megatron.core.enums.ModelType"
    assert obj.stub_args == (1,)
    data2 = b"\x80\x02ctransformer_engine.common.recipe\nDelayedScaling\nq\x00)\x81q\x01}q\x02X\x01\x00\x00\x00aq\x03K\x02sb."
    obj2 = safe_loads(data2, "x")
    assert obj2.get("a") == 2


def test_path_escape_refused(tmp_path):
    dcp.save({"x": torch.arange(4.0)}, checkpoint_id=str(tmp_path / "ck"))
    md = pickle.loads((tmp_path / "ck" / ".metadata").read_bytes())  # our own file: trusted here
    for info in md.storage_data.values():
        info.relative_path = "../../x.distcp"
    (tmp_path / "ck" / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(BridgeError, match="escapes the checkpoint directory"):
        DcpCheckpoint(tmp_path / "ck")


def test_truncated_and_missing_files_named(tmp_path):
    dcp.save({"x": torch.arange(40.0)}, checkpoint_id=str(tmp_path / "ck"))
    f = tmp_path / "ck" / "__0_0.distcp"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(BridgeError, match=r"truncated shard file .*__0_0\.distcp"):
        DcpCheckpoint(tmp_path / "ck")
    f.unlink()
    with pytest.raises(BridgeError, match=r"missing shard file .*__0_0\.distcp"):
        DcpCheckpoint(tmp_path / "ck")


def test_damaged_chunk_bytes_named(tmp_path):
    dcp.save({"x": torch.arange(40.0)}, checkpoint_id=str(tmp_path / "ck"))
    f = tmp_path / "ck" / "__0_0.distcp"
    data = bytearray(f.read_bytes())
    data[:4] = b"XXXX"  # break the zip header
    f.write_bytes(bytes(data))
    ck = DcpCheckpoint(tmp_path / "ck")
    with pytest.raises(BridgeError, match=r"cannot read x chunk"):
        ck.read_full("x")


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(BridgeError, match="not a torch_dist checkpoint"):
        DcpCheckpoint(tmp_path)
    with pytest.raises(BridgeError, match="no such directory"):
        DcpCheckpoint(tmp_path / "nope")
    (tmp_path / ".metadata").write_bytes(b"garbage")
    with pytest.raises(BridgeError, match="damaged pickle"):
        DcpCheckpoint(tmp_path)


def test_nested_bytesio_unwrapped():
    inner = io.BytesIO()
    torch.save([{"k": 1}], inner)
    outer = io.BytesIO()
    torch.save(inner, outer)  # what DCP does with Megatron's BytesIO objects
    assert safe_torch_load_object(outer.getvalue(), "x") == [{"k": 1}]


def test_symlink_escape_refused(tmp_path):
    dcp.save({"x": torch.arange(4.0)}, checkpoint_id=str(tmp_path / "ck"))
    outside = tmp_path / "outside.distcp"
    (tmp_path / "ck" / "__0_0.distcp").rename(outside)
    (tmp_path / "ck" / "__0_0.distcp").symlink_to(outside)
    with pytest.raises(BridgeError, match="resolves outside the checkpoint directory"):
        DcpCheckpoint(tmp_path / "ck")


def test_record_crc_checked_unless_the_writer_recorded_none():
    from converters.megatron.read.dcp import safe_torch_load_tensor

    t = torch.arange(10.0)
    for compute_crc in (True, False):
        torch.serialization.set_crc32_options(compute_crc)
        try:
            buf = io.BytesIO()
            torch.save(t, buf)
        finally:
            torch.serialization.set_crc32_options(True)
        data = bytearray(buf.getvalue())
        assert torch.equal(safe_torch_load_tensor(bytearray(data), "x"), t)
        i = data.index(t.numpy().tobytes())
        data[i + 4] ^= 0x01  # one bit of element 1
        if compute_crc:
            with pytest.raises(BridgeError, match=r"x: CRC-32 mismatch in zip member 'archive/data/0'"):
                safe_torch_load_tensor(data, "x")
        else:  # nothing recorded to check against: read as written (documented limit)
            assert safe_torch_load_tensor(data, "x")[1] != 1.0
