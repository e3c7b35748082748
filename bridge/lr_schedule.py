"""Megatron's learning-rate (and weight-decay) schedule as optax schedules of optax's `count`.

Megatron's `OptimizerParamScheduler` counts *samples*: after each successful update it adds the
global batch size to `num_steps`, and the next update uses `get_lr(num_steps)`. The converter records
the scheduler state at the checkpoint (`extra.megatron.scheduler`, see
`bridge.format.scheduler.SchedulerRecord`) together
with `at_count`, the optax/Adam count the restored state carries. An optax schedule is called with
the count *before* the update it scales, so

    samples(count) = num_steps + (count - at_count) * increment

and `schedule(count) == get_lr(samples(count))`; for an unbroken run `num_steps = at_count *
increment`, i.e. samples = count * increment. Branch boundaries (`<=` warmup, `>` decay end, WSD
anneal start) are decided exactly in integer count space; the ratios use the default float dtype
(float32, float64 under `jax_enable_x64`), so values agree with Megatron's double-precision
`get_lr` to a few ulp of that dtype.
"""

from __future__ import annotations

import dataclasses
import math
from fractions import Fraction
from typing import Any, Callable, Mapping

from bridge.errors import BridgeError
from bridge.format.scheduler import SchedulerRecord

_I32 = 2**31 - 1


def _last_count_at_or_below(rec: SchedulerRecord, threshold: float) -> int:
    """Largest count c with samples(c) <= threshold, exact (thresholds may be fractional), int32-clipped.

    >>> r = SchedulerRecord(1.0, 0.0, 16, 80, "linear", num_steps=24, increment=8, at_count=3)
    >>> _last_count_at_or_below(r, 16), _last_count_at_or_below(r, 16.5), _last_count_at_or_below(r, 15)
    (2, 2, 1)
    """
    k = math.floor((Fraction(threshold) - int(rec.num_steps)) / int(rec.increment))
    return max(-_I32, min(_I32, k + int(rec.at_count)))


def _affine(rec: SchedulerRecord, count: Any, offset: float, scale: float) -> Any:
    """(samples(count) - offset) * scale in the default float dtype, without cancellation.

    Written as a + k*b around the anchor count r = last count with samples <= offset: k = count - r is
    an exact integer, a = (samples(r) - offset) * scale (exact in double, |a| < increment * scale),
    so ratios near a phase start are not the small difference of two large rounded numbers.
    """
    import jax.numpy as jnp

    r = _last_count_at_or_below(rec, offset)
    a = float((Fraction(samples_at(rec, r)) - Fraction(offset)) * Fraction(scale))
    k = (jnp.asarray(count) - r).astype(jnp.result_type(float))
    return a + k * (int(rec.increment) * scale)


def samples_at(rec: SchedulerRecord | Mapping, count: int) -> int:
    """Megatron's `num_steps` (samples consumed by successful updates) when optax's count is `count`.

    This is what a checkpoint written back at `count` must store as the scheduler's `num_steps`.

    >>> samples_at(SchedulerRecord(1.0, 0.0, 16, 80, "linear", num_steps=28, increment=8, at_count=3), 5)
    44
    """
    rec = rec if isinstance(rec, SchedulerRecord) else SchedulerRecord.from_json(rec)
    return int(rec.num_steps) + (int(count) - int(rec.at_count)) * int(rec.increment)


def scheduler_state_dict(rec: SchedulerRecord | Mapping, count: int) -> dict:
    """What Megatron's `OptimizerParamScheduler.state_dict()` holds once optax's count is `count`
    (for writing a checkpoint back: `common_state["opt_param_scheduler"]`).

    >>> r = SchedulerRecord(1.0, 0.0, 16, 80, "linear", num_steps=24, increment=8, at_count=3)
    >>> scheduler_state_dict(r, 5)["num_steps"]
    40
    """
    rec = rec if isinstance(rec, SchedulerRecord) else SchedulerRecord.from_json(rec)
    out = {"max_lr": rec.max_lr, "lr_warmup_steps": rec.lr_warmup_steps, "num_steps": samples_at(rec, count),
           "lr_decay_style": rec.lr_decay_style, "lr_decay_steps": rec.lr_decay_steps, "min_lr": rec.min_lr}
    if rec.wd_incr_style is not None:
        out.update(start_wd=rec.start_wd, end_wd=rec.end_wd, wd_incr_style=rec.wd_incr_style,
                   wd_incr_steps=rec.wd_incr_steps)
    return out


