"""Process groups and autograd collectives of the reference GTP trainer (gloo on CPU, NCCL on GPU).

`RankGroups` builds, from a `bridge.layout.ParallelLayout`, the torch process groups a rank takes
part in (TP, GTP, dense / expert DistOpt, data-parallel-with-GTP). Every rank creates every group
in the same order, as `torch.distributed.new_group` requires. A group of size 1 is `None` and all
collectives on it are no-ops, so the unsharded reference needs no process group at all.

The autograd functions are Megatron's: `copy_to_tp` (f), `reduce_from_tp` (g), a vocab gather for
the logits, and the GTP weight gather (all-gather shards over the GTP group and strip the tail
padding forward; zero-pad and reduce-scatter the weight gradient backward, so padding rows get
zero gradients).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from bridge.errors import BridgeError
from bridge.testing.model import EPComm, TPComm

__all__ = ["CommGroup", "RankGroups", "all_gather_into", "reduce_scatter_into", "all_reduce", "gtp_gather", "DistTPComm",
           "DistEPComm"]


@dataclass(frozen=True)
class CommGroup:
    """A process group with this rank's place in it (`pg` None when size 1 or not distributed)."""

    pg: Any
    size: int
    rank: int
    ranks: tuple[int, ...]

    @classmethod
    def single(cls, rank: int = 0) -> "CommGroup":
        return cls(None, 1, 0, (rank,))


def _new_groups(all_groups: list[list[int]], rank: int, backend: str | None) -> CommGroup:
    """Create every group of one kind (all ranks call this identically); return `rank`'s."""
    mine = None
    for members in all_groups:
        pg = dist.new_group(members, backend=backend) if len(members) > 1 else None
        if rank in members:
            mine = CommGroup(pg, len(members), members.index(rank), tuple(members))
    if mine is None:
        raise BridgeError(f"rank {rank} is in none of the groups {all_groups}; build groups from the run's own layout")
    return mine


@dataclass(frozen=True)
class RankGroups:
    """The groups one rank of the reference trainer uses."""

    rank: int
    world: int
    tp: CommGroup
    gtp: CommGroup
    distopt: CommGroup          # dense DistOpt sharding group (DP x CP, GTP excluded)
    data: CommGroup             # GTP x DP x CP: ranks that see different data
    expert_tp: CommGroup
    expert_gtp: CommGroup
    expert_distopt: CommGroup   # expert DP (EGTP excluded)
    ep: CommGroup
    world_group: CommGroup

    @classmethod
    def single(cls) -> "RankGroups":
        """The unsharded reference: every group is this one rank."""
        s = CommGroup.single()
        return cls(0, 1, s, s, s, s, s, s, s, s, s)

    @classmethod
    def build(cls, layout, backend: str | None = None) -> "RankGroups":
        """Create the groups of `layout` inside the initialized default process group."""
        if layout.world == 1 and not dist.is_initialized():
            return cls.single()
        if not dist.is_initialized():
            raise BridgeError(f"layout needs {layout.world} ranks but torch.distributed is not initialized; "
                              "call torch.distributed.init_process_group first")
        rank, world = dist.get_rank(), dist.get_world_size()
        if world != layout.world:
            raise BridgeError(f"layout world size {layout.world} != process group size {world}; "
                              "pass the layout of this process group")
        d, e = layout.dense, layout.expert
        return cls(
            rank, world,
            tp=_new_groups(d.groups("tp"), rank, backend),
            gtp=_new_groups(d.groups("gtp_remat"), rank, backend),
            distopt=_new_groups(d.groups("dp-cp"), rank, backend),
            data=_new_groups(d.groups("gtp_remat-dp-cp"), rank, backend),
            expert_tp=_new_groups(e.groups("tp"), rank, backend),
            expert_gtp=_new_groups(e.groups("gtp_remat"), rank, backend),
            expert_distopt=_new_groups(e.groups("dp"), rank, backend),
            ep=_new_groups(e.groups("ep"), rank, backend),
            world_group=CommGroup(None if world == 1 else dist.group.WORLD, world, rank, tuple(range(world))),
        )


# --- plain collectives (no autograd) ---------------------------------------------------------------

def all_gather_into(out: torch.Tensor, inp: torch.Tensor, group: CommGroup) -> None:
    """`out` = concatenation of every member's `inp` (1-D, member order)."""
    if group.size == 1:
        out.copy_(inp)
        return
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp.contiguous(), group=group.pg)


