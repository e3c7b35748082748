"""What every writer of one `convert` run shares: one options object handed down the layers
(`convert.write_share` -> `writer_procs.run_parallel` -> a spawned writer -> `convert.run_blocks`)
instead of a chain of positional arguments. Pickled once per writer process (spawn)."""

from __future__ import annotations

from dataclasses import dataclass

from bridge.store import WritePlan


@dataclass(frozen=True)
class WriterJob:
    """The part of a writer's work that is the same for every writer of a conversion (its blocks,
    units and id are its own)."""

    src_root: str           # the Megatron save being read (a directory, or s3:// / gs://)
    plan: WritePlan         # the output's write plan
    tmp: str                # the claimed temporary destination the writers write into
    share: int              # budget bytes of one writer (spent as `bridge.budget.split_share` says)
    force: bool             # keep converting when masters disagree with weights (warning instead)
    defect_suspect: bool    # the save matches megatron-core 0.19.2's multi-bucket defect pattern
    step: int               # the training step recorded in the output
