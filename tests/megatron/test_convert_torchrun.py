"""`convert` and `verify` under real `torchrun` (issue 34): ranks share the blocks, one commit.

Every conversion under torchrun is compared, bit for bit with plain TensorStore reads, to the
single-process conversion of the same source (and both to the synthetic state the source was built
from); `verify` runs under torchrun too. A rank that fails (a source record only it reads is
damaged; the private seam that errors or SIGKILLs one rank once its writers are done) makes every
rank exit non-zero, nothing is committed, and the retry succeeds. At 20ceaea two ranks on one
destination collide ("is being written by a live run").
"""

from __future__ import annotations

import os
import shutil
import sys

import pytest

import convert_synth as synth
from torchrun_cases import assert_same_arrays, plain_arrays, torchrun

DIMS = dict(L=4, H=64, NQ=4, NG=2, HD=16, F=128, V=256)   # ~1 MB of state
BUDGET = "64k"          # the smallest budget: 4 KiB blocks, hundreds of them for every rank


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    d = tmp_path_factory.mktemp("tr")
    with synth.dims(**DIMS):
        st = synth.make_checkpoint(str(d / "src"), "fully_reshardable", tp=2, dp=1)
    return d, st


@pytest.fixture(scope="module")
def reference(source):
    """The single-process conversion (the existing path, unchanged), read with plain TensorStore."""
    from converters.megatron.convert import ConvertOptions
    from converters.megatron.convert_entry import convert

    d, st = source
    convert(str(d / "src"), str(d / "ref"), ConvertOptions(workers=1, budget=64 << 10))
    arrays = plain_arrays(str(d / "ref"))
    # the reference itself holds the synthetic state (fp32 masters of every section, bit for bit)
    q = arrays["params.decoder.layers.self_attention.linear_qkv.weight.query"]
    assert q.tobytes() == st["params"]["decoder.layers.self_attention.linear_qkv.weight.query"].tobytes()
    return arrays


def _ok(res) -> str:
    ours = [ln for ln in res.stderr.splitlines() if "gtp-bridge" in ln]
    assert res.returncode == 0, "\n".join([res.stdout[-3000:], *ours, res.stderr[-2000:]])
    return res.stdout


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [2, 4])
def test_convert_under_torchrun_equals_one_process_and_verifies(source, reference, tmp_path, ranks):
    d, _ = source
    dst = str(tmp_path / "out")
    out = _ok(torchrun(ranks, "convert", str(d / "src"), dst, "--budget", BUDGET))
    assert out.count("converted ") == 1, out            # rank 0 reports for every rank
    assert f"ranks: {ranks} ({ranks} writers)" in out, out
    assert sorted(n for n in os.listdir(dst) if n.startswith("ocdbt.process_")) == \
        [f"ocdbt.process_{r}" for r in range(ranks)]    # every rank wrote its own database
    assert_same_arrays(plain_arrays(dst), reference)
    out = _ok(torchrun(ranks, "verify", dst))
    assert out.count("OK: ") == 1 and f"OK: {len(reference)} arrays intact" in out, out


@pytest.mark.slow
def test_two_ranks_of_two_writer_processes(source, reference, tmp_path):
    """Each rank runs its own writer processes (writer ids 2r, 2r+1) with its own budget."""
    d, _ = source
    dst = str(tmp_path / "out")
    out = _ok(torchrun(2, str(d / "src"), dst, script=__file__))
    assert "ranks: 2 (4 writers)" in out, out
    assert_same_arrays(plain_arrays(dst), reference)


@pytest.mark.slow
def test_verify_under_torchrun_names_a_damaged_array(source, tmp_path):
    """The ranks' digests add up: a damaged chunk read by either rank fails the check on every rank."""
    d, _ = source
    dst = str(tmp_path / "out")
    shutil.copytree(str(d / "ref"), dst)
    data = sorted((os.path.join(r, f) for r, _, fs in os.walk(os.path.join(dst, "ocdbt.process_0", "d")) for f in fs),
                  key=os.path.getsize)[-1]
    with open(data, "r+b") as f:     # flip one byte in the middle of the largest data file
        f.seek(os.path.getsize(data) // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    res = torchrun(2, "verify", dst)
    assert res.returncode != 0
    assert res.stdout.count("DAMAGED ") >= 1 and "arrays damaged" in res.stderr, res.stdout + res.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["s3", "gs"])
