"""A refused commit never deletes what another writer committed (issue 20).

While this run holds the claim on a prefix, another writer (one that takes no claim, such as plain
Orbax) commits a checkpoint there: its objects land, `_METADATA` among them. Our commit must then
refuse in one line and leave every one of that checkpoint's objects as it was, so that it still
verifies and reads back; only our claim object goes. The other checkpoint is a real one, written
with `save_checkpoint` to a prefix of its own and copied into ours with the server's own client
(boto3 / the GCS JSON API), not with the bridge.
"""

from __future__ import annotations

import json
import os
import sys
import urllib.request
from urllib.parse import quote

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "support"))  # tests/support: shared helpers
from servers import remote_servers  # noqa: E402

from bridge.errors import BridgeError  # noqa: E402


@pytest.fixture(scope="module")
def servers():
    with remote_servers() as servers:
        yield servers


class Bucket:
    """The objects of one test bucket through the server's own API (never the bridge's kvstore)."""

    def __init__(self, srv, scheme: str) -> None:
        self.srv, self.scheme, self.bucket = srv, scheme, srv.buckets[0]

    def keys(self, prefix: str) -> list[str]:
        return sorted(self.srv.list_keys(prefix + "/"))

    def get(self, key: str) -> bytes:
        if self.scheme == "s3":
            return self.srv.client().get_object(Bucket=self.bucket, Key=key)["Body"].read()
        url = f"{self.srv.endpoint}/download/storage/v1/b/{self.bucket}/o/{quote(key, safe='')}?alt=media"
        with urllib.request.urlopen(url) as r:
            return r.read()

    def put(self, key: str, body: bytes) -> None:
        if self.scheme == "s3":
            self.srv.client().put_object(Bucket=self.bucket, Key=key, Body=body)
            return
        url = (f"{self.srv.endpoint}/upload/storage/v1/b/{self.bucket}/o?uploadType=media&"
               f"name={quote(key, safe='')}")
        urllib.request.urlopen(urllib.request.Request(url, data=body, method="POST")).read()

    def snapshot(self, prefix: str) -> dict[str, bytes]:
        """{key relative to `prefix`: bytes} of every object under `prefix`."""
        return {k[len(prefix) + 1:]: self.get(k) for k in self.keys(prefix)}


def _key(url: str) -> str:
    return url.split("/", 3)[3].rstrip("/")


def _other_checkpoint(servers, scheme: str, name: str) -> tuple[dict, dict[str, bytes]]:
    """A committed checkpoint written at a prefix of its own: (its arrays, its objects)."""
    from bridge.store.commit import save_checkpoint

    rng = np.random.default_rng(7)
    arrays = {"params/w": rng.standard_normal((64, 48)).astype(np.float32), "step": np.array(3, np.int64)}
    url = servers[scheme].url(f"foreign/{name}-theirs")
    save_checkpoint(url, arrays)
    objects = Bucket(servers[scheme], scheme).snapshot(_key(url))
    assert "_METADATA" in objects
    return arrays, objects


def _land(bucket: Bucket, dst: str, objects: dict[str, bytes]) -> None:
    """The other writer commits at `dst`: its objects, `_METADATA` last."""
    for k in sorted(objects, key=lambda k: k == "_METADATA"):
        bucket.put(f"{_key(dst)}/{k}", objects[k])


def _assert_intact(bucket: Bucket, dst: str, arrays: dict, objects: dict[str, bytes]) -> None:
    from bridge.store.reader import open_checkpoint
    from bridge.store.remote import CLAIM_KEY
    from bridge.store.verify import verify_checkpoint

    now = bucket.snapshot(_key(dst))
    missing = sorted(k for k in objects if k not in now)
    changed = sorted(k for k in objects if k in now and now[k] != objects[k])
    assert not missing and not changed, (missing, changed)
    assert CLAIM_KEY not in now  # ours went: it was ours to remove
    res = verify_checkpoint(dst)
    assert res.ok, res.damaged
    ck = open_checkpoint(dst)
    for k, a in arrays.items():
        assert np.array_equal(ck.read(tuple(k.split("/"))), a), k


@pytest.mark.parametrize("scheme", ["s3", "gs"])
def test_publish_refused_by_a_foreign_commit_keeps_that_checkpoint(servers, scheme, capsys):
    """Our writer's data is under the prefix; the other checkpoint lands; `publish` refuses in one
    line saying nothing was removed, and the other checkpoint stays whole (our partial data object
    stays too: it cannot be told apart from theirs)."""
    from bridge.store import held
    from bridge.store import kvstore as kv
    from bridge.store import remote

    bucket = Bucket(servers[scheme], scheme)
    arrays, objects = _other_checkpoint(servers, scheme, "publish")
    dst = servers[scheme].url("foreign/publish")
    mine = remote.claim_remote(dst)
    kv.write_bytes(dst, "ocdbt.process_0/d/ours-partial", b"x" * 1000)
    _land(bucket, dst, objects)
    files = [("_CHECKPOINT_METADATA", b'{"ours": 1}'), ("commit_success.txt", b"ours"), ("_METADATA", b'{"ours": 1}')]
    with pytest.raises(BridgeError, match="another run committed a checkpoint there") as exc:
        mine.publish(files=files)
    assert "\n" not in str(exc.value) and "nothing there was removed" in str(exc.value)
    assert not any(d is mine for d in held.all_held())   # published or released: no longer held
    _assert_intact(bucket, dst, arrays, objects)
    assert "left every object there in place" in capsys.readouterr().err


