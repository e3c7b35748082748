"""Checkpoints on object storage (issue 20): convert / verify / inspect against a local S3 server
(moto) and a GCS emulator (fake-gcs-server) that these tests start on 127.0.0.1 themselves.

References are independent of the remote path: the same conversion written to a local directory
(the established, separately tested path), and the stored objects listed through boto3 / plain
TensorStore rather than through the bridge.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "support"))  # tests/support: shared helpers
from servers import environ, remote_servers  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
DEMO_SRC = REPO / "bridge" / "demo_data" / "gtp2_local"


@pytest.fixture(scope="module")
def stores():
    """{"s3": S3Server, "gs": GcsServer}, both running, their environment set for this module."""
    with remote_servers() as servers:
        yield servers


def cli(*argv, cwd, env=None):
    return subprocess.run([sys.executable, "-m", "bridge.cli", *map(str, argv)], capture_output=True, text=True,
                          cwd=cwd, env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})}, timeout=600)


def cli_here(*argv, cwd, capsys, monkeypatch):
    """`cli` in this process (`bridge.cli.main`, the function the console script calls): the same
    exit code and output, without a second interpreter's start-up and imports."""
    from types import SimpleNamespace

    from bridge.cli import main

    monkeypatch.chdir(cwd)
    capsys.readouterr()
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return SimpleNamespace(returncode=code, stdout=out, stderr=err)


def one_line_error(r, text):
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("gtp-bridge: error:")]
    assert len(errors) == 1 and text in errors[0], r.stderr


@pytest.fixture(scope="module")
def local_reference(tmp_path_factory):
    """The demo checkpoint converted to a local directory: what every remote copy must equal."""
    from converters.megatron.convert import ConvertOptions
    from converters.megatron.convert_entry import convert

    dst = tmp_path_factory.mktemp("ref") / "ck"
    convert(str(DEMO_SRC), str(dst), ConvertOptions(workers=1, show_progress=False))
    return str(dst)


def read_all(location):
    from bridge.store.reader import open_checkpoint

    ck = open_checkpoint(location)
    return {p: np.asarray(ck.read(p)) for p in ck.paths()}, ck.manifest


def check_committed_layout(srv, key):
    """The commit left exactly the checkpoint: metadata objects and OCDBT databases; no claim, no reports."""
    names = {k[len(key) + 1:].split("/", 1)[0] for k in srv.list_keys(key + "/")}
    assert {"_METADATA", "_CHECKPOINT_METADATA", "commit_success.txt", "manifest.ocdbt"} <= names
    assert not any(n.startswith("_gtpb_claim") or n.startswith("_gtp_bridge_writers") for n in names), names


def same_as_reference(dst, local_reference):
    got, manifest = read_all(dst)
    want, want_manifest = read_all(local_reference)
    assert got.keys() == want.keys() and len(got) > 50
    for p in want:
        assert got[p].dtype == want[p].dtype and np.array_equal(got[p], want[p]), p
    assert {n: a.digest for n, a in manifest.arrays.items()} == {n: a.digest for n, a in want_manifest.arrays.items()}
    return len(want)


@pytest.mark.slow
def test_cli_convert_verify_inspect_diff_on_s3(stores, local_reference, tmp_path, capsys, monkeypatch):
    srv = stores["s3"]
    dst = srv.url("runs/convert-cli")
    r = cli_here("convert", DEMO_SRC, dst, cwd=tmp_path, capsys=capsys, monkeypatch=monkeypatch)
    assert r.returncode == 0, r.stderr
    assert f"-> {dst}:" in r.stdout
    assert os.listdir(tmp_path) == []  # nothing written locally for a URL
    n = same_as_reference(dst, local_reference)
    check_committed_layout(srv, "runs/convert-cli")
    r = cli_here("verify", dst, cwd=tmp_path, capsys=capsys, monkeypatch=monkeypatch)
    assert r.returncode == 0 and f"OK: {n} arrays intact" in r.stdout, r.stdout + r.stderr
    r = cli_here("convert", DEMO_SRC, dst, cwd=tmp_path, capsys=capsys, monkeypatch=monkeypatch)
    one_line_error(r, f"destination {dst} already exists")
    assert os.listdir(tmp_path) == []
    # inspect and diff (the notebooks' opener and the diff command's report), in-process
    from bridge.commands.diff import diff_report
    from bridge.inspect.open import open_for_inspection

    info = open_for_inspection(dst)
    assert len(info.arrays) == n
    report = diff_report(local_reference, dst)
    assert report["equal"], report


