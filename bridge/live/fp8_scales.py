"""FP8 scale arithmetic on plain tensors: a shard's scale grid and its bf16 dequantization.

Below both users: `bridge.live.api` (`QuantizedWeight.dequantize`) and `bridge.live.fp8`
(re-quantize on reload, optimizer binding); it knows none of the live API's dataclasses.
"""

from __future__ import annotations

import torch

from bridge.errors import BridgeError

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def scale_grid(data: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """fp32 `scale_inv` broadcastable to `data` (per-block grids expanded and cropped).

    >>> import torch
    >>> scale_grid(torch.zeros(3, 4, dtype=torch.float8_e4m3fn), torch.tensor([[1., 2.], [3., 4.]]), (2, 2)).tolist()
    [[1.0, 1.0, 2.0, 2.0], [1.0, 1.0, 2.0, 2.0], [3.0, 3.0, 4.0, 4.0]]
    """
    s = scale_inv.to(torch.float32)
    if block is None:
        if s.numel() != 1:
            raise BridgeError(f"per-tensor FP8 scale_inv has {s.numel()} elements; pass block=(rows, cols) for per-block scaling")
        return s.reshape(())
    if data.dim() < 2:
        raise BridgeError(f"per-block FP8 scaling needs a >=2-D shard, got shape {tuple(data.shape)}")
    br, bc = block
    rows, cols = data.shape[-2], data.shape[-1]
    need = (-(-rows // br), -(-cols // bc))
    if s.dim() < 2 or s.shape[-2] < need[0] or s.shape[-1] < need[1]:
        raise BridgeError(f"FP8 scale_inv shape {tuple(s.shape)} is too small for data {tuple(data.shape)} with block {block}; "
                          f"need at least {need}")
    s = s[..., : need[0], : need[1]]
    s = s.repeat_interleave(br, dim=-2)[..., :rows, :].repeat_interleave(bc, dim=-1)[..., :cols]
    return s


def dequantized(data: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """bf16 `float32(data) * scale_inv` of an FP8 shard.

    >>> import torch
    >>> dequantized(torch.tensor([[1.0, -2.0]]).to(torch.float8_e4m3fn), torch.tensor([0.5]), None).tolist()
    [[0.5, -1.0]]
    """
    if data.dtype not in FP8_DTYPES:
        raise BridgeError(f"QuantizedWeight.data has dtype {data.dtype}; expected torch.float8_e4m3fn or torch.float8_e5m2")
    return (data.to(torch.float32) * scale_grid(data, scale_inv, block).to(data.device)).to(torch.bfloat16)
