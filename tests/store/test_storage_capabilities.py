"""What the converters used to ask the store's insides for, now methods of the storage object
(`bridge.store.Storage`, issue 32): a path object for readers, whether a run left a partial
checkpoint, taking back a published one, creating a run directory. Each checked on a local directory
and on an S3 prefix against what the file system and boto3 (not the bridge) see."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from servers import remote_servers

from bridge.store import open_storage


@pytest.fixture(scope="module")
def s3():
    with remote_servers() as servers:
        yield servers["s3"]


def _put(s3, key: str, data: bytes) -> None:
    s3.client().put_object(Bucket="bridge-test", Key=key, Body=data)


def test_path_reads_like_pathlib(tmp_path, s3):
    """`path()`: a `Path` locally; on object storage a str with the Path methods over the objects."""
    local = open_storage(str(tmp_path / "run"))
    assert local.path() == Path(tmp_path / "run")
    for key, data in (("caps/run/latest_checkpointed_iteration.txt", b"3"), ("caps/run/iter_0000003/.metadata", b"m"),
                      ("caps/run/iter_0000001/.metadata", b"n")):
        _put(s3, key, data)
    root = open_storage(s3.url("caps/run")).path()
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "3"
    assert (root / "iter_0000003" / ".metadata").is_file() and not (root / "iter_0000002" / ".metadata").is_file()
    assert root.is_dir() and not (root / "latest_checkpointed_iteration.txt").is_dir()
    assert [p.name for p in root.glob("iter_*")] == ["iter_0000001", "iter_0000003"]
    assert (root / "iter_0000003").parent == root and root.name == "run"


def test_a_partial_checkpoint_is_seen_while_its_claim_stands(tmp_path, s3):
    """`holds_partial()` is true exactly while a claim this tool made is there and not committed: its
    temporary directory beside a local destination, its claim object under a prefix."""
    local = open_storage(str(tmp_path / "out"))
    assert not local.holds_partial()
    with local.claim() as claim:
        assert os.listdir(claim.tmp) and local.holds_partial()
        claim.release()
    assert not os.path.exists(str(tmp_path / "out.orbax-checkpoint-tmp")) and not local.holds_partial()

    remote = open_storage(s3.url("caps/partial/iter_0000002"))
    assert not remote.holds_partial()
    with remote.claim(marker=".metadata") as claim:
        assert s3.list_keys("caps/partial/") == ["caps/partial/iter_0000002/_gtpb_claim.json"]
        assert remote.holds_partial()
        claim.publish(files=[(".metadata", b"md")])
    assert s3.list_keys("caps/partial/") == ["caps/partial/iter_0000002/.metadata"] and not remote.holds_partial()


def test_taking_back_a_published_checkpoint_removes_only_what_the_run_wrote(tmp_path, s3):
    """`remove_published(marker)`: the renamed directory; under a prefix the objects a writer of that
    kind of checkpoint writes, a user's object left."""
    local = open_storage(str(tmp_path / "iter_0000004"))
    with local.claim() as claim:
        open_storage(claim.tmp).replace_bytes("__0_0.distcp", b"x")
        claim.publish(files=[(".metadata", b"md")])
    assert sorted(os.listdir(tmp_path / "iter_0000004")) == [".metadata", "__0_0.distcp"]
    local.remove_published(".metadata")
    assert not os.path.exists(tmp_path / "iter_0000004")

    remote = open_storage(s3.url("caps/taken/iter_0000004"))
    with remote.claim(marker=".metadata") as claim:
        open_storage(claim.tmp).replace_bytes("__0_0.distcp", b"x")
        claim.publish(files=[("metadata.json", b"{}"), (".metadata", b"md")])
    _put(s3, "caps/taken/iter_0000004/notes.txt", b"mine")   # the user's, added after the commit
    remote.remove_published(".metadata")
    assert s3.list_keys("caps/taken/") == ["caps/taken/iter_0000004/notes.txt"]


def test_make_dirs_says_whether_it_created_the_directory(tmp_path, s3):
    run = open_storage(str(tmp_path / "a" / "run"))
    assert run.make_dirs() is True and os.path.isdir(tmp_path / "a" / "run")
    assert run.make_dirs() is False                     # there already: not this call's to take back
    assert open_storage(s3.url("caps/dirs")).make_dirs() is False and s3.list_keys("caps/dirs") == []
