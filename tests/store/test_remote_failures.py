"""Failure modes on object storage (issue 20), against moto (S3, IAM enforced) and fake-gcs-server:
bad credentials, missing bucket, no permission (each one line); a killed writer leaves nothing
loadable and a retry cleans it up; damaged objects are found by verify."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "support"))  # tests/support: shared helpers
from servers import environ, remote_servers  # noqa: E402

from bridge.errors import BridgeError, IntegrityError  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def stores():
    with remote_servers() as servers:
        yield servers


def arrays(seed=0):
    rng = np.random.default_rng(seed)
    return {"params/w": rng.standard_normal((64, 48)).astype(np.float32),
            "params/b": rng.standard_normal(9).astype(np.float32), "step": np.array(3, np.int32)}


def assert_one_line(exc, *texts):
    msg = str(exc.value)
    assert "\n" not in msg and all(t in msg for t in texts), msg


def test_bad_credentials_missing_bucket_no_permission(stores):
    from bridge.store.commit import save_checkpoint
    from bridge.store.reader import open_checkpoint

    s3 = stores["s3"]
    committed = save_checkpoint(s3.url("fail/ok"), arrays())
    cases = []
    with environ(AWS_ACCESS_KEY_ID="AKIAWRONGWRONGWRONG", AWS_SECRET_ACCESS_KEY="wrong"):
        cases += [(lambda: save_checkpoint(s3.url("fail/w1"), arrays()), ("refused the credentials", "AWS_ACCESS_KEY_ID")),
                  (lambda: open_checkpoint(committed), ("refused the credentials", "InvalidAccessKeyId"))]
        for call, texts in cases[-2:]:
            with pytest.raises(BridgeError) as e:
                call()
            assert_one_line(e, *texts)
    with environ(AWS_ACCESS_KEY_ID=s3.nobody[0], AWS_SECRET_ACCESS_KEY=s3.nobody[1]):
        for call in (lambda: save_checkpoint(s3.url("fail/w2"), arrays()), lambda: open_checkpoint(committed)):
            with pytest.raises(BridgeError) as e:
                call()
            assert_one_line(e, "permission denied", "AccessDenied")
    for url in ("s3://no-such-bucket/x", "gs://no-such-bucket/x"):
        with pytest.raises(BridgeError) as e:
            save_checkpoint(url, arrays())
        assert_one_line(e, "bucket 'no-such-bucket' does not exist")
    with pytest.raises(BridgeError) as e:
        open_checkpoint("s3://no-such-bucket/x")
    assert_one_line(e, "bucket 'no-such-bucket' does not exist")
    # nothing was written by the refused writes
    assert s3.list_keys("fail/w") == []


WRITER = textwrap.dedent("""
    import os, signal, sys, time
    import numpy as np
    from bridge.store.claim import claim_destination
    from bridge.store.plan import make_write_plan
    from bridge.store.commit import catalog_of
    from bridge.store.writer import CheckpointWriter
    dst, mode = sys.argv[1], sys.argv[2]
    rng = np.random.default_rng(1)
    data = {"params/w": rng.standard_normal((64, 48)).astype(np.float32), "params/v": np.ones((40, 8), np.float32)}
    plan = make_write_plan(catalog_of(data), 2)
    claim = claim_destination(dst)
    for w in range(2):
        writer = CheckpointWriter(claim.tmp, plan, w)
        for name, ap in plan.arrays.items():
            for box in ap.ownership.boxes_owned_by(w):
                writer.write(name, box, data[name.replace(".", "/")][box.slices])
        writer.finish()
    print("written", flush=True)
    if mode == "hang":
        time.sleep(600)
    os.kill(os.getpid(), signal.SIGKILL)  # killed before the commit
