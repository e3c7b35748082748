"""The versioned manifest stored in `_METADATA["custom_metadata"]["gtp_bridge"]` (JSON only).

One source of truth for provenance and semantics: source layout, optimizer hyper-parameters,
fused section tables, per-array records (shape, dtype, digest) and extras. Writers build it from
these dataclasses only (`Manifest`, `SourceLayout.of`, `OptimizerConfig`, `MegatronRecord`) and put
it into custom_metadata with `custom_metadata`; readers get it back with `manifest_from_custom` /
`as_manifest` and read the typed fields (`Manifest.megatron` for what convert recorded), so no
module spells a manifest key. Field order is JSON key order on disk: append new fields last.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Mapping

from bridge.errors import BridgeError, IntegrityError

FORMAT_VERSION = 1
MANIFEST_KEY = "gtp_bridge"               # custom_metadata[MANIFEST_KEY] holds the manifest

# Keys of `OptimizerConfig.groups` entries and of `Manifest.extra` that gtp-bridge itself writes.
GROUP_PARAMS = "params"                   # a group's parameters ("/"-joined param paths)
MEGATRON_KEY = "megatron"                 # MegatronRecord: what convert recorded about the source run
PREVIOUS_SOURCE_KEY = "previous_source"   # a JAX save-back: the SourceLayout of the checkpoint it restored
OPTIMIZER_EXTRA_KEY = "optimizer_extra"   # live export: LiveRun.optimizer.extra, as given
PADS_KEY = "pad_for_alignment_values"     # live export: every pad_for_alignment when params differ
MAXTEXT_KEY = "maxtext"                   # the maxtext preset: the options it wrote a MaxText checkpoint with
REPLICAS_KEY = "replicas"                 # ReplicaRecord: convert's comparison of the source's replicated copies

DEFAULT_BETAS = (0.9, 0.999)              # Megatron's --adam-beta1/2, --adam-eps and --weight-decay defaults
DEFAULT_EPS = 1e-8                        # (megatron-core OptimizerConfig: adam_beta1/2, adam_eps, weight_decay)
DEFAULT_WEIGHT_DECAY = 0.01
MAX_STEP = 2**31 - 1                      # optax / MaxText keep the Adam count and the step as int32


def _number(value: Any, name: str, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) and not hasattr(value, "__float__"):
        raise BridgeError(f"{where}: {name} {value!r} is not a number")
    try:
        x = float(value)
    except (TypeError, ValueError, OverflowError):
        raise BridgeError(f"{where}: {name} {value!r} is not a number") from None
    if not math.isfinite(x):
        raise BridgeError(f"{where}: {name} is {x}; it must be a finite number")
    return x


def check_hyperparameters(where: str, *, lr: Any = None, betas: Any = None, eps: Any = None,
                          weight_decay: Any = None, clip_grad: Any = None) -> None:
    """Refuse AdamW hyper-parameters no run can have, in one line naming `where` and the field: every
    value finite, lr >= 0, 0 <= beta1, beta2 < 1, eps > 0, weight decay >= 0, clip_grad >= 0 (None: not
    given, not checked). The one check every entry point uses (CLI flags, Python API, manifests read).

    >>> check_hyperparameters("--lr", lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    >>> check_hyperparameters("from-maxtext", lr=float("nan"))
    Traceback (most recent call last):
    bridge.errors.BridgeError: from-maxtext: lr is nan; it must be a finite number
    >>> check_hyperparameters("manifest", betas=(5, -1))
    Traceback (most recent call last):
    bridge.errors.BridgeError: manifest: beta1 5.0 is outside [0, 1)
    """
    if lr is not None and _number(lr, "lr", where) < 0:
        raise BridgeError(f"{where}: lr {float(lr)} is negative; a learning rate is >= 0")
    if betas is not None:
        if isinstance(betas, (str, bytes)) or not hasattr(betas, "__len__") or len(betas) != 2:
            raise BridgeError(f"{where}: betas {betas!r} is not a pair (beta1, beta2)")
        for name, b in zip(("beta1", "beta2"), betas):
            if not 0.0 <= _number(b, name, where) < 1.0:
                raise BridgeError(f"{where}: {name} {float(b)} is outside [0, 1)")
    if eps is not None and not _number(eps, "eps", where) > 0:
        raise BridgeError(f"{where}: eps {float(eps)} is not positive; Adam's eps is > 0")
    if weight_decay is not None and _number(weight_decay, "weight_decay", where) < 0:
        raise BridgeError(f"{where}: weight_decay {float(weight_decay)} is negative; it must be >= 0")
    if clip_grad is not None and _number(clip_grad, "clip_grad", where) < 0:
        raise BridgeError(f"{where}: clip_grad {float(clip_grad)} is negative; use 0 or None for no clipping")


def check_step(value: Any, name: str, where: str) -> int:
    """An Adam count or a step as an int in [0, 2**31 - 1], else a one-line BridgeError naming it.

    >>> check_step(3, "Adam count", "ckpt")
    3
    >>> check_step(-5, "Adam count", "ckpt")
    Traceback (most recent call last):
    bridge.errors.BridgeError: ckpt: Adam count -5 is outside [0, 2147483647]
    """
    try:
        n = int(value)
        exact = n == value
    except (TypeError, ValueError, OverflowError):
        n, exact = None, False
    if isinstance(value, bool) or n is None or not exact:
        raise BridgeError(f"{where}: {name} {value!r} is not an integer")
    if not 0 <= n <= MAX_STEP:
        raise BridgeError(f"{where}: {name} {n} is outside [0, {MAX_STEP}]")
    return n


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

    @classmethod
    def of(cls, layout: Any, framework: str, optimizer_format: str, pad_for_alignment: int = 0) -> "SourceLayout":
        """The record of a `bridge.layout.ParallelLayout` (any object with its size attributes)."""
        return cls(framework=framework, tp=layout.tp, gtp=layout.gtp, dp=layout.dp, ep=layout.ep, etp=layout.etp,
                   egtp=layout.egtp, pp=layout.pp, cp=layout.cp, pad_for_alignment=pad_for_alignment,
                   optimizer_format=optimizer_format, world_size=layout.world)


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

    def with_defaults(self) -> "OptimizerConfig":
        """A copy with Megatron's defaults where the record has none (betas (0.9, 0.999), eps 1e-8,
        weight decay 0.01): what every reader (JAX restore, reload, to-megatron) resumes with. One
        rule for all, so a checkpoint resumes with the same hyper-parameters whichever side reads it.

        >>> o = OptimizerConfig(betas=[0.9, 0.95]).with_defaults()
        >>> o.betas, o.eps, o.weight_decay
        ((0.9, 0.95), 1e-08, 0.01)
        """
        return replace(self, betas=tuple(self.betas) if self.betas is not None else DEFAULT_BETAS,
                       eps=self.eps if self.eps is not None else DEFAULT_EPS,
                       weight_decay=self.weight_decay if self.weight_decay is not None else DEFAULT_WEIGHT_DECAY)

    def check(self, where: str) -> "OptimizerConfig":
        """Self, after `check_hyperparameters` on what it records (`where`: the checkpoint, for the message)."""
        check_hyperparameters(f"{where}: recorded optimizer", lr=self.lr, betas=self.betas, eps=self.eps,
                              weight_decay=self.weight_decay, clip_grad=self.clip_grad)
        if self.step is not None:
            check_step(self.step, "step", f"{where}: recorded optimizer")
        return self


@dataclass
class MegatronParam:
    """One Megatron parameter as convert found it, in registration order (to-megatron rebuilds the
    run's parameter list, and so its DistributedOptimizer buffer layout, from these)."""

    name: str                       # Megatron name without wrappers
    key: str                        # its torch_dist key
    shape: list[int]                # logical shape (without prepended layer / expert axes)
    prepend: list[int]              # stacked layer / expert axes
    tp_kind: str                    # "column", "row", "replicated", ...
    gtp: Any = field(default=False, kw_only=True)   # optional, yet in this place of the JSON
    expert: Any
    dtype: str                      # the weight's dtype
    optimized: bool = True          # has fp32 master and moments

    @classmethod
    def from_json(cls, d: Mapping) -> "MegatronParam":
        return cls(**_known(cls, d))


@dataclass
class MegatronRecord:
    """What `convert` records about its Megatron source (`extra["megatron"]`): what `to-megatron`
    needs to write the run back (parameters, param groups, args, _extra_state keys) and the
    scheduler state the JAX side continues the learning-rate schedule from."""

    source_dir: str = ""
    params: list[MegatronParam] = field(default_factory=list)
    param_groups: list[list[dict]] = field(default_factory=list)  # per chained optimizer, without their params
    extra_state_keys: list[str] = field(default_factory=list)
    extra_state_payload: str = "none"                           # "none" or "empty_uint8_tensor" (TE)
    args: dict[str, Any] = field(default_factory=dict)          # the run's plain-valued args
    inferred: list[str] = field(default_factory=list)           # what the converter had to infer
    wd_mult_zero_params: list[str] = field(default_factory=list)
    iteration: Any = None
    checkpoint_version: Any = None
    scheduler: dict | None = None                               # SchedulerRecord JSON; absent when the run had none

    def to_json(self) -> dict:
        """JSON-ready dict; no `scheduler` key when there is none (the converter never wrote one then).

        >>> list(MegatronRecord(source_dir="ck").to_json())[:3], "scheduler" in MegatronRecord().to_json()
        (['source_dir', 'params', 'param_groups'], False)
        >>> Manifest(extra={MEGATRON_KEY: {"source_dir": "ck", "unknown": 1}}).megatron.source_dir
        'ck'
        """
        d = asdict(self)
        if d["scheduler"] is None:
            del d["scheduler"]
        return d

    @classmethod
    def from_json(cls, d: Mapping) -> "MegatronRecord":
        """Parse what convert wrote; IntegrityError when a parameter record is malformed."""
        known = _known(cls, d)
        try:
            known["params"] = [MegatronParam.from_json(p) for p in known.get("params") or []]
        except (TypeError, AttributeError) as e:
            raise IntegrityError(f"gtp_bridge manifest's megatron parameter list is malformed ({e}); "
                                 f"the checkpoint metadata is damaged") from None
        return cls(**known)


@dataclass
class ReplicaDiff:
    """Copies of one logical array in one role that differ from the main replica's."""

    param: str                      # the Megatron parameter (without wrappers; fused sections together)
    role: str                       # "params" (fp32 master), "mu" (exp_avg), "nu" (exp_avg_sq), "model"
    replicas: list[str]             # the other copies that differ ("tp1", "gtp1", "tp1.gtp1")
    elements: int                   # elements compared (over every other copy)
    differ: int                     # of those, elements whose bits differ from the main replica's
    max_abs_diff: float             # largest |main - copy| over finite differences
    nonfinite: int = 0              # differences that are not finite (NaN / Inf in one copy only)


@dataclass
class ReplicaRecord:
    """`extra["replicas"]`: what `convert` found comparing the copies of TP-/GTP-replicated parameters
    a save holds (each TP / GTP rank's DistributedOptimizer keeps its own copy of norms, biases,
    position embeddings), and which copy it kept. Versioned on its own (`version`)."""

    version: int = 1
    kept: str = "tp0.gtp0"          # the copy written: Megatron's main replica (replica_id 0)
    copies: int = 1                 # copies of each replicated parameter the save holds
    compared: int = 0               # parameter states (parameter, role) with another copy compared
    elements_compared: int = 0
    differ: list[ReplicaDiff] = field(default_factory=list)

    @classmethod
    def from_json(cls, d: Mapping) -> "ReplicaRecord":
        """Parse what convert wrote; IntegrityError when malformed.

        >>> r = ReplicaRecord(copies=2, differ=[ReplicaDiff("w", "params", ["tp1"], 4, 3, 0.5)])
        >>> ReplicaRecord.from_json(json.loads(json.dumps(asdict(r)))) == r
        True
        """
        try:
            known = _known(cls, d)
            known["differ"] = [ReplicaDiff(**_known(ReplicaDiff, x)) for x in known.get("differ") or []]
            return cls(**known)
        except (TypeError, AttributeError) as e:
            raise IntegrityError(f"gtp_bridge manifest's replica record is malformed ({e}); the checkpoint "
                                 f"metadata is damaged") from None


@dataclass
class ArrayRecord:
    """What the writer promised for one array: logical shape, dtype name, digest (hex) or None."""

    shape: tuple[int, ...]
    dtype: str
    digest: str | None = None

    def to_json(self) -> dict:
        """As the manifest stores it.

        >>> ArrayRecord((2, 3), "float32").to_json()
        {'shape': [2, 3], 'dtype': 'float32', 'digest': None}
        """
        return {"shape": [int(s) for s in self.shape], "dtype": self.dtype, "digest": self.digest}


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

    def with_arrays(self, arrays: Mapping[str, ArrayRecord], digest_algorithm: str) -> "Manifest":
        """A copy recording what the writer wrote: one ArrayRecord per Orbax name (digests in
        `digest_algorithm`, "" when some writer could not digest)."""
        return replace(self, arrays=dict(arrays), digest_algorithm=digest_algorithm)

    @property
    def megatron(self) -> MegatronRecord | None:
        """What convert recorded about a Megatron source, or None (written by another writer)."""
        rec = self.extra.get(MEGATRON_KEY) if isinstance(self.extra, Mapping) else None
        return MegatronRecord.from_json(rec) if isinstance(rec, Mapping) else None

    @property
    def replicas(self) -> ReplicaRecord | None:
        """What convert recorded comparing the source's replicated copies, or None (not recorded)."""
        rec = self.extra.get(REPLICAS_KEY) if isinstance(self.extra, Mapping) else None
        return ReplicaRecord.from_json(rec) if isinstance(rec, Mapping) else None


def as_manifest(manifest: "Manifest | Mapping | None") -> "Manifest | None":
    """Accept a Manifest, its JSON dict, or None."""
    if manifest is None or isinstance(manifest, Manifest):
        return manifest
    return Manifest.from_json(manifest)


def custom_metadata(manifest: Manifest) -> dict:
    """`_METADATA`'s custom_metadata carrying `manifest` (before sealing)."""
    return {MANIFEST_KEY: manifest.to_json()}


def manifest_from_custom(custom: Any) -> Manifest | None:
    """The manifest in a custom_metadata object; None when there is none (a plain Orbax checkpoint).
    IntegrityError when it is there but malformed."""
    raw = custom.get(MANIFEST_KEY) if isinstance(custom, Mapping) else None
    return None if raw is None else Manifest.from_json(raw)


def _known(cls, d: Mapping) -> dict:
    """Keep fields this version knows (older writers may lack some, newer minor ones may add some)."""
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in dict(d).items() if k in names}
