"""Megatron's OptimizerParamScheduler carried to optax: schedule values against Megatron's get_lr.

The reference is `MegatronScheduler` below, transcribed line by line from megatron-core 0.19.2
`megatron/core/optimizer_param_scheduler.py` (get_lr, get_wd, step) in Python doubles; where that
source file is available (vendored in tests/fixtures/megatron_core_src, or MEGATRON_CORE_SRC), the real class driving a real
torch optimizer is checked against the transcription. The converter part writes a synthetic
common_state with scheduler state through real `torch.distributed.checkpoint.save` (the real
fixtures carry no scheduler state) and converts it with the real converter.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from bridge.errors import BridgeError
from bridge.jaxside import optimizer_from_manifest
from bridge.jaxside.manifest_view import scheduler_of
from bridge.lr_schedule import (SchedulerRecord, megatron_lr_schedule, megatron_wd_schedule, samples_at,
                                    scheduler_state_dict)
from converters.megatron.convert import scheduler_record


class MegatronScheduler:
    """megatron-core 0.19.2 OptimizerParamScheduler.get_lr/get_wd/step, without the optimizer."""

    def __init__(self, init_lr, max_lr, min_lr, lr_warmup_steps, lr_decay_steps, lr_decay_style, start_wd=0.1,
                 end_wd=0.1, wd_incr_steps=1, wd_incr_style="constant", wsd_decay_steps=None, lr_wsd_decay_style=None):
        self.init_lr, self.max_lr, self.min_lr = init_lr, float(max_lr), min_lr
        self.lr_warmup_steps, self.lr_decay_steps, self.lr_decay_style = lr_warmup_steps, lr_decay_steps, lr_decay_style
        self.wsd_decay_steps, self.lr_wsd_decay_style = wsd_decay_steps, lr_wsd_decay_style
        self.start_wd, self.end_wd, self.wd_incr_steps, self.wd_incr_style = start_wd, end_wd, wd_incr_steps, wd_incr_style
        self.num_steps = 0

    def get_wd(self):
        if self.num_steps > self.wd_incr_steps:
            return self.end_wd
        if self.wd_incr_style == 'constant':
            return self.end_wd
        incr_ratio = float(self.num_steps) / float(self.wd_incr_steps)
        delta_wd = self.end_wd - self.start_wd
        if self.wd_incr_style == 'linear':
            coeff = incr_ratio
        elif self.wd_incr_style == 'cosine':
            coeff = 0.5 * (math.cos(math.pi * (1 - incr_ratio)) + 1.0)
        return self.start_wd + coeff * delta_wd

    def get_lr(self, param_group=None):
        param_group = param_group or {}
        max_lr = param_group.get('max_lr', self.max_lr)
        min_lr = param_group.get('min_lr', self.min_lr)
        if self.lr_warmup_steps > 0 and self.num_steps <= self.lr_warmup_steps:
            return self.init_lr + ((max_lr - self.init_lr) * float(self.num_steps) / float(self.lr_warmup_steps))
        if self.lr_decay_style == 'constant':
            return max_lr
        if self.num_steps > self.lr_decay_steps:
            return min_lr
        if self.lr_decay_style == 'inverse-square-root':
            warmup_steps = max(self.lr_warmup_steps, 1)
            num_steps = max(self.num_steps, 1)
            lr = max_lr * warmup_steps**0.5 / (num_steps**0.5)
            return max(min_lr, lr)
        num_steps_ = self.num_steps - self.lr_warmup_steps
        decay_steps_ = self.lr_decay_steps - self.lr_warmup_steps
        decay_ratio = float(num_steps_) / float(decay_steps_)
        delta_lr = max_lr - min_lr
        if self.lr_decay_style == 'linear':
            coeff = 1.0 - decay_ratio
        elif self.lr_decay_style == 'cosine':
            coeff = 0.5 * (math.cos(math.pi * decay_ratio) + 1.0)
        elif self.lr_decay_style == 'WSD':
            wsd_anneal_start_ = self.lr_decay_steps - self.wsd_decay_steps
            if self.num_steps <= wsd_anneal_start_:
                coeff = 1.0
            else:
                wsd_steps = self.num_steps - wsd_anneal_start_
                wsd_decay_ratio = float(wsd_steps) / float(self.wsd_decay_steps)
                if self.lr_wsd_decay_style == "linear":
                    coeff = 1.0 - wsd_decay_ratio
                elif self.lr_wsd_decay_style == "cosine":
                    coeff = 0.5 * (math.cos(math.pi * wsd_decay_ratio) + 1.0)
                elif self.lr_wsd_decay_style == "exponential":
                    coeff = (2.0 * math.pow(0.5, wsd_decay_ratio)) - 1.0
                elif self.lr_wsd_decay_style == "minus_sqrt":
                    coeff = 1.0 - math.sqrt(wsd_decay_ratio)
        return min_lr + coeff * delta_lr

    def step(self, increment):
        self.num_steps += increment


GBS = 8
# (name, scheduler kwargs in samples); warmup 5 iterations, decay over 40 iterations (in samples x GBS)
CASES = [
    ("constant", dict(lr_decay_style="constant")),
    ("linear", dict(lr_decay_style="linear")),
    ("cosine", dict(lr_decay_style="cosine")),
    ("inverse-square-root", dict(lr_decay_style="inverse-square-root")),
    ("wsd-linear", dict(lr_decay_style="WSD", wsd_decay_steps=12 * GBS, lr_wsd_decay_style="linear")),
    ("wsd-cosine", dict(lr_decay_style="WSD", wsd_decay_steps=12 * GBS, lr_wsd_decay_style="cosine")),
    ("wsd-exponential", dict(lr_decay_style="WSD", wsd_decay_steps=12 * GBS, lr_wsd_decay_style="exponential")),
    ("wsd-minus_sqrt", dict(lr_decay_style="WSD", wsd_decay_steps=12 * GBS, lr_wsd_decay_style="minus_sqrt")),
    ("cosine-fractional-warmup", dict(lr_decay_style="cosine", lr_warmup_steps=0.13 * 40 * GBS)),
    ("linear-no-warmup", dict(lr_decay_style="linear", lr_warmup_steps=0)),
]
BASE = dict(init_lr=1e-5, max_lr=3e-3, min_lr=3e-4, lr_warmup_steps=5 * GBS, lr_decay_steps=40 * GBS)
ITERS = 60   # past the end of decay


def _kwargs(case):
    return {**BASE, **case}


def _record(kw, num_steps, at_count, increment=GBS, wd=None) -> SchedulerRecord:
    wd = wd or {}
    return SchedulerRecord(max_lr=kw["max_lr"], min_lr=kw["min_lr"], lr_warmup_steps=kw["lr_warmup_steps"],
                           lr_decay_steps=kw["lr_decay_steps"], lr_decay_style=kw["lr_decay_style"],
                           num_steps=num_steps, increment=increment, at_count=at_count, init_lr=kw["init_lr"],
                           wsd_decay_steps=kw.get("wsd_decay_steps"), lr_wsd_decay_style=kw.get("lr_wsd_decay_style"),
                           **wd)


def _reference_lrs(kw, num_steps, n, increment=GBS):
    """The lr Megatron uses for the next n updates after resuming at num_steps samples."""
    s = MegatronScheduler(**kw)
    s.step(num_steps)                     # load_state_dict: self.step(increment=num_steps)
    out = []
    for _ in range(n):
        out.append(s.get_lr())            # optimizer.step() uses the lr set by the last scheduler step
        s.step(increment)                 # train_step: opt_param_scheduler.step(increment=global batch)
    return np.asarray(out)


def _tol(kw):
    """A few float32 ulp of the largest lr (the schedule computes in float32; Megatron in double)."""
    return 4 * float(np.spacing(np.float32(kw["max_lr"])))


def _schedule_values(sched, counts):
    return np.asarray(jax.jit(jax.vmap(sched))(jnp.asarray(counts, dtype=jnp.int32)), dtype=np.float64)


@pytest.mark.parametrize("name,case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("resume", [0, 3, 5, 17, 38, 52])   # start, in warmup, warmup end, decay, WSD anneal, after
def test_schedule_matches_megatron_get_lr(name, case, resume):
    kw = _kwargs(case)
    counts = np.arange(resume, ITERS)
    want = _reference_lrs(kw, resume * GBS, len(counts))
    sched = megatron_lr_schedule(_record(kw, num_steps=resume * GBS, at_count=resume))
    got = _schedule_values(sched, counts)
    tol = _tol(kw)
    assert np.max(np.abs(got - want)) <= tol, (name, resume, np.max(np.abs(got - want)), tol)
    # the step alignment matters: where Megatron's lr still changes, one iteration early or late is far
    # outside the tolerance (constant stretches, e.g. after the decay, cannot tell steps apart)
    if np.max(np.abs(np.diff(want)), initial=0.0) > 100 * tol:
        for shift in (-1, 1):
            off = _schedule_values(sched, counts + shift)
            assert np.max(np.abs(off - want)) > 50 * tol, (name, resume, shift)


def test_resume_after_batch_size_change_continues_from_recorded_samples():
    """num_steps need not be at_count x increment (e.g. global batch changed): samples continue from it."""
    kw = _kwargs(dict(lr_decay_style="cosine"))
    num_steps, at_count, new_gbs = 13 * GBS + 4, 11, 12
    want = _reference_lrs(kw, num_steps, 30, increment=new_gbs)
    got = _schedule_values(megatron_lr_schedule(_record(kw, num_steps, at_count, increment=new_gbs)),
                           np.arange(at_count, at_count + 30))
    assert np.max(np.abs(got - want)) <= _tol(kw)
    naive = _schedule_values(megatron_lr_schedule(_record(kw, at_count * new_gbs, at_count, increment=new_gbs)),
                             np.arange(at_count, at_count + 30))
    assert np.max(np.abs(naive - want)) > 50 * _tol(kw)


def test_inverse_sqrt_jump_to_min_lr_at_decay_end():
    """inverse-square-root is discontinuous at lr_decay_steps: `>` (not `>=`) decides it."""
    kw = _kwargs(dict(lr_decay_style="inverse-square-root", min_lr=1e-6))
    sched = megatron_lr_schedule(_record(kw, 0, 0))
    end = kw["lr_decay_steps"] // GBS
    got = _schedule_values(sched, [end, end + 1])
    want = _reference_lrs(kw, 0, end + 2)[end:end + 2]
    assert want[0] > 10 * want[1] and np.allclose(got, want, rtol=1e-6, atol=0)


def test_float64_agrees_to_double_precision():
    """Under x64 the schedule is Megatron's formula to ~1e-15: any difference above is a formula error."""
    with jax.enable_x64(True):
        for name, case in CASES:
            kw = _kwargs(case)
            want = _reference_lrs(kw, 7 * GBS, ITERS - 7)
            sched = megatron_lr_schedule(_record(kw, 7 * GBS, 7))
            got = np.asarray(jax.vmap(sched)(jnp.arange(7, ITERS, dtype=jnp.int64)))
            assert got.dtype == np.float64
            assert np.max(np.abs(got - want)) <= 1e-15 * kw["max_lr"] * 8, name


