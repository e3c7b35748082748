"""What a live torch.distributed run hands to `export_state` and gets back from `reload_state`.

This module is the stable contract between the live exporter and the two producers of its input
(the reference GTP trainer, the Megatron-Core adapter). It holds dataclasses only; the work lives
in `bridge.live.export` / `bridge.live.reload`.

Per rank, a run describes every parameter it holds with one `LocalParam`:

- `key`       the logical key (Megatron key without `module.`/`model.` prefixes and without the
              layer / expert index when the geometry carries it as a prepended axis);
- `geometry`  `bridge.layout.ParamGeometry`: logical shape, TP partition, GTP split + padding,
              prepended axes, fused sections -- everything needed to map this rank's physical shard
              to logical boxes (the exporter asks the layout engine, never re-derives the math);
- `weight`    the physical shard exactly as the rank holds it: a torch tensor (bf16 / fp16 / fp32,
              padded GTP rows included) or a `QuantizedWeight` (native FP8 data + scale_inv);
- `optim`     this rank's distributed-optimizer fragment of that physical shard (`OptimFragment`:
              flat range `[f0, f1)` of `shard.view(-1)` and the fp32 `master`, `exp_avg`,
              `exp_avg_sq` of that range), or None when the rank owns none of it;
- `index`     position of this instance on the geometry's prepended (layer / expert) axes;
- `main_replica` writer election among ranks that hold identical copies of the same logical data
              (DP / TP / GTP replicas): False = never use this copy (weight and fragment) as a
              source (e.g. Megatron's non-main replicas); True / None = usable, and the exporter's
              ownership planner picks, per chunk, one holder (the owner itself when it holds it).

Run-level facts go in one `LiveRun` (layout, rank, process group, step, optimizer settings).
For reload the same `LocalParam` list is the *target*: tensors are allocated by the run with the
physical shapes of its new layout and `reload_state` fills them in place (padding rows as zeros).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping

from bridge.format.schema import MU, NU, PARAMS

if TYPE_CHECKING:  # the layout engine is pure numpy; only annotations refer to it here
    import torch

    from bridge.layout.parallel import ParallelLayout
    from bridge.layout.params import ParamGeometry

__all__ = ["QuantizedWeight", "OptimFragment", "LocalParam", "AdamConfig", "LiveRun", "ReloadResult"]


@dataclass(eq=False)
class QuantizedWeight:
    """A native-FP8 physical shard: `data` (float8_e4m3fn / float8_e5m2) with explicit scales.

    `scale_inv` is fp32 (E8M0 scales are passed decoded to fp32). Per-tensor scaling: `block` is
    None and `scale_inv` has one element. Per-block scaling: `block = (rows, cols)` of the last two
    dims and `scale_inv[..., i, j]` scales `data[..., i*rows:(i+1)*rows, j*cols:(j+1)*cols]`;
    `scale_inv` may be larger than needed (TE pads scale grids), extra entries are ignored.
    The exported model entry is `bf16(float32(data) * scale_inv)` (see `bridge.live.fp8`); the
    optimizer state binds to this object through the dequantized copy's `_gtp_dequant_src`.
    """

    data: "torch.Tensor"
    scale_inv: "torch.Tensor"
    block: tuple[int, int] | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)

    @property
    def device(self) -> "torch.device":
        return self.data.device

    def numel(self) -> int:
        return self.data.numel()

    def dequantize(self) -> "torch.Tensor":
        """bf16 copy of the shard whose `_gtp_dequant_src` is this object."""
        from bridge.live.fp8_scales import dequantized  # torch: this module stays cheap to import

        out = dequantized(self.data, self.scale_inv, self.block)
        out._gtp_dequant_src = self
        return out


@dataclass(eq=False)
class OptimFragment:
    """A rank's distributed-optimizer state for the flat range `[f0, f1)` of one physical shard.

    Offsets are element offsets into the row-major physical (padded) shard, as in Megatron's
    `param_range_map["param"]`. `master`, `exp_avg`, `exp_avg_sq` are 1-D with `f1 - f0`
    elements (fp32 unless the run is configured otherwise). Elements of GTP padding rows are
    accepted and dropped on export; on reload they come back as zeros.
    """

    f0: int
    f1: int
    master: "torch.Tensor"
    exp_avg: "torch.Tensor"
    exp_avg_sq: "torch.Tensor"

    @property
    def numel(self) -> int:
        return self.f1 - self.f0

    def tensors(self) -> dict[str, "torch.Tensor"]:
        """The three state tensors by logical tree root (`params`, `mu`, `nu`)."""
        return {PARAMS: self.master, MU: self.exp_avg, NU: self.exp_avg_sq}

    def check(self, where: str, shard_numel: int) -> None:
        """Refuse a range outside the physical shard or state tensors of the wrong length."""
        from bridge.errors import BridgeError

        if not 0 <= self.f0 <= self.f1 <= shard_numel:
            raise BridgeError(f"{where}: optimizer range [{self.f0}, {self.f1}) is outside the physical shard "
                              f"of {shard_numel} elements")
        for root, tensor in self.tensors().items():
            if tensor.numel() != self.numel:
                raise BridgeError(f"{where}: optimizer {root} has {tensor.numel()} elements, range "
                                  f"[{self.f0}, {self.f1}) has {self.numel}")


@dataclass(eq=False)
class LocalParam:
    """One parameter as this rank holds it (export input) or must receive it (reload target)."""

    key: str
    geometry: "ParamGeometry"
    weight: "torch.Tensor | QuantizedWeight | None"
    optim: OptimFragment | None = None
    main_replica: bool | None = None
    index: tuple[int, ...] = ()  # position on the geometry's prepended (layer / expert) axes


@dataclass(frozen=True)
class AdamConfig:
    """Optimizer hyper-parameters recorded in the manifest (optax.adamw / Megatron FusedAdam)."""

    lr: float
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    no_decay: tuple[str, ...] = ()  # logical keys with weight-decay multiplier 0
    lr_mult: Mapping[str, float] = field(default_factory=dict)  # per-key lr multipliers (default 1)
    clip_grad: float | None = None  # global-norm gradient clipping the run applies before Adam (None/0 = off)
    extra: Mapping[str, Any] = field(default_factory=dict)  # scheduler, grad scaler, ... (JSON values)


@dataclass
class LiveRun:
    """Run-level facts shared by every `LocalParam` of one rank.

    `group` is the process group spanning the layout's ranks (None = the default world group; any
    subgroup works: the export's ranks talk over it only); `rank` is this process's rank in it. `step` is the number of completed optimizer steps (optax `count`).
    `device` is informational: collectives run where the group's backend needs them (NCCL: the
    current CUDA device; gloo: CPU), tensors stay where the run keeps them.
    """

    layout: "ParallelLayout"
    rank: int
    step: int
    optimizer: AdamConfig | None = None
    group: Any = None
    device: "torch.device | str | None" = None
    extra: Mapping[str, Any] = field(default_factory=dict)  # free-form manifest `extra` (JSON values)


@dataclass(frozen=True)
class ReloadResult:
    """What `reload_state` learned from the checkpoint besides the tensors it filled."""

    step: int
    optimizer: AdamConfig | None
    source_layout: Mapping[str, Any]  # the manifest's source layout record
    bytes_read: int  # array bytes this rank read (bytes needed, never whole arrays unless needed)
