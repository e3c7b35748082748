"""Megatron's learning-rate schedule carried to MaxText's schedule settings, and back (issue #31).

Reference on each side is the framework's own code: Megatron-LM's scheduler (megatron-core 0.19.2's
`OptimizerParamScheduler`, built by Megatron-LM's verbatim `get_optimizer_param_scheduler` from the run's
arguments, stepped by the global batch size as its training loop does; vendored in
tests/fixtures/megatron_core_src) and MaxText 0.2.5's `create_learning_rate_schedule` on the config
its `pyconfig` parses from the settings (tests/support/maxtext_schedule_client.py, in MAXTEXT_PYTHON; those
tests are skipped without it). For every case the lr MaxText applies at each following step (optax
count c from the converted count to the run's end) equals the lr Megatron applies at iteration c,
within float32 rounding (MaxText evaluates its schedule in float32). Where MaxText cannot express the
schedule, `maxtext_schedule` refuses in one line naming the difference.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from bridge.format.scheduler import SchedulerRecord
from bridge.format.scheduler_args import record_from_args
from bridge.jaxside.presets.maxtext_schedule import (ScheduleGap, horizon_of, maxtext_schedule,
                                                     record_from_maxtext)
from megatron_scheduler import megatron_args, real_scheduler, vendored_megatron

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/
CLIENT = os.path.join(HERE, "support", "maxtext_schedule_client.py")
PY = os.environ.get("MAXTEXT_PYTHON", "")
# MaxText's schedule is float32: its values sit within a few float32 ulps (2**-23 relative) of the peak lr
RTOL = 8 * 2.0**-23

# Megatron-LM arguments of a run, and the iteration at which it is converted to MaxText
CASES = {
    "cosine_in_warmup": (dict(lr=3e-4, min_lr=3e-5, lr_decay_style="cosine", lr_warmup_iters=10, train_iters=60,
                              global_batch_size=8), 4),
    "cosine_mid_decay": (dict(lr=3e-4, min_lr=3e-5, lr_decay_style="cosine", lr_warmup_iters=10, train_iters=60,
                              global_batch_size=8), 25),
    "linear_warmup": (dict(lr=1e-3, lr_decay_style="linear", lr_warmup_iters=5, train_iters=40,
                           global_batch_size=4), 2),
    "wsd_linear": (dict(lr=1e-3, min_lr=1e-4, lr_decay_style="WSD", lr_wsd_decay_style="linear",
                        lr_wsd_decay_iters=10, lr_warmup_iters=5, train_iters=50, global_batch_size=4), 3),
    "wsd_cosine_warm_init_past_warmup": (dict(lr=1e-3, lr_decay_style="WSD", lr_wsd_decay_style="cosine",
                                              lr_wsd_decay_iters=20, train_iters=100, global_batch_size=4,
                                              lr_warmup_init=1e-5, lr_warmup_iters=5), 10),
    "constant_in_warmup": (dict(lr=2e-4, lr_decay_style="constant", lr_warmup_iters=8, train_iters=30,
                                global_batch_size=2), 3),
    "cosine_zero_tail": (dict(lr=1e-3, min_lr=0.0, lr_decay_style="cosine", lr_warmup_iters=4, lr_decay_iters=30,
                              train_iters=45, global_batch_size=8), 10),
    "past_decay": (dict(lr=1e-3, min_lr=1e-5, lr_decay_style="cosine", lr_decay_iters=20, train_iters=30,
                        global_batch_size=8), 25),
    "samples_cosine": (dict(lr=5e-4, lr_decay_style="cosine", lr_warmup_samples=40, lr_decay_samples=240,
                            train_samples=320, global_batch_size=8), 6),
    "warmup_fraction_linear": (dict(lr=1e-3, min_lr=1e-4, lr_decay_style="linear", lr_warmup_fraction=0.25,
                                    train_iters=32, global_batch_size=4), 5),
}

# (Megatron-LM arguments, iteration, what the one-line refusal names)
GAPS = {
    "inverse_square_root": (dict(lr=1e-3, lr_decay_style="inverse-square-root", lr_warmup_iters=4, train_iters=40,
                                 global_batch_size=4), 10, "inverse-square-root"),
    "warmup_init_in_warmup": (dict(lr=1e-3, lr_decay_style="cosine", lr_warmup_init=1e-4, lr_warmup_iters=10,
                                   train_iters=40, global_batch_size=4), 3, "lr_warmup_init 0.0001"),
    "wsd_exponential": (dict(lr=1e-3, lr_decay_style="WSD", lr_wsd_decay_style="exponential", lr_wsd_decay_iters=10,
                             train_iters=40, global_batch_size=4), 3, "lr_wsd_decay_style exponential"),
    "warmup_samples_not_whole": (dict(lr=1e-3, lr_decay_style="cosine", lr_warmup_samples=42, train_samples=400,
                                      global_batch_size=8), 2, "warmup ends at sample 42"),
    "min_lr_tail": (dict(lr=1e-3, min_lr=1e-5, lr_decay_style="cosine", lr_decay_iters=30, train_iters=45,
                         global_batch_size=8), 5, "holds min_lr 1e-05 from iteration 31"),
    "weight_decay_increment": (dict(lr=1e-3, lr_decay_style="cosine", train_iters=40, global_batch_size=4,
                                    weight_decay_incr_style="linear", start_weight_decay=0.0, end_weight_decay=0.1),
                               5, "changes its weight decay"),
}

# MaxText settings of a run (MaxText's names) for the way back; steps: MaxText's `steps`
BACK = {
    "cosine": ({"learning_rate": 3e-4, "lr_schedule_type": "cosine", "warmup_steps_fraction": 0.1,
                "learning_rate_schedule_steps": 50, "learning_rate_final_fraction": 0.1}, 50),
    "wsd_linear": ({"learning_rate": 1e-3, "lr_schedule_type": "wsd", "warmup_steps_fraction": 0.1,
                    "wsd_decay_steps_fraction": 0.2, "wsd_decay_style": "linear", "learning_rate_schedule_steps": 40,
                    "learning_rate_final_fraction": 0.1}, 40),
    "wsd_cosine_zero_tail": ({"learning_rate": 1e-3, "lr_schedule_type": "wsd", "warmup_steps_fraction": 0.0,
                              "wsd_decay_steps_fraction": 0.25, "wsd_decay_style": "cosine",
                              "learning_rate_schedule_steps": 40, "learning_rate_final_fraction": 0.0}, 48),
    "wsd_no_stable_is_linear": ({"learning_rate": 1e-3, "lr_schedule_type": "wsd", "warmup_steps_fraction": 0.25,
                                 "wsd_decay_steps_fraction": 0.75, "learning_rate_schedule_steps": 20,
                                 "learning_rate_final_fraction": 0.05}, 20),
}


def _maxtext_ok() -> bool:
    return bool(PY) and os.path.exists(PY) and subprocess.run(
        [PY, "-c", "import maxtext.utils.maxtext_utils"], capture_output=True, timeout=300).returncode == 0


needs_maxtext = pytest.mark.skipif(not _maxtext_ok(), reason="needs MAXTEXT_PYTHON: a Python 3.12 env with maxtext 0.2.5")


def megatron_lrs(monkeypatch, args: dict, n: int) -> list[float]:
    """The lr Megatron-LM's own scheduler applies at iterations 0..n-1 of a run given `args`."""
    _, tr = vendored_megatron(monkeypatch)
    sched, opt = real_scheduler(tr, megatron_args(**args))
    out = []
    for _ in range(n):
        out.append(opt.param_groups[0]["lr"])
        sched.step(increment=args["global_batch_size"])
    return out


