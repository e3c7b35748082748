"""`convert` under hostile conditions (issue 17): killed parents, signals, overlapping paths, and
masters that disagree with the weights."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from bridge.errors import BridgeError
from converters.megatron.convert import _TESTING_HOLD_ENV, ConvertOptions
from converters.megatron.convert_entry import convert
import convert_synth as synth
from probes import wait_dead

TMP = ".orbax-checkpoint-tmp"

RUN = """
import signal, sys
# Ctrl-C as from a terminal, even when the suite runs as a background job (SIGINT then ignored, inherited)
signal.signal(signal.SIGINT, signal.default_int_handler)
from converters.megatron.convert import ConvertOptions
from converters.megatron.convert_entry import convert
if __name__ == "__main__":
    convert(sys.argv[1], sys.argv[2], ConvertOptions(workers=2, budget=256 << 10, min_worker_bytes=1))
"""


@pytest.fixture(scope="module")
def scale_src(tmp_path_factory):
    d = tmp_path_factory.mktemp("hyg")
    with synth.dims(L=4, H=128, NQ=4, NG=2, HD=32, F=256, V=1024):
        synth.make_checkpoint(str(d / "dp"), "dp_reshardable", tp=2, dp=2, bucket_size=200_000)
    return d / "dp"


def children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def start_and_wait_for_workers(src, dst) -> tuple[subprocess.Popen, list[int]]:
    """Start a 2-writer convert whose writers are held after their first block (convert's private seam),
    and wait until both are: the run is then known to be mid-write, however fast or loaded the machine."""
    held = f"{dst}.held"
    os.mkdir(held)
    proc = subprocess.Popen([sys.executable, "-c", RUN, str(src), str(dst)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, env=dict(os.environ, **{_TESTING_HOLD_ENV: held}))
    deadline = time.monotonic() + 300   # only for a run that fails before writing: not a race
    while time.monotonic() < deadline and proc.poll() is None:
        if sorted(os.listdir(held)) == ["held.0", "held.1"]:
            return proc, children(proc.pid)
        time.sleep(0.05)
    proc.kill()
    pytest.fail(f"the workers never reached their first block: {proc.stderr.read()[-1000:]!r}")


def tree(path: str) -> dict[str, int]:
    """Every file under `path` and its size."""
    return {os.path.join(r, f): os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs}


@pytest.mark.slow
def test_sigkill_of_the_parent_kills_the_workers_and_a_retry_converts(scale_src, tmp_path):
    dst = tmp_path / "out"
    proc, kids = start_and_wait_for_workers(scale_src, dst)
    assert len(kids) >= 2
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    # Workers die with their parent (parent-death signal), so nothing is written after it is gone;
    # at e9efc35 they went on writing into the temp directory.
    left = tree(str(dst) + TMP)
    assert wait_dead(kids) == [], "worker processes outlived their killed parent"
    assert tree(str(dst) + TMP) == left, "workers wrote into the temp directory after their parent died"
    assert not os.path.lexists(dst)
    # the next run recognises the dead run's temp directory as stale, removes it and converts
    convert(str(scale_src), str(dst), ConvertOptions(workers=1, budget=1 << 20))
    assert os.path.isdir(dst) and not os.path.lexists(str(dst) + TMP)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_stops_workers_and_removes_the_temp_dir(scale_src, tmp_path, sig):
    dst = tmp_path / "out"
    proc, kids = start_and_wait_for_workers(scale_src, dst)
    os.kill(proc.pid, sig)
    assert proc.wait(timeout=60) != 0
    assert wait_dead(kids) == []
    assert not os.path.lexists(dst) and not os.path.lexists(str(dst) + TMP), os.listdir(tmp_path)


def test_source_overlapping_the_destination_is_refused(tmp_path):
    src = tmp_path / ("x" + TMP)
    synth.make_checkpoint(str(src), "dp_reshardable", tp=1, dp=1)
    before = sorted(os.listdir(src))
    with pytest.raises(BridgeError):
        convert(str(src), str(tmp_path / "x"))
    with pytest.raises(BridgeError):
        convert(str(src), str(src / "inside"))
    assert sorted(os.listdir(src)) == before and not os.path.lexists(tmp_path / "x")


@pytest.fixture(scope="module")
def corrupt_weight(tmp_path_factory):
    """A single-bucket fully_reshardable save whose one bf16 weight element is not bf16(master)."""
    d = tmp_path_factory.mktemp("corrupt")
    name = "decoder.layers.mlp.linear_fc2.weight"
    orig = synth.state

    def state(seed=0, tied=False):
        st = orig(seed, tied)
        st["model"][name] = st["model"][name].copy()
        st["model"][name][1, 3, 5] = st["model"][name][1, 3, 5] + np.float32(1.0)
        return st

    synth.state = state
    try:
        st = synth.make_checkpoint(str(d / "fr"), "fully_reshardable", tp=1, dp=1)
    finally:
        synth.state = orig
    return d / "fr", name, st


def test_master_mismatch_names_the_element_without_blaming_a_release(corrupt_weight, tmp_path):
    src, name, st = corrupt_weight
    with pytest.raises(BridgeError) as e:
        convert(str(src), str(tmp_path / "x"))
    msg = str(e.value)
    weight, master = float(st["model"][name][1, 3, 5]), float(st["params"][name][1, 3, 5])
    assert "weights disagree with masters: corrupt source or wrong layout flags" in msg
    assert name in msg and "(1, 3, 5)" in msg and repr(weight) in msg and repr(master) in msg
    assert "0.19.2" not in msg and "\n" not in msg
    assert not os.path.lexists(tmp_path / "x") and not os.path.lexists(str(tmp_path / "x") + TMP)
