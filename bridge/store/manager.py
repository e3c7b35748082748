"""Orbax `CheckpointManager` layout: write a checkpoint as one step of a manager root, find its latest step.

A manager root holds one directory per step, named by the step number, each with the per-step
`_CHECKPOINT_METADATA` (item handlers by item name, timestamps) and the item `default/` holding the
PyTree checkpoint (what `ocp.CheckpointManager(root).save(step, args=StandardSave(tree))` writes):

    root/
      1000/
        _CHECKPOINT_METADATA   {"item_handlers": {"default": "...PyTreeCheckpointHandler"}, ...}
        default/               the logical checkpoint (_METADATA, manifest.ocdbt, ocdbt.process_*/, ...)

Writers build the step in a hidden staging directory of the root (`.gtpb-staging-<tag>/`), which
Orbax does not take for a step, and rename it to `root/<step>` once complete, so
`CheckpointManager.latest_step()` only ever sees whole steps.

>>> step_of_name("1000"), step_of_name("1000.orbax-checkpoint-tmp"), step_of_name(".gtpb-staging-7")
(1000, None, None)
"""

from __future__ import annotations

import logging
import os
import shutil
import time
import uuid
from typing import Callable, TypeVar

from bridge.errors import BridgeError
from bridge.location import local_path

ITEM = "default"
STEP_METADATA = "_CHECKPOINT_METADATA"
# The handler Orbax records for a PyTree item; its name is what Orbax 0.11/0.12 write.
PYTREE_HANDLER = "orbax.checkpoint._src.handlers.pytree_checkpoint_handler.PyTreeCheckpointHandler"
STAGING_PREFIX = ".gtpb-staging-"

log = logging.getLogger("bridge")
_noted: set[str] = set()
R = TypeVar("R")


def step_of_name(name: str) -> int | None:
    """The step a manager-root entry stands for (Orbax's default `{step}` names), or None."""
    return int(name) if name.isdigit() else None


def committed_steps(root: str) -> list[int]:
    """Steps of manager root `root` whose item holds a committed checkpoint, ascending."""
    try:
        names = os.listdir(root)
    except OSError:
        return []
    steps = []
    for name in names:
        step = step_of_name(name)
        if step is not None and os.path.isfile(os.path.join(root, name, ITEM, "_METADATA")):
            steps.append(step)
    return sorted(steps)


def resolve(location: str) -> str:
    """The checkpoint directory `location` names: itself, or a manager root's latest step (logged).

    A step directory (`root/<step>`, holding `default/`) is returned as is; the store's reader finds
    the item below it.
    """
    path = local_path(location)
    if not os.path.isdir(path) or os.path.isfile(os.path.join(path, "_METADATA")) \
            or os.path.isdir(os.path.join(path, ITEM)):
        return path
    steps = committed_steps(path)
    if not steps:
        return path
    chosen = os.path.join(path, str(steps[-1]))
    if chosen in _noted:
        return chosen
    _noted.add(chosen)  # say it once, though a command may open the checkpoint several times
    log.info(f"{path} is an Orbax CheckpointManager root; using its latest step {steps[-1]} "
             f"({len(steps)} step{'s' if len(steps) > 1 else ''}): {chosen}")
    return chosen


def staging_item_dir(root: str, tag: str) -> str:
    """Where a writer builds the item of a new step of manager root `root` (the root is created).

    Refuses a root that is itself a checkpoint. `tag` makes the staging name unique per save
    (the step, or a random token when the step is only known after writing).
    """
    root = local_path(root, "Orbax CheckpointManager root")
    if os.path.isfile(os.path.join(root, "_METADATA")) or os.path.isdir(os.path.join(root, ITEM)):
        raise BridgeError(f"{root} is a checkpoint, not an Orbax CheckpointManager root; name the root directory "
                          f"that holds the step directories")
    if os.path.exists(root) and not os.path.isdir(root):
        raise BridgeError(f"{root} is not a directory; name a CheckpointManager root directory")
    os.makedirs(root, exist_ok=True)
    staging = os.path.join(root, STAGING_PREFIX + tag)
    if os.path.lexists(staging):  # left by a crashed write of the same tag: never a step, safe to drop
        shutil.rmtree(staging)
    os.makedirs(staging)
    return os.path.join(staging, ITEM)


def check_step_free(root: str, step: int) -> None:
    """BridgeError when `root/<step>` exists (checkpoints are never overwritten)."""
    if int(step) < 0:
        raise BridgeError(f"step {step} is negative; Orbax steps are >= 0")
    if os.path.lexists(os.path.join(root, str(int(step)))):
        raise BridgeError(f"{os.path.join(root, str(int(step)))} exists; the manager root already has step {step}")


def commit_step(item_dir: str, step: int) -> str:
    """Turn the staging directory holding the written `item_dir` into step `step` of its root; returns it.

    Writes the step metadata Orbax's CheckpointManager reads, then renames the staging directory to
    `root/<step>` in one step (a crash leaves only the hidden staging directory).
    """
    from bridge.store.claim import rename_noreplace
    from bridge.store.durable import fsync_path, write_json_atomic

    staging = os.path.dirname(os.path.abspath(item_dir))
    root = os.path.dirname(staging)
    final = os.path.join(root, str(int(step)))
    try:
        check_step_free(root, step)
        now = time.time_ns()
        meta = {"item_handlers": {ITEM: PYTREE_HANDLER}, "metrics": {}, "performance_metrics": {},
                "init_timestamp_nsecs": now, "commit_timestamp_nsecs": now, "custom_metadata": {}}
        write_json_atomic(os.path.join(staging, STEP_METADATA), meta)
        try:
            rename_noreplace(staging, final)  # a step another process made meanwhile is never replaced
        except FileExistsError:
            check_step_free(root, step)  # raises, in the one wording
            raise
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    fsync_path(root)
    return final


def write_step(root: str, write: Callable[[str], R], step_of: Callable[[R], int]) -> tuple[R, str]:
    """Run `write(item_dir)` (a writer that creates a new checkpoint directory) into a staging step of
    manager root `root`, then commit it as step `step_of(result)`; returns (result, step directory).

    For writers that learn the step while writing, e.g. a conversion:
        write_step(root, lambda d: convert(src, d), lambda r: r.step)
    """
    item = staging_item_dir(root, uuid.uuid4().hex[:12])
    try:
        result = write(item)
        step = step_of(result)
        if step is None:
            raise BridgeError("the checkpoint records no step, so it cannot become a step of an Orbax "
                              "CheckpointManager root; write it to a plain directory instead")
        return result, commit_step(item, int(step))
    except BaseException:
        shutil.rmtree(os.path.dirname(item), ignore_errors=True)
        raise