@pytest.mark.parametrize("style", ["linear", "cosine"])
def test_weight_decay_increment_matches_get_wd(style):
    wd = dict(start_wd=0.01, end_wd=0.1, wd_incr_steps=50 * GBS, wd_incr_style=style)
    kw = _kwargs(dict(lr_decay_style="linear"))
    s = MegatronScheduler(**kw, **wd)
    s.step(9 * GBS)
    want = []
    for _ in range(60):
        want.append(s.get_wd())
        s.step(GBS)
    got = _schedule_values(megatron_wd_schedule(_record(kw, 9 * GBS, 9, wd=wd)), np.arange(9, 69))
    assert np.max(np.abs(got - np.asarray(want))) <= 4 * float(np.spacing(np.float32(0.1)))
    assert megatron_wd_schedule(_record(kw, 0, 0, wd=dict(wd, wd_incr_style="constant", start_wd=0.1))) == 0.1


def test_bad_records_are_refused():
    kw = _kwargs(dict(lr_decay_style="cosine"))
    good = _record(kw, 0, 0).to_json()
    for bad in ({"lr_decay_style": "polynomial"}, {"lr_warmup_steps": kw["lr_decay_steps"]}, {"increment": None},
                {"lr_decay_style": "WSD"}, {"min_lr": 1.0}, {"rampup_samples": 10_000}, {"version": 99}):
        with pytest.raises(BridgeError):
            SchedulerRecord.from_json({**good, **bad})
    with pytest.raises(BridgeError):
        SchedulerRecord.from_json({k: v for k, v in good.items() if k != "num_steps"})


