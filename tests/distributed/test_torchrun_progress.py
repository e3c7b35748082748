"""Rank 0's progress under torchrun counts every rank's bytes (`bridge.torchrun.RankCounter`), through a
real torch.distributed store as the launch's rendezvous store is one; other ranks show nothing."""

from __future__ import annotations

import torch.distributed as dist

from bridge.torchrun import RankCounter


class Bar:
    """A progress bar that records what it was moved by."""

    def __init__(self) -> None:
        self.n = 0

    def update(self, n: int = 1) -> None:
        self.n += n


def test_rank_0_shows_every_ranks_bytes():
    store = dist.PrefixStore("gtpb-progress/test", dist.HashStore())
    bar0, bar1 = Bar(), Bar()
    with RankCounter(store, 0, every_s=0.01).watch(bar0) as mine:
        with RankCounter(store, 1, every_s=3600).watch(bar1) as theirs:   # batched: sent at the end only
            theirs.update(7)
            theirs.update(5)
        mine.update(30)
    assert bar0.n == 42      # rank 0's own 30 and rank 1's 12
    assert bar1.n == 0       # a rank other than 0 shows nothing


def test_without_a_store_rank_0_shows_its_own_bytes():
    bar = Bar()
    with RankCounter(None, 0).watch(bar) as mine:
        mine.update(9)
    assert bar.n == 9
