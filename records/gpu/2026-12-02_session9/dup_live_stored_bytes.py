"""Stored / logical bytes of a live export (world 2, gloo, TP1xGTP2) at the default depth and at depth 1
(a writer subclass forcing commit_depth=1). From the repository root: PYTHONPATH=$PWD python3 <this file> LABEL K
BATCH_KIB,CHUNK_KIB ... (K scales the model: K=4 is 140 MiB)."""
import os, sys, tempfile, shutil, pathlib
sys.path.insert(0, "tests")
import test_live_export_stored_bytes as M
from test_live_sharding import RefModel, RefParam
def model(k):
    return RefModel(params=(
        RefParam("decoder.layers.mlp.linear_fc1.weight", (("gate", (256 * k, 256 * k)), ("up", (256 * k, 256 * k)))),
        RefParam("decoder.layers.self_attention.linear_proj.weight", ((None, (256 * k, 512 * k)),), kind="row"),
        RefParam("embedding.word_embeddings.weight", ((None, (512 * k, 256 * k)),)),
        RefParam("decoder.final_layernorm.weight", ((None, (256 * k,)),), kind="replicated")),
        layers={"decoder.layers.mlp.linear_fc1.weight": 2, "decoder.layers.self_attention.linear_proj.weight": 2}, seed=11)
from test_live_sharding import spawn
from test_live_export import expected_state

def measure(mib_batch_kib, chunk_kib, label, force_depth=None, k=1):
    tmp = pathlib.Path(tempfile.mkdtemp())
    dst = str(tmp / "ck")
    M.BATCH = mib_batch_kib << 10
    _, errors = spawn(2, _export, (dst, mib_batch_kib, chunk_kib, force_depth, k), tmp, timeout_s=400)
    assert not errors, errors
    want = expected_state(model(k), 1, 2, 1, 4, None)
    width = {"model": 2, "params": 4, "mu": 4, "nu": 4}
    logical = sum(a.size * width[r] for r, arrs in want.items() for a in arrs.values())
    stored = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(dst) for f in fs)
    print(f"{label}: batch {mib_batch_kib} KiB chunk {chunk_kib} KiB depth {force_depth or 'default'}: stored/logical {stored/logical:.3f} (logical {logical >> 20} MiB)", flush=True)
    shutil.rmtree(tmp)

def _export(rank, world, dst, batch_kib, chunk_kib, force_depth, k):
    from bridge.layout import ParallelLayout
    from bridge.live.api import AdamConfig, LiveRun
    from bridge.live.export import ExportOptions, export_state
    from bridge.store.writer import CheckpointWriter
    class W(CheckpointWriter):
        def __init__(self, *a, **k):
            if force_depth: k["commit_depth"] = force_depth
            super().__init__(*a, **k)
    params, _ = M.local_params(model(k), 1, 2, 1, 4, rank, None)
    run = LiveRun(ParallelLayout(tp=1, gtp=2, dp=1), rank, 3, AdamConfig(lr=1e-3))
    from bridge import _testing
    with _testing.seams(writer_class=W):
        export_state(dst, run, params, ExportOptions(inflight_bytes=4 * (batch_kib << 10), target_chunk_bytes=chunk_kib << 10))
    return {}

if __name__ == "__main__":
    label = sys.argv[1]
    k = int(sys.argv[2])
    for b, c in [tuple(map(int, x.split(","))) for x in sys.argv[3:]]:
        for d in (None, 1):
            measure(b, c, label, d, k)
