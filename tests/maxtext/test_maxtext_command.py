"""`to-maxtext` prints MaxText's command as one line that runs as printed (issue #30, item 5).

Without MaxText: the printed line is whole shell words (every override one argument, whatever its
brackets, quotes or regex characters: read back with `shlex` and JSON, equal to `--overrides-json`),
with an absolute `base_output_directory` and the `run_name` that make MaxText's checkpoint_dir the
root written; the CPU try's settings are printed apart; README.md and docs/maxtext.md show the very
line `to-maxtext` prints.

With MaxText (MAXTEXT_PYTHON: a Python 3.12 env with maxtext 0.2.5, CPU jax; skipped otherwise): the
printed text, command + CPU settings, goes to `bash -c` as is, from a directory that holds no
`src/maxtext/configs/` (so the config is found through the installed package), with that env's
`python` first on PATH. MaxText restores our step and takes one step from it: its own save of step
dir 3 holds Adam count 4 and step 4 (a run that had not restored would count 1), read with plain
TensorStore, and its masters are one Adam step (<= lr per element, > 0) from the ones we wrote.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/
ROOT = os.path.dirname(HERE)
LIVE = os.path.join(HERE, "fixtures", "maxtext", "llama", "live")   # a logical checkpoint of a llama-style run
PY = os.environ.get("MAXTEXT_PYTHON", "")
DOC_ROOT = "/data/mt/myrun/checkpoints"   # the root the README and docs/maxtext.md show


def to_maxtext(tmp_path, root: str, *extra: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT)
    r = subprocess.run([sys.executable, "-m", "bridge.cli", "to-maxtext", LIVE, root, *extra], capture_output=True,
                       text=True, env=env, cwd=str(tmp_path), timeout=600)
    assert r.returncode == 0, r.stderr
    return r


def printed(stdout: str) -> tuple[str, str]:
    """(the command line, the CPU try's settings line) as to-maxtext printed them."""
    lines = stdout.splitlines()
    cmd = [ln for ln in lines if ln.startswith("python -m maxtext.")]
    assert len(cmd) == 1, stdout
    i = lines.index(cmd[0])
    assert "append" in lines[i + 1], stdout
    return cmd[0], lines[i + 2]


def settings(words: list[str]) -> dict[str, str]:
    pairs = [w.split("=", 1) for w in words]
    assert all(len(p) == 2 for p in pairs), words
    keys = [k for k, _ in pairs]
    assert len(keys) == len(set(keys)), keys
    return dict(pairs)


def value(text: str):
    """A MaxText setting's value as its YAML config reads JSON-shaped values (lists, numbers, booleans)."""
    try:
        return json.loads(text)
    except ValueError:
        return text


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """`to-maxtext LIVE <tmp>/data/mt/myrun/checkpoints --overrides-json ov.json`, run once: (tmp, stdout)."""
    tmp = tmp_path_factory.mktemp("to_maxtext")
    r = to_maxtext(tmp, "data/mt/myrun/checkpoints", "--overrides-json", "ov.json")
    return tmp, r.stdout


@pytest.mark.slow
def test_printed_command_is_whole_words(written):
    tmp, stdout = written
    command, cpu = printed(stdout)
    words = shlex.split(command)
    assert words[:4] == ["python", "-m", "maxtext.trainers.pre_train.train", "src/maxtext/configs/base.yml"]
    kv = settings(words[4:])
    assert kv.pop("base_output_directory") == str(tmp / "data" / "mt") and kv.pop("run_name") == "myrun"
    overrides = json.load(open(tmp / "ov.json"))
    assert set(kv) == set(overrides)
    for k, v in overrides.items():
        assert value(kv[k]) == v, k
    assert any(isinstance(v, list) for v in overrides.values())  # the case unquoted text split in two
    try_ = settings(shlex.split(cpu))
    assert {k: value(v) for k, v in try_.items()} == {
        "hardware": "cpu", "skip_jax_distributed_system": True, "attention": "dot_product",
        "async_checkpointing": False, "per_device_batch_size": 1, "max_target_length": 16, "steps": 4}
    assert not set(try_) & set(kv)


def _doc_commands(path: str) -> list[str]:
    """The `python -m maxtext...` lines of a markdown file, backslash-continued lines joined."""
    text = re.sub(r"\\\n\s*", "", open(path).read())
    return [ln.strip() for ln in text.splitlines() if ln.strip().startswith("python -m maxtext.")]


def test_readme_and_docs_show_the_printed_command(written):
    """The README and docs/maxtext.md show what `to-maxtext LIVE /data/mt/myrun/checkpoints` prints."""
    tmp, stdout = written
    command, cpu = printed(stdout)
    command = command.replace(f"base_output_directory={tmp}/data/mt", "base_output_directory=/data/mt")
    assert "run_name=myrun" in command and "/data/mt " in command
    for doc in ("README.md", os.path.join("docs", "maxtext.md")):
        shown = _doc_commands(os.path.join(ROOT, doc))
        assert shown == [command], (doc, shown)
        assert cpu in open(os.path.join(ROOT, doc)).read(), doc


def _maxtext_ok() -> bool:
    if not PY or not os.path.exists(PY):
        return False
    r = subprocess.run([PY, "-c", "import maxtext.trainers.pre_train.train"], capture_output=True, timeout=300)
    return r.returncode == 0


@pytest.mark.slow
@pytest.mark.skipif(not _maxtext_ok(), reason="needs MAXTEXT_PYTHON: a Python 3.12 env with maxtext 0.2.5")
def test_printed_command_runs_in_maxtext(tmp_path):
    from test_maxtext_preset import _plain_read

    r = to_maxtext(tmp_path, "mt/myrun/checkpoints")
    command, cpu = printed(r.stdout)
    elsewhere = tmp_path / "elsewhere"      # no src/maxtext/configs here: MaxText finds its installed base.yml
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XLA_FLAGS")}
    env.update(PATH=os.path.dirname(PY) + os.pathsep + env.get("PATH", ""), JAX_PLATFORMS="cpu")
    run = subprocess.run(["bash", "-c", command + " " + cpu], capture_output=True, text=True, env=env,
                         cwd=str(elsewhere), timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    root = tmp_path / "mt" / "myrun" / "checkpoints"
    ours, theirs = _plain_read(str(root / "2" / "items")), _plain_read(str(root / "3" / "items"))
    assert int(ours["opt_state/0/count"]) == 3 and int(ours["step"]) == 3
    assert int(theirs["opt_state/0/count"]) == 4 and int(theirs["step"]) == 4
    lr = json.loads(re.search(r"learning_rate=(\S+)", command).group(1))
    moved = [float(np.abs(theirs[k] - ours[k]).max()) for k in ours if k.startswith("params/")]
    assert moved and 0 < max(moved) <= 2 * lr, moved   # one Adam step: |update| about lr at most
