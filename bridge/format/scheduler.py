"""The Megatron scheduler record the manifest keeps (`extra.megatron.scheduler`).

The converter fills it from Megatron's `OptimizerParamScheduler` state and args
(`converters.megatron.convert.scheduler_record`); `bridge.lr_schedule` turns it into optax schedules
and `to-megatron` writes the scheduler state back from it.
"""

from __future__ import annotations

from dataclasses import KW_ONLY, asdict, dataclass, field, fields
from typing import Mapping

from bridge.errors import BridgeError

RECORD_VERSION = 1
DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")
WD_STYLES = ("constant", "linear", "cosine")


@dataclass(frozen=True)
class SchedulerRecord:
    """Megatron `OptimizerParamScheduler` state (all step quantities in samples) as the manifest keeps it.

    `init_lr`, `wsd_decay_steps`, `lr_wsd_decay_style` are not in Megatron's scheduler state_dict;
    the converter takes them from the run's args (`lr_warmup_init`, `lr_wsd_decay_iters` x
    `global_batch_size` or `lr_wsd_decay_samples`, `lr_wsd_decay_style`).
    """

    # Declaration order is the JSON key order in the manifest (asdict): keep it, so checkpoints stay
    # byte-identical; fields after num_steps are keyword-only.
    version: int = field(default=RECORD_VERSION, kw_only=True)
    max_lr: float
    min_lr: float
    lr_warmup_steps: float
    lr_decay_steps: float
    lr_decay_style: str
    num_steps: int
    _: KW_ONLY
    start_wd: float | None = None
    end_wd: float | None = None
    wd_incr_steps: float | None = None
    wd_incr_style: str | None = None
    init_lr: float = 0.0
    wsd_decay_steps: float | None = None
    lr_wsd_decay_style: str | None = None
    increment: int
    rampup_samples: int | None = None
    at_count: int

    def to_json(self) -> dict:
        """JSON-ready dict."""
        return asdict(self)

    @classmethod
    def from_json(cls, d: Mapping) -> "SchedulerRecord":
        """Parse and validate (Megatron's own constructor assertions); BridgeError when malformed."""
        if not isinstance(d, Mapping):
            raise BridgeError("manifest scheduler record is not a JSON object; re-convert the checkpoint")
        if int(d.get("version", RECORD_VERSION)) > RECORD_VERSION:
            raise BridgeError(f"manifest scheduler record version {d.get('version')} is newer than this gtp-bridge "
                              f"supports ({RECORD_VERSION}); upgrade gtp-bridge")
        names = {f.name for f in fields(cls)}
        try:
            rec = cls(**{k: v for k, v in d.items() if k in names})
        except TypeError as e:
            raise BridgeError(f"manifest scheduler record is incomplete ({e}); re-convert the checkpoint") from None
        rec.validate()
        return rec

    def validate(self) -> None:
        """Refuse what Megatron's scheduler would refuse, with one line naming the field."""
        bad = None
        if self.lr_decay_style not in DECAY_STYLES:
            bad = f"lr_decay_style {self.lr_decay_style!r} is not one of {DECAY_STYLES}"
        elif not (0.0 <= self.min_lr <= self.max_lr) or self.init_lr > self.max_lr:
            bad = f"lrs must satisfy 0 <= min_lr <= max_lr and init_lr <= max_lr (got {self.min_lr}, {self.max_lr}, {self.init_lr})"
        elif not (self.lr_decay_steps > 0 and self.lr_warmup_steps < self.lr_decay_steps):
            bad = f"need 0 < lr_decay_steps and lr_warmup_steps < lr_decay_steps (got {self.lr_warmup_steps}, {self.lr_decay_steps})"
        elif self.increment is None or int(self.increment) <= 0:
            bad = f"increment (global batch size) must be a positive int, got {self.increment}"
        elif self.rampup_samples is not None and self.num_steps < self.rampup_samples:
            bad = (f"batch-size ramp-up was still running at the checkpoint ({self.num_steps} of "
                   f"{self.rampup_samples} samples), so later increments are not the global batch size")
        elif self.lr_decay_style == "WSD" and (self.wsd_decay_steps is None or self.wsd_decay_steps <= 0
                                               or self.lr_wsd_decay_style not in WSD_STYLES):
            bad = f"WSD needs wsd_decay_steps > 0 and lr_wsd_decay_style in {WSD_STYLES}"
        elif self.wd_incr_style is not None and self.wd_incr_style not in WD_STYLES:
            bad = f"wd_incr_style {self.wd_incr_style!r} is not one of {WD_STYLES}"
        if bad:
            raise BridgeError(f"manifest scheduler record: {bad}; fix the record or pass learning_rate= yourself")
