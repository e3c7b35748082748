"""Megatron torch_dist checkpoints read from and written to object storage (issue 20).

Sources are real Megatron-Core saves (tests/fixtures/megatron) uploaded with boto3; results are
compared with the same conversion from the local directory, and the torch_dist written to S3 is
downloaded and read by torch's own `dcp.load`, against Megatron-Core's own save.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "support"))  # tests/support: shared helpers
from servers import remote_servers  # noqa: E402

torch = pytest.importorskip("torch")

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "megatron"


@pytest.fixture(scope="module")
def stores():
    with remote_servers() as servers:
        yield servers


def upload(s3, local: Path, key: str) -> None:
    c = s3.client()
    for f in local.iterdir():
        c.upload_file(str(f), s3.buckets[0], f"{key}/{f.name}")


def download(s3, key: str, local: Path) -> Path:
    c = s3.client()
    for k in s3.list_keys(key + "/"):
        out = local / k[len(key) + 1:]
        out.parent.mkdir(parents=True, exist_ok=True)
        c.download_file(s3.buckets[0], k, str(out))
    return local


def same_arrays(a_loc, b_loc):
    from bridge.store.reader import open_checkpoint

    a, b = open_checkpoint(a_loc), open_checkpoint(b_loc)
    assert a.paths() == b.paths() and len(a.paths()) > 50
    for p in a.paths():
        x, y = np.asarray(a.read(p)), np.asarray(b.read(p))
        assert x.dtype == y.dtype and np.array_equal(x, y), p


@pytest.mark.slow
def test_convert_megatron_run_on_s3_to_gcs_with_ranged_reads(stores, tmp_path):
    """SRC is a Megatron run prefix on S3 (tracker -> iter_0000003), DST on GCS; a 64 KiB budget makes
    the larger records exceed the chunk cache, so they are read by byte ranges."""
    from converters.megatron.convert import ConvertOptions
    from converters.megatron.convert_entry import convert
    from converters.megatron.read.dcp import DcpCheckpoint

    s3, gs = stores["s3"], stores["gs"]
    src = FIXTURES / "tp1_buckets" / "dp_reshardable"
    upload(s3, src, "mega/run/iter_0000003")
    s3.client().put_object(Bucket=s3.buckets[0], Key="mega/run/latest_checkpointed_iteration.txt", Body=b"3")
    ck = DcpCheckpoint(s3.url("mega/run"))
    assert ck.root == s3.url("mega/run/iter_0000003")
    from bridge.budget import split_share

    assert max(r.length for r in ck.all_refs()) > split_share(64 << 10).cache  # some record is read by ranges
    ref = convert(str(src), str(tmp_path / "ref"), ConvertOptions(workers=1, show_progress=False))
    got = convert(s3.url("mega/run"), gs.url("logical/tp1b"), ConvertOptions(workers=1, budget=64 << 10,
                                                                           show_progress=False))
    assert got.dst == gs.url("logical/tp1b") and got.step == ref.step
    same_arrays(str(tmp_path / "ref"), gs.url("logical/tp1b"))


@pytest.mark.slow
def test_to_megatron_on_s3_is_what_megatron_saved(stores, tmp_path):
    """to-megatron writes the run prefix on S3 (iteration, then the tracker); downloaded, torch's own
    dcp.load reads every tensor equal to Megatron-Core's save at that layout; converting the S3
    copy back gives the logical checkpoint again."""
    import torch.distributed.checkpoint as dcp

    from converters.megatron.convert import ConvertOptions
    from converters.megatron.convert_entry import convert
    from converters.megatron.read.dcp import DcpCheckpoint
    from converters.megatron.write.torch_dist import MegatronTarget
    from converters.megatron.write.to_megatron import to_megatron

    s3 = stores["s3"]
    theirs_dir = FIXTURES / "tp2" / "fully_reshardable"
    logical = s3.url("logical/tp2")
    convert(str(theirs_dir), logical, ConvertOptions(workers=1, show_progress=False))
    res = to_megatron(logical, s3.url("megatron/tp2"), MegatronTarget(tp=2), show_progress=False)
    assert res["dst"] == s3.url("megatron/tp2/iter_0000003")
    keys = s3.list_keys("megatron/tp2/")
    assert "megatron/tp2/latest_checkpointed_iteration.txt" in keys and not any("_gtpb_claim" in k for k in keys)
    local = download(s3, "megatron/tp2/iter_0000003", tmp_path / "mc")
    theirs = DcpCheckpoint(theirs_dir)
    want = {k: torch.zeros(t.shape, dtype=t.dtype.torch()) for k, t in theirs.tensors.items()}
    got = {k: torch.zeros(t.shape, dtype=t.dtype.torch()) for k, t in theirs.tensors.items()}
    dcp.load(want, checkpoint_id=str(theirs_dir))
    dcp.load(got, checkpoint_id=str(local))
    for k in want:
        assert torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8)), k
    convert(s3.url("megatron/tp2"), s3.url("logical/tp2-back"), ConvertOptions(workers=1, show_progress=False))
    same_arrays(logical, s3.url("logical/tp2-back"))
    with pytest.raises(Exception, match="already exists"):
        to_megatron(logical, s3.url("megatron/tp2"), MegatronTarget(tp=2), show_progress=False)
