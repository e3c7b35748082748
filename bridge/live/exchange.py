"""Batched collectives on flat byte buffers: the only data movement of live export.

One call moves every piece of one exchange: the sender concatenates the byte views of its
contiguous local runs per destination (in the plan's order) into one uint8 buffer and a single
`all_to_all_single` delivers them; receivers know every split size from the shared plan, so no
size exchange is needed. NCCL when the buffers are on a CUDA device, gloo on CPU.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist

from bridge.errors import BridgeError


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """Flat uint8 view of a contiguous tensor (no copy).

    >>> as_bytes(torch.ones(2, dtype=torch.bfloat16)).tolist()
    [128, 63, 128, 63]
    """
    if not t.is_contiguous():
        raise BridgeError(f"cannot take a byte view of a non-contiguous {tuple(t.shape)} tensor; pass contiguous shards")
    return t.reshape(-1).view(torch.uint8)


def pack(segments: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Concatenate byte views of `segments` into one uint8 buffer on `device`."""
    if not segments:
        return torch.empty(0, dtype=torch.uint8, device=device)
    views = [as_bytes(s) if s.dtype != torch.uint8 else s.reshape(-1) for s in segments]
    if any(v.device != device for v in views):
        views = [v.to(device, non_blocking=True) for v in views]
    return torch.cat(views)


def start_all_to_all_bytes(send: torch.Tensor, send_splits: Sequence[int], recv_splits: Sequence[int],
                           group: Any = None) -> tuple[torch.Tensor, Any]:
    """Start one `all_to_all_single` of a flat uint8 buffer; returns (receive buffer, work handle).

    The caller may do other work (e.g. write what it already holds) and must call `work.wait()`
    before reading the receive buffer or releasing `send`. `send_splits[r]` bytes go to group
    rank r; `recv_splits[r]` bytes come from it.
    """
    if send.numel() != sum(send_splits):
        raise BridgeError(f"exchange send buffer has {send.numel()} bytes but the plan's splits sum to {sum(send_splits)}")
    recv = torch.empty(sum(recv_splits), dtype=torch.uint8, device=send.device)
    work = dist.all_to_all_single(recv, send, output_split_sizes=list(map(int, recv_splits)),
                                  input_split_sizes=list(map(int, send_splits)), group=group, async_op=True)
    return recv, work


def all_to_all_bytes(send: torch.Tensor, send_splits: Sequence[int], recv_splits: Sequence[int],
                     group: Any = None) -> torch.Tensor:
    """One `all_to_all_single` of a flat uint8 buffer; returns the receive buffer (same device).

    `send_splits[r]` bytes go to group rank r; `recv_splits[r]` bytes come from it.
    """
    recv, work = start_all_to_all_bytes(send, send_splits, recv_splits, group)
    work.wait()
    return recv
