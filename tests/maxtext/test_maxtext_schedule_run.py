"""Real MaxText resumes a streamed `to-maxtext` output and follows the Megatron run's lr schedule (issue #31).

`to-maxtext` (the CLI, streamed) writes the llama fixture's state at iteration 3 (tests/fixtures/maxtext/llama/live)
with the scheduler of a Megatron-LM run given by its own flags: cosine from 1e-2 to 1e-3 over 12 iterations
after a 5-iteration warmup, so the run is still warming up at iteration 3. MaxText's trainer runs from the
printed command (+ its CPU settings, `steps` = the run's 12 iterations, `metrics_file`) and restores our step;
the learning rate MaxText logs for each of its steps 3..11 (`learning/current_learning_rate`, its metric
logger's value of its own schedule at that step, the count its optimizer applies) equals what Megatron-LM's
own scheduler (megatron-core 0.19.2, vendored; see tests/maxtext/test_maxtext_schedule.py) applies at those iterations.
Needs MAXTEXT_PYTHON (skipped otherwise).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess

import pytest

from test_maxtext_command import printed, to_maxtext
from test_maxtext_schedule import RTOL, _maxtext_ok, megatron_lrs

PY = os.environ.get("MAXTEXT_PYTHON", "")
ARGS = dict(lr=1e-2, min_lr=1e-3, lr_decay_style="cosine", lr_warmup_iters=5, train_iters=12, global_batch_size=4)
FLAGS = [f"--{k.replace('_', '-')}={v}" for k, v in ARGS.items()]


@pytest.mark.slow
@pytest.mark.skipif(not _maxtext_ok(), reason="needs MAXTEXT_PYTHON: a Python 3.12 env with maxtext 0.2.5")
def test_maxtext_run_takes_megatrons_lr_at_each_step(tmp_path, monkeypatch):
    r = to_maxtext(tmp_path, "mt/myrun/checkpoints", *FLAGS)
    command, cpu = printed(r.stdout)
    metrics = tmp_path / "metrics.jsonl"
    words = shlex.split(command) + [w for w in shlex.split(cpu) if not w.startswith("steps=")]
    words += [f"steps={ARGS['train_iters']}", f"metrics_file={metrics}", "checkpoint_period=1000"]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XLA_FLAGS")}
    env.update(PATH=os.path.dirname(PY) + os.pathsep + env.get("PATH", ""), JAX_PLATFORMS="cpu")
    run = subprocess.run(words, capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    logged = {}
    for line in metrics.read_text().splitlines():
        m = json.loads(line)
        logged[int(m["step"])] = float(m["learning/current_learning_rate"])
    want = megatron_lrs(monkeypatch, ARGS, ARGS["train_iters"])
    assert sorted(logged) == list(range(3, ARGS["train_iters"])), sorted(logged)   # resumed at our step 3
    worst = max(abs(logged[s] - want[s]) for s in logged)
    print(f"MaxText's logged lr at steps 3..11 {[round(logged[s], 7) for s in sorted(logged)]}; Megatron's "
          f"{[round(want[s], 7) for s in sorted(logged)]}; max |diff| / lr {worst / ARGS['lr']:.1e}")
    assert worst <= RTOL * ARGS["lr"]
    assert logged[3] < logged[5] and logged[11] < logged[6]   # warming up, then decaying: not a constant lr
