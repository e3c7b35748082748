"""Where the committed checkpoint of an object-storage location lies (s3://, gs://).

A URL may name a checkpoint, an Orbax item sub-prefix of one, or an Orbax CheckpointManager root;
this needs both the commit rules of object storage (`bridge.store.remote`) and the manager's
layout (`bridge.store.manager`), so it sits above both.
"""

from __future__ import annotations

from bridge.errors import BridgeError, IntegrityError
from bridge.store import kvstore as kv
from bridge.store.manager import ITEM, latest_step_note, steps_of_keys
from bridge.store.remote import CLAIM_KEY, METADATA


def committed_root(root: str) -> str:
    """`root` (a URL) if it holds a committed checkpoint; else BridgeError / IntegrityError saying why.

    An Orbax item sub-prefix (`state/`, `default/`) holding `_METADATA` is accepted as well, and an
    Orbax CheckpointManager root stands for its latest committed step (`bridge.store.manager`)."""
    keys = set(kv.list_keys(root))
    if METADATA in keys:
        return root
    for item in ("state", "default"):
        if f"{item}/{METADATA}" in keys:
            return f"{root}/{item}"
    steps = steps_of_keys(keys)  # an Orbax CheckpointManager root: its latest committed step
    if steps:
        latest_step_note(root, steps, f"{root}/{steps[-1]}")
        return f"{root}/{steps[-1]}/{ITEM}"
    if CLAIM_KEY in keys:
        raise IntegrityError(f"{root} is a partial checkpoint (its writer never committed: no _METADATA); "
                             f"rerun the write, which removes it")
    if ".metadata" in keys:
        raise BridgeError(f"{root} is a torch_dist (Megatron/DCP) checkpoint, not a logical one; "
                          f"convert it first: gtp-bridge convert {root} OUT")
    if any(k in keys for k in ("_CHECKPOINT_METADATA", "manifest.ocdbt", "commit_success.txt")):
        raise IntegrityError(f"{root}/_METADATA is missing; the checkpoint is damaged")
    if not keys:
        raise BridgeError(f"{root} does not exist (no objects under it); pass a checkpoint location")
    raise BridgeError(f"{root} has no _METADATA: not a committed Orbax checkpoint")
