"""Megatron's learning-rate schedule in MaxText 0.2.5's settings, and back (pure: no I/O).

MaxText builds its schedule from a few config keys (`maxtext.utils.maxtext_utils.
create_learning_rate_schedule`): a linear warmup from 0 over `W = int(S * warmup_steps_fraction)`
steps (S = `learning_rate_schedule_steps`), then either a cosine from `learning_rate` to
`learning_rate * learning_rate_final_fraction` whose last value falls on step S - 1, or WSD (stable,
then a linear / cosine decay over `int(S * wsd_decay_steps_fraction)` steps ending on step S - 1),
then 0 from step S on (when `steps` > S). optax calls it with the optimizer's count before the
update, the count `to-maxtext` writes (the Megatron run's iteration).

Megatron's `get_lr` works in samples (`num_steps`); at optax count c the run has consumed
`samples(c) = num_steps + (c - at_count) * global_batch_size` (`bridge.lr_schedule.samples_at`).
In count units, warmup ends at `w = lr_warmup_steps / G - off` and decay at `d = lr_decay_steps / G - off`
(`off = num_steps / G - at_count`, 0 for an unbroken run). MaxText gives Megatron's value at every
following count when: w and d are whole counts; S = d + 1 (Megatron's cosine/linear ratio is
(c - w) / (d - w), MaxText's (c - W) / (S - 1 - W)); the decay style is cosine, linear (WSD with no
stable phase and linear decay) or WSD with a linear or cosine anneal; and, while still warming up,
Megatron warms up from 0 with no offset. Where the lr stays constant over every following count
(constant style past warmup, or past the decay's end at min_lr), a constant schedule is exact.

    >>> from bridge.format.scheduler import SchedulerRecord
    >>> r = SchedulerRecord(1e-3, 1e-4, 10 * 8, 100 * 8, "cosine", num_steps=3 * 8, increment=8, at_count=3)
    >>> s = maxtext_schedule(r, 3, horizon=100)   # a 100-iteration run
    >>> s.settings["lr_schedule_type"], s.settings["learning_rate_schedule_steps"], s.warmup_steps, s.notes
    ('cosine', 101, 10, ())
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Mapping

from bridge.errors import BridgeError
from bridge.format.scheduler import SchedulerRecord

#: MaxText's schedule keys that `maxtext_schedule` sets (the rest of base.yml's schedule keys are not read)
KEYS = ("learning_rate", "lr_schedule_type", "learning_rate_schedule_steps", "warmup_steps_fraction",
        "wsd_decay_steps_fraction", "wsd_decay_style", "learning_rate_final_fraction")
# MaxText's steps are int32 counts: a constant schedule's length when the run's end is unknown
_LONGEST = 2**31 - 1


class ScheduleGap(BridgeError):
    """Megatron's schedule cannot be expressed in MaxText's settings; the message names the difference."""


@dataclass(frozen=True)
class MaxTextSchedule:
    """MaxText's schedule settings (`settings`, keys `KEYS`) and what they mean in MaxText's steps."""

    settings: dict[str, Any]
    warmup_steps: int = 0
    notes: tuple[str, ...] = field(default=())


def fraction_for(steps: int, n: int) -> float:
    """A float f with `int(steps * f) == n` as MaxText computes it (Python floats), the smallest such
    near n / steps (a plain n / steps can land one below).

    >>> fraction_for(101, 10), int(101 * fraction_for(101, 10))
    (0.09900990099009901, 10)
    """
    f = n / steps
    for _ in range(8):
        if int(steps * f) == n:
            return f
        f = math.nextafter(f, math.inf) if int(steps * f) < n else math.nextafter(f, -math.inf)
    raise ScheduleGap(f"no MaxText fraction of {steps} steps gives {n} steps")  # pragma: no cover - not seen


def _constant(lr: float) -> dict[str, Any]:
    """A constant lr: WSD with no warmup and no decay, whatever MaxText's `steps`."""
    return {"learning_rate": lr, "lr_schedule_type": "wsd", "learning_rate_schedule_steps": -1,
            "warmup_steps_fraction": 0.0, "wsd_decay_steps_fraction": 0.0, "wsd_decay_style": "linear",
            "learning_rate_final_fraction": 1.0}


def _whole(x: Fraction, what: str, samples: float, g: int) -> int:
    if x.denominator != 1:
        raise ScheduleGap(f"the Megatron run's {what} ends at sample {samples}, not on an iteration boundary "
                          f"({g} samples per iteration); MaxText counts whole steps")
    return int(x)


