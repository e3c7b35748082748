"""`_sharding`: the file Orbax's default restore places arrays with, and its seal.

Orbax's `PyTreeCheckpointer().restore(path)` / `CheckpointManager.restore(step)` without a target
take each `jax.Array`'s sharding from `<checkpoint>/_sharding` (JSON: base64url(Orbax name) -> the
serialized `ShardingMetadata`, `orbax.checkpoint._src.metadata.sharding`); without the file they
raise "Sharding of jax.Array cannot be None". A JAX save gets Orbax's own file (the saving mesh);
every other writer (convert, live export, from-maxtext, to-maxtext) writes the one below at commit.

Which sharding: one that restores anywhere. Orbax writes a `SingleDeviceSharding` of
`device_str` "cpu:0" / "cuda:0" for an array on the default device, which another platform
cannot resolve (its lookup is by that string among `jax.local_devices()`). A `NamedSharding` on a
one-device mesh of device id 0 is the same placement (the default device of process 0) and every
JAX backend has a device 0: it restores on 1 CPU, 8 CPUs, GPUs, TPUs. Readers that want another
placement pass one (`restore(..., mesh=)`, Orbax's `StandardRestore(abstract)`), as with any
Orbax checkpoint.

The file's sha256 goes into `_METADATA`'s custom_metadata (`SHARDING_DIGEST_KEY`), which the
metadata checksum covers: an edited or removed `_sharding` is refused like an edited `_METADATA`.
"""

from __future__ import annotations

import base64
import hashlib
import json
from typing import Any, Mapping

SHARDING_FILE = "_sharding"
SHARDING_DIGEST_KEY = "gtp_bridge_sharding_sha256"   # custom_metadata key: sha256 hex of the `_sharding` bytes

#: `NamedShardingMetadata.to_serialized_string()` of NamedSharding(Mesh([device 0], ("device",)), P())
DEFAULT_SHARDING = {"sharding_type": "NamedSharding", "shape": [1], "axis_names": ["device"],
                    "partition_spec": [], "device_mesh": {"mesh": [{"id": 0}]}}


def array_names(tree_metadata: Mapping[str, Any]) -> list[str]:
    """Orbax names of the `jax.Array` leaves of a `_METADATA` tree (keys joined with '.').

    >>> array_names({"('params', 'w')": {"key_metadata": [{"key": "params"}, {"key": "w"}],
    ...                                  "value_metadata": {"value_type": "jax.Array"}},
    ...              "('opt_state', '1')": {"key_metadata": [{"key": "opt_state"}, {"key": "1"}],
    ...                                     "value_metadata": {"value_type": "None"}}})
    ['params.w']
    """
    names = []
    for entry in tree_metadata.values():
        if entry.get("value_metadata", {}).get("value_type") == "jax.Array":
            names.append(".".join(str(k["key"]) for k in entry["key_metadata"]))
    return sorted(names)


def sharding_file(tree_metadata: Mapping[str, Any]) -> bytes:
    """The `_sharding` file for a tree: `DEFAULT_SHARDING` for every array, as Orbax serializes it
    (one JSON object, values JSON strings).

    >>> doc = json.loads(sharding_file({"('w',)": {"key_metadata": [{"key": "w"}],
    ...                                            "value_metadata": {"value_type": "jax.Array"}}}))
    >>> list(doc), json.loads(doc["dw=="])["device_mesh"]
    (['dw=='], {'mesh': [{'id': 0}]})
    """
    value = json.dumps(DEFAULT_SHARDING)
    doc = {base64.urlsafe_b64encode(n.encode()).decode(): value for n in array_names(tree_metadata)}
    return json.dumps(doc, separators=(",", ":")).encode()


def sharding_digest(data: bytes) -> str:
    """sha256 hex of a `_sharding` file's bytes (what `SHARDING_DIGEST_KEY` records)."""
    return hashlib.sha256(data).hexdigest()


def record_sharding(metadata: dict, data: bytes) -> None:
    """Record the digest of `_sharding` in `metadata`'s custom_metadata (in place, before sealing)."""
    metadata.setdefault("custom_metadata", {})[SHARDING_DIGEST_KEY] = sharding_digest(data)


def sharding_problems(metadata: Mapping, data: bytes | None) -> list[str]:
    """What is wrong with `_sharding` (`data`: its bytes, None when absent) given `_METADATA`.

    Checked only when `_METADATA` records a digest (older checkpoints and plain Orbax ones do not).

    >>> m = {"custom_metadata": {}}; record_sharding(m, b"{}")
    >>> sharding_problems(m, b"{}"), sharding_problems(m, None), sharding_problems(m, b'{"x":1}')
    ([], ['_sharding is missing'], ['_sharding was modified after commit (checksum mismatch)'])
    """
    custom = metadata.get("custom_metadata")
    want = custom.get(SHARDING_DIGEST_KEY) if isinstance(custom, Mapping) else None
    if want is None:
        return []
    if data is None:
        return ["_sharding is missing"]
    if sharding_digest(data) != want:
        return ["_sharding was modified after commit (checksum mismatch)"]
    return []
