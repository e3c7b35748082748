"""The streamed MaxText moves' writer processes and MaxText steps on object storage (issue 31).

- `to-maxtext` / `from-maxtext` with two writer processes, held after their first block (the
  writers' private seam) so the run is known to be mid-write, then the command SIGKILLed: both
  writers are gone too (at ca2f42d they went on running, and writing, with nobody to commit or
  clean up; nor did the MaxText writers have the seam);
- a step directory MaxText itself saved (`tests/fixtures/maxtext/fresh_maxtext/1`, not written by
  gtp-bridge), put object by object on the local S3 server and on the local GCS server, converts
  back (`from-maxtext` of the s3:// / gs:// step) to arrays bit-equal to the conversion of the
  local copy; both read with plain TensorStore.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from probes import alive, wait_dead
from bridge.worker_life import TESTING_HOLD_ENV

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/
REPO = os.path.dirname(HERE)
LLAMA_LIVE = os.path.join(HERE, "fixtures", "maxtext", "llama", "live")
FRESH_STEP = os.path.join(HERE, "fixtures", "maxtext", "fresh_maxtext", "1")
HYPER = ["--lr", "0.01", "--betas", "0.9,0.95", "--eps", "1e-8", "--weight-decay", "0.1"]


def cli(*argv: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bridge.cli", *argv], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=REPO), timeout=600, **kw)


#: the streamed move with two writers whatever the state's size (the CLI gives a small state one)
RUN = """
import sys
from bridge.jaxside.presets.maxtext import Hyper
from bridge.jaxside.presets.maxtext_stream import read_maxtext, write_maxtext
from bridge.jaxside.presets.maxtext_stream import StreamOptions
s = StreamOptions(workers=2, budget=64 << 10, min_worker_bytes=1)
if sys.argv[1] == "to-maxtext":
    write_maxtext(sys.argv[2], sys.argv[3], stream=s)
else:
    read_maxtext(sys.argv[2], sys.argv[3], stream=s,
                 hyper=Hyper(lr=0.01, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, clip_grad=1.0))
"""


def held_writers(argv: list[str], held: str) -> tuple[subprocess.Popen, list[int]]:
    """Start the move `argv` with its two writers held after their first block; wait until both are
    (the seam writes each writer's pid into held.<writer>)."""
    import time

    os.mkdir(held)
    proc = subprocess.Popen([sys.executable, "-c", RUN, *argv], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, env=dict(os.environ, PYTHONPATH=REPO, **{TESTING_HOLD_ENV: held}))
    deadline = time.monotonic() + 300   # only for a run that fails before writing: not a race
    while time.monotonic() < deadline and proc.poll() is None:
        if sorted(n for n in os.listdir(held) if not n.startswith(".")) == ["held.0", "held.1"]:
            return proc, [int(open(os.path.join(held, f"held.{w}")).read()) for w in (0, 1)]
        time.sleep(0.05)
    proc.kill()
    pytest.fail(f"the writers never reached their first block: {proc.stderr.read()[-1000:]!r}")


@pytest.mark.parametrize("direction", ["to-maxtext", "from-maxtext"])
def test_writers_die_with_a_sigkilled_command(tmp_path, direction):
    src = LLAMA_LIVE if direction == "to-maxtext" else FRESH_STEP
    proc, writers = held_writers([direction, src, str(tmp_path / "out")], str(tmp_path / "held"))
    assert all(alive(p) for p in writers) and proc.pid not in writers
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert wait_dead(writers) == [], f"{direction}: writers {writers} outlived their SIGKILLed command"


def _plain(root: str) -> dict[str, np.ndarray]:
    """Every array of a logical checkpoint, by its OCDBT key name, with plain TensorStore."""
    from torchrun_cases import plain_arrays

    return plain_arrays(root)


def _upload(srv, local: str, prefix: str) -> None:
    """Every file under `local` as an object under `prefix` (how a MaxText step lands on a bucket)."""
    import tensorstore as ts

    url = srv.url(prefix)
    driver, _, rest = url.partition("://")
    bucket, _, path = rest.partition("/")
    spec = {"driver": "s3", "bucket": bucket, "path": path.rstrip("/") + "/",
            "endpoint": os.environ["AWS_ENDPOINT_URL"], "aws_region": os.environ.get("AWS_REGION", "us-east-1")} \
        if driver == "s3" else {"driver": "gcs", "bucket": bucket, "path": path.rstrip("/") + "/"}
    kv = ts.KvStore.open(spec).result()
    for r, _, files in os.walk(local):
        for f in files:
            full = os.path.join(r, f)
            kv.write(os.path.relpath(full, local), open(full, "rb").read()).result()


@pytest.mark.parametrize("kind", ["s3", "gs"])
def test_a_maxtext_step_on_object_storage_converts_back_as_the_local_one(tmp_path, kind):
    from servers import remote_servers

    local = cli("from-maxtext", FRESH_STEP, str(tmp_path / "local"), *HYPER)
    assert local.returncode == 0, local.stderr
    want = _plain(str(tmp_path / "local"))
    assert len(want) > 10
    with remote_servers() as servers:
        srv = servers[kind]
        tag = os.path.basename(str(tmp_path))
        _upload(srv, FRESH_STEP, f"mtback/{tag}/run/1")
        res = cli("from-maxtext", srv.url(f"mtback/{tag}/run/1"), str(tmp_path / "remote"), *HYPER,
                  "--workers", "2", "--budget", "64k")
        assert res.returncode == 0, res.stderr
        got = _plain(str(tmp_path / "remote"))
    assert sorted(got) == sorted(want)
    for name, a in want.items():
        b = got[name]
        assert (b.dtype, b.shape) == (a.dtype, a.shape) and b.tobytes() == a.tobytes(), name