def megatron_lr_schedule(rec: SchedulerRecord | Mapping, max_lr: float | None = None,
                         min_lr: float | None = None) -> Callable[[Any], Any]:
    """optax schedule `count -> lr` equal to Megatron's `get_lr` at samples(count).

    `max_lr`/`min_lr` override the scheduler's (Megatron param groups' own `max_lr`/`min_lr`).

    >>> r = SchedulerRecord(1.0, 0.0, 16, 80, "linear", num_steps=24, increment=8, at_count=3)
    >>> [round(float(megatron_lr_schedule(r)(c)), 6) for c in (0, 1, 2, 3, 6, 10, 11)]
    [0.0, 0.5, 1.0, 0.875, 0.5, 0.0, 0.0]
    """
    import jax.numpy as jnp

    rec = rec if isinstance(rec, SchedulerRecord) else SchedulerRecord.from_json(rec)
    rec.validate()
    hi = float(rec.max_lr if max_lr is None else max_lr)
    lo = float(rec.min_lr if min_lr is None else min_lr)
    init = float(rec.init_lr)
    warm, decay = float(rec.lr_warmup_steps), float(rec.lr_decay_steps)
    warm_last = _last_count_at_or_below(rec, warm)
    decay_last = _last_count_at_or_below(rec, decay)
    style = rec.lr_decay_style

    def affine(count, offset: float, scale: float):
        return _affine(rec, count, offset, scale)

    def schedule(count):
        count = jnp.asarray(count)
        if style == "constant":
            lr = jnp.full_like(affine(count, 0.0, 0.0), hi)
        elif style == "inverse-square-root":
            samples = jnp.maximum(affine(count, 0.0, 1.0), 1.0)
            lr = jnp.maximum(lo, (hi * math.sqrt(max(warm, 1.0))) / jnp.sqrt(samples))
            lr = jnp.where(count > decay_last, lo, lr)
        else:
            ratio = affine(count, warm, 1.0 / (decay - warm))
            if style == "linear":
                coeff = 1.0 - ratio
            elif style == "cosine":
                coeff = 0.5 * (jnp.cos(math.pi * ratio) + 1.0)
            else:  # WSD: constant until lr_decay_steps - wsd_decay_steps, then anneal
                anneal = decay - float(rec.wsd_decay_steps)
                r = affine(count, anneal, 1.0 / float(rec.wsd_decay_steps))
                coeff = {"linear": lambda: 1.0 - r,
                         "cosine": lambda: 0.5 * (jnp.cos(math.pi * r) + 1.0),
                         "exponential": lambda: 2.0 * jnp.power(0.5, r) - 1.0,
                         "minus_sqrt": lambda: 1.0 - jnp.sqrt(jnp.maximum(r, 0.0))}[rec.lr_wsd_decay_style]()
                coeff = jnp.where(count <= _last_count_at_or_below(rec, anneal), 1.0, coeff)
            lr = lo + coeff * (hi - lo)
            lr = jnp.where(count > decay_last, lo, lr)
        if warm > 0:
            wr = affine(count, 0.0, 1.0 / warm)
            lr = jnp.where(count <= warm_last, init + (hi - init) * wr, lr)
        return lr

    # `bridge.save(lr_schedule=...)` records it, so to-megatron writes Megatron's scheduler state back
    schedule.megatron_scheduler = rec if max_lr is None and min_lr is None else \
        dataclasses.replace(rec, max_lr=hi, min_lr=lo)
    return schedule


def megatron_schedule(args: Mapping[str, Any], at_count: int = 0) -> Callable[[Any], Any]:
    """The optax schedule of a Megatron-LM run given `args` (Megatron-LM's argument names: `lr`,
    `min_lr`, `lr_decay_style`, `lr_warmup_iters`, `train_iters`, `global_batch_size`, ...; see
    `bridge.format.scheduler_args.SCHEDULER_ARGS`), for a JAX run at optax count `at_count`.
    `bridge.save(..., lr_schedule=it)` records it, so `to-megatron` writes the state that run's
    `--load` expects.

    >>> s = megatron_schedule({"lr": 1.0, "lr_decay_style": "linear", "train_iters": 10, "global_batch_size": 4})
    >>> [round(float(s(c)), 6) for c in (0, 5, 10)], s.megatron_scheduler.lr_decay_steps
    ([1.0, 0.5, 0.0], 40)
    """
    from bridge.format.scheduler_args import record_from_args

    return megatron_lr_schedule(record_from_args(args, at_count))


def recorded_scheduler(lr_schedule: Any) -> SchedulerRecord:
    """The Megatron scheduler record of a schedule `bridge.save` was given; BridgeError (naming what to
    do instead) for a schedule that is not one of Megatron's: an optax schedule is a plain function."""
    rec = getattr(lr_schedule, "megatron_scheduler", None)
    if not isinstance(rec, SchedulerRecord):
        raise BridgeError(f"lr_schedule {lr_schedule!r} is not a Megatron schedule: gtp-bridge cannot describe an "
                          f"arbitrary optax schedule in Megatron-LM's terms; build it with "
                          f"bridge.lr_schedule.megatron_schedule({{'lr': ..., 'train_iters': ..., "
                          f"'global_batch_size': ..., ...}}), or leave lr_schedule out and pass the loading run's "
                          f"--lr / --train-iters / --global-batch-size ... to to-megatron")
    return rec


def megatron_wd_schedule(rec: SchedulerRecord | Mapping) -> Callable[[Any], Any] | float | None:
    """Megatron's `get_wd` at samples(count): a float when constant, None when the record has no wd state.

    >>> r = SchedulerRecord(1.0, 0.0, 0, 80, "constant", num_steps=0, increment=8, at_count=0,
    ...                     start_wd=0.0, end_wd=0.1, wd_incr_steps=80, wd_incr_style="linear")
    >>> [round(float(megatron_wd_schedule(r)(c)), 6) for c in (0, 5, 10, 11)]
    [0.0, 0.05, 0.1, 0.1]
    """
    import jax.numpy as jnp

    rec = rec if isinstance(rec, SchedulerRecord) else SchedulerRecord.from_json(rec)
    if rec.wd_incr_style is None or rec.end_wd is None:
        return None
    end = float(rec.end_wd)
    if rec.wd_incr_style == "constant":
        return end
    start, steps = float(rec.start_wd), float(rec.wd_incr_steps)
    if steps <= 0:
        raise BridgeError(f"manifest scheduler record: wd_incr_steps must be positive for {rec.wd_incr_style!r}")
    last = _last_count_at_or_below(rec, steps)

    def schedule(count):
        count = jnp.asarray(count)
        ratio = _affine(rec, count, 0.0, 1.0 / steps)
        coeff = ratio if rec.wd_incr_style == "linear" else 0.5 * (jnp.cos(math.pi * (1.0 - ratio)) + 1.0)
        return jnp.where(count > last, end, start + coeff * (end - start))

    return schedule
