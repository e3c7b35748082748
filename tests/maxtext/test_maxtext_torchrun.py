"""`from-maxtext` under real `torchrun` (issues 34 and 31): ranks share the writers, one commit.

A step directory MaxText itself saved (`tests/fixtures/maxtext/fresh_maxtext/1`) converted back by two
ranks (one writer each, a tiny budget: many chunks per writer) equals, bit for bit and read with plain
TensorStore, the single-process conversion; the same onto the local S3 server. A rank that fails
after writing its share (the launch's private fault seam) makes every rank exit non-zero with the
rank named, and nothing is committed. `to-maxtext` of the llama fixture by two ranks: one step made by
rank 0, its item written by both, arrays and sidecar equal to the single-process output; on S3 too.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from torchrun_cases import REPO, assert_same_arrays, env, plain_arrays, torchrun

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/
FRESH_STEP = os.path.join(HERE, "fixtures", "maxtext", "fresh_maxtext", "1")
LLAMA_LIVE = os.path.join(HERE, "fixtures", "maxtext", "llama", "live")
HYPER = ["--lr", "0.01", "--betas", "0.9,0.95", "--eps", "1e-8", "--weight-decay", "0.1"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """from-maxtext in one process (the existing path), read with plain TensorStore."""
    d = tmp_path_factory.mktemp("mtref")
    r = subprocess.run([sys.executable, "-m", "bridge.cli", "from-maxtext", FRESH_STEP, str(d / "one"), *HYPER],
                       capture_output=True, text=True, env=env(), cwd=REPO)
    assert r.returncode == 0, r.stderr
    return plain_arrays(str(d / "one"))


@pytest.mark.parametrize("name", ["bridge.jaxside.presets.maxtext_ranks", "bridge.phases", "bridge.torchrun",
                                  "converters.megatron.distributed"])
def test_docstring_examples(name):
    import doctest
    import importlib

    res = doctest.testmod(importlib.import_module(name))
    assert res.attempted > 0 and res.failed == 0, res


def _ok(res) -> str:
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    return res.stdout


@pytest.mark.slow
def test_from_maxtext_under_torchrun_equals_one_process(reference, tmp_path):
    dst = str(tmp_path / "out")
    out = _ok(torchrun(2, "from-maxtext", FRESH_STEP, dst, *HYPER, "--workers", "1", "--budget", "64k"))
    assert out.count("wrote ") == 1, out               # rank 0 reports for every rank
    assert sorted(n for n in os.listdir(dst) if n.startswith("ocdbt.process_")) == ["ocdbt.process_0",
                                                                                     "ocdbt.process_1"]
    assert_same_arrays(plain_arrays(dst), reference)


@pytest.mark.slow
def test_from_maxtext_to_s3_under_torchrun(reference, tmp_path):
    from servers import remote_servers

    with remote_servers() as servers:
        s3 = servers["s3"]
        url = s3.url(f"torchrun34/mt-{os.path.basename(str(tmp_path))}")
        _ok(torchrun(2, "from-maxtext", FRESH_STEP, url, *HYPER, "--workers", "1", "--budget", "64k"))
        assert_same_arrays(plain_arrays(url), reference)


@pytest.mark.slow
def test_a_failing_rank_stops_every_rank_and_commits_nothing(tmp_path):
    dst = str(tmp_path / "out")
    res = torchrun(2, "from-maxtext", FRESH_STEP, dst, *HYPER, "--workers", "1", "--budget", "64k",
                   extra_env={"_GTPB_TESTING_RANK_FAULT": "1:error"})
    assert res.returncode != 0
    assert "rank 1" in res.stderr and "testing fault" in res.stderr, res.stderr[-3000:]
    assert not os.path.exists(dst)


@pytest.fixture(scope="module")
def to_reference(tmp_path_factory):
    """to-maxtext in one process: the step's items read with plain TensorStore, and its sidecar."""
    d = tmp_path_factory.mktemp("mtto")
    r = subprocess.run([sys.executable, "-m", "bridge.cli", "to-maxtext", LLAMA_LIVE, str(d / "root")],
                       capture_output=True, text=True, env=env(), cwd=REPO)
    assert r.returncode == 0, r.stderr
    step = os.path.join(str(d / "root"), "2")
    return plain_arrays(os.path.join(step, "items")), open(os.path.join(step, "gtp_bridge_maxtext.json")).read()


@pytest.mark.slow
def test_to_maxtext_under_torchrun_equals_one_process(to_reference, tmp_path):
    arrays, sidecar = to_reference
    root = str(tmp_path / "root")
    out = _ok(torchrun(2, "to-maxtext", LLAMA_LIVE, root, "--workers", "1", "--budget", "64k"))
    assert out.count("wrote ") == 1, out
    assert sorted(os.listdir(root)) == ["2"]                       # one step, made by rank 0
    step = os.path.join(root, "2")
    assert {"_CHECKPOINT_METADATA", "commit_success.txt", "gtp_bridge_maxtext.json", "items"} <= set(os.listdir(step))
    assert sorted(n for n in os.listdir(os.path.join(step, "items")) if n.startswith("ocdbt.process_")) == \
        ["ocdbt.process_0", "ocdbt.process_1"]                     # both ranks wrote the item
    assert open(os.path.join(step, "gtp_bridge_maxtext.json")).read() == sidecar
    assert_same_arrays(plain_arrays(os.path.join(step, "items")), arrays)


@pytest.mark.slow
def test_to_maxtext_to_s3_under_torchrun(to_reference, tmp_path):
    from servers import remote_servers

    arrays, _ = to_reference
    with remote_servers() as servers:
        s3 = servers["s3"]
        tag = os.path.basename(str(tmp_path))
        url = s3.url(f"torchrun34/mtroot-{tag}")
        _ok(torchrun(2, "to-maxtext", LLAMA_LIVE, url, "--workers", "1", "--budget", "64k"))
        assert_same_arrays(plain_arrays(url + "/2/items"), arrays)


@pytest.mark.slow
def test_to_maxtext_failing_rank_makes_no_step(tmp_path):
    root = str(tmp_path / "root")
    res = torchrun(2, "to-maxtext", LLAMA_LIVE, root, "--workers", "1", "--budget", "64k",
                   extra_env={"_GTPB_TESTING_RANK_FAULT": "1:error"})
    assert res.returncode != 0
    assert "rank 1" in res.stderr and "testing fault" in res.stderr, res.stderr[-3000:]
    assert not os.path.exists(os.path.join(root, "2"))