# --- the real megatron-core source, when available ------------------------------------------------

_VENDORED = os.path.join(os.path.dirname(__file__), "..", "fixtures", "megatron_core_src")
MC_SRC = os.path.join(os.environ.get("MEGATRON_CORE_SRC", _VENDORED), "megatron", "core", "optimizer_param_scheduler.py")


def _real_megatron_module(monkeypatch):
    """The real file, loaded alone (its only megatron import is a logging helper, replaced by a no-op)."""
    utils = types.ModuleType("megatron.core.utils")
    utils.log_single_rank = lambda *a, **k: None
    for mod in ("megatron", "megatron.core"):
        monkeypatch.setitem(sys.modules, mod, sys.modules.get(mod) or types.ModuleType(mod))
    monkeypatch.setitem(sys.modules, "megatron.core.utils", utils)
    spec = importlib.util.spec_from_file_location("mc_optimizer_param_scheduler", MC_SRC)
    real = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(real)
    return real


needs_mc = pytest.mark.skipif(not os.path.exists(MC_SRC),
                              reason="megatron-core 0.19.2 source not unpacked (set MEGATRON_CORE_SRC)")


@needs_mc
@pytest.mark.parametrize("name,case", CASES, ids=[c[0] for c in CASES])
def test_transcription_equals_real_megatron_scheduler(name, case, monkeypatch):
    """The real class driving a real torch optimizer gives the transcription's lrs bit for bit."""
    import torch

    real = _real_megatron_module(monkeypatch)
    kw = _kwargs(case)
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=0.0)
    s = real.OptimizerParamScheduler(opt, start_wd=0.1, end_wd=0.1, wd_incr_steps=ITERS * GBS, wd_incr_style="constant",
                                     **kw)
    got = []
    for _ in range(ITERS):
        got.append(opt.param_groups[0]["lr"])
        s.step(GBS)
    want = _reference_lrs(kw, 0, ITERS)
    assert got == list(want), name   # same double arithmetic, bit for bit


