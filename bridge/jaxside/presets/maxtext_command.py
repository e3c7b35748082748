"""The MaxText command `to-maxtext` prints: one line that a shell runs as printed (pure text, no I/O).

MaxText (0.2.5) resumes from `<base_output_directory>/<run_name>/checkpoints/` (its `checkpoint_dir`,
always that path) and requires an absolute `base_output_directory` ("Checkpoint path should be
absolute"). Its config argument `src/maxtext/configs/base.yml` is the path MaxText's own docs use:
in a source checkout it is that file, and for an installed package `pyconfig.resolve_config_path`
maps it onto the package's own `maxtext/configs/base.yml`, so the line works in both. Every
`key=value` is shell-quoted (`'mlp_activations=["silu", "linear"]'` must reach MaxText as one
argument). A local try on a CPU needs a few more settings (`CPU_SETTINGS`), printed apart because a
real run on accelerators must not have them.
"""

from __future__ import annotations

import json
import os
import shlex
from dataclasses import dataclass
from typing import Any, Mapping

TRAIN_MODULE = "maxtext.trainers.pre_train.train"
BASE_CONFIG = "src/maxtext/configs/base.yml"
CHECKPOINTS = "checkpoints"   # MaxText's checkpoint_dir = base_output_directory/run_name/checkpoints

#: what a CPU try needs beyond the run's overrides: no accelerator, no jax.distributed, an attention
#: kernel CPUs have, a synchronous save (the process exits right after), a tiny batch
CPU_SETTINGS: dict[str, Any] = {"hardware": "cpu", "skip_jax_distributed_system": True, "attention": "dot_product",
                                "async_checkpointing": False, "per_device_batch_size": 1}
CPU_SEQUENCE = 16   # max_target_length for the CPU try when the overrides do not set one


@dataclass(frozen=True)
class MaxTextCommand:
    """`command`: MaxText's trainer resuming from the checkpoint root, as one shell line; `cpu_settings`:
    what to append to it for a local try on a CPU (one training step, MaxText's synthetic data)."""

    command: str
    cpu_settings: str


def setting(key: str, value: Any) -> str:
    """One MaxText `key=value` argument as MaxText parses it (lists and booleans as JSON / YAML).

    >>> setting("mlp_activations", ["silu", "linear"]), setting("scan_layers", True), setting("adam_eps", 1e-08)
    ('mlp_activations=["silu", "linear"]', 'scan_layers=true', 'adam_eps=1e-08')
    """
    return f"{key}={json.dumps(value) if isinstance(value, (list, bool)) else value}"


def quoted(settings: Mapping[str, Any]) -> str:
    """`settings` as shell words, each quoted only where a shell would split or expand it.

    >>> quoted({"mlp_activations": ["silu", "linear"], "vocab_size": 72})
    '\\'mlp_activations=["silu", "linear"]\\' vocab_size=72'
    """
    return " ".join(shlex.quote(setting(k, v)) for k, v in settings.items())


def run_location(root: str) -> tuple[str, str] | None:
    """(base_output_directory, run_name) that make MaxText's checkpoint_dir the root `root`, or None when
    `root` is not `<dir>/<run>/checkpoints`.

    >>> run_location("/data/mt/myrun/checkpoints"), run_location("/data/ckpts")
    (('/data/mt', 'myrun'), None)
    """
    root = os.path.normpath(root)
    run_dir = os.path.dirname(root)
    if os.path.basename(root) != CHECKPOINTS or not os.path.basename(run_dir) or not os.path.isabs(root):
        return None
    return os.path.dirname(run_dir), os.path.basename(run_dir)


def maxtext_command(root: str, overrides: Mapping[str, Any], resume_step: int) -> MaxTextCommand | None:
    """The command that makes MaxText resume from the checkpoint root `root` (absolute) with `overrides`
    (the model and optimizer settings), and the settings of a one-step CPU try from `resume_step`.
    None when MaxText cannot resume from `root` (see `run_location`).

    >>> c = maxtext_command("/data/mt/myrun/checkpoints", {"vocab_size": 72, "mlp_activations": ["silu", "linear"]}, 3)
    >>> c.command
    'python -m maxtext.trainers.pre_train.train src/maxtext/configs/base.yml base_output_directory=/data/mt run_name=myrun vocab_size=72 \\'mlp_activations=["silu", "linear"]\\''
    >>> c.cpu_settings
    'hardware=cpu skip_jax_distributed_system=true attention=dot_product async_checkpointing=false per_device_batch_size=1 max_target_length=16 steps=4'
    """
    where = run_location(root)
    if where is None:
        return None
    base, run = where
    head = ["python", "-m", TRAIN_MODULE, BASE_CONFIG]
    command = " ".join(shlex.quote(w) for w in head) + " " + quoted({"base_output_directory": base, "run_name": run})
    if overrides:
        command += " " + quoted(overrides)
    cpu = dict(CPU_SETTINGS)
    if "max_target_length" not in overrides:
        cpu["max_target_length"] = CPU_SEQUENCE
    cpu["steps"] = int(resume_step) + 1   # MaxText's `steps` counts from 0: one step after the resumed one
    return MaxTextCommand(command, quoted(cpu))