def test_convert_and_verify_on_gcs(stores, local_reference):
    from bridge.store.verify import verify_checkpoint
    from converters.megatron.convert import ConvertOptions
    from converters.megatron.convert_entry import convert

    srv = stores["gs"]
    dst = srv.url("runs/convert-api")
    assert convert(str(DEMO_SRC), dst, ConvertOptions(workers=1, show_progress=False)).dst == dst
    n = same_as_reference(dst, local_reference)
    check_committed_layout(srv, "runs/convert-api")
    res = verify_checkpoint(dst)
    assert res.ok and res.checked == n


def test_store_save_multiwriter_roundtrip(stores):
    """The store's own API: 3 writers into one S3 prefix, merged, committed, read back bit-exact."""
    from bridge.store.commit import save_checkpoint
    from bridge.store.reader import open_checkpoint

    rng = np.random.default_rng(0)
    arrays = {"params/w": rng.standard_normal((96, 40)).astype(np.float32),
              "params/b": rng.standard_normal(7).astype(np.float32), "step": np.array(5, np.int32)}
    for scheme in ("s3", "gs"):
        dst = stores[scheme].url("api/multi")
        assert save_checkpoint(dst, arrays, num_writers=3) == dst
        ck = open_checkpoint(dst)
        for k, a in arrays.items():
            assert np.array_equal(ck.read(tuple(k.split("/"))), a), (scheme, k)


@pytest.mark.parametrize("where", ["s3", "gs", "local"])
def test_save_checkpoint_reads_the_callers_arrays_in_place(stores, tmp_path, where):
    """`save_checkpoint` hands the caller's arrays to the writer without copying them: read-only,
    strided, Fortran-ordered, 0-d and bfloat16 inputs are stored bit-exact (read back with plain
    TensorStore here, not the bridge reader), left unchanged, and `verify` recomputes digests that
    match the ones the writer took beside the uploads."""
    import ml_dtypes
    import tensorstore as ts

    from bridge.store import kvstore
    from bridge.store.commit import save_checkpoint
    from bridge.store.verify import verify_checkpoint

    rng = np.random.default_rng(11)
    ro = rng.standard_normal((300, 256), dtype=np.float32)
    ro.flags.writeable = False
    base = rng.standard_normal((64, 512), dtype=np.float32)
    arrays = {"params/ro": ro, "params/strided": base[:, ::2], "params/fortran": np.asfortranarray(base[:48]),
              "params/bf16": rng.standard_normal((40, 24)).astype(ml_dtypes.bfloat16), "step": np.array(9, np.int64)}
    before = {k: np.array(a, copy=True) for k, a in arrays.items()}

    def bits(x):
        return np.ascontiguousarray(x).reshape(-1).view(np.uint8)

    dst = str(tmp_path / "ck") if where == "local" else stores[where].url("api/in_place")
    assert save_checkpoint(dst, arrays) == dst
    for k, a in arrays.items():
        assert np.array_equal(bits(a), bits(before[k])), f"{k} was modified"
        spec = {"driver": "zarr3", "kvstore": {"driver": "ocdbt", "base": kvstore.base_kvstore(dst),
                                               "path": k.replace("/", ".") + "/"}}
        got = ts.open(spec, open=True, read=True).result().read().result()
        assert got.dtype == before[k].dtype and np.array_equal(bits(got), bits(before[k])), k
    res = verify_checkpoint(dst)
    assert res.ok, res.damaged


def test_unknown_scheme_and_bucket_root_refused(tmp_path, capsys, monkeypatch):
    from bridge.errors import BridgeError
    from bridge.location import location

    r = cli_here("convert", DEMO_SRC, "s3://bucket", cwd=tmp_path, capsys=capsys, monkeypatch=monkeypatch)
    one_line_error(r, "name a prefix inside the bucket")
    assert os.listdir(tmp_path) == []
    for url, text in (("msc://profile/ckpt", "multi-storage-client profile"), ("s3://Bad_Bucket/x", "valid bucket"),
                      ("gs://bkt/a/../b", "'..' components"), ("ftp://h/x", "unknown storage scheme ftp://")):
        with pytest.raises(BridgeError, match=text):
            location(url)