# --- the converter records it; optimizer_from_manifest uses it --------------------------------------


def _at_count(state, c):
    """Every optax count (Adam's, the schedule's) set to c, as restore fills them from the checkpoint."""
    return jax.tree_util.tree_map(lambda x: jnp.full_like(x, c) if x.dtype == jnp.int32 and x.ndim == 0 else x, state)


def _common_state(sched_sd: dict, step: int, lr: float) -> dict:
    import convert_synth as synth

    cs = synth.common_state(1, 1, "fully_reshardable")
    args = cs["args"]
    for k, v in dict(train_iters=40, global_batch_size=GBS, micro_batch_size=GBS, lr=BASE["max_lr"],
                     min_lr=BASE["min_lr"], lr_warmup_init=BASE["init_lr"], lr_decay_style="WSD",
                     lr_wsd_decay_iters=12, lr_wsd_decay_style="cosine", rampup_batch_size=None).items():
        setattr(args, k, v)
    for g in cs["optimizer"]["optimizer"]["param_groups"]:
        g.update(step=step, max_lr=BASE["max_lr"], min_lr=BASE["min_lr"], lr=lr)
    cs["iteration"] = step
    cs["opt_param_scheduler"] = sched_sd
    return cs


@pytest.fixture(scope="module")
def converted_with_scheduler(tmp_path_factory):
    """A synthetic tp1/dp1 checkpoint whose common_state has Megatron's scheduler state_dict, via real DCP."""
    import convert_synth as synth
    from converters.megatron.convert import ConvertOptions
    from converters.megatron.convert_entry import convert

    step = 31   # inside the WSD anneal (warmup 5 iterations, decay ends at 40, anneal starts at 28)
    kw = _kwargs(dict(lr_decay_style="WSD", wsd_decay_steps=12 * GBS, lr_wsd_decay_style="cosine"))
    sd = {"max_lr": kw["max_lr"], "lr_warmup_steps": kw["lr_warmup_steps"], "num_steps": step * GBS,
          "lr_decay_style": "WSD", "lr_decay_steps": kw["lr_decay_steps"], "min_lr": kw["min_lr"],
          "start_wd": 0.1, "end_wd": 0.1, "wd_incr_style": "constant", "wd_incr_steps": 40 * GBS}
    d = tmp_path_factory.mktemp("sched")
    src = str(d / "src")
    st = synth.state(0)
    entries = synth.model_space_entries(st, 1, True)
    synth.save(src, entries, {}, _common_state(sd, step, float(_reference_lrs(kw, step * GBS, 1)[0])), 1)
    with open(os.path.join(src, "metadata.json"), "w") as f:
        f.write('{"sharded_backend": "torch_dist", "sharded_backend_version": 1}')
    dst = str(d / "dst")
    convert(src, dst, ConvertOptions(workers=1))
    return dst, kw, step


