"""The storage object (`bridge.store.open_storage`, issue 32): chosen once from the location, the same
operations on a local directory and on an object-store prefix, checked against what the file system
and boto3 (not the bridge) see."""

from __future__ import annotations

import os

import pytest

from servers import remote_servers

from bridge.errors import BridgeError
from bridge.store import LocalStorage, ObjectStorage, Storage, open_storage


@pytest.fixture(scope="module")
def stores():
    with remote_servers() as servers:
        yield servers


def test_kind_is_chosen_once_from_the_location(tmp_path):
    assert isinstance(open_storage(tmp_path), LocalStorage) and open_storage(tmp_path).root == str(tmp_path)
    o = open_storage("S3://bkt-1/runs/ck/")
    assert isinstance(o, ObjectStorage) and o.root == "s3://bkt-1/runs/ck" and not o.file_system
    assert open_storage(o) is o                       # passed down as an object, never re-derived
    assert isinstance(open_storage("gs://bkt-1/x").at("iter_0000001"), ObjectStorage)
    with pytest.raises(BridgeError, match="unknown storage scheme hdfs://"):
        open_storage("hdfs://nn/x")


def _same_operations(st: Storage, listed) -> None:
    """What every storage does alike; `listed()` lists the names there without the bridge."""
    assert not st.occupied() and st.read_bytes("tracker.txt") is None and not st.exists("tracker.txt")
    st.make_dirs()
    st.replace_bytes("tracker.txt", b"7")
    st.replace_bytes("tracker.txt", b"1000")           # replaced whole
    assert listed() == ["tracker.txt"] and st.occupied() and st.exists("tracker.txt")
    assert st.read_bytes("tracker.txt") == b"1000" and st.list_keys() == ["tracker.txt"]
    with st.open_range("tracker.txt") as r:
        assert r.pread(2, 1) == b"00"
    assert st.source().read_whole("tracker.txt") == b"1000"


def test_local_and_object_storage_do_the_same(tmp_path, stores):
    local = open_storage(str(tmp_path / "run"))
    _same_operations(local, lambda: sorted(os.listdir(tmp_path / "run")))
    s3 = stores["s3"]
    remote = open_storage(s3.url("storage/ops"))
    _same_operations(remote, lambda: [k.split("/", 2)[2] for k in s3.list_keys("storage/ops/")])


def test_claim_and_publish_through_the_object(tmp_path, stores):
    s3 = stores["s3"]
    st = open_storage(s3.url("storage/claimed/iter_0000003"))
    with st.claim(sources=[str(tmp_path)], marker=".metadata") as claim:
        assert s3.list_keys("storage/claimed/") == ["storage/claimed/iter_0000003/_gtpb_claim.json"]
        claim.publish(files=[("metadata.json", b"{}"), (".metadata", b"md")])
    assert s3.list_keys("storage/claimed/") == ["storage/claimed/iter_0000003/.metadata",
                                                "storage/claimed/iter_0000003/metadata.json"]
    with pytest.raises(BridgeError, match="overlaps the source"):
        open_storage(s3.url("storage/claimed")).check_sources([s3.url("storage/claimed/iter_0000003")])
    local = open_storage(str(tmp_path / "out"))
    with local.claim() as claim:
        open_storage(claim.tmp).replace_bytes("x", b"1")
        claim.publish()
    assert sorted(os.listdir(tmp_path / "out")) == ["x"]


def test_a_writer_joins_a_claim_it_can_see(tmp_path):
    gone = open_storage(str(tmp_path / "missing.orbax-checkpoint-tmp"))
    assert not gone.visible()
    (tmp_path / "bare").mkdir()
    with pytest.raises(BridgeError, match="holds no gtp-bridge claim"):
        open_storage(str(tmp_path / "bare")).hold_claim()
    assert open_storage("s3://bkt-1/p").visible()
    with open_storage("s3://bkt-1/p").hold_claim():   # nothing to hold on object storage
        pass
