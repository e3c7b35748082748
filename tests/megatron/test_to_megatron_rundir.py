"""`to-megatron` writes what Megatron-LM's `--load RUN` finds; `convert` takes a run or an iteration directory.

Megatron-LM's own reading is replicated here from megatron-core 0.19.2's source (the training
package needs triton and CUDA to import, so it cannot run on this CPU): `read_metadata`,
`get_checkpoint_name`, `find_checkpoint_rank_0` (megatron/training/checkpointing.py 195-395),
`check_is_distributed_checkpoint` (megatron/core/dist_checkpointing/core.py 37-66) and
`load_common_state_dict` (megatron/core/dist_checkpointing/serialization.py 206-236, with the
weights_only allow-list of megatron/core/safe_globals.py that applies to common_state).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import signal
import subprocess
import sys
import types

import pytest
import torch
import torch.distributed.checkpoint as dcp

import convert_reference as cref
from bridge.cli import main

RUNS = cref.available_runs()
pytestmark = pytest.mark.skipif("tp2" not in RUNS, reason="needs the real fixtures")
TRACKER = "latest_checkpointed_iteration.txt"
STEP = 3  # the tp2 fixture run saved after 3 steps


# --- Megatron-LM 0.19.2, replicated -----------------------------------------------------------

def megatron_read_metadata(tracker_filename: str) -> tuple[int, bool]:
    """checkpointing.py:353-395 (single process: no all_reduce)."""
    iteration, release = -1, False
    with open(tracker_filename, "r") as f:
        metastring = f.read().strip()
        try:
            iteration = int(metastring)
        except ValueError:
            release = metastring == "release"
            if not release:
                raise SystemExit("ERROR: Invalid metadata file")
            iteration = 0
    assert iteration > -1 or release, f"error parsing metadata file {tracker_filename}"
    return iteration, release


def megatron_get_checkpoint_name(checkpoints_path: str, iteration: int, release: bool) -> str:
    """checkpointing.py:195-213 with return_base_dir=True."""
    directory = "release" if release else "iter_{:07d}".format(iteration)
    return os.path.join(checkpoints_path, directory)


def megatron_find_checkpoint_rank_0(checkpoints_path: str, iteration: int, release: bool) -> str | None:
    """checkpointing.py:265-337: legacy mp_rank_* files first, then a distributed checkpoint."""
    base = megatron_get_checkpoint_name(checkpoints_path, iteration, release)
    for sub in ("mp_rank_00", "mp_rank_00_000", "mp_rank_00_000_000"):
        if os.path.isfile(os.path.join(base, sub, "model_optim_rng.pt")):
            return os.path.join(base, sub, "model_optim_rng.pt")
    config_path = os.path.join(base, "metadata.json")   # core.py: check_is_distributed_checkpoint
    if os.path.exists(config_path):
        with open(config_path) as f:
            config = json.load(f)
        assert "sharded_backend" in config   # CheckpointingConfig(sharded_backend, ...) requires it
        return base
    return None


def megatron_load_common_state_dict(checkpoint_dir: str) -> dict:
    """serialization.py:206-236: the `common_state/shard_0_1` object through dcp.load (no_dist)."""
    assert not os.path.exists(os.path.join(checkpoint_dir, "common.pt"))  # else the legacy path
    key = "common_state/shard_0_1"   # ShardedObject("common_state", None, (1,), (0,)).unique_key
    sd = {key: io.BytesIO()}
    dcp.load(sd, storage_reader=dcp.FileSystemReader(checkpoint_dir), no_dist=True)
    loaded = sd[key]
    if isinstance(loaded, io.BytesIO):   # Megatron's own planner hands the bytes over
        loaded.seek(0)
        loaded = torch.load(loaded, weights_only=True)
    return loaded[0]


def common_state_loads_weights_only(checkpoint_dir: str) -> dict:
    """The common_state blob, located through torch's own DCP metadata, loads with weights_only=True
    allowing only megatron-core's safe globals a plain common state needs (safe_globals.py)."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    md = dcp.FileSystemReader(checkpoint_dir).read_metadata()
    info = md.storage_data[MetadataIndex("common_state/shard_0_1")]
    with open(os.path.join(checkpoint_dir, info.relative_path), "rb") as f:
        f.seek(info.offset)
        blob = f.read(info.length)
    with torch.serialization.safe_globals([argparse.Namespace, types.SimpleNamespace]):
        return torch.load(io.BytesIO(blob), weights_only=True)[0]