def horizon_of(rec: SchedulerRecord, train_iters: int | None = None) -> int | None:
    """The optax count at which the Megatron run ends (its last update uses count - 1): `train_iters`
    when given, else the weight-decay horizon Megatron-LM sets to the run's length (`wd_incr_steps` =
    train_iters x G, or train_samples); None when neither is known or it is not a whole count.

    >>> horizon_of(SchedulerRecord(1.0, 0.0, 0, 80, "linear", num_steps=24, increment=8, at_count=3,
    ...                            wd_incr_steps=96, wd_incr_style="constant", start_wd=0.1, end_wd=0.1))
    12
    """
    if train_iters is not None:
        return int(train_iters)
    if not rec.wd_incr_steps:
        return None
    off = Fraction(int(rec.num_steps), int(rec.increment)) - int(rec.at_count)
    h = Fraction(rec.wd_incr_steps) / int(rec.increment) - off
    return int(h) if h.denominator == 1 and h > 0 else None


def maxtext_schedule(rec: SchedulerRecord, count: int, horizon: int | None = None) -> MaxTextSchedule:
    """MaxText's settings under which the lr of every update from optax count `count` on (up to the
    run's end `horizon`, see `horizon_of`) equals Megatron's `get_lr`; `ScheduleGap` naming the
    difference where MaxText cannot express it."""
    rec.validate()
    g = int(rec.increment)
    hi, lo, init = float(rec.max_lr), float(rec.min_lr), float(rec.init_lr)
    off = Fraction(int(rec.num_steps), g) - int(rec.at_count)
    w_exact = Fraction(rec.lr_warmup_steps) / g - off
    d_exact = Fraction(rec.lr_decay_steps) / g - off
    style = rec.lr_decay_style
    _check_weight_decay(rec, count, horizon, off)
    warming = rec.lr_warmup_steps > 0 and count < w_exact
    if not warming and style == "constant":
        return MaxTextSchedule(_constant(hi))
    if style != "constant" and count > d_exact:
        return MaxTextSchedule(_constant(lo))   # Megatron holds min_lr after the decay
    if warming and init != 0.0:
        raise ScheduleGap(f"the Megatron run warms up from lr_warmup_init {init}, MaxText's warmup starts at 0 "
                          f"(the run is at iteration {count} of a {w_exact}-iteration warmup)")
    if warming and off != 0:
        raise ScheduleGap(f"the Megatron run's sample count is {rec.num_steps} at iteration {rec.at_count}, not "
                          f"iteration x {g}: its warmup ramp is offset from MaxText's, which starts at step 0")
    w = _whole(w_exact, "warmup", rec.lr_warmup_steps, g)
    if style == "constant":   # still warming up: warm up, then hold max_lr to the run's end
        steps = max(horizon, w + 1) if horizon else _LONGEST
        out = _constant(hi) | {"learning_rate_schedule_steps": steps, "warmup_steps_fraction": fraction_for(steps, w)}
        return MaxTextSchedule(out, w)
    if style == "inverse-square-root":
        raise ScheduleGap("the Megatron run decays its lr as inverse-square-root; MaxText has cosine and WSD only")
    if w < 0:
        raise ScheduleGap(f"the Megatron run's warmup ended before MaxText's step 0 (at {w}): its sample count "
                          f"{rec.num_steps} at iteration {rec.at_count} is ahead of iteration x {g}")
    d = _whole(d_exact, "decay", rec.lr_decay_steps, g)
    steps = d + 1                     # MaxText's last decay value falls on step S - 1 = d, Megatron's on d
    notes = _tail(lo, d, horizon)
    base = {"learning_rate": hi, "learning_rate_schedule_steps": steps, "warmup_steps_fraction": fraction_for(steps, w),
            "learning_rate_final_fraction": lo / hi if hi else 1.0}
    if style == "cosine":
        return MaxTextSchedule(base | {"lr_schedule_type": "cosine", "wsd_decay_steps_fraction": 0.0,
                                       "wsd_decay_style": "linear"}, w, notes)
    if style == "linear":             # WSD, no stable phase, a linear decay over d - w steps
        return MaxTextSchedule(_wsd(base, steps, w, steps - w, "linear"), w, notes)
    wsd_c = _whole(Fraction(rec.wsd_decay_steps) / g, "WSD anneal", rec.lr_decay_steps - rec.wsd_decay_steps, g)
    anneal = d - wsd_c
    if anneal < w:
        raise ScheduleGap(f"the Megatron run's WSD anneal starts (iteration {anneal}) inside its warmup (ends {w}); "
                          f"MaxText's decay follows the warmup and a stable phase")
    wsd_style = rec.lr_wsd_decay_style
    if wsd_style not in ("linear", "cosine"):
        if horizon is not None and horizon - 1 <= anneal:
            wsd_style = "linear"      # the anneal is never reached: its shape does not matter
        else:
            raise ScheduleGap(f"the Megatron run anneals its lr with lr_wsd_decay_style {wsd_style}; MaxText's WSD "
                              f"decays linearly or by cosine only")
    return MaxTextSchedule(_wsd(base, steps, w, wsd_c + 1, wsd_style), w, notes)


