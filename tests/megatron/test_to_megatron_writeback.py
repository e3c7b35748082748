"""`to-megatron`'s write path: early writeback of each `.distcp` file (sync_file_range while the
next blobs are read) leaves the bytes unchanged, and the CLI in a fresh process (DCP imported on a
thread meanwhile) writes the same checkpoint as the API. Arrays larger than a budget share."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp

import convert_reference as cref
import converters.megatron.write.torch_dist as w
from converters.megatron.write.to_megatron import to_megatron

RUNS = cref.available_runs()
pytestmark = pytest.mark.skipif("tp2" not in RUNS, reason="needs the real fixtures")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def logical(tmp_path_factory):
    from converters.megatron.convert_entry import convert

    out = str(tmp_path_factory.mktemp("wb") / "tp2")
    convert(os.path.join(cref.FIXTURES, "tp2", "dp_reshardable"), out)
    return out


def _load_all(mc: str) -> dict[str, torch.Tensor]:
    md = dcp.FileSystemReader(mc).read_metadata()
    sd = {k: torch.zeros(tuple(m.size), dtype=m.properties.dtype) for k, m in md.state_dict_metadata.items()
          if hasattr(m, "size")}
    dcp.load(sd, checkpoint_id=mc, no_dist=True)
    return sd


def _files(d: str) -> dict[str, bytes]:
    return {n: open(os.path.join(d, n), "rb").read() for n in sorted(os.listdir(d)) if n.endswith(".distcp")}


@pytest.mark.slow
@pytest.mark.skipif(w._SYNC_FILE_RANGE is None, reason="no sync_file_range on this platform")
def test_early_writeback_leaves_every_byte_and_reads_back_exactly(logical, tmp_path):
    from bridge.store.reader import open_checkpoint

    target = w.MegatronTarget(tp=2)
    budget = 1 << 10  # below the largest array (chunks split into row slabs, many blobs per file)
    assert max(i.nbytes for i in open_checkpoint(logical).arrays().values()) > 4 * budget
    # without the hint: the reference bytes (one worker: the file's blob order is the plan's)
    ref = to_megatron(logical, str(tmp_path / "ref"), target, budget=budget, workers=1,
                        open_file=lambda root, index: w.DcpFile(root, index, sync_range=None))
    real = w._sync_file_range()
    calls = []

    def spy(fd, off, n, flags):  # the real syscall, counted
        calls.append((off, n))
        rc = real(fd, off, n, flags)
        assert rc == 0, os.strerror(__import__("ctypes").get_errno())
        return rc

    def every_blob(root, index):  # the hint after every blob
        return w.DcpFile(root, index, writeback_bytes=1, sync_range=spy)

    res = to_megatron(logical, str(tmp_path / "wb"), target, budget=budget, workers=1, open_file=every_blob)
    assert len(calls) > 10
    # the ranges handed to the kernel tile the file's tensor blobs from 0 without gaps or overlaps
    assert calls[0][0] == 0 and all(a[0] + a[1] == b[0] for a, b in zip(calls, calls[1:]))
    assert _files(res["dst"]) == _files(ref["dst"])
    # several workers: every file written back in pieces, the checkpoint converts back to the source
    calls.clear()
    res3 = to_megatron(logical, str(tmp_path / "wb3"), target, budget=budget, workers=3, open_file=every_blob)
    assert len(calls) > 10
    got, want = _load_all(res3["dst"]), _load_all(ref["dst"])
    assert set(got) == set(want) and all(torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8)) for k in want)
    from bridge.cli import main

    assert main(["convert", os.path.dirname(res3["dst"]), str(tmp_path / "back"), "--workers", "1"]) == 0
    cref.assert_same_checkpoint(logical, str(tmp_path / "back"))


@pytest.mark.slow
def test_cli_in_a_fresh_process_writes_what_the_api_writes(logical, tmp_path):
    """A fresh interpreter has not imported torch.distributed.checkpoint: to-megatron imports it on a
    thread while it works; the `.metadata` it then writes indexes the same tensors."""
    api = to_megatron(logical, str(tmp_path / "api"), w.MegatronTarget(tp=2), budget=1 << 10, workers=2)
    env = dict(os.environ, PYTHONPATH=ROOT)
    r = subprocess.run([sys.executable, "-m", "bridge.cli", "to-megatron", "--no-scheduler", logical, str(tmp_path / "cli"), "--tp", "2",
                        "--budget", "1K", "--workers", "2"], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    cli_dst = os.path.join(tmp_path / "cli", os.path.basename(api["dst"]))
    got, want = _load_all(cli_dst), _load_all(api["dst"])
    assert set(got) == set(want) and all(torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8)) for k in want)
