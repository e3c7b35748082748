"""A live export stores each logical byte once (two writer commits in flight, the export's default).

World 2 on gloo (TP1 x GTP2), arrays of 128-512 KiB in chunks of 64 KiB and writer batches of
256 KiB, so every rank's writer commits many transactions with two in flight (host data: the
export's fixed depth 2; device data: `commit_depth` = 2 by default), each into its slot's
database (see tests/store/test_store_commit_slots.py for the duplication that avoids: the live export
did not hit it in the sizes measured, 1.001-1.010 before as well, but goes through the same
writer). The bytes of every file of the checkpoint are compared with the logical bytes computed
from the independently assembled reference state (element counts x the stored width: bf16 model
weights, fp32 master and moments); what remains is the chunk indexes, B-tree nodes and metadata
files, a few KiB."""

from __future__ import annotations

import os

import numpy as np
import pytest

from live_model import expected_state, local_params
from live_reference import RefModel, RefParam
from spawn_ranks import spawn

MODEL = RefModel(
    params=(
        RefParam("decoder.layers.mlp.linear_fc1.weight", (("gate", (256, 256)), ("up", (256, 256)))),
        RefParam("decoder.layers.self_attention.linear_proj.weight", ((None, (256, 512)),), kind="row"),
        RefParam("embedding.word_embeddings.weight", ((None, (512, 256)),)),
        RefParam("decoder.final_layernorm.weight", ((None, (256,)),), kind="replicated"),
    ),
    layers={"decoder.layers.mlp.linear_fc1.weight": 2, "decoder.layers.self_attention.linear_proj.weight": 2},
    seed=11,
)
BATCH = 256 << 10


def _export(rank, world, dst):
    from bridge.layout import ParallelLayout
    from bridge.live.api import AdamConfig, LiveRun
    from bridge.live.export import ExportOptions, export_state

    params, _ = local_params(MODEL, 1, 2, 1, 4, rank, None)
    run = LiveRun(ParallelLayout(tp=1, gtp=2, dp=1), rank, 3, AdamConfig(lr=1e-3))
    export_state(dst, run, params, ExportOptions(budget=4 * BATCH, target_chunk_bytes=64 << 10))
    return {}


@pytest.mark.slow
def test_live_export_stores_the_logical_bytes_once(tmp_path):
    from bridge.budget import export_split
    from bridge.store.reader import open_checkpoint

    assert export_split(4 * BATCH, 2).batch == BATCH  # (the batch the test means to use)
    dst = str(tmp_path / "ck")
    _, errors = spawn(2, _export, (dst,), tmp_path, timeout_s=240)
    assert not errors, errors
    want = expected_state(MODEL, 1, 2, 1, 4, None)
    width = {"model": 2, "params": 4, "mu": 4, "nu": 4}
    logical = sum(a.size * width[root] for root, arrays in want.items() for a in arrays.values())
    assert logical > 30 * BATCH  # many transactions per writer
    stored = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(dst) for f in fs)
    assert logical <= stored < logical * 1.01 + (64 << 10), (stored, logical, stored / logical)
    assert all(os.path.isdir(os.path.join(dst, f"ocdbt.process_{r}.1")) for r in range(2))  # two slots each
    ck = open_checkpoint(dst)  # and it is the reference state
    name, arr = next(iter(want["params"].items()))
    from bridge.format.tree import megatron_key_to_path

    got = ck.read(("params",) + megatron_key_to_path(name)).astype(np.float32)
    assert np.array_equal(got.view(np.uint32), arr.view(np.uint32)), name