def _wsd(base: dict, steps: int, warmup: int, decay: int, style: str) -> dict:
    """WSD settings with `warmup` and `decay` steps of `steps`; their fractions are checked by MaxText to
    sum to at most 1, so the decay's is lowered by ulps where the float sum would round above 1."""
    fw, fd = base["warmup_steps_fraction"], fraction_for(steps, decay)
    while fw + fd > 1.0 and int(steps * math.nextafter(fd, 0.0)) == decay:
        fd = math.nextafter(fd, 0.0)
    if fw + fd > 1.0:
        raise ScheduleGap(f"MaxText cannot hold a {warmup}-step warmup and a {decay}-step decay in {steps} steps "
                          f"(its fractions would sum above 1)")   # pragma: no cover - not seen
    return base | {"lr_schedule_type": "wsd", "wsd_decay_steps_fraction": fd, "wsd_decay_style": style}


def _tail(lo: float, d: int, horizon: int | None) -> tuple[str, ...]:
    """Past the decay Megatron holds min_lr; MaxText's schedule is 0 from step d + 1 on."""
    if lo == 0.0:
        return ()
    if horizon is not None and horizon - 1 > d:
        raise ScheduleGap(f"the Megatron run holds min_lr {lo} from iteration {d + 1} to its end ({horizon}); "
                          f"MaxText's schedule drops to 0 after learning_rate_schedule_steps")
    if horizon is None:
        return (f"MaxText's lr is 0 from step {d + 1} on, where Megatron's stays at min_lr {lo}: run MaxText with "
                f"steps <= {d + 1}",)
    return ()


def _check_weight_decay(rec: SchedulerRecord, count: int, horizon: int | None, off: Fraction) -> None:
    """MaxText's AdamW weight decay is constant: refuse a Megatron weight-decay increment still running."""
    if rec.wd_incr_style in (None, "constant") or rec.start_wd == rec.end_wd or not rec.wd_incr_steps:
        return
    end = Fraction(rec.wd_incr_steps) / int(rec.increment) - off
    if count < end:
        raise ScheduleGap(f"the Megatron run changes its weight decay ({rec.wd_incr_style} from {rec.start_wd} to "
                          f"{rec.end_wd} until sample {rec.wd_incr_steps}); MaxText's weight decay is constant")


# ------------------------------------------------------------------------------------ the way back


