"""Native FP8 weights: dequantize for export, re-quantize on reload, bind optimizer state by backlink.

Megatron checkpoints an FP8 shard as `bf16(float32(data) * scale_inv)` and tags that copy with
`_gtp_dequant_src = <live FP8 param>`; the optimizer is keyed by the live param, so binding state
to model entries must follow the backlink, never tensor identity (docs/megatron-layout.md §3, §7.6).
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

import torch

from bridge.errors import BridgeError
from bridge.live.api import LocalParam, OptimFragment, QuantizedWeight
from bridge.live.fp8_scales import scale_grid

BACKLINK_ATTRS = ("_gtp_dequant_src", "gtp_pad_src")


def dequantize(q: QuantizedWeight) -> torch.Tensor:
    """bf16 `float32(data) * scale_inv`, tagged `_gtp_dequant_src = q` (Megatron's checkpoint copy):
    `q.dequantize()`.

    >>> import torch
    >>> q = QuantizedWeight(torch.tensor([[1.0, -2.0]]).to(torch.float8_e4m3fn), torch.tensor([0.5]))
    >>> dequantize(q).tolist(), dequantize(q)._gtp_dequant_src is q
    ([[0.5, -1.0]], True)
    """
    return q.dequantize()


def quantize_into(q: QuantizedWeight, value: torch.Tensor) -> None:
    """Re-quantize `value` into `q` in place with current scaling (amax per tensor or per block).

    Like Megatron's load path (`param.copy_(bf16)` re-quantizes), the scale is recomputed from the
    data; all-zero blocks keep scale_inv 1.
    """
    if tuple(value.shape) != tuple(q.data.shape):
        raise BridgeError(f"cannot quantize a {tuple(value.shape)} tensor into an FP8 shard of shape {tuple(q.data.shape)}")
    fmax = torch.finfo(q.data.dtype).max
    x = value.to(q.data.device, torch.float32)
    if q.block is None:
        amax = x.abs().max() if x.numel() else torch.zeros((), device=x.device)
        scale_inv = torch.where(amax > 0, amax / fmax, torch.ones_like(amax))
        q.scale_inv.copy_(scale_inv.reshape(q.scale_inv.shape))
    else:
        br, bc = q.block
        rows, cols = x.shape[-2], x.shape[-1]
        nb = (-(-rows // br), -(-cols // bc))
        padded = torch.zeros(*x.shape[:-2], nb[0] * br, nb[1] * bc, device=x.device)
        padded[..., :rows, :cols] = x
        blocks = padded.reshape(*x.shape[:-2], nb[0], br, nb[1], bc).abs().amax(dim=(-3, -1))
        scale_inv = torch.where(blocks > 0, blocks / fmax, torch.ones_like(blocks))
        q.scale_inv.fill_(1.0)
        q.scale_inv[..., : nb[0], : nb[1]].copy_(scale_inv)
    q.data.copy_((x / scale_grid(q.data, q.scale_inv, q.block).to(x.device)).clamp(-fmax, fmax).to(q.data.dtype))


def backlink_source(entry: object) -> object:
    """The live parameter a model entry stands for: follow `_gtp_dequant_src`, then `gtp_pad_src`.

    >>> import torch
    >>> live = torch.zeros(2); copy = live.clone(); copy._gtp_dequant_src = live
    >>> backlink_source(copy) is live, backlink_source(live) is live
    (True, True)
    """
    for attr in BACKLINK_ATTRS:
        src = getattr(entry, attr, None)
        if src is not None:
            return src
    return entry


def bind_optimizer_state(
    entries: Sequence[tuple[str, object, object]],
    state_by_param: Mapping[int, OptimFragment] | Iterable[tuple[object, OptimFragment]],
) -> list[LocalParam]:
    """Attach optimizer fragments to model entries through their dequant backlinks.

    `entries` are `(key, geometry, weight)` with `weight` a live tensor, a `QuantizedWeight`, or a
    dequantized copy carrying `_gtp_dequant_src`/`gtp_pad_src`. `state_by_param` maps the *live*
    parameter (as `(param, fragment)` pairs, or `{id(param): fragment}`) to this rank's fragment.
    Every fragment must bind to exactly one entry, else BridgeError naming the parameter. A
    parameter without a fragment here is fine (DistOpt gave its range to other ranks); the
    exporter checks globally that the fragments cover every trained array.
    """
    if isinstance(state_by_param, Mapping):
        by_id = dict(state_by_param.items())
        names = {k: f"id {k}" for k in by_id}
    else:
        pairs = list(state_by_param)
        by_id = {id(p): frag for p, frag in pairs}
        names = {id(p): getattr(p, "_debug_name", None) or f"{type(p).__name__} {tuple(getattr(p, 'shape', ()))}" for p, _ in pairs}
    out: list[LocalParam] = []
    bound: set[int] = set()
    for key, geometry, weight in entries:
        src = backlink_source(weight)
        frag = by_id.get(id(src))
        if frag is not None:
            if id(src) in bound:
                raise BridgeError(f"optimizer state of {key} is bound to two model entries (same live param); "
                                  "give each model entry its own live parameter")
            bound.add(id(src))
        live = src if isinstance(src, (torch.Tensor, QuantizedWeight)) else weight
        out.append(LocalParam(key=key, geometry=geometry, weight=live, optim=frag))
    unbound = [names[i] for i in by_id if i not in bound]
    if unbound:
        raise BridgeError(f"optimizer state of {len(unbound)} parameter(s) matches no model entry (first: {unbound[0]}); "
                          "tag dequantized/padded copies with _gtp_dequant_src or gtp_pad_src pointing at the live param")
    return out