@pytest.mark.slow
def test_converted_manifest_carries_the_schedule(converted_with_scheduler):
    from bridge.store.reader import open_checkpoint

    dst, kw, step = converted_with_scheduler
    ck = open_checkpoint(dst)
    assert int(ck.read(("opt_state", "0", "count"))) == step
    raw = json.load(open(os.path.join(dst, "_METADATA")))["custom_metadata"]["gtp_bridge"]
    rec = raw["extra"]["megatron"]["scheduler"]
    assert rec["num_steps"] == step * GBS and rec["increment"] == GBS and rec["at_count"] == step
    assert rec["wsd_decay_steps"] == 12 * GBS and rec["lr_wsd_decay_style"] == "cosine"
    assert rec["init_lr"] == kw["init_lr"]
    sched = megatron_lr_schedule(scheduler_of(ck.manifest))
    counts = np.arange(step, ITERS)
    want = _reference_lrs(kw, step * GBS, len(counts))
    got = _schedule_values(sched, counts)
    assert np.max(np.abs(got - want)) <= _tol(kw)
    assert np.max(np.abs(_schedule_values(sched, counts + 1) - want)) > 50 * _tol(kw)


def test_to_megatron_writes_megatrons_scheduler_state_back(converted_with_scheduler, tmp_path):
    """convert -> to-megatron gives back the scheduler state_dict Megatron saved (same count)."""
    from converters.megatron.read.dcp import DcpCheckpoint
    from converters.megatron.write.torch_dist import MegatronTarget
    from converters.megatron.write.to_megatron import to_megatron

    dst, kw, step = converted_with_scheduler
    out = str(tmp_path / "megatron")
    to_megatron(dst, out, MegatronTarget(tp=1))
    got = DcpCheckpoint(out).common_state()["opt_param_scheduler"]
    # What the source checkpoint held (the fixture's Megatron state_dict), field by field.
    assert got == {"max_lr": kw["max_lr"], "lr_warmup_steps": kw["lr_warmup_steps"], "num_steps": step * GBS,
                   "lr_decay_style": "WSD", "lr_decay_steps": kw["lr_decay_steps"], "min_lr": kw["min_lr"],
                   "start_wd": 0.1, "end_wd": 0.1, "wd_incr_style": "constant", "wd_incr_steps": 40 * GBS}


