"""The versioned manifest stored in `_METADATA["custom_metadata"]["gtp_bridge"]` (JSON only).

One source of truth for provenance and semantics: source layout, optimizer hyper-parameters,
fused section tables, per-array records (shape, dtype, digest) and free-form extras.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Mapping

from bridge.errors import BridgeError

FORMAT_VERSION = 1
MANIFEST_KEY = "gtp_bridge"


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
            raise BridgeError("gtp_bridge manifest is not a JSON object; the checkpoint metadata is damaged")
        version = d.get("format_version")
        if not isinstance(version, int):
            raise BridgeError("gtp_bridge manifest has no integer format_version; the checkpoint metadata is damaged")
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
            raise BridgeError(f"gtp_bridge manifest is malformed ({e}); the checkpoint metadata is damaged") from e

    def dumps(self) -> str:
        return json.dumps(self.to_json(), sort_keys=True)


def _known(cls, d: Mapping) -> dict:
    """Keep fields this version knows (older writers may lack some, newer minor ones may add some)."""
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in dict(d).items() if k in names}