def megatron_lrs_of_record(monkeypatch, rec: SchedulerRecord, n: int) -> list[float]:
    """The lr megatron-core's OptimizerParamScheduler, constructed from `rec`'s fields, applies at 0..n-1."""
    import torch

    cls, _ = vendored_megatron(monkeypatch)
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=0.0)
    s = cls(opt, init_lr=rec.init_lr, max_lr=rec.max_lr, min_lr=rec.min_lr, lr_warmup_steps=rec.lr_warmup_steps,
            lr_decay_steps=rec.lr_decay_steps, lr_decay_style=rec.lr_decay_style, start_wd=rec.start_wd,
            end_wd=rec.end_wd, wd_incr_steps=rec.wd_incr_steps, wd_incr_style=rec.wd_incr_style,
            wsd_decay_steps=rec.wsd_decay_steps, lr_wsd_decay_style=rec.lr_wsd_decay_style)
    out = []
    for _ in range(n):
        out.append(opt.param_groups[0]["lr"])
        s.step(increment=rec.increment)
    return out


def horizon(args: dict) -> int:
    return args.get("train_iters") or args["train_samples"] // args["global_batch_size"]


def forward(name: str) -> tuple[dict, int, int, dict]:
    args, at = CASES[name]
    rec = record_from_args(args, at)
    h = horizon_of(rec)
    assert h == horizon(args)
    return args, at, h, maxtext_schedule(rec, at, h).settings


