"""The versioned manifest stored in `_METADATA["custom_metadata"]["gtp_bridge"]` (JSON only).

One source of truth for provenance and semantics: source layout, optimizer hyper-parameters,
fused section tables, per-array records (shape, dtype, digest) and free-form extras.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Mapping

from bridge.errors import BridgeError, IntegrityError

FORMAT_VERSION = 1
MANIFEST_KEY = "gtp_bridge"
CHECKSUM_KEY = "gtp_bridge_checksum"
CHECKSUM_PREFIX = "sha256-all:"   # the checksum covers every field of _METADATA (older: tree + manifest only)


@dataclass
class SourceLayout:
    """Parallel layout of the run that wrote the checkpoint (informational; data is layout-free)."""

    framework: str = "unknown"          # "megatron", "jax", "numpy", ...
    tp: int = 1
    gtp: int = 1
    dp: int = 1
    ep: int = 1
    etp: int = 1
    egtp: int = 1
    pp: int = 1
    cp: int = 1
    pad_for_alignment: int = 0
    optimizer_format: str = ""          # e.g. "fully_reshardable", "dp_reshardable", "legacy_gtp", "live"
    world_size: int = 1


@dataclass
class OptimizerConfig:
    """Optimizer hyper-parameters (AdamW) and the step they belong to."""

    name: str = "adamw"
    lr: float | None = None
    betas: tuple[float, float] | None = None
    eps: float | None = None
    weight_decay: float | None = None
    step: int | None = None
    groups: list[dict] = field(default_factory=list)     # per-group {"params": [...], "lr_mult":, "wd_mult":, ...}
    no_decay: list[str] = field(default_factory=list)    # param paths ("/"-joined) without weight decay
    clip_grad: float | None = None                       # global-norm gradient clipping (Megatron clip_grad; 0/None = off)


@dataclass
class ArrayRecord:
    """What the writer promised for one array: logical shape, dtype name, digest (hex) or None."""

    shape: tuple[int, ...]
    dtype: str
    digest: str | None = None


@dataclass
class Manifest:
    """Everything the bridge records beside the arrays. Arrays are keyed by Orbax name ("a.b.c")."""

    format_version: int = FORMAT_VERSION
    source: SourceLayout = field(default_factory=SourceLayout)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    fused: dict[str, Any] = field(default_factory=dict)      # param path -> FusedSpec.to_json()
    arrays: dict[str, ArrayRecord] = field(default_factory=dict)
    digest_algorithm: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict:
        """JSON-ready dict (tuples become lists)."""
        return json.loads(json.dumps(asdict(self)))

    @classmethod
    def from_json(cls, d: Mapping) -> "Manifest":
        """Parse; refuse a newer format version and malformed content with a BridgeError."""
        if not isinstance(d, Mapping):
            raise IntegrityError("gtp_bridge manifest is not a JSON object; the checkpoint metadata is damaged")
        version = d.get("format_version")
        if not isinstance(version, int):
            raise IntegrityError("gtp_bridge manifest has no integer format_version; the checkpoint metadata is damaged")
        if version > FORMAT_VERSION:
            raise BridgeError(f"checkpoint manifest format version {version} is newer than this gtp-bridge "
                              f"supports ({FORMAT_VERSION}); upgrade gtp-bridge")
        try:
            src = _known(SourceLayout, d.get("source", {}))
            opt = _known(OptimizerConfig, d.get("optimizer", {}))
            if opt.get("betas") is not None:
                opt["betas"] = tuple(opt["betas"])
            arrays = {str(k): ArrayRecord(tuple(int(s) for s in v["shape"]), str(v["dtype"]), v.get("digest"))
                      for k, v in d.get("arrays", {}).items()}
            return cls(format_version=version, source=SourceLayout(**src), optimizer=OptimizerConfig(**opt),
                       fused=dict(d.get("fused", {})), arrays=arrays,
                       digest_algorithm=str(d.get("digest_algorithm", "")), extra=dict(d.get("extra", {})))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise IntegrityError(f"gtp_bridge manifest is malformed ({e}); the checkpoint metadata is damaged") from e

    def dumps(self) -> str:
        return json.dumps(self.to_json(), sort_keys=True)


def _known(cls, d: Mapping) -> dict:
    """Keep fields this version knows (older writers may lack some, newer minor ones may add some)."""
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in dict(d).items() if k in names}


# -- the metadata checksum ------------------------------------------------------------------------
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