@pytest.mark.slow
def test_optimizer_from_manifest_applies_megatron_lr_at_the_restored_count(converted_with_scheduler):
    """One optax update from count=step uses exactly the lr Megatron would use for its next update."""
    from bridge.store.reader import open_checkpoint

    dst, kw, step = converted_with_scheduler
    manifest = open_checkpoint(dst).manifest
    tx = optimizer_from_manifest(manifest)
    params = {"w": jnp.linspace(-1.0, 1.0, 12, dtype=jnp.float32).reshape(3, 4)}
    grads = {"w": jnp.cos(jnp.arange(12, dtype=jnp.float32)).reshape(3, 4)}

    for i, lr in enumerate(_reference_lrs(kw, step * GBS, 8)):
        # a plain adamw with Megatron's lr for this update as a constant, from the same state
        ref = optax.adamw(float(np.float32(lr)), b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1)
        want, _ = ref.update(grads, _at_count(ref.init(params), step + i), params)
        got, _ = tx.update(grads, _at_count(tx.init(params), step + i), params)
        np.testing.assert_allclose(np.asarray(got["w"]), np.asarray(want["w"]), rtol=2e-6, atol=0)
    # and a caller's learning_rate still wins over the recorded schedule
    const = optimizer_from_manifest(manifest, learning_rate=0.5)
    s0 = const.init(params)
    u, _ = const.update(grads, s0, params)
    u_ref, _ = optax.adamw(0.5, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1).update(grads, s0, params)
    np.testing.assert_array_equal(np.asarray(u["w"]), np.asarray(u_ref["w"]))


def test_scheduler_record_reads_old_key_names():
    """OptimizerParamScheduler.load_state_dict's legacy keys (start_lr, warmup_iter, end_iter, ...)."""
    sd = {"start_lr": 1e-3, "min_lr": 1e-5, "warmup_iter": 80, "end_iter": 800, "decay_style": "cosine",
          "num_iters": 240}
    args = {"global_batch_size": 8, "train_iters": 100, "lr_warmup_init": 0.0}
    rec = SchedulerRecord.from_json(scheduler_record({"opt_param_scheduler": sd}, args, 30))
    assert (rec.max_lr, rec.lr_warmup_steps, rec.lr_decay_steps, rec.lr_decay_style, rec.num_steps, rec.at_count) == \
        (1e-3, 80, 800, "cosine", 240, 30)
    assert scheduler_record({"iteration": 3}, args, 3) is None


@pytest.mark.slow
def test_groups_with_their_own_max_min_lr_follow_their_own_schedule():
    """Megatron param groups carry max_lr/min_lr (decoupled lr, muP); get_lr reads them per group."""
    from bridge.format.manifest import Manifest, OptimizerConfig

    kw = _kwargs(dict(lr_decay_style="cosine"))
    rec = _record(kw, 9 * GBS, 9).to_json()
    own = {"max_lr": 1e-2, "min_lr": 1e-3}
    groups = [{"max_lr": kw["max_lr"], "min_lr": kw["min_lr"], "wd_mult": 1.0, "lr_mult": 1.0},
              {**own, "wd_mult": 1.0, "lr_mult": 1.0, "params": ["emb"]}]
    m = Manifest(optimizer=OptimizerConfig(lr=kw["max_lr"], betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0,
                                           step=9, groups=groups), extra={"megatron": {"scheduler": rec}})
    tx = optimizer_from_manifest(m)
    params = {"emb": jnp.ones((4, 2), jnp.float32), "w": jnp.full((2, 3), -0.5, jnp.float32)}
    grads = jax.tree_util.tree_map(lambda p: jnp.sin(jnp.arange(p.size, dtype=jnp.float32)).reshape(p.shape) + 0.1,
                                   params)
    for i in range(0, 40, 3):   # warmup end, decay, past decay end
        s = MegatronScheduler(**kw)
        s.step((9 + i) * GBS)
        got, _ = tx.update(grads, _at_count(tx.init(params), 9 + i), params)
        for name, lr in (("emb", s.get_lr(own)), ("w", s.get_lr())):
            ref = optax.adamw(float(np.float32(lr)), b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.0)
            want, _ = ref.update(grads, _at_count(ref.init(params), 9 + i), params)
            np.testing.assert_allclose(np.asarray(got[name]), np.asarray(want[name]), rtol=2e-6, err_msg=f"{name} {i}")
    with pytest.raises(BridgeError, match="lists no params"):
        optimizer_from_manifest(Manifest(optimizer=OptimizerConfig(groups=[{**own}]),
                                         extra={"megatron": {"scheduler": rec}}))


