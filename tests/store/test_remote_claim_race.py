"""The claim's conditional create against servers that enforce it (issue 20): of two runs claiming
one prefix at the same time, the server refuses the second create, and that run stops in one line.

TensorStore creates an object only if absent with a precondition the server checks: on S3 a HEAD,
then a PUT with `If-None-Match: *` (moto enforces it); on GCS a media upload with
`ifGenerationMatch=0`. fake-gcs-server (v1.54) enforces that precondition on multipart uploads but
ignores it on media uploads, and gcp-storage-emulator ignores it altogether, so against either as
they are a lost race would go unnoticed: here TensorStore's media uploads pass through a small
proxy that resends each as a multipart upload with the same query (the precondition included).
Either way the decision to refuse is the server's own precondition check on the request
TensorStore sent. The other run's claim is made to land at the worst moment: on S3 between our
HEAD and our PUT (the proxy writes it as soon as it answered the HEAD), on GCS between our listing
and our create.
"""

from __future__ import annotations

import dataclasses
import http.client
import http.server
import json
import os
import sys
import threading
import urllib.request
import uuid
from urllib.parse import parse_qs, quote, urlencode, urlsplit

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "support"))  # tests/support: shared helpers
from servers import environ, remote_servers  # noqa: E402

from bridge.errors import BridgeError  # noqa: E402


class Forwarder:
    """HTTP forwarder to `upstream`; `multipart`: GCS JSON-API media uploads are resent as multipart
    uploads; `after(command, path)` runs once a response went back to the client."""

    def __init__(self, upstream: str, multipart: bool = False) -> None:
        u = urlsplit(upstream)
        host, port = u.hostname, u.port
        self.rewritten = 0
        self.after = lambda command, path: None
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def _forward(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n) if n else b""
                path, _, query = self.path.partition("?")
                q = parse_qs(query)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("connection", "content-length")}
                target = self.path
                if multipart and self.command == "POST" and path.startswith("/upload/") and \
                        q.get("uploadType") == ["media"]:
                    name = q.pop("name")[0]
                    q["uploadType"] = ["multipart"]
                    b = uuid.uuid4().hex
                    ctype = headers.pop("Content-Type", headers.pop("content-type", "application/octet-stream"))
                    body = (f"--{b}\r\nContent-Type: application/json\r\n\r\n{json.dumps({'name': name})}\r\n"
                            f"--{b}\r\nContent-Type: {ctype}\r\n\r\n").encode() + body + f"\r\n--{b}--\r\n".encode()
                    headers["Content-Type"] = f"multipart/related; boundary={b}"
                    target = f"{path}?{urlencode(q, doseq=True)}"
                    outer.rewritten += 1
                conn = http.client.HTTPConnection(host, port, timeout=60)
                conn.request(self.command, target, body=body or None, headers=headers)
                r = conn.getresponse()
                data = r.read()
                self.send_response(r.status, r.reason)
                for k, v in r.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                self.wfile.flush()
                conn.close()
                outer.after(self.command, path)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def servers():
    with remote_servers() as servers:
        yield servers


@pytest.fixture()
def gcs(servers):
    """The GCS emulator reached through the adapter (the environment points every client at it)."""
    gs = servers["gs"]
    proxy = Forwarder(gs.endpoint, multipart=True)
    try:
        with environ(TENSORSTORE_GCS_HTTP_URL=proxy.url, STORAGE_EMULATOR_HOST=proxy.url):
            yield gs, proxy
    finally:
        proxy.close()


def test_gcs_create_if_absent_is_refused_by_the_server_when_the_object_exists(gcs):
    from bridge.store import kvstore as kv

    gs, proxy = gcs
    root = gs.url("claims/plain")
    before = proxy.rewritten
    assert kv.write_bytes(root, "k", b"first", if_absent=True) is True
    assert kv.write_bytes(root, "k", b"second", if_absent=True) is False
    assert kv.read_bytes(root, "k") == b"first"
    assert proxy.rewritten - before == 2  # both went to the server as conditional uploads