@pytest.mark.parametrize("scheme", ["s3", "gs"])
def test_write_failing_after_a_foreign_commit_keeps_that_checkpoint(servers, scheme):
    """The whole write: our writer stores its data, the other checkpoint lands before our commit;
    the commit refuses before merging (the merge would write the prefix's root database) and the
    claim's release deletes none of the other checkpoint's objects."""
    from bridge.store.claim import claim_destination
    from bridge.store.commit import catalog_of, commit_checkpoint
    from bridge.store.plan import make_write_plan
    from bridge.store.writer import CheckpointWriter

    bucket = Bucket(servers[scheme], scheme)
    arrays, objects = _other_checkpoint(servers, scheme, "write")
    dst = servers[scheme].url("foreign/write")
    ours = {"params/v": np.arange(4096, dtype=np.float32).reshape(64, 64)}
    plan = make_write_plan(catalog_of(ours), 1)
    with pytest.raises(BridgeError, match="another run committed a checkpoint there") as exc:
        with claim_destination(dst) as claim:
            writer = CheckpointWriter(claim.tmp, plan, 0)
            for name, a in ours.items():
                path = tuple(name.split("/"))
                for box in plan.lookup(path).ownership.boxes_owned_by(0):
                    writer.write(path, box, a[box.slices])
            report = writer.finish(publish=False)
            _land(bucket, dst, objects)
            commit_checkpoint(claim, plan, reports=[report])
    assert "\n" not in str(exc.value)
    _assert_intact(bucket, dst, arrays, objects)


def test_release_with_a_foreign_marker_removes_only_our_claim(servers):
    """`release` (an error, SIGTERM or exit before the commit) with another run's `_METADATA` at the
    prefix: only the claim object goes; without one, every object of ours goes (the usual cleanup)."""
    from bridge.store import kvstore as kv
    from bridge.store import remote

    bucket = Bucket(servers["s3"], "s3")
    dst = servers["s3"].url("foreign/release")
    mine = remote.claim_remote(dst)
    kv.write_bytes(dst, "ocdbt.process_0/d/0123456789abcdef0123456789abcdef", b"o")
    bucket.put(f"{_key(dst)}/_METADATA", json.dumps({"theirs": 1}).encode())
    mine.release(reason="interrupted")
    assert bucket.keys(_key(dst)) == [f"{_key(dst)}/_METADATA", f"{_key(dst)}/ocdbt.process_0/d/0123456789abcdef0123456789abcdef"]

    dst = servers["s3"].url("foreign/release-plain")
    mine = remote.claim_remote(dst)
    kv.write_bytes(dst, "ocdbt.process_0/d/0123456789abcdef0123456789abcdef", b"o")
    mine.release(reason="interrupted")
    assert bucket.keys(_key(dst)) == []


def test_marker_landing_just_before_ours_is_never_replaced(servers):
    """Another run's `_METADATA` lands after our checks passed, between the HEAD and the PUT of our
    own (the proxy writes it as soon as it answered the HEAD): moto refuses our PUT (If-None-Match),
    publish fails in one line, their marker stays as they wrote it and release deletes none of it."""
    from test_remote_claim_race import Forwarder

    from bridge.store import remote
    from servers import environ

    s3 = servers["s3"]
    bucket = Bucket(s3, "s3")
    dst = s3.url("foreign/late-marker")
    theirs = json.dumps({"theirs": 1}).encode()
    mine = remote.claim_remote(dst)
    proxy = Forwarder(s3.endpoint)
    landed = []

    def after(command, path):
        if command == "HEAD" and path.endswith("/_METADATA") and not landed:
            bucket.put(f"{_key(dst)}/_METADATA", theirs)
            landed.append(path)

    proxy.after = after
    try:
        with environ(AWS_ENDPOINT_URL=proxy.url):
            with pytest.raises(BridgeError, match="another run committed a checkpoint there") as exc:
                mine.publish(files=[("commit_success.txt", b"ours"), ("_METADATA", b'{"ours": 1}')])
    finally:
        proxy.close()
    assert landed and "\n" not in str(exc.value)
    assert bucket.get(f"{_key(dst)}/_METADATA") == theirs
    assert remote.CLAIM_KEY not in bucket.snapshot(_key(dst))