def test_samples_at_matches_megatron_num_steps_after_updates():
    kw = _kwargs(dict(lr_decay_style="linear"))
    s = MegatronScheduler(**kw)
    s.step(13 * GBS + 4)
    rec = _record(kw, s.num_steps, 11)
    for _ in range(7):
        s.step(GBS)
    assert samples_at(rec, 18) == s.num_steps


@needs_mc
@pytest.mark.parametrize("name,case", CASES[1:5], ids=[c[0] for c in CASES[1:5]])
def test_written_back_state_dict_resumes_real_megatron_at_the_schedule(name, case, monkeypatch):
    """scheduler_state_dict(rec, count) loaded by the real OptimizerParamScheduler sets schedule(count)."""
    import torch

    real = _real_megatron_module(monkeypatch)
    kw = _kwargs(case)
    rec = _record(kw, 13 * GBS, 13, wd=dict(start_wd=0.1, end_wd=0.1, wd_incr_steps=ITERS * GBS,
                                             wd_incr_style="constant"))
    sched = megatron_lr_schedule(rec)
    for count in (13, 21, 44):
        opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=0.0)
        s = real.OptimizerParamScheduler(opt, start_wd=0.1, end_wd=0.1, wd_incr_steps=ITERS * GBS,
                                         wd_incr_style="constant", **kw)
        s.load_state_dict(scheduler_state_dict(rec, count))
        assert abs(opt.param_groups[0]["lr"] - float(sched(count))) <= _tol(kw), (name, count)


@pytest.mark.slow
def test_restored_state_continues_megatron_schedule(converted_with_scheduler):
    """Real restore (8 devices, 2x4 mesh) into the manifest's optimizer: every count, the schedule's
    too, is the checkpoint's step, and the next update uses the lr Megatron would use next."""
    from jax.sharding import Mesh

    from bridge.jaxside import restore
    from bridge.jaxside.abstract import PARAMS, stored_arrays
    from bridge.jaxside.keypaths import nested_from_paths

    dst, kw, step = converted_with_scheduler
    stored = stored_arrays(dst)
    abstract = nested_from_paths({p: jax.ShapeDtypeStruct(a.shape, jnp.float32)
                                  for p, a in stored.section(PARAMS).items()})
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("fsdp", "tp"))
    tx = optimizer_from_manifest(stored.custom_metadata["gtp_bridge"])
    r = restore(dst, mesh=mesh, optimizer=jax.eval_shape(tx.init, abstract))
    is_sched = lambda x: isinstance(x, optax.ScaleByScheduleState)  # noqa: E731
    sched_states = [x for x in jax.tree_util.tree_leaves(r.opt_state, is_leaf=is_sched) if is_sched(x)]
    assert sched_states and all(int(s.count) == step for s in sched_states)
    # the same restored state under a constant lr equal to Megatron's next lr gives the same update
    lr = float(np.float32(_reference_lrs(kw, step * GBS, 1)[0]))
    const = optimizer_from_manifest(r.manifest, learning_rate=lr)
    rc = restore(dst, mesh=mesh, optimizer=jax.eval_shape(const.init, abstract), items=("params", "opt_state"))
    grads = jax.tree.map(lambda x: jnp.full_like(x, 1e-3) + 1e-4 * x, r.params)
    got, _ = jax.jit(tx.update)(grads, r.opt_state, r.params)
    want, _ = jax.jit(const.update)(grads, rc.opt_state, rc.params)
    for (p, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-6, atol=1e-6 * lr, err_msg=jax.tree_util.keystr(p))
    # one step late (the schedule read at step + 1) is visibly different
    late = optimizer_from_manifest(r.manifest, learning_rate=float(_reference_lrs(kw, (step + 1) * GBS, 1)[0]))
    off, _ = late.update(grads, rc.opt_state, rc.params)
    assert max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree_util.tree_leaves(off),
                                                               jax.tree_util.tree_leaves(want))) > 1e-3 * lr
