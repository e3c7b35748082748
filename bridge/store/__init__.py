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

# The public face: code outside bridge/store imports from here only (`from bridge.store import ...`),
# never a submodule (counted by tests/repo/test_store_face.py). The submodules stay the store's own.
# Importing it loads numpy but neither TensorStore, torch nor JAX (they load on first use).

# claim & commit: who owns a destination, and the one commit every writer ends with
from bridge.store.claim import (TMP_SUFFIX, Destination, DestinationClaim, check_destination_free, check_sources,
                                claim_destination, tmp_dir_for)
from bridge.store.commit import (begin_checkpoint, commit_checkpoint, finalize, publish_checkpoint,
                                 save_checkpoint)
# plan & writer: the catalog, chunk ownership, the writers and their staging grid
from bridge.store.plan import ArrayPlan, ArraySpec, WritePlan, make_write_plan
from bridge.store.staging import cells_are_row_runs, grid_cells
from bridge.store.writer import CheckpointWriter, default_batch_bytes
# reader: opening a committed checkpoint, its integrity check
from bridge.store.reader import ArrayInfo, Checkpoint, find_checkpoint_root, one_line, open_checkpoint, open_root
from bridge.store.verify import VerifyResult, verify_checkpoint
# storage & byte sources: where a checkpoint lives (chosen once) and ranged reads of its files
from bridge.store.storage import LocalStorage, ObjectStorage, Storage, open_storage
from bridge.store.ranged import RangeReader, open_range
from bridge.store.sources import check_relative_path, short_value, source_of
# manager steps: Orbax CheckpointManager roots (`<root>/<step>/default`)
from bridge.store.manager import ITEM, begin_step, check_step_free, commit_step, write_step
# durable file helpers: fsync and JSON as the store writes them
from bridge.store.durable import fsync_path, fsync_tree, json_bytes
# specs: chunking of arrays as every writer lays it out
from bridge.store.specs import DEFAULT_INNER_CHUNK_BYTES, divisors, inner_chunk_shape, max_chunk_bytes
# the checkpoint's schema (owned by bridge.format), re-exported for writers of a store
from bridge.format.manifest import ArrayRecord, Manifest, OptimizerConfig, SourceLayout
from bridge.format.schema import adamw_empty_paths
from bridge.format.tree import megatron_key_to_path, name_to_path, path_to_name

__all__ = [
    # claim & commit
    "Destination", "DestinationClaim", "TMP_SUFFIX", "begin_checkpoint", "check_destination_free", "check_sources",
    "claim_destination", "commit_checkpoint", "finalize", "publish_checkpoint",
    "save_checkpoint", "tmp_dir_for",
    # plan & writer
    "ArrayPlan", "ArraySpec", "CheckpointWriter", "WritePlan", "cells_are_row_runs", "default_batch_bytes",
    "grid_cells", "make_write_plan",
    # reader
    "ArrayInfo", "Checkpoint", "VerifyResult", "find_checkpoint_root", "one_line", "open_checkpoint", "open_root",
    "verify_checkpoint",
    # storage & byte sources
    "LocalStorage", "ObjectStorage", "RangeReader", "Storage", "check_relative_path", "open_range", "open_storage",
    "short_value", "source_of",
    # manager steps
    "ITEM", "begin_step", "check_step_free", "commit_step", "write_step",
    # durable file helpers
    "fsync_path", "fsync_tree", "json_bytes",
    # specs
    "DEFAULT_INNER_CHUNK_BYTES", "divisors", "inner_chunk_shape", "max_chunk_bytes",
    # schema
    "ArrayRecord", "Manifest", "OptimizerConfig", "SourceLayout", "adamw_empty_paths", "megatron_key_to_path",
    "name_to_path", "path_to_name",
]
