"""The logical checkpoint store: Orbax-compatible TensorStore checkpoints written by many processes.

Every writer plans the same catalog and writes only the chunks it owns; one commit publishes:

    plan = make_write_plan([ArraySpec(("params", "w"), (1024, 512), "float32")], num_writers=2)
    claim = begin_checkpoint(dst, coordinator=coord)           # begin: before any writer starts; the claim
    w = CheckpointWriter(claim.tmp, plan, rank)
    for b in plan.lookup(("params", "w")).ownership.boxes_owned_by(rank):
        w.write(("params", "w"), b, full[b.slices])
    w.finish(); finalize(claim, plan, rank, Manifest(), coordinator=coord)  # then: open_checkpoint(dst).read(...)

Where a checkpoint lives is decided once: `open_storage(location)` (a local path, s3://, gs://).

The modules and their roles: docs/ARCHITECTURE.md.
"""

from bridge.store.claim import (Destination, DestinationClaim, check_destination_free, check_sources, claim_destination,
                                tmp_dir_for)
from bridge.store.commit import begin_checkpoint, commit_checkpoint, finalize, publish_checkpoint, save_checkpoint
from bridge.format.manifest import ArrayRecord, Manifest, OptimizerConfig, SourceLayout
from bridge.store.plan import ArrayPlan, ArraySpec, WritePlan, make_write_plan
from bridge.store.reader import ArrayInfo, Checkpoint, open_checkpoint
from bridge.store.storage import LocalStorage, ObjectStorage, Storage, open_storage
from bridge.format.schema import adamw_empty_paths
from bridge.format.tree import megatron_key_to_path, name_to_path, path_to_name
from bridge.store.writer import CheckpointWriter

__all__ = [
    "ArrayInfo", "ArrayPlan", "ArrayRecord", "ArraySpec", "Checkpoint", "CheckpointWriter", "Destination",
    "DestinationClaim", "LocalStorage", "ObjectStorage", "Storage", "open_storage",
    "Manifest", "OptimizerConfig", "SourceLayout", "WritePlan", "adamw_empty_paths", "begin_checkpoint",
    "check_destination_free", "check_sources", "claim_destination", "commit_checkpoint",
    "finalize", "publish_checkpoint", "make_write_plan", "megatron_key_to_path", "name_to_path", "open_checkpoint", "path_to_name",
    "save_checkpoint", "tmp_dir_for",
]