def megatron_load(run_dir: str) -> tuple[int, str, dict]:
    """What `--load run_dir` reads first (`_load_base_checkpoint(rank0=True)`): iteration, dir, common state."""
    tracker = os.path.join(run_dir, TRACKER)
    assert os.path.isfile(tracker), "no tracker: Megatron-LM would start from random initialisation"
    iteration, release = megatron_read_metadata(tracker)
    name = megatron_find_checkpoint_rank_0(run_dir, iteration, release)
    assert name is not None, f"no checkpoint for iteration {iteration} in {run_dir}"
    return iteration, name, megatron_load_common_state_dict(name)


# --- fixtures -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def logical(tmp_path_factory):
    from converters.megatron.convert_entry import convert

    d = str(tmp_path_factory.mktemp("rundir") / "tp2_logical")
    convert(os.path.join(cref.FIXTURES, "tp2", "dp_reshardable"), d)
    return d


def _leftovers(root) -> list[str]:
    """Temporary directories / files of a run (old name `DST.tmp-<pid>`, the claim's `.orbax-checkpoint-tmp`)."""
    return [os.path.join(dp, n) for dp, ds, fs in os.walk(root) for n in ds + fs
            if ".tmp-" in n or n.endswith("-tmp") or n == ".gtpb-claim.json"]


# --- tests ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("as_iter_dir", [False, True])
def test_megatron_finds_the_step_and_the_target_layout(logical, tmp_path, as_iter_dir, capsys):
    run = tmp_path / "runs" / "gpt_tp1_dp2"
    dst = run / "iter_0000003" if as_iter_dir else run
    assert main(["to-megatron", "--no-scheduler", logical, str(dst), "--tp", "1", "--dp", "2"]) == 0
    iteration, name, common = megatron_load(str(run))
    assert iteration == STEP and name == str(run / "iter_0000003")
    assert (run / TRACKER).read_text() == "3"     # what Megatron's save_checkpoint writes
    assert sorted(os.listdir(run)) == ["iter_0000003", TRACKER]
    assert common["iteration"] == STEP and common["checkpoint_version"] == 3.0
    a = common["args"]
    assert (a.tensor_model_parallel_size, a.pipeline_model_parallel_size, a.data_parallel_size, a.world_size,
            a.gtp_weight_remat_size, a.expert_model_parallel_size, a.iteration) == (1, 1, 2, 2, 1, 1, STEP)
    # check_checkpoint_args reads these without a default; the source run's sizes (run.json)
    assert (a.num_layers, a.hidden_size, a.num_attention_heads) == (2, 24, 4)
    assert a.no_save_rng is True   # no rng_state object is written: Megatron must not try to load one
    assert common["content_metadata"]["distrib_optim_sharding_type"] == "fully_reshardable"
    assert common_state_loads_weights_only(name)["iteration"] == STEP
    out = capsys.readouterr().out
    assert f"--load {run}" in out