@pytest.fixture(scope="module")
def maxtext_lrs(tmp_path_factory):
    """MaxText's schedule values for every forward case and every way-back case, in one MaxText process."""
    if not _maxtext_ok():
        pytest.skip("needs MAXTEXT_PYTHON")
    d = tmp_path_factory.mktemp("schedule")
    cases = []
    for name in CASES:
        _, at, h, settings = forward(name)
        cases.append({"settings": settings, "steps": h, "counts": list(range(at, h))})
    for settings, steps in BACK.values():
        cases.append({"settings": settings, "steps": steps, "counts": list(range(steps))})
    (d / "cases.json").write_text(json.dumps(cases))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XLA_FLAGS")}
    env["JAX_PLATFORMS"] = "cpu"
    r = subprocess.run([PY, CLIENT, str(d / "cases.json"), str(d / "out.json")], capture_output=True, text=True,
                       timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads((d / "out.json").read_text())
    return dict(zip(list(CASES) + [f"back:{n}" for n in BACK], got))


def _close(got: list[float], want: list[float], peak: float) -> float:
    assert len(got) == len(want)
    worst = max(abs(g - w) for g, w in zip(got, want))
    assert worst <= RTOL * peak, (worst / peak, [(i, g, w) for i, (g, w) in enumerate(zip(got, want))
                                                  if abs(g - w) > RTOL * peak][:5])
    return worst / peak


@pytest.mark.slow
@needs_maxtext
@pytest.mark.parametrize("name", list(CASES))
def test_maxtext_applies_megatrons_lr_at_every_following_step(name, maxtext_lrs, monkeypatch):
    args, at, h, settings = forward(name)
    want = megatron_lrs(monkeypatch, args, h)[at:]
    rel = _close(maxtext_lrs[name], want, args["lr"])
    # control: the schedule moves over these steps (a constant lr would not pass), except where it should not
    moving = max(want) - min(want) > 100 * RTOL * args["lr"]
    assert moving or name == "past_decay", (name, want[:3])
    print(f"{name}: {h - at} steps from {at}, max |MaxText - Megatron| / lr = {rel:.1e}; {settings}")


@pytest.mark.parametrize("name", list(GAPS))
def test_inexpressible_schedules_refused_in_one_line(name):
    args, at, says = GAPS[name]
    rec = record_from_args(args, at)
    with pytest.raises(ScheduleGap) as e:
        maxtext_schedule(rec, at, horizon_of(rec))
    msg = str(e.value)
    assert says in msg and "\n" not in msg, msg


def test_refused_only_where_the_following_steps_see_the_difference():
    """A warmup init or exponential anneal that lies wholly in the past (or past the run's end) is no gap."""
    args, _, _ = GAPS["warmup_init_in_warmup"]
    maxtext_schedule(record_from_args(args, 10), 10, 40)      # warmup over at iteration 10
    args, _, _ = GAPS["wsd_exponential"]
    maxtext_schedule(record_from_args(args, 3), 3, 31)        # its last update (30) is the anneal's start
    with pytest.raises(ScheduleGap):
        maxtext_schedule(record_from_args(args, 3), 3, 32)


@pytest.mark.slow
@needs_maxtext
@pytest.mark.parametrize("name", list(BACK))
def test_way_back_megatron_applies_maxtexts_lr(name, maxtext_lrs, monkeypatch):
    settings, steps = BACK[name]
    rec = record_from_maxtext(settings, 0, 8)
    want = maxtext_lrs[f"back:{name}"]
    rel = _close(megatron_lrs_of_record(monkeypatch, rec, steps), want, settings["learning_rate"])
    # and forward again gives MaxText's own settings' values back at a later count
    again = maxtext_schedule(record_from_maxtext(settings, 7, 8), 7, steps).settings
    assert again["learning_rate"] == settings["learning_rate"]
    print(f"{name}: {rec.lr_decay_style}, max |Megatron - MaxText| / lr = {rel:.1e}; forward again: {again}")


LIVE = os.path.join(HERE, "fixtures", "maxtext", "llama", "live")   # a logical checkpoint at iteration 3


def test_refusal_names_the_gap_and_writes_nothing(tmp_path):
    """to-maxtext with a schedule MaxText cannot express: exit 2, one line, nothing written; --constant-lr goes on."""
    import sys

    root = tmp_path / "mt" / "run" / "checkpoints"
    cmd = [sys.executable, "-m", "bridge.cli", "to-maxtext", LIVE, str(root), "--lr", "1e-3", "--lr-decay-style",
           "inverse-square-root", "--lr-warmup-iters", "2", "--train-iters", "20", "--global-batch-size", "4"]
    env = dict(os.environ, PYTHONPATH=os.path.dirname(HERE))
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "inverse-square-root" in r.stderr and "--constant-lr" in r.stderr and LIVE in r.stderr, r.stderr
    assert not (tmp_path / "mt").exists()
    r = subprocess.run(cmd + ["--constant-lr"], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0 and "constant recorded lr" in r.stderr, r.stderr
    assert (root / "2" / "items").is_dir()


def test_way_back_carries_the_scheduler_megatron_lm_builds(tmp_path, monkeypatch):
    """to-maxtext with Megatron-LM's scheduler flags, then from-maxtext: the scheduler state to-megatron would
    write at the step MaxText saved equals the state_dict() of Megatron-LM's own scheduler after that many
    iterations; and from-maxtext --maxtext-settings records a MaxText run's schedule the same way."""
    from bridge.jaxside.manifest_view import scheduler_of
    from bridge.jaxside.presets.maxtext_stream import read_maxtext, write_maxtext
    from bridge.jaxside.presets.maxtext_schedule import MaxTextRunSchedule, ScheduleOptions
    from bridge.lr_schedule import scheduler_state_dict
    from bridge.store.reader import open_checkpoint

    args = dict(lr=1e-2, min_lr=1e-3, lr_decay_style="cosine", lr_warmup_iters=5, train_iters=12,
                global_batch_size=4, weight_decay=0.1)
    root = str(tmp_path / "mt" / "run" / "checkpoints")
    w = write_maxtext(LIVE, root, schedule=ScheduleOptions(scheduler_args=args))
    assert w.overrides["lr_schedule_type"] == "cosine" and w.overrides["learning_rate_schedule_steps"] == 13
    read_maxtext(root, str(tmp_path / "back"))
    rec = scheduler_of(open_checkpoint(str(tmp_path / "back")).manifest)
    _, tr = vendored_megatron(monkeypatch)
    for later in (3, 9):    # the step written, and one MaxText might save after more steps
        real, _ = real_scheduler(tr, megatron_args(**args))
        for _ in range(later):
            real.step(increment=args["global_batch_size"])
        assert scheduler_state_dict(rec, later) == real.state_dict()
    # a MaxText run's own schedule (its settings as to-maxtext printed them), with no Megatron record
    run = MaxTextRunSchedule({k: v for k, v in w.overrides.items() if k in ("learning_rate", "lr_schedule_type",
                              "learning_rate_schedule_steps", "warmup_steps_fraction", "wsd_decay_steps_fraction",
                              "wsd_decay_style", "learning_rate_final_fraction")}, 4)
    read_maxtext(root, str(tmp_path / "back2"), schedule=run)
    rec2 = scheduler_of(open_checkpoint(str(tmp_path / "back2")).manifest)
    want = megatron_lrs(monkeypatch, args, 12)
    got = megatron_lrs_of_record(monkeypatch, rec2, 12)
    assert max(abs(a - b) for a, b in zip(got, want)) <= 1e-15, (got, want)
    assert rec2.lr_decay_steps == rec.lr_decay_steps and rec2.lr_warmup_steps == rec.lr_warmup_steps