""")


def run_writer(dst, mode):
    p = subprocess.Popen([sys.executable, "-c", WRITER, dst, mode], stdout=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert p.stdout.readline().strip() == "written"
    return p


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["s3", "gs"])
def test_killed_writer_leaves_nothing_loadable_and_a_retry_cleans_it(stores, scheme, capfd):
    from bridge.store.commit import save_checkpoint
    from bridge.store.reader import open_checkpoint
    from bridge.store.verify import verify_checkpoint

    srv = stores[scheme]
    key = f"killed/{scheme}"
    dst = srv.url(key)
    # A writer still running: its prefix is neither loadable nor taken over; SIGTERMed, it cleans up.
    p = run_writer(dst, "hang")
    try:
        left = srv.list_keys(key + "/")
        assert any("ocdbt.process_1/" in k for k in left) and not any(k.endswith("/_METADATA") for k in left)
        with pytest.raises(IntegrityError) as e:
            open_checkpoint(dst)
        assert_one_line(e, "partial checkpoint", "never committed")
        with pytest.raises(BridgeError) as e:
            save_checkpoint(dst, arrays())
        assert_one_line(e, "is being written by pid", str(p.pid))
        # SIGTERM: the writer removes what it wrote (its claim last) and exits
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=60) != 0
        assert srv.list_keys(key + "/") == []
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    # Killed (SIGKILL: no cleanup ran): still nothing loadable; plain Orbax cannot load it either.
    p = run_writer(dst, "kill")
    assert p.wait() == -signal.SIGKILL
    res = verify_checkpoint(dst)
    assert not res.ok and "partial checkpoint" in res.metadata_problems[0]
    if scheme == "gs" and importlib.util.find_spec("gcsfs") is not None:  # Orbax reaches gs:// through gcsfs
        import orbax.checkpoint as ocp

        with environ(GOOGLE_CLOUD_PROJECT="test"), pytest.raises(ValueError, match="incomplete checkpoint"):
            ocp.StandardCheckpointer().restore(dst)
    # A retry on this host sees the writer is gone, removes its objects and commits its own.
    capfd.readouterr()
    want = arrays(2)
    assert save_checkpoint(dst, want) == dst
    assert "removing the partial checkpoint" in capfd.readouterr().err
    ck = open_checkpoint(dst)
    assert sorted("/".join(q) for q in ck.paths()) == sorted(want)
    assert np.array_equal(ck.read(("params", "w")), want["params/w"])
    assert not any("ocdbt.process_1/" in k for k in srv.list_keys(key + "/"))  # the killed run's database is gone


def test_objects_that_are_not_ours_are_never_deleted(stores):
    from bridge.store.commit import save_checkpoint

    s3 = stores["s3"]
    s3.client().put_object(Bucket=s3.buckets[0], Key="foreign/data.bin", Body=b"keep me")
    with pytest.raises(BridgeError) as e:
        save_checkpoint(s3.url("foreign"), arrays())
    assert_one_line(e, "not a gtp-bridge checkpoint")
    assert s3.list_keys("foreign/") == ["foreign/data.bin"]


@pytest.mark.parametrize("scheme", ["s3", "gs"])
def test_damaged_objects_are_detected_by_verify(stores, scheme):
    from bridge.store.commit import save_checkpoint
    from bridge.store.verify import verify_checkpoint
    from bridge.store import kvstore

    srv = stores[scheme]
    dst = save_checkpoint(srv.url(f"damage/{scheme}"), arrays(), num_writers=2)
    assert verify_checkpoint(dst).ok
    # Flip one byte in the middle of every data file (objects rewritten through plain TensorStore).
    import tensorstore as ts

    store = ts.KvStore.open(kvstore.base_kvstore(dst)).result()
    data_files = [k for k in store.list().result() if b"/d/" in k]
    assert data_files
    for k in data_files:
        blob = bytearray(store.read(k).result().value)
        blob[len(blob) // 2] ^= 0xFF
        store.write(k, bytes(blob)).result()
    res = verify_checkpoint(dst)
    assert not res.ok and res.damaged, res
    # A missing _METADATA: damaged, never taken for a checkpoint.
    store.delete_range(ts.KvStore.KeyRange("_METADATA", "_METADATA\x00")).result()
    res = verify_checkpoint(dst)
    assert not res.ok and "_METADATA is missing" in res.metadata_problems[0]


def test_claim_is_a_conditional_create_on_s3(stores):
    """Two runs racing for one prefix: the claim object is created only if absent, so one of two
    creates wins and the other is told (the first one's content stays). Only on S3: fake-gcs-server
    ignores `ifGenerationMatch=0` (a second conditional create replaces the object there), so the GCS
    side of the race is not testable against the emulator."""
    from concurrent.futures import ThreadPoolExecutor

    from bridge.store import kvstore
    from bridge.store.remote import CLAIM_KEY

    root = stores["s3"].url("race/claim")
    with ThreadPoolExecutor(2) as pool:
        won = list(pool.map(lambda i: kvstore.write_bytes(root, CLAIM_KEY, b"run%d" % i, if_absent=True), range(2)))
    assert sorted(won) == [False, True], won
    assert kvstore.read_bytes(root, CLAIM_KEY) == b"run%d" % won.index(True)
    assert kvstore.write_bytes(root, CLAIM_KEY, b"late", if_absent=True) is False