def test_dst_naming_another_iteration_is_refused(logical, tmp_path, capsys):
    dst = tmp_path / "run" / "iter_0001000"
    assert main(["to-megatron", "--no-scheduler", logical, str(dst), "--tp", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "iteration 1000" in err and "iter_0000003" in err
    assert not (tmp_path / "run").exists()


def test_existing_run_dir_gets_the_new_iteration_and_the_tracker_moves(logical, tmp_path, capsys):
    run = tmp_path / "run"
    old = run / "iter_0000001"
    old.mkdir(parents=True)
    (old / "keep.txt").write_text("an earlier save")
    (run / TRACKER).write_text("1")
    assert main(["to-megatron", "--no-scheduler", logical, str(run), "--tp", "2"]) == 0
    assert "(was 1)" in capsys.readouterr().out
    assert (old / "keep.txt").read_text() == "an earlier save"
    iteration, name, common = megatron_load(str(run))
    assert (iteration, name, common["args"].tensor_model_parallel_size) == (STEP, str(run / "iter_0000003"), 2)
    # the same iteration again: refused, nothing changed
    assert main(["to-megatron", "--no-scheduler", logical, str(run), "--tp", "1"]) == 2
    assert "iter_0000003 already exists" in capsys.readouterr().err
    assert megatron_load(str(run))[2]["args"].tensor_model_parallel_size == 2
    assert not _leftovers(run)


def test_a_directory_that_is_not_a_run_is_refused(logical, tmp_path, capsys):
    d = tmp_path / "mine"
    d.mkdir()
    (d / "notes.txt").write_text("x")
    assert main(["to-megatron", "--no-scheduler", logical, str(d), "--tp", "1"]) == 2
    assert "not a Megatron run directory" in capsys.readouterr().err
    assert sorted(os.listdir(d)) == ["notes.txt"]


def test_convert_reads_the_iteration_the_tracker_names(logical, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["to-megatron", "--no-scheduler", logical, str(run), "--tp", "2", "--dp", "1"]) == 0
    (run / "iter_0000001").mkdir()   # an older, unrelated directory: the tracker decides, not the listing
    capsys.readouterr()
    assert main(["convert", str(run), str(tmp_path / "back"), "--workers", "1"]) == 0
    out = capsys.readouterr().out
    assert "iteration 3" in out and str(run / "iter_0000003") in out
    cref.assert_same_checkpoint(logical, str(tmp_path / "back"))
    assert main(["convert", str(run / "iter_0000003"), str(tmp_path / "back2"), "--workers", "1"]) == 0
    cref.assert_same_checkpoint(logical, str(tmp_path / "back2"))


def test_convert_names_a_tracker_pointing_nowhere(tmp_path, capsys):
    run = tmp_path / "run"
    (run / "iter_0000001").mkdir(parents=True)
    (run / TRACKER).write_text("7")
    assert main(["convert", str(run), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "iteration 7" in err and "iter_0000007 does not exist" in err
    (run / TRACKER).unlink()
    assert main(["convert", str(run), str(tmp_path / "out")]) == 2
    assert f"without {TRACKER}" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_resolve_megatron_dir(tmp_path):
    from converters.megatron.read.rundir import resolve_megatron_dir

    run = tmp_path / "run"
    it = run / "iter_0000042"
    it.mkdir(parents=True)
    (it / "metadata.json").write_text("{}")
    (run / TRACKER).write_text("42\n")
    assert resolve_megatron_dir(str(run)) == str(it)
    assert resolve_megatron_dir(str(it)) == str(it)
    (run / TRACKER).write_text("latest")
    with pytest.raises(Exception, match="neither an iteration number nor 'release'"):
        resolve_megatron_dir(str(run))


def test_failure_midway_leaves_the_run_dir_as_it_was(logical, tmp_path):
    """An error after part of the files are written: no iteration dir, no temp dir, tracker unchanged."""
    from bridge.errors import BridgeError
    from converters.megatron.write.torch_dist import DcpFile, MegatronTarget
    from converters.megatron.write.to_megatron import to_megatron

    run = tmp_path / "run"
    (run / "iter_0000001").mkdir(parents=True)
    (run / TRACKER).write_text("1")

    class FullDisk(DcpFile):
        """Objects (extra_state, common_state) go after every tensor: fail there."""

        def obj(self, fqn, value):
            raise BridgeError("disk full (simulated after the tensors were written)")

    with pytest.raises(BridgeError, match="disk full"):
        to_megatron(logical, str(run), MegatronTarget(tp=1), open_file=FullDisk)
    assert sorted(os.listdir(run)) == ["iter_0000001", TRACKER] and (run / TRACKER).read_text() == "1"
    fresh = tmp_path / "fresh"
    with pytest.raises(BridgeError, match="disk full"):
        to_megatron(logical, str(fresh), MegatronTarget(tp=1), open_file=FullDisk)
    assert not fresh.exists() and not _leftovers(tmp_path)


def _cli_to_megatron(logical: str, run, tensor_hook: str) -> str:
    """A program that runs to-megatron through the command line's error handling (`bridge.cli.run`,
    exit 130 on Ctrl-C; SIGTERM exits 143) with `tensor_hook` run in each `.distcp` tensor write,
    passed through `to_megatron(open_file=...)`."""
    return (
        "import argparse, os, signal, sys\n"
        # Ctrl-C as from a terminal, even when the suite runs as a background job (SIGINT then ignored, inherited)
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        "from bridge.cli import run\n"
        "from converters.megatron.write.torch_dist import DcpFile, MegatronTarget\n"
        "from converters.megatron.write.to_megatron import to_megatron\n"
        "class Hooked(DcpFile):\n"
        "    def tensor(self, *a, **k):\n"
        + "".join(f"        {line}\n" for line in tensor_hook.splitlines()) +
        "def parser():\n"
        "    p = argparse.ArgumentParser()\n"
        f"    p.set_defaults(command='to-megatron', func=lambda args: to_megatron({logical!r}, {str(run)!r}, "
        "MegatronTarget(tp=1), open_file=Hooked) and 0)\n"
        "    return p\n"
        "sys.exit(run(parser, []))\n"
    )


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_midway_leaves_no_temp_dir(logical, tmp_path, sig):
    """SIGTERM / SIGINT while the .distcp files are being written: the CLI exits, nothing is left behind.

    The run is held at a known point: its first tensor write says `held` and waits for a line on stdin;
    the test signals the process (as a kill / Ctrl-C from outside does) and only then lets the write go
    on. The held write keeps the run inside its writing loop until the signal has been received, however
    loaded the machine (the signal used to come from the write hook itself, and once under heavy load
    the run exited 0)."""
    run = tmp_path / "run"
    code = _cli_to_megatron(logical, run, (
        "if not getattr(Hooked, 'held', False):  # the first tensor: say so, wait for the test's signal\n"
        "    Hooked.held = True\n"
        "    print('held', flush=True)\n"
        "    sys.stdin.readline()\n"
        "return super().tensor(*a, **k)"))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()   # blocks until a writer is mid-write (EOF if the run failed before)
        if line != "held\n":
            proc.kill()
            pytest.fail(f"the run never reached its first tensor write: {line!r} {proc.communicate()[1][-2000:]}")
        os.kill(proc.pid, sig)          # one signal, as from one kill / one Ctrl-C
        proc.stdin.write("go\n")        # only now: the held write may finish
        proc.stdin.flush()
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode in (130, 143, -int(sig)) and proc.returncode != 0, err[-2000:]
    assert not _leftovers(tmp_path), _leftovers(tmp_path)
    assert not run.exists()


@pytest.mark.slow
def test_a_killed_runs_temp_dir_is_removed_by_the_next_run(logical, tmp_path):
    """SIGKILL cannot be caught: the next run to the same DST recognises the dead run's temp and removes it."""
    run = tmp_path / "run"
    code = _cli_to_megatron(logical, run, (
        "super().tensor(*a, **k)\n"
        "os.kill(os.getpid(), signal.SIGKILL)"))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL
    assert _leftovers(tmp_path)  # the killed run's partial files
    assert main(["to-megatron", "--no-scheduler", logical, str(run), "--tp", "1"]) == 0
    assert not _leftovers(tmp_path), _leftovers(tmp_path)
    assert megatron_load(str(run))[0] == STEP


def test_edited_manifest_is_refused_before_the_run_dir_is_touched(logical, tmp_path, capsys):
    """lr=123 written into _METADATA after commit (issue 17 item 7): refused; the run dir stays as it was."""
    import shutil

    src = str(tmp_path / "edited")
    shutil.copytree(logical, src)
    meta_path = os.path.join(src, "_METADATA")
    with open(meta_path) as f:
        meta = json.load(f)
    meta["custom_metadata"]["gtp_bridge"]["optimizer"]["lr"] = 123.0
    with open(meta_path, "w") as f:
        json.dump(meta, f)
    run = tmp_path / "run"
    (run / "iter_0000001").mkdir(parents=True)
    (run / TRACKER).write_text("1")
    assert main(["to-megatron", "--no-scheduler", src, str(run), "--tp", "1"]) != 0
    err = capsys.readouterr().err
    assert "checksum" in err and err.strip().count("\n") == 0
    assert sorted(os.listdir(run)) == ["iter_0000001", TRACKER] and (run / TRACKER).read_text() == "1"


@pytest.mark.parametrize("url", ["hdfs://bucket/run", "az://b/run/iter_0000003"])
def test_a_url_dst_is_refused_not_made_a_local_dir(logical, tmp_path, monkeypatch, capsys, url):
    """An unknown scheme (s3:// and gs:// are storage locations: tests/megatron/test_remote_megatron.py)."""
    monkeypatch.chdir(tmp_path)
    assert main(["to-megatron", "--no-scheduler", logical, url, "--tp", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"unknown storage scheme {url.split('://')[0]}://" in err
    assert os.listdir(tmp_path) == []   # no ./hdfs:/bucket/run