def reduce_scatter_into(out: torch.Tensor, inp: torch.Tensor, group: CommGroup) -> None:
    """`out` = this member's 1/size slice (dim 0) of the sum of every member's `inp`."""
    if group.size == 1:
        out.copy_(inp)
        return
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, inp.contiguous(), group=group.pg)


def all_reduce(x: torch.Tensor, group: CommGroup, op: str = "sum") -> torch.Tensor:
    """In-place all-reduce (sum or max); returns `x`."""
    if group.size > 1:
        dist.all_reduce(x, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=group.pg)
    return x


# --- autograd collectives ------------------------------------------------------------------------------

class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        return all_reduce(g.contiguous().clone(), ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x.contiguous().clone(), group)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _GatherLastDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        n = x.shape[-1]
        ctx.n = n
        # gather member slices along dim 0 of a moved-last-dim copy, then move back
        xt = x.movedim(-1, 0).contiguous()
        out = torch.empty((group.size * n,) + tuple(xt.shape[1:]), dtype=x.dtype, device=x.device)
        all_gather_into(out.view(-1), xt.view(-1), group)
        return out.movedim(0, -1)

    @staticmethod
    def backward(ctx, g):
        r = ctx.group.rank
        return g[..., r * ctx.n:(r + 1) * ctx.n].contiguous(), None


class _GTPGather(torch.autograd.Function):
    """Shard [S, ...] on each GTP member -> TP-local logical weight [L, ...] (tail padding stripped)."""

    @staticmethod
    def forward(ctx, shard, group, logical_rows):
        ctx.group, ctx.shape = group, tuple(shard.shape)
        full = torch.empty((group.size * shard.shape[0],) + tuple(shard.shape[1:]), dtype=shard.dtype, device=shard.device)
        all_gather_into(full.view(-1), shard.reshape(-1), group)
        return full[:logical_rows]

    @staticmethod
    def backward(ctx, g):
        S = ctx.shape[0]
        padded = torch.zeros((ctx.group.size * S,) + ctx.shape[1:], dtype=g.dtype, device=g.device)
        padded[: g.shape[0]] = g  # padding rows receive zero gradient
        out = torch.empty(ctx.shape, dtype=g.dtype, device=g.device)
        reduce_scatter_into(out.view(-1), padded.view(-1), ctx.group)
        return out, None, None


def gtp_gather(shard: torch.Tensor, group: CommGroup, logical_rows: int) -> torch.Tensor:
    """Differentiable GTP all-gather of a weight shard (padding rows stripped).

    >>> w = torch.arange(6.).view(3, 2).requires_grad_()
    >>> full = gtp_gather(w, CommGroup.single(), 2); full.sum().backward()
    >>> full.shape, w.grad[:, 0].tolist()
    (torch.Size([2, 2]), [1.0, 1.0, 0.0])
    """
    return _GTPGather.apply(shard, group, logical_rows)


class DistTPComm(TPComm):
    """`TPComm` over a TP process group."""

    def __init__(self, group: CommGroup):
        self.group = group
        self.size = group.size
        self.rank = group.rank

    def copy_to_tp(self, x):
        return x if self.size == 1 else _CopyToTP.apply(x, self.group)

    def reduce_from_tp(self, x):
        return x if self.size == 1 else _ReduceFromTP.apply(x, self.group)

    def gather_last_dim(self, x):
        return x if self.size == 1 else _GatherLastDim.apply(x, self.group)


def _gather_dim0(x: torch.Tensor, group: CommGroup) -> torch.Tensor:
    out = torch.empty((group.size * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    all_gather_into(out.view(-1), x.contiguous().view(-1), group)
    return out


def _reduce_scatter_dim0(x: torch.Tensor, group: CommGroup) -> torch.Tensor:
    out = torch.empty((x.shape[0] // group.size,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    reduce_scatter_into(out.view(-1), x.contiguous().view(-1), group)
    return out


class _GatherTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_dim0(x, group)

    @staticmethod
    def backward(ctx, g):
        return _reduce_scatter_dim0(g, ctx.group), None


class _ScatterTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_dim0(x, group)

    @staticmethod
    def backward(ctx, g):
        return _gather_dim0(g, ctx.group), None


class DistEPComm(EPComm):
    """`EPComm` over an expert-parallel process group (all-gather token dispatcher)."""

    def __init__(self, group: CommGroup):
        self.group = group
        self.size = group.size
        self.rank = group.rank

    def gather_tokens(self, x):
        return x if self.size == 1 else _GatherTokens.apply(x, self.group)

    def scatter_tokens(self, x):
        return x if self.size == 1 else _ScatterTokens.apply(x, self.group)