def record_from_maxtext(settings: Mapping[str, Any], count: int, global_batch_size: int,
                        steps: int | None = None, weight_decay: float | None = None) -> SchedulerRecord:
    """The Megatron scheduler (iteration-based, `global_batch_size` samples per iteration, at optax
    count `count`) whose lr equals MaxText's schedule of `settings` at every count below MaxText's
    `learning_rate_schedule_steps` (and after it when the final lr is 0); `steps` stands for MaxText's
    `steps` where the schedule length is -1; `weight_decay` the run's (constant) AdamW weight decay.
    ScheduleGap where Megatron cannot express it.

    >>> r = record_from_maxtext({"learning_rate": 1e-3, "lr_schedule_type": "cosine", "warmup_steps_fraction": 0.1,
    ...                          "learning_rate_schedule_steps": 100, "learning_rate_final_fraction": 0.1}, 5, 8)
    >>> r.lr_decay_style, r.lr_warmup_steps, r.lr_decay_steps, r.num_steps, round(r.min_lr, 9)
    ('cosine', 80, 792, 40, 0.0001)
    """
    from bridge.format.scheduler_args import record_from_args

    s = {"lr_schedule_type": "cosine", "warmup_steps_fraction": 0.1, "learning_rate_final_fraction": 0.1,
         "wsd_decay_steps_fraction": 0.1, "wsd_decay_style": "linear", "learning_rate_schedule_steps": -1,
         **settings}   # MaxText 0.2.5's base.yml defaults
    lr = float(s["learning_rate"])
    total = int(s["learning_rate_schedule_steps"])
    if total == -1:
        if steps is None:
            raise ScheduleGap("learning_rate_schedule_steps is -1 (MaxText's steps): give the run's steps too")
        total = int(steps)
    if total <= 1:
        raise ScheduleGap(f"learning_rate_schedule_steps {total}: Megatron's decay needs at least 2 steps")
    warm = int(total * float(s["warmup_steps_fraction"]))
    final = lr * float(s["learning_rate_final_fraction"])
    args = {"lr": lr, "min_lr": final, "lr_warmup_iters": warm, "lr_decay_iters": total - 1,
            "train_iters": total, "global_batch_size": int(global_batch_size)}
    if weight_decay is not None:
        args["weight_decay"] = float(weight_decay)
    kind = str(s["lr_schedule_type"]).lower()
    if kind == "cosine":
        if total - warm < 2:
            raise ScheduleGap(f"MaxText's cosine phase is {total - warm} step(s) long; Megatron's needs 2")
        args["lr_decay_style"] = "cosine"
    elif kind == "wsd":
        decay = int(total * float(s["wsd_decay_steps_fraction"]))
        style = str(s["wsd_decay_style"]).lower()
        if decay == 0 or final == lr:
            args.update(lr_decay_style="constant", min_lr=lr if decay == 0 else final)
        elif decay < 2:
            raise ScheduleGap(f"MaxText's WSD decay is {decay} step long; Megatron's anneal needs 2")
        elif total - warm - decay == 0 and style == "linear":
            args["lr_decay_style"] = "linear"
        else:
            args.update(lr_decay_style="WSD", lr_wsd_decay_iters=decay - 1, lr_wsd_decay_style=style)
    else:
        raise ScheduleGap(f"MaxText lr_schedule_type {kind!r} is not cosine or wsd")
    if args["lr_decay_style"] == "constant" and args["min_lr"] > lr:
        args["min_lr"] = lr
    return record_from_args(args, int(count))


# ------------------------------------------------------------------------------------ to-maxtext's choice


def schedule_note(rec, count: int) -> str | None:
    """Why MaxText's constant learning rate departs from the Megatron run's schedule after `count`, or None.

    The preset continues at the recorded lr (MaxText's WSD with no warmup and no decay), which is exact
    only where Megatron's own lr and weight decay stay constant from `count` on.

    >>> from bridge.format.scheduler import SchedulerRecord
    >>> r = SchedulerRecord(1e-3, 1e-5, 800, 8000, "cosine", num_steps=1600, increment=8, at_count=200)
    >>> schedule_note(r, 200).startswith("the Megatron run decays its learning rate (cosine to 1e-05")
    True
    >>> schedule_note(r, 50).startswith("the Megatron run is still warming up")   # sample 400 of 800
    True
    >>> schedule_note(SchedulerRecord(1e-3, 1e-3, 0, 0, "constant", num_steps=80, increment=8, at_count=10), 10)
    """
    from bridge.lr_schedule import samples_at

    if rec is None:
        return None
    samples = samples_at(rec, count)
    if samples < float(rec.lr_warmup_steps):
        return (f"the Megatron run is still warming up its learning rate (sample {samples} of "
                f"{rec.lr_warmup_steps}); MaxText continues at the constant recorded lr instead")
    if rec.lr_decay_style != "constant" and samples < float(rec.lr_decay_steps):
        return (f"the Megatron run decays its learning rate ({rec.lr_decay_style} to {rec.min_lr} by sample "
                f"{rec.lr_decay_steps}, now {samples}); MaxText continues at the constant recorded lr instead")
    if rec.wd_incr_style not in (None, "constant") and rec.wd_incr_steps and samples < float(rec.wd_incr_steps):
        return (f"the Megatron run changes its weight decay ({rec.wd_incr_style} to {rec.end_wd}); MaxText "
                f"continues at the constant recorded weight decay instead")
    return None


@dataclass(frozen=True)
class ScheduleOptions:
    """How `to-maxtext` sets MaxText's schedule: from `scheduler_args` (Megatron-LM's argument names, as
    `to-megatron` takes them; they win over a recorded scheduler) or the source's recorded scheduler;
    `constant_lr` keeps the recorded constant lr instead (the schedule is then not followed)."""

    scheduler_args: Mapping[str, Any] | None = None
    constant_lr: bool = False


