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

On object storage (s3://, gs://; no rename) the item is written in place at `root/<step>/default/`
under the store's claim (its `_METADATA` written last commits it), then the step's
`_CHECKPOINT_METADATA` and last `commit_success.txt`, the marker by which Orbax takes a step on
GCS as finalized. A step counts only once both the item's `_METADATA` and that marker are there.

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
from bridge.location import is_remote, join, local_path, location

ITEM = "default"
STEP_METADATA = "_CHECKPOINT_METADATA"
# The handler Orbax records for a PyTree item; its name is what Orbax 0.11/0.12 write.
PYTREE_HANDLER = "orbax.checkpoint._src.handlers.pytree_checkpoint_handler.PyTreeCheckpointHandler"
STAGING_PREFIX = ".gtpb-staging-"
COMMIT_SUCCESS = "commit_success.txt"   # Orbax's finalization marker of a step on object storage

log = logging.getLogger("bridge")
_noted: set[str] = set()
R = TypeVar("R")


def step_of_name(name: str) -> int | None:
    """The step a manager-root entry stands for (Orbax's default `{step}` names), or None."""
    return int(name) if name.isdigit() else None


def committed_steps(root: str) -> list[int]:
    """Steps of manager root `root` whose item holds a committed checkpoint, ascending."""
    if is_remote(root):
        from bridge.store import kvstore

        return steps_of_keys(kvstore.list_keys(root))
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


def steps_of_keys(keys) -> list[int]:
    """Committed steps in a listing of a manager root on object storage (keys relative to it):
    the item's `_METADATA` and the step's `commit_success.txt` both present.

    >>> steps_of_keys(["5/default/_METADATA", "5/commit_success.txt", "7/default/_METADATA", "x/commit_success.txt"])
    [5]
    """
    have = set(keys)
    steps = {step_of_name(k.split("/", 1)[0]) for k in have if k.endswith(f"/{ITEM}/_METADATA")}
    return sorted(s for s in steps if s is not None and f"{s}/{COMMIT_SUCCESS}" in have)


def latest_step_note(root: str, steps: list[int], chosen: str) -> None:
    """Say once (per process) which step of manager root `root` a command reads."""
    if chosen in _noted:
        return
    _noted.add(chosen)  # say it once, though a command may open the checkpoint several times
    log.info(f"{root} is an Orbax CheckpointManager root; using its latest step {steps[-1]} "
             f"({len(steps)} step{'s' if len(steps) > 1 else ''}): {chosen}")


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
    latest_step_note(path, steps, chosen)
    return chosen


def staging_item_dir(root: str, tag: str, item: str = ITEM) -> str:
    """Where a writer builds the item of a new step of manager root `root` (the root is created).

    Refuses a root that is itself a checkpoint. `tag` makes the staging name unique per save (a
    random token, after the step when it is known): two runs writing one step at once each stage
    their own. Staging directories left by killed writers of this host are removed
    (`_remove_dead_staging`); a live writer's never is.
    """
    root = local_path(root, "Orbax CheckpointManager root")
    if os.path.isfile(os.path.join(root, "_METADATA")) or os.path.isdir(os.path.join(root, ITEM)):
        raise BridgeError(f"{root} is a checkpoint, not an Orbax CheckpointManager root; name the root directory "
                          f"that holds the step directories")
    if os.path.exists(root) and not os.path.isdir(root):
        raise BridgeError(f"{root} is not a directory; name a CheckpointManager root directory")
    os.makedirs(root, exist_ok=True)
    _remove_dead_staging(root)
    staging = os.path.join(root, STAGING_PREFIX + tag)
    try:
        os.makedirs(staging)
    except FileExistsError:  # another save of this tag: its directory is never taken over
        raise BridgeError(f"{staging} exists (another save is staging there); rerun") from None
    return os.path.join(staging, item)


def _remove_dead_staging(root: str) -> None:
    """Remove the staging directories of `root` whose item's claim proves its writer is gone (same
    host, process dead or machine rebooted): never a step, and nobody else's work in progress."""
    from bridge.store.claim import TMP_SUFFIX, ClaimInfo

    for name in os.listdir(root):
        if not name.startswith(STAGING_PREFIX):
            continue
        staging = os.path.join(root, name)
        # the item's claim, whatever the item is named (`default`, MaxText's `items`)
        for entry in (os.listdir(staging) if os.path.isdir(staging) else []):
            tmp = os.path.join(staging, entry)
            info = ClaimInfo.load(tmp) if entry.endswith(TMP_SUFFIX) and os.path.isdir(tmp) else None
            if info is not None and info.dead_here(tmp):
                shutil.rmtree(staging, ignore_errors=True)
                break


def _staging_tag(step: int) -> str:
    return f"{int(step)}-{uuid.uuid4().hex[:12]}"


def begin_step(root: str, step: int, item: str = ITEM) -> str:
    """Where a writer writes the item of step `step` of manager root `root`: a hidden staging
    directory locally (`staging_item_dir`), the step's own `root/<step>/default` on object storage
    (refused when the root is itself a checkpoint or the step exists). `commit_step` then makes it
    the step."""
    if not is_remote(root):
        return staging_item_dir(root, _staging_tag(step), item)
    from bridge.store import kvstore

    root = location(root, "Orbax CheckpointManager root")
    if kvstore.exists(root, "_METADATA") or kvstore.exists(root, f"{ITEM}/_METADATA"):
        raise BridgeError(f"{root} is a checkpoint, not an Orbax CheckpointManager root; name the root prefix "
                          f"that holds the step prefixes")
    check_step_free(root, step, item)
    return join(root, str(int(step)), item)


def check_step_free(root: str, step: int, item: str = ITEM) -> None:
    """BridgeError when `root/<step>` exists (checkpoints are never overwritten).

    On object storage the step exists once its item is committed or its step metadata written; a
    partial item left by a killed writer is the item claim's to judge (removed if its writer is gone)."""
    if int(step) < 0:
        raise BridgeError(f"step {step} is negative; Orbax steps are >= 0")
    if is_remote(root):
        from bridge.store import kvstore

        prefix = join(root, str(int(step)))
        if any(kvstore.exists(prefix, k) for k in (COMMIT_SUCCESS, STEP_METADATA, f"{item}/_METADATA")):
            raise BridgeError(f"{prefix} exists; the manager root already has step {step}")
        return
    if os.path.lexists(os.path.join(root, str(int(step)))):
        raise BridgeError(f"{os.path.join(root, str(int(step)))} exists; the manager root already has step {step}")


def commit_step(item_dir: str, step: int, step_metadata: dict | None = None,
                files: dict[str, bytes] | None = None, *, commit_marker: bool = False) -> str:
    """Turn the staging directory holding the written `item_dir` into step `step` of its root; returns it.

    Writes the step metadata Orbax's CheckpointManager reads, then renames the staging directory to
    `root/<step>` in one step (a crash leaves only the hidden staging directory). `commit_marker`:
    write Orbax's `commit_success.txt` into the step too (on object storage it is always written,
    last: there it is what makes the step complete).
    """
    if is_remote(item_dir):
        return _commit_remote_step(item_dir, step, step_metadata, files)
    from bridge.store.claim import rename_noreplace
    from bridge.store.durable import fsync_path, write_bytes_atomic, write_json_atomic

    staging = os.path.dirname(os.path.abspath(item_dir))
    root = os.path.dirname(staging)
    final = os.path.join(root, str(int(step)))
    try:
        check_step_free(root, step)
        for name, data in (files or {}).items():
            write_bytes_atomic(os.path.join(staging, name), data)
        if commit_marker:
            write_bytes_atomic(os.path.join(staging, COMMIT_SUCCESS), _commit_success(final))
        write_json_atomic(os.path.join(staging, STEP_METADATA), step_metadata or _step_metadata())
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


def _step_metadata() -> dict:
    now = time.time_ns()
    return {"item_handlers": {ITEM: PYTREE_HANDLER}, "metrics": {}, "performance_metrics": {},
            "init_timestamp_nsecs": now, "commit_timestamp_nsecs": now, "custom_metadata": {}}


def _commit_remote_step(item_url: str, step: int, step_metadata: dict | None = None,
                        files: dict[str, bytes] | None = None) -> str:
    """`commit_step` on object storage: the item at `root/<step>/default` is committed (its
    `_METADATA`); write the step metadata, then Orbax's `commit_success.txt` last."""
    from bridge.store import kvstore
    from bridge.store.durable import json_bytes

    final = item_url.rstrip("/").rsplit("/", 1)[0]
    if not kvstore.exists(item_url, "_METADATA"):
        raise BridgeError(f"{item_url} holds no committed checkpoint; the step {step} was not written")
    for name, data in (files or {}).items():
        kvstore.write_bytes(final, name, data)
    kvstore.write_bytes(final, STEP_METADATA, json_bytes(step_metadata or _step_metadata()))
    kvstore.write_bytes(final, COMMIT_SUCCESS, _commit_success(final))
    return final


def _commit_success(step_dir: str) -> bytes:
    """The content Orbax writes to a step's `commit_success.txt`."""
    return f"Checkpoint commit was successful to {step_dir}".encode()


def write_step(root: str, write: Callable[[str], R], step_of: Callable[[R], int], *,
               step: int | Callable[[], int | None] | None = None, item: str = ITEM, step_metadata: dict | None = None,
               files: Callable[[R], dict[str, bytes]] | None = None, commit_marker: bool = False) -> tuple[R, str]:
    """Run `write(item_dir)` (a writer that creates a new checkpoint directory) into a staging step of
    manager root `root`, then commit it as step `step_of(result)`; returns (result, step directory).

    For writers that learn the step while writing, e.g. a conversion:
        write_step(root, lambda d: convert(src, d), lambda r: r.step)

    On object storage the item is written in place, so the step must be known before writing
    (`step`, or a function giving it: called only there); `step_of(result)` must then agree with it. `item`: the item's name (Orbax's
    `default`; MaxText's `items`); `step_metadata`: the step's `_CHECKPOINT_METADATA` when not a
    PyTree item's default; `files(result)`: more files of the step directory, written before it
    becomes a step; `commit_marker`: see `commit_step`.
    """
    more = files or (lambda _r: {})
    if is_remote(root):
        if callable(step):
            step = step()
        if step is None:
            raise BridgeError(f"{root}: the checkpoint records no step, so it cannot become a step of an Orbax "
                              f"CheckpointManager root; write it to a plain prefix instead")
        result = write(begin_step(root, step, item))
        if step_of(result) != int(step):
            raise BridgeError(f"{root}: the checkpoint written records step {step_of(result)}, not {step}; "
                              f"it stays at {join(root, str(int(step)), item)} without becoming a step")
        return result, commit_step(join(root, str(int(step)), item), int(step), step_metadata, more(result))
    item_dir = staging_item_dir(root, uuid.uuid4().hex[:12], item)
    try:
        result = write(item_dir)
        step = step_of(result)
        if step is None:
            raise BridgeError("the checkpoint records no step, so it cannot become a step of an Orbax "
                              "CheckpointManager root; write it to a plain directory instead")
        return result, commit_step(item_dir, int(step), step_metadata, more(result), commit_marker=commit_marker)
    except BaseException:
        shutil.rmtree(os.path.dirname(item_dir), ignore_errors=True)
        raise