def test_convert_to_object_storage_under_torchrun(source, reference, scheme):
    from servers import remote_servers

    d, _ = source
    with remote_servers() as servers:
        store = servers[scheme]
        url = store.url(f"torchrun34/{scheme}-out")
        out = _ok(torchrun(2, "convert", str(d / "src"), url, "--budget", BUDGET))
        assert "ranks: 2 (2 writers)" in out, out
        keys = store.list_keys(f"torchrun34/{scheme}-out/")
        assert any(k.startswith(f"torchrun34/{scheme}-out/ocdbt.process_1/") for k in keys), keys
        assert_same_arrays(plain_arrays(url), reference)
        assert "OK: " in _ok(torchrun(2, "verify", url))


def _record_only(cp, rank: int, world: int):
    """A source record (file, offset, length) that rank `rank`'s blocks read and no other rank's
    (the largest such: its middle is tensor data)."""
    def records(r: int) -> set:
        out = set()
        for w in cp.writers_of(r):
            for b in cp.blocks_of(w):
                for copies in cp.units[b.unit].copies.values():
                    for c in copies:
                        if c.array == b.array and c.dst.intersect(b.box) is not None:
                            s = cp.ck.tensors[c.key].chunks[c.chunk].storage
                            out.add((s.relative_path, s.offset, s.length))
        return out

    others = set().union(*(records(r) for r in range(world) if r != rank))
    return max(records(rank) - others, key=lambda rec: rec[2])