@dataclass(frozen=True)
class PlannedSchedule:
    """MaxText settings to merge into the overrides, the Megatron record the sidecar keeps for the
    way back (None: the source's own, if any), and notes for the user."""

    settings: dict[str, Any]
    record: SchedulerRecord | None
    notes: tuple[str, ...]


def plan_schedule(recorded: SchedulerRecord | None, megatron_args: Mapping[str, Any], count: int,
                  opts: ScheduleOptions, where: str) -> PlannedSchedule:
    """MaxText's schedule for a source at optax count `count` whose manifest records `recorded` (or
    None) and Megatron args `megatron_args`. No schedule known: {} (MaxText continues at the recorded
    lr, as the overrides say). BridgeError naming the difference where MaxText cannot follow it."""
    from bridge.format.scheduler_args import record_from_args
    from bridge.lr_schedule import samples_at

    built = None
    if opts.scheduler_args:
        built = record_from_args(opts.scheduler_args, count)
        if recorded is not None:   # the samples the source consumed, as to-megatron does
            built = SchedulerRecord(**{**built.to_json(), "num_steps": samples_at(recorded, count)})
    rec = built or recorded
    if rec is None:
        return PlannedSchedule({}, None, ())
    if opts.constant_lr:
        note = schedule_note(rec, count)
        return PlannedSchedule({}, built, (note,) if note else ())
    # the run's end: from the arguments' weight-decay horizon (train_iters x G), else the recorded run's args
    iters = None if built else megatron_args.get("train_iters")
    horizon = horizon_of(rec, int(iters) if iters else None)
    try:
        s = maxtext_schedule(rec, count, horizon)
    except ScheduleGap as e:
        raise BridgeError(f"{where}: MaxText cannot follow the Megatron run's lr schedule: {e}; pass --constant-lr "
                          f"to continue at the constant recorded lr instead") from None
    return PlannedSchedule(s.settings, built, s.notes)


def with_scheduler(manifest_json: dict, record: SchedulerRecord | None) -> dict:
    """The manifest JSON the sidecar keeps, with `record` as its Megatron scheduler (`extra.megatron.scheduler`)
    when one was built from scheduler arguments: from-maxtext brings it back and to-megatron writes it."""
    if record is None:
        return manifest_json
    extra = dict(manifest_json.get("extra") or {})
    extra["megatron"] = {**(extra.get("megatron") or {}), "scheduler": record.to_json()}
    return {**manifest_json, "extra": extra}


# ------------------------------------------------------------------------------------ from-maxtext's input


@dataclass(frozen=True)
class MaxTextRunSchedule:
    """A MaxText run's schedule settings (`KEYS`, MaxText's `steps`) and its global batch size: what
    `from-maxtext` records as the Megatron scheduler (`record_at`) for `to-megatron`."""

    settings: Mapping[str, Any]
    global_batch_size: int

    def record_at(self, count: int, weight_decay: float | None = None) -> SchedulerRecord:
        """The Megatron scheduler at optax count `count` for a run of AdamW `weight_decay` (see
        `record_from_maxtext`)."""
        steps = self.settings.get("steps")
        return record_from_maxtext({k: v for k, v in self.settings.items() if k in KEYS}, count,
                                   self.global_batch_size, int(steps) if steps is not None else None, weight_decay)


def settings_from_text(text: str, where: str) -> dict[str, Any]:
    """MaxText's schedule settings (`KEYS` and `steps`) from a JSON object (e.g. to-maxtext's
    --overrides-json) or MaxText's command-line words `key=value` (other words and keys ignored).

    >>> settings_from_text("python -m maxtext.train base.yml learning_rate=3e-4 steps=100 run_name=x", "f")
    {'learning_rate': '3e-4', 'steps': '100'}
    """
    import json
    import shlex

    try:
        d = json.loads(text)
    except ValueError:
        try:
            d = dict(w.split("=", 1) for w in shlex.split(text, comments=True) if "=" in w)
        except ValueError as e:
            raise BridgeError(f"{where}: cannot read MaxText settings ({e}); give a JSON object or key=value "
                              f"words") from None
    if not isinstance(d, dict):
        raise BridgeError(f"{where}: MaxText settings must be a JSON object or key=value words")
    out = {k: v for k, v in d.items() if k in KEYS + ("steps",)}
    if "learning_rate" not in out:
        raise BridgeError(f"{where}: no learning_rate among the MaxText settings; give the run's schedule keys "
                          f"({', '.join(KEYS)}, steps)")
    return out
