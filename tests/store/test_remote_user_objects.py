"""On object storage a run deletes only objects it wrote (issue 29, item 2).

`gtp-bridge convert SRC s3://b/run` is held at a known point (a test-side seam in the child: the
claim just written, or every data object written and nothing committed), SIGKILLed there, and a
user's object is put under the prefix. The retry refuses in one line naming the user's object and
the fix, as a local destination that exists is refused, and removes nothing; nothing of the killed
run is loadable; once the user moved the object away the retry cleans up and converts. A run that
stops by itself (SIGTERM) removes its own objects and leaves the user's.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "support"))  # tests/support: shared helpers
from servers import remote_servers  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
SRC = REPO / "tests" / "fixtures" / "megatron" / "tp2" / "fully_reshardable"
NOTE = b"my notes about this run"

# The CLI in a child process, held at `point` until its stdin closes (or it is killed there).
DRIVER = textwrap.dedent("""
    import sys
    from bridge.store import remote

    point, argv = sys.argv[1], sys.argv[2:]

    def hold():
        print("@@held", flush=True)
        sys.stdin.read()
        raise SystemExit(3)

    if point == "written":       # every data object written, nothing committed
        remote.RemoteDestination.publish = lambda self, *a, **k: hold()
    elif point == "claimed":     # the run's first object (its claim) written, nothing else
        claim = remote.claim_remote
        remote.claim_remote = lambda *a, **k: (claim(*a, **k), hold())
    from bridge.cli import main
    sys.exit(main(argv))
""")


@pytest.fixture(scope="module")
def stores():
    with remote_servers() as servers:
        yield servers


def held_convert(dst: str, point: str) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", DRIVER, point, "convert", str(SRC), dst, "--workers", "1"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    out = []
    for line in p.stdout:   # blocks until the child prints (no clock involved)
        if line.strip() == "@@held":
            return p
        out.append(line)
    p.kill()
    raise AssertionError(f"the convert did not reach {point}: {out} {p.communicate()[1][-2000:]}")


def cli(capfd, *argv: str) -> tuple[int, str]:
    """The command line in this process: (exit code, its stderr lines but TensorStore's own log lines)."""
    from bridge.cli import main

    capfd.readouterr()
    rc = main(list(argv))
    err = [ln for ln in capfd.readouterr().err.splitlines() if not re.match(r"[EWI]\d{4} ", ln)]
    return rc, "\n".join(err)


def put(srv, scheme: str, key: str, data: bytes) -> None:
    """A user's object, put by the server's own client (boto3; the JSON API for GCS)."""
    if scheme == "s3":
        srv.client().put_object(Bucket=srv.buckets[0], Key=key, Body=data)
    else:
        import urllib.parse
        import urllib.request

        url = f"{srv.endpoint}/upload/storage/v1/b/{srv.buckets[0]}/o?uploadType=media&name={urllib.parse.quote(key)}"
        urllib.request.urlopen(urllib.request.Request(url, data=data, method="POST"), timeout=10).read()


def delete(srv, scheme: str, key: str) -> None:
    if scheme == "s3":
        srv.client().delete_object(Bucket=srv.buckets[0], Key=key)
    else:
        import urllib.parse
        import urllib.request

        url = f"{srv.endpoint}/storage/v1/b/{srv.buckets[0]}/o/{urllib.parse.quote(key, safe='')}"
        urllib.request.urlopen(urllib.request.Request(url, method="DELETE"), timeout=10).read()


@pytest.mark.parametrize("scheme,point", [pytest.param("s3", "claimed", marks=pytest.mark.slow), ("s3", "written"),
                                          pytest.param("gs", "written", marks=pytest.mark.slow)])
@pytest.mark.slow
def test_retry_after_a_killed_convert_never_deletes_a_users_object(stores, scheme, point, capfd):
    from bridge.errors import BridgeError
    from bridge.store.reader import open_checkpoint

    srv = stores[scheme]
    key = f"users/{point}/run"
    dst = srv.url(key)
    p = held_convert(dst, point)
    p.kill()   # SIGKILL: no cleanup runs
    assert p.wait() == -signal.SIGKILL
    p.stdout.close(), p.stderr.close(), p.stdin.close()
    killed = srv.list_keys(key + "/")
    assert f"{key}/_gtpb_claim.json" in killed and not any(k.endswith("_METADATA") for k in killed), killed
    if point == "written":
        assert any("/ocdbt.process_0/" in k for k in killed), killed
    put(srv, scheme, f"{key}/users_notes.txt", NOTE)
    before = srv.list_keys(key + "/")

    rc, err = cli(capfd, "convert", str(SRC), dst)
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert f"{dst}/users_notes.txt" in err and "did not write" in err and "move your objects out" in err, err
    assert srv.list_keys(key + "/") == before          # nothing removed, nothing written
    with pytest.raises(BridgeError, match="partial checkpoint"):
        open_checkpoint(dst)                           # nothing of the killed run is loadable

    # The user moves the notes away: the retry removes the killed run's objects and converts.
    delete(srv, scheme, f"{key}/users_notes.txt")
    rc, err = cli(capfd, "convert", str(SRC), dst, "--workers", "1")
    assert rc == 0 and "removing the partial checkpoint" in err, err
    assert cli(capfd, "verify", dst)[0] == 0
    after = srv.list_keys(key + "/")
    assert not any(k.endswith("_gtpb_claim.json") for k in after)


@pytest.mark.slow
def test_a_stopped_run_removes_its_objects_and_leaves_the_users(stores):
    """SIGTERM while the user's object sits under the prefix: the run removes what it wrote, its claim
    included, and only that."""
    srv = stores["s3"]
    key = "users/stopped/run"
    p = held_convert(srv.url(key), "written")
    try:
        ours = srv.list_keys(key + "/")
        assert any("/ocdbt.process_0/" in k for k in ours), ours
        put(srv, "s3", f"{key}/users_notes.txt", NOTE)
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=120) != 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert srv.list_keys(key + "/") == [f"{key}/users_notes.txt"]
    body = srv.client().get_object(Bucket=srv.buckets[0], Key=f"{key}/users_notes.txt")["Body"].read()
    assert body == NOTE


@pytest.mark.slow
def test_owned_names_are_what_writers_write(stores, capfd):
    """The names a cleanup may delete (`OWNED_NAMES`) cover every object a committed convert and
    to-megatron left on S3 (so a partial one is removed whole), and no user-like name."""
    from bridge.store.remote import METADATA, foreign_keys

    srv = stores["s3"]
    assert cli(capfd, "convert", str(SRC), srv.url("users/names/logical"), "--budget", "1m", "--workers", "2")[0] == 0
    assert cli(capfd, "to-megatron", srv.url("users/names/logical"), srv.url("users/names/mega"), "--tp", "2",
               "--no-scheduler")[0] == 0
    logical = [k[len("users/names/logical/"):] for k in srv.list_keys("users/names/logical/")]
    mega = [k[len("users/names/mega/iter_0000003/"):] for k in srv.list_keys("users/names/mega/iter_0000003/")]
    assert any(k.startswith("d/") for k in logical) and any(k.endswith(".distcp") for k in mega)
    assert foreign_keys(logical, METADATA) == [] and foreign_keys(mega, ".metadata") == []
    users = ["users_notes.txt", "d/notes", "ocdbt.process_0/README", "iter_0000003/x", "run.yaml", "_METADATA.bak"]
    assert foreign_keys(users, METADATA) == users and foreign_keys(users, ".metadata") == users
