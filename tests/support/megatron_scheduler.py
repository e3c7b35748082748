"""Megatron-LM's own learning-rate scheduler, as an independent reference for the scheduler state
gtp-bridge builds (to-megatron) and translates (to-maxtext): megatron-core 0.19.2's vendored
`OptimizerParamScheduler` and Megatron-LM's `get_optimizer_param_scheduler` (tests/fixtures/megatron_core_src)."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import types

import torch

MC = os.environ.get("MEGATRON_CORE_SRC") or os.path.join(os.path.dirname(__file__), "..", "fixtures", "megatron_core_src")


def vendored_megatron(monkeypatch):
    """(OptimizerParamScheduler, get_optimizer_param_scheduler, validate) from the vendored 0.19.2 files."""
    utils = types.ModuleType("megatron.core.utils")
    utils.log_single_rank = lambda *a, **k: None
    for mod in ("megatron", "megatron.core"):
        monkeypatch.setitem(sys.modules, mod, sys.modules.get(mod) or types.ModuleType(mod))
    monkeypatch.setitem(sys.modules, "megatron.core.utils", utils)

    def load(rel, name):
        spec = importlib.util.spec_from_file_location(name, os.path.join(MC, rel))
        m = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(m)
        return m

    ops = load("megatron/core/optimizer_param_scheduler.py", "mc_ops_handoff")
    tr = load("megatron/training/scheduler_from_args.py", "mc_sched_from_args")
    tr.OptimizerParamScheduler = ops.OptimizerParamScheduler
    tr.update_train_iters = lambda args: None  # sets train_iters only; the scheduler does not read it
    return ops.OptimizerParamScheduler, tr


def megatron_args(**given) -> argparse.Namespace:
    """Megatron-LM's parsed args: its parser's defaults (0.19.2) + the given ones."""
    from bridge.format.scheduler_args import SCHEDULER_ARGS

    a = {d: default for d, (_, default, _) in SCHEDULER_ARGS.items()}
    a.update(given, use_checkpoint_opt_param_scheduler=False, override_opt_param_scheduler=False)
    return argparse.Namespace(**a)


def real_scheduler(tr, args: argparse.Namespace):
    """Megatron-LM's scheduler for `args` over a real torch optimizer (a copy of args: it mutates them)."""
    args = argparse.Namespace(**vars(args))
    tr._validate_weight_decay_args(args)
    tr.get_args = lambda: args
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=0.0)
    return tr.get_optimizer_param_scheduler(opt), opt
