"""How a memory budget is split: the one place of that arithmetic (issue 32).

A budget is the bytes of host memory an entry point may hold: `--budget` / `ConvertOptions.budget`
(convert), `StreamOptions.budget` (to-maxtext / from-maxtext), `ExportOptions.budget` (live
export). Offline conversions share it evenly between their writer processes (`per_worker`), and
each process spends its share as `split_share` says; a live export spends it as `export_split`
says. `default_budget` (bridge.machine) picks a budget when none is given.

    >>> per_worker(1 << 30, 4) >> 20                  # four writer processes of a 1 GiB budget
    256
    >>> s = split_share(256 << 20); (s.block >> 20, s.cache >> 20, s.batch >> 20)
    (16, 16, 12)
    >>> e = export_split(256 << 20, commit_depth=2); (e.batch >> 20, e.staging >> 20)
    (64, 256)
"""

from __future__ import annotations

from dataclasses import dataclass

# Every writer transaction adds OCDBT B-tree nodes that later commits rewrite; below about 1 MiB of
# data per commit they outgrow the data on disk.
MIN_BATCH_BYTES = 1 << 20


def per_worker(budget: int, workers: int) -> int:
    """Each of `workers` writer processes' share of `budget` (evenly; the parent only plans and
    commits, outside the budget).

    >>> per_worker(10, 3)
    3
    """
    return max(1, int(budget) // max(1, int(workers)))


@dataclass(frozen=True)
class ShareSplit:
    """How one writer process's share of the budget is spent (bytes)."""

    block: int      # one block being assembled (all roles) / one output chunk in hand
    cache: int      # decoded stored chunks kept for the next blocks (convert)
    batch: int      # per writer transaction (one filling + one committing)


def split_share(share: int, *, min_block: int = 1) -> ShareSplit:
    """A sixteenth each for the block being filled and the source chunks kept, a twentieth for the
    writer's batch (at least MIN_BATCH_BYTES); the block at least `min_block`.

    Each costs several times its nominal size (resident bytes measured on the CPU): the writer
    holds a batch filling and one committing, each up to a block beyond its size, plus TensorStore's
    encoded shards (~3x batch + block); a block is assembled next to its master check's cast
    (~1.4x); whole-chunk reads decode next to the raw record (~1.6x). With these fractions the sum
    stays near half the share, the rest covers allocator slack and the per-process state that
    grows with the share (larger fractions overshot the 0.5 GiB + share bound on the GPU host;
    README, tuning constants).

    >>> split_share(192 << 20)
    ShareSplit(block=12582912, cache=12582912, batch=10066329)
    >>> split_share(1 << 20).batch == MIN_BATCH_BYTES, split_share(1 << 10, min_block=4 << 10).block
    (True, 4096)
    """
    q = max(1, share // 16)
    return ShareSplit(block=max(min_block, q), cache=q, batch=max(share // 20, MIN_BATCH_BYTES))


@dataclass(frozen=True)
class ExportSplit:
    """How a live export spends its budget on one rank (bytes)."""

    batch: int      # per writer transaction, and per pinned staging buffer
    staging: int    # the staged writer's buffers together: (commit_depth + 2) batches


def export_split(budget: int, commit_depth: int) -> ExportSplit:
    """A quarter of the budget per writer transaction: the writer holds the batch being filled plus
    the two committing, and GPU staging `commit_depth` + 2 buffers of one batch each (one filling,
    one being handed over, `commit_depth` committing; the writer then references them, no slabs),
    so host memory stays near the budget at the default depth of 2.

    >>> export_split(256 << 20, 2).batch >> 20, export_split(256 << 20, 1).staging >> 20
    (64, 192)
    """
    return staged_split(max(1, int(budget) // 4), commit_depth)


def staged_split(batch: int, commit_depth: int) -> ExportSplit:
    """The staging bytes for writer transactions of `batch` bytes (when the batch is chosen
    elsewhere, e.g. the store's `default_batch_bytes`).

    >>> staged_split(10, 2)
    ExportSplit(batch=10, staging=40)
    """
    return ExportSplit(batch=batch, staging=staging_buffers(commit_depth) * batch)


def staging_buffers(commit_depth: int) -> int:
    """Pinned buffers a staged writer cuts its staging bytes into: one filling, one being handed
    over, `commit_depth` committing (`bridge.live.staging.StagedWriter`).

    >>> staging_buffers(2)
    4
    """
    return max(1, int(commit_depth)) + 2


def save_batch(budget: int) -> int:
    """Bytes per writer transaction of a JAX save held to `budget` bytes in flight (`save(...,
    concurrent_gb=)`): half of it, since the writer holds the batch filling and the one committing
    (at least MIN_BATCH_BYTES).

    >>> save_batch(256 << 20) >> 20, save_batch(1000) == MIN_BATCH_BYTES
    (128, True)
    """
    return max(MIN_BATCH_BYTES, int(budget) // 2)