def test_gcs_claim_that_lost_the_race_is_refused_and_the_winners_claim_kept(gcs):
    """The other run's claim lands between our listing (DST empty) and our create: the server refuses
    our create (412), the claim fails in one line and theirs stays."""
    from bridge.store import held
    from bridge.store import kvstore as kv
    from bridge.store import remote

    gs, proxy = gcs
    dst = gs.url("claims/race")
    theirs = _their_claim(dst)
    landed = []

    def after(command, path):
        if command == "GET" and path.endswith(f"/b/{gs.buckets[0]}/o") and not landed:  # our listing
            name = quote(f"claims/race/{remote.CLAIM_KEY}", safe="")
            req = urllib.request.Request(f"{gs.endpoint}/upload/storage/v1/b/{gs.buckets[0]}/o?uploadType=media&"
                                         f"name={name}", data=theirs, method="POST")
            urllib.request.urlopen(req, timeout=10).read()
            landed.append(path)

    proxy.after = after
    try:
        with pytest.raises(BridgeError, match="being claimed by another run at the same time") as exc:
            remote.claim_remote(dst)
    finally:
        proxy.after = lambda command, path: None
    assert landed and "\n" not in str(exc.value)
    assert kv.read_bytes(dst, remote.CLAIM_KEY) == theirs
    assert not any(d.dst == dst for d in held.all_held())   # this process holds no claim on dst


def _their_claim(dst: str) -> bytes:
    from bridge.store.claim import ClaimInfo

    return json.dumps(dataclasses.asdict(dataclasses.replace(ClaimInfo.mine(dst), run_id="other-run", pid=1))).encode()


def test_s3_claim_whose_put_lost_the_race_is_refused(servers):
    """The other run's claim lands between our HEAD (absent) and our PUT: moto refuses our PUT
    (If-None-Match: *), the claim fails in one line and theirs stays."""
    from bridge.store import held
    from bridge.store import kvstore as kv
    from bridge.store import remote

    s3 = servers["s3"]
    dst = s3.url("claims/race-s3")
    theirs = _their_claim(dst)
    key = f"claims/race-s3/{remote.CLAIM_KEY}"
    proxy = Forwarder(s3.endpoint)
    landed = []

    def after(command, path):
        if command == "HEAD" and path.endswith(remote.CLAIM_KEY) and not landed:
            s3.client().put_object(Bucket=s3.buckets[0], Key=key, Body=theirs)
            landed.append(path)

    proxy.after = after
    try:
        with environ(AWS_ENDPOINT_URL=proxy.url):
            with pytest.raises(BridgeError, match="being claimed by another run at the same time") as exc:
                remote.claim_remote(dst)
    finally:
        proxy.close()
    assert landed and "\n" not in str(exc.value)
    assert kv.read_bytes(dst, remote.CLAIM_KEY) == theirs
    assert not any(d.dst == dst for d in held.all_held())   # this process holds no claim on dst


@pytest.mark.parametrize("scheme", ["s3", "gs"])
def test_publish_refuses_when_the_claim_was_taken_over_or_the_marker_appeared(servers, scheme):
    """`publish` checks the claim and the marker in one round trip before writing anything: with
    another run's claim in place of ours, or a `_METADATA` that appeared meanwhile (both written
    with the server's own client), it fails in one line and writes none of its files."""
    from bridge.store import kvstore as kv
    from bridge.store import remote

    srv = servers[scheme]
    files = [("_CHECKPOINT_METADATA", b"{}"), ("commit_success.txt", b"ok"), ("_METADATA", b"{}")]

    def put(dst: str, name: str, body: bytes) -> None:
        prefix = dst.split("/", 3)[3]
        if scheme == "s3":
            srv.client().put_object(Bucket=srv.buckets[0], Key=f"{prefix}/{name}", Body=body)
        else:
            url = (f"{srv.endpoint}/upload/storage/v1/b/{srv.buckets[0]}/o?uploadType=media&"
                   f"name={quote(prefix + '/' + name, safe='')}")
            urllib.request.urlopen(urllib.request.Request(url, data=body, method="POST")).read()

    dst = srv.url("claims/publish-taken")
    mine = remote.claim_remote(dst)
    theirs = _their_claim(dst)
    put(dst, remote.CLAIM_KEY, theirs)
    with pytest.raises(BridgeError, match="no longer holds this run's claim") as exc:
        mine.publish(files=files)
    assert "\n" not in str(exc.value)
    assert kv.list_keys(dst) == [remote.CLAIM_KEY] and kv.read_bytes(dst, remote.CLAIM_KEY) == theirs

    dst = srv.url("claims/publish-marker")
    mine = remote.claim_remote(dst)
    put(dst, "_METADATA", b'{"theirs": 1}')
    with pytest.raises(BridgeError, match="already exists"):
        mine.publish(files=files)
    assert kv.read_bytes(dst, "_CHECKPOINT_METADATA") is None and kv.read_bytes(dst, "commit_success.txt") is None
