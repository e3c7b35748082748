"""A checkpoint that records no weight decay resumes with the same one whichever side reads it.

The rule is Megatron's: megatron-core's `OptimizerConfig.weight_decay` defaults to 0.01
(megatron/core/optimizer/optimizer_config.py), as Megatron-LM's `--weight-decay` does. The JAX
restore (`adam_hparams`), the live reload (`reload_state`) and `to-megatron`'s param groups all read
it through `OptimizerConfig.with_defaults`.
"""

from __future__ import annotations

import numpy as np

from bridge.format.manifest import Manifest, OptimizerConfig

MEGATRON_DEFAULT_WEIGHT_DECAY = 0.01   # megatron-core OptimizerConfig.weight_decay, written out independently
MEGATRON_DEFAULT_BETAS = (0.9, 0.999)  # adam_beta1, adam_beta2
MEGATRON_DEFAULT_EPS = 1e-8            # adam_eps


def _unrecorded() -> Manifest:
    return Manifest(optimizer=OptimizerConfig(lr=3e-4, step=5))   # lr and step only: no betas, eps, weight decay


def test_jax_restore_uses_megatrons_defaults():
    from bridge.jaxside.manifest_view import adam_hparams

    h = adam_hparams(_unrecorded())
    assert (h.weight_decay, (h.b1, h.b2), h.eps) == (MEGATRON_DEFAULT_WEIGHT_DECAY, MEGATRON_DEFAULT_BETAS,
                                                     MEGATRON_DEFAULT_EPS)


def test_to_megatron_param_groups_use_megatrons_defaults():
    from converters.megatron.write.objects import param_groups

    groups = param_groups(_unrecorded(), step=5)
    decayed, not_decayed = groups   # Megatron's two default groups: wd_mult 1 and wd_mult 0
    assert decayed["weight_decay"] == MEGATRON_DEFAULT_WEIGHT_DECAY and decayed["wd_mult"] == 1.0
    assert decayed["betas"] == MEGATRON_DEFAULT_BETAS and decayed["eps"] == MEGATRON_DEFAULT_EPS
    assert not_decayed["wd_mult"] == 0.0


def test_reload_uses_megatrons_defaults(tmp_path):
    from bridge.layout import ParallelLayout
    from bridge.live.reload import reload_state
    from bridge.store import save_checkpoint
    from bridge.testing.trainer import ReferenceTrainer

    dst = str(tmp_path / "ck")
    save_checkpoint(dst, {("params", "w"): np.zeros((2, 2), np.float32)}, manifest=_unrecorded())
    run = ReferenceTrainer(ParallelLayout(), init=False).live_run()
    opt = reload_state(dst, run, []).optimizer
    assert (opt.weight_decay, tuple(opt.betas), opt.eps) == (MEGATRON_DEFAULT_WEIGHT_DECAY, MEGATRON_DEFAULT_BETAS,
                                                             MEGATRON_DEFAULT_EPS)


def test_a_recorded_weight_decay_is_kept_by_every_reader():
    from bridge.jaxside.manifest_view import adam_hparams
    from converters.megatron.write.objects import param_groups

    m = Manifest(optimizer=OptimizerConfig(lr=3e-4, step=5, weight_decay=0.0))
    assert adam_hparams(m).weight_decay == 0.0
    assert param_groups(m, step=5)[0]["weight_decay"] == 0.0