def _assert_nothing_committed(dst: str) -> None:
    from bridge.store.reader import open_checkpoint

    assert not os.path.exists(dst)
    with pytest.raises(Exception):
        open_checkpoint(dst)


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["source", "error", "kill"])
def test_a_failing_rank_stops_every_rank_and_the_retry_succeeds(source, reference, tmp_path, fault):
    """`source`: a record only rank 1 reads is damaged (its CRC-32 fails there, after its writes);
    `error` / `kill`: the private seam fails rank 1 (a BridgeError; SIGKILL) once its writers are done,
    while rank 0 waits to commit."""
    from converters.megatron.convert import ConvertOptions, plan_conversion

    d, _ = source
    src = str(tmp_path / "src")
    shutil.copytree(str(d / "src"), src)
    dst = str(tmp_path / "out")
    env = {}
    if fault == "source":
        cp = plan_conversion(src, ConvertOptions(workers=1), 64 << 10, 1, ranks=2)
        rel, off, length = _record_only(cp, 1, 2)
        path = os.path.join(src, rel)
        with open(path, "r+b") as f:
            f.seek(off + length // 2)   # inside the tensor's bytes
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 0x01]))
            saved = (path, off + length // 2, b)
    else:
        env = {"_GTPB_TESTING_RANK_FAULT": f"1:{fault}"}
    res = torchrun(2, "convert", src, dst, "--budget", BUDGET, extra_env=env)
    log = res.stdout + res.stderr
    assert res.returncode != 0, log[-3000:]
    if fault != "kill":
        # each rank prints the same line, naming rank 1 only
        lines = [ln for ln in res.stderr.splitlines() if ln.startswith("gtp-bridge: error: ")]
        assert len(lines) >= 1 and all("rank 1 failed during writing" in ln and "also" not in ln for ln in lines), log
    _assert_nothing_committed(dst)
    if fault == "source":
        path, at, b = saved
        with open(path, "r+b") as f:
            f.seek(at)
            f.write(b)
    _ok(torchrun(2, "convert", src, dst, "--budget", BUDGET))
    assert_same_arrays(plain_arrays(dst), reference)


@pytest.mark.slow
def test_a_launch_of_one_process_is_the_single_process_path(source, reference, tmp_path):
    """torchrun --nproc-per-node 1 runs the single-process conversion: one writer, no rank report."""
    d, _ = source
    dst = str(tmp_path / "out")
    out = _ok(torchrun(1, "convert", str(d / "src"), dst, "--budget", BUDGET))
    assert "ranks:" not in out, out
    assert sorted(n for n in os.listdir(dst) if n.startswith("ocdbt.")) == ["ocdbt.process_0"]
    assert_same_arrays(plain_arrays(dst), reference)


def dcp_tensors(path: str) -> dict:
    """Every tensor of a DCP checkpoint, loaded by torch's own DCP loader (no process group)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(path)
    md = reader.read_metadata()
    sd = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype) for k, v in md.state_dict_metadata.items()
          if isinstance(v, TensorStorageMetadata)}
    dcp.load(sd, storage_reader=reader, no_dist=True)
    return sd


def _same_tensors(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for k in want:
        a, b = got[k], want[k]
        assert (a.dtype, a.shape) == (b.dtype, b.shape), k
        assert a.reshape(-1).view(dtype=__import__("torch").uint8).tolist() == \
            b.reshape(-1).view(dtype=__import__("torch").uint8).tolist(), k


@pytest.mark.slow
def test_to_megatron_under_torchrun_writes_what_one_process_writes(source, reference, tmp_path):
    """Two ranks of two writer threads each write their files; rank 0 the metadata, common state and
    tracker. torch's DCP loader reads the same tensors as from the one-process output, and converting
    it back gives the logical checkpoint again."""
    from converters.megatron.convert import ConvertOptions
    from converters.megatron.convert_entry import convert
    from converters.megatron.write.torch_dist import MegatronTarget
    from converters.megatron.write.to_megatron import to_megatron

    d, _ = source
    one = str(tmp_path / "one")
    to_megatron(str(d / "ref"), one, MegatronTarget(tp=2, dp=2), budget=256 << 10, workers=2)
    run = str(tmp_path / "run")
    out = _ok(torchrun(2, "to-megatron", "--no-scheduler", str(d / "ref"), run, "--tp", "2", "--dp", "2", "--workers", "2",
                       "--budget", "256k"))
    assert out.count("wrote ") == 1 and "ranks: 2 (4 writers)" in out, out
    it = os.path.join(run, "iter_0000003")
    assert sorted(n for n in os.listdir(it) if n.endswith(".distcp")) == [f"__{i}_0.distcp" for i in range(4)]
    with open(os.path.join(run, "latest_checkpointed_iteration.txt")) as f:
        assert f.read().strip() == "3"
    _same_tensors(dcp_tensors(it), dcp_tensors(os.path.join(one, "iter_0000003")))
    back = str(tmp_path / "back")
    convert(it, back, ConvertOptions(workers=1))
    assert_same_arrays(plain_arrays(back), reference)


@pytest.mark.slow
def test_to_megatron_to_s3_under_torchrun_converts_back(source, reference, tmp_path):
    """Ranks upload their own `__<i>_<j>.distcp` objects; rank 0 `.metadata` last, then the tracker."""
    from converters.megatron.convert import ConvertOptions
    from converters.megatron.convert_entry import convert
    from servers import remote_servers

    d, _ = source
    with remote_servers() as servers:
        s3 = servers["s3"]
        url = s3.url("torchrun34/meg")
        _ok(torchrun(2, "to-megatron", "--no-scheduler", str(d / "ref"), url, "--tp", "2", "--workers", "2", "--budget", "256k"))
        keys = s3.list_keys("torchrun34/meg/")
        assert "torchrun34/meg/iter_0000003/.metadata" in keys and \
            "torchrun34/meg/latest_checkpointed_iteration.txt" in keys, keys
        assert any(k.startswith("torchrun34/meg/iter_0000003/__3_") for k in keys), keys   # rank 1's second file
        back = str(tmp_path / "back")
        convert(url, back, ConvertOptions(workers=1))
    assert_same_arrays(plain_arrays(back), reference)


@pytest.mark.slow
def test_to_megatron_failing_rank_publishes_nothing(source, tmp_path):
    d, _ = source
    run = str(tmp_path / "run")
    argv = ("to-megatron", "--no-scheduler", str(d / "ref"), run, "--tp", "2", "--workers", "2", "--budget", "256k")
    res = torchrun(2, *argv, extra_env={"_GTPB_TESTING_RANK_FAULT": "1:error"})
    assert res.returncode != 0
    assert "rank 1 failed during writing: testing fault on rank 1" in res.stderr, res.stderr[-3000:]
    assert not os.path.exists(run) or os.listdir(run) == [], os.listdir(run)
    _ok(torchrun(2, *argv))
    assert os.path.isfile(os.path.join(run, "iter_0000003", ".metadata"))


def _main(src: str, dst: str) -> None:  # pragma: no cover - a rank of test_two_ranks_of_two_writer_processes
    from converters.megatron.convert import ConvertOptions
    from converters.megatron.convert_entry import convert
    from converters.megatron.distributed import rank_summary

    res = convert(src, dst, ConvertOptions(workers=2, budget=128 << 10, min_worker_bytes=1))
    if res.rank == 0:
        print(rank_summary(res.ranks, sum(res.timings.values())), flush=True)


if __name__ == "__main__":
    _main(*sys.argv[1:3])