def test_environment_is_restored_after_module():
    """The fixtures leave no endpoint behind for other test modules (they would hit a stopped server)."""
    with environ(AWS_ENDPOINT_URL=None):
        assert "AWS_ENDPOINT_URL" not in os.environ


@pytest.mark.slow
def test_demo_with_a_bucket_workdir(stores, tmp_path):
    """`demo --workdir s3://...`: every step (convert, restore on a mesh, to-megatron, convert back)
    reads and writes the bucket; nothing is written locally."""
    work = stores["s3"].url("demo/work")
    r = cli("demo", "--workdir", work, cwd=tmp_path)
    assert r.returncode == 0 and "all checks passed" in r.stdout, r.stdout + r.stderr
    keys = stores["s3"].list_keys("demo/work/")
    assert "demo/work/logical/_METADATA" in keys and "demo/work/logical_again/_METADATA" in keys
    assert "demo/work/megatron_tp2_dp2/latest_checkpointed_iteration.txt" in keys
    assert os.listdir(tmp_path) == []


def test_destination_overlapping_a_source_prefix_is_refused():
    from bridge.errors import BridgeError
    from bridge.store.remote import check_remote_sources

    for dst, src in (("s3://bkt/a/b", "s3://bkt/a"), ("s3://bkt/a", "s3://bkt/a/b"), ("gs://bkt/x", "gs://bkt/x")):
        with pytest.raises(BridgeError, match="overlaps the source"):
            check_remote_sources(dst, [src])
    check_remote_sources("s3://bkt/a", ["s3://bkt/ab", "gs://bkt/a", "s3://other/a", "/local/a"])  # no overlap


@pytest.mark.parametrize("scheme", ["s3", "gs"])
def test_writer_in_many_transactions_stores_each_byte_once(stores, scheme):
    """A writer whose data spans several transactions (batch far below the data), arrays written in
    pieces, on object storage where the arrays are created inside the first data transaction: the
    data objects stored add up to the logical bytes once (no rewritten or duplicated value), and the
    checkpoint reads back equal."""
    from bridge.layout.boxes import Box
    from bridge.store.claim import claim_destination
    from bridge.store.commit import catalog_of, commit_checkpoint
    from bridge.store.plan import make_write_plan
    from bridge.store.reader import open_checkpoint
    from bridge.store.specs import max_chunk_bytes
    from bridge.store.writer import CheckpointWriter

    srv = stores[scheme]
    url = srv.url("store/txns")
    rng = np.random.default_rng(4)
    arrays = {f"params/w{i}": rng.standard_normal((1024, 512), dtype=np.float32) for i in range(6)}  # 2 MiB each
    plan = make_write_plan(catalog_of(arrays), 1, max_chunk_bytes=max_chunk_bytes(url) // 16)  # 1 MiB chunks
    with claim_destination(url) as claim:
        writer = CheckpointWriter(claim.tmp, plan, 0, batch_bytes=3 << 20)  # about 4 transactions
        for name, a in arrays.items():
            path = tuple(name.split("/"))
            for box in plan.lookup(path).ownership.boxes_owned_by(0):
                half = (box.start[0] + box.stop[0]) // 2  # each chunk in two writes
                for lo, hi in ((box.start[0], half), (half, box.stop[0])):
                    part = Box((lo,) + box.start[1:], (hi,) + box.stop[1:])
                    writer.write(path, part, a[part.slices])
        report = writer.finish(publish=False)
        assert writer._issued >= 4
        commit_checkpoint(claim, plan, reports=[report])
    logical = sum(a.nbytes for a in arrays.values())
    if scheme == "s3":
        c = srv.client()
        sizes = [o["Size"] for page in c.get_paginator("list_objects_v2").paginate(Bucket=srv.buckets[0],
                                                                                 Prefix="store/txns/ocdbt.process_0/d/")
                 for o in page.get("Contents", [])]
    else:
        import json
        import urllib.request
        from urllib.parse import quote

        with urllib.request.urlopen(f"{srv.endpoint}/storage/v1/b/{srv.buckets[0]}/o?"
                                    f"prefix={quote('store/txns/ocdbt.process_0/d/', safe='')}") as r:
            sizes = [int(o["size"]) for o in json.load(r).get("items", [])]
    assert logical <= sum(sizes) < logical * 1.01, (sum(sizes), logical)
    ck = open_checkpoint(url)
    for name, a in arrays.items():
        assert np.array_equal(ck.read(tuple(name.split("/"))), a), name
