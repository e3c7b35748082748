"""Sealing `_METADATA`: a checksum of every field, kept in its custom_metadata (and a copy in
`_CHECKPOINT_METADATA`), so an edited or replaced metadata file is refused rather than trusted.

Every writer seals (the store's commit, the JAX save after Orbax wrote); readers and `verify` ask
`metadata_problems`. The checksum is over sorted-key JSON, so it does not depend on key order.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Mapping

from bridge.format.manifest import MANIFEST_KEY

CHECKSUM_KEY = "gtp_bridge_checksum"
CHECKSUM_PREFIX = "sha256-all:"   # the checksum covers every field of _METADATA (older: tree + manifest only)


def metadata_checksum(metadata: Mapping) -> str:
    """Checksum of a whole `_METADATA` object (every field, except the checksum itself).

    >>> m = {"tree_metadata": {}, "use_ocdbt": True, "custom_metadata": {"gtp_bridge": {}}}
    >>> c = metadata_checksum(m)
    >>> c.startswith(CHECKSUM_PREFIX), metadata_checksum({**m, "use_ocdbt": False}) == c
    (True, False)
    """
    body = dict(metadata)
    custom = body.get("custom_metadata")
    if isinstance(custom, Mapping):
        body["custom_metadata"] = {k: v for k, v in custom.items() if k != CHECKSUM_KEY}
    return CHECKSUM_PREFIX + _sha256_json(body)


def legacy_metadata_checksum(tree: Any, manifest_json: Any) -> str:
    """The checksum of checkpoints written before it covered every field (tree + manifest only)."""
    return _sha256_json({"tree_metadata": tree, MANIFEST_KEY: manifest_json})


def _sha256_json(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def seal_metadata(metadata: dict) -> str:
    """Store the checksum of `metadata` in its custom_metadata (in place); returns the checksum."""
    custom = metadata.setdefault("custom_metadata", {})
    custom.pop(CHECKSUM_KEY, None)
    checksum = metadata_checksum(json.loads(json.dumps(metadata)))  # as it reads back (tuples -> lists)
    custom[CHECKSUM_KEY] = checksum
    return checksum


def metadata_problems(metadata: Mapping, checkpoint_metadata: Mapping | None) -> list[str]:
    """What is wrong with a checkpoint's `_METADATA` (empty list: intact or not written by gtp-bridge).

    `checkpoint_metadata` is `_CHECKPOINT_METADATA`, whose custom_metadata carries a copy of the
    checksum: it tells a bridge checkpoint whose custom_metadata was removed from a plain Orbax one.
    A checkpoint with neither checksum was never sealed by gtp-bridge and is not checked.

    >>> m = {"tree_metadata": {}, "use_ocdbt": True, "custom_metadata": {"gtp_bridge": {}}}
    >>> c = seal_metadata(m)
    >>> metadata_problems(m, {"custom_metadata": {CHECKSUM_KEY: c}})
    []
    >>> metadata_problems({**m, "use_ocdbt": False}, None)
    ['_METADATA was modified after commit (checksum mismatch)']
    >>> metadata_problems({"tree_metadata": {}}, {"custom_metadata": {CHECKSUM_KEY: c}})[0]
    '_METADATA has no custom_metadata.gtp_bridge (the manifest was removed)'
    """
    cm = checkpoint_metadata.get("custom_metadata") if isinstance(checkpoint_metadata, Mapping) else None
    marker = cm.get(CHECKSUM_KEY) if isinstance(cm, Mapping) else None
    custom = metadata.get("custom_metadata")
    if custom is not None and not isinstance(custom, Mapping):
        return ["_METADATA custom_metadata is not a JSON object"]
    custom = custom or {}
    stored = custom.get(CHECKSUM_KEY)
    if marker is None and stored is None:
        # Never sealed by gtp-bridge (every version of its writers seals): a plain Orbax checkpoint, possibly
        # carrying a manifest written by another tool. Nothing to check against.
        return []
    problems = []
    if MANIFEST_KEY not in custom:
        problems.append("_METADATA has no custom_metadata.gtp_bridge (the manifest was removed)")
    if not isinstance(stored, str):
        problems.append("_METADATA has no gtp_bridge_checksum (the checksum was removed)")
    else:
        want = (metadata_checksum(metadata) if stored.startswith(CHECKSUM_PREFIX)
                else legacy_metadata_checksum(metadata.get("tree_metadata"), custom.get(MANIFEST_KEY)))
        if stored != want:
            problems.append("_METADATA was modified after commit (checksum mismatch)")
        elif marker is not None and marker != stored:
            problems.append("_METADATA's checksum differs from the copy in _CHECKPOINT_METADATA (metadata replaced)")
    return problems
