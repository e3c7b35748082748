"""Single-process checks of the live exporter's pure parts: planning, staging, FP8, binding, errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bridge.errors import BridgeError
from bridge.layout import FusedSpec, ParallelLayout, ParamGeometry
from bridge.layout.boxes import Box
from bridge.live.api import LocalParam, OptimFragment, QuantizedWeight
from bridge.live.fp8 import bind_optimizer_state, dequantize, quantize_into
from bridge.live.holdings import RankSummary, rank_holdings, tree_name
from bridge.live.plan import build_plan
from bridge.live.staging import StagedWriter, WriteItem, split_rows


def _summary(params, layout, rank, with_optim=True):
    hs, cat = rank_holdings(params, layout, rank, with_optim)
    return RankSummary(cat, tuple(h.describe() for h in hs))


def _w(shape, fill=0.0):
    return torch.full(shape, fill, dtype=torch.bfloat16)


def test_plan_replicas_owners_keep_local_and_every_element_written_once():
    """DP replicas of a column weight + a fragment split over DP: every element written exactly once."""
    lay = ParallelLayout(tp=1, gtp=2, dp=2)
    geom = ParamGeometry("w", (10, 6), "column", gtp=True, pad_for_alignment=4)  # S=8? (a*G=8: pad 6, S=8)
    shape = geom.physical_shape(1, 2)
    n = int(np.prod(shape))
    sums = []
    for r in range(4):
        d = r // 2
        f0, f1 = (0, 20) if d == 0 else (20, n)
        frag = OptimFragment(f0, f1, torch.zeros(f1 - f0), torch.zeros(f1 - f0), torch.zeros(f1 - f0))
        sums.append(_summary([LocalParam("w", geom, _w(shape), frag)], lay, r))
    plan = build_plan(sums, tree_name, target_chunk_bytes=16)
    for spec in plan.catalog:
        hit = np.zeros(spec.shape, np.int32)
        for t in plan.transfers:
            if t.array == spec.name:
                assert t.src.box.contains(t.box)
                assert plan.ownership[spec.name].owner_of(t.box) == t.dst  # inside chunks its destination owns
                hit[t.box.slices] += 1
        assert (hit == 1).all(), spec.name
    # the model array's chunks went to DP replicas that hold them: nothing moves for weights
    assert all(t.src.rank == t.dst for t in plan.transfers if t.array.startswith("model."))
    # a DP cut inside row 3 (flat 20 of 6-wide rows): some optimizer bytes do move
    assert plan.moved_bytes() > 0
    assert sum(plan.send_splits(0)) == sum(plan.split_bytes(0, d) for d in range(4) if d != 0)


def test_plan_names_missing_optimizer_state_and_disagreeing_replicas():
    lay = ParallelLayout(tp=1, gtp=1, dp=2)
    geom = ParamGeometry("w", (4, 4), "replicated")
    frag = OptimFragment(0, 8, *(torch.zeros(8) for _ in range(3)))
    sums = [_summary([LocalParam("w", geom, _w((4, 4)), frag)], lay, r) for r in range(2)]
    with pytest.raises(BridgeError, match=r"params\.w: no rank holds optimizer state for element \(2, 0\)"):
        build_plan(sums, tree_name)
    sums[1] = RankSummary({tree_name("model", "w"): ((4, 4), "float32")}, ())
    with pytest.raises(BridgeError, match="model.w: rank 0 holds it as bfloat16"):
        build_plan(sums, tree_name)


def test_main_replica_false_copies_are_not_sources():
    lay = ParallelLayout(tp=1, gtp=1, dp=2)
    geom = ParamGeometry("w", (4, 4), "replicated")
    sums = [_summary([LocalParam("w", geom, _w((4, 4), r), None, main_replica=(r == 1))], lay, r, False)
            for r in range(2)]
    plan = build_plan(sums, tree_name)
    assert {t.src.rank for t in plan.transfers} == {1}


def test_holdings_reject_bad_shapes_ranges_and_duplicates():
    lay = ParallelLayout(tp=2, gtp=1, dp=1)
    geom = ParamGeometry("w", (8, 4), "column")
    with pytest.raises(BridgeError, match=r"rank 1: w: weight shard has shape \(8, 4\).*\(4, 4\)"):
        rank_holdings([LocalParam("w", geom, _w((8, 4)))], lay, 1, False)
    frag = OptimFragment(10, 20, *(torch.zeros(10) for _ in range(3)))
    with pytest.raises(BridgeError, match=r"optimizer range \[10, 20\) is outside the physical shard of 16"):
        rank_holdings([LocalParam("w", geom, _w((4, 4)), frag)], lay, 0, True)
    with pytest.raises(BridgeError, match="listed twice"):
        rank_holdings([LocalParam("w", geom, _w((4, 4)))] * 2, lay, 0, False)
    with pytest.raises(BridgeError, match="QuantizedWeight"):
        rank_holdings([LocalParam("w", geom, torch.zeros(4, 4).to(torch.float8_e4m3fn))], lay, 0, False)


def test_fused_sections_become_sibling_arrays():
    lay = ParallelLayout()
    geom = ParamGeometry("m.fc1.weight", (12, 2), "column", fused=FusedSpec.swiglu(6))
    hs, cat = rank_holdings([LocalParam(geom.name, geom, _w((12, 2)))], lay, 0, False)
    assert sorted(cat) == ["model.m.fc1.weight.gate", "model.m.fc1.weight.up"]
    assert [p.array for p in hs[0].pieces] == ["m.fc1.weight.gate", "m.fc1.weight.up"]


def test_dequantize_per_tensor_and_per_block_against_numpy():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 7)).astype(np.float32)
    data = torch.from_numpy(x).to(torch.float8_e4m3fn)
    sinv = torch.tensor([[0.5, 2.0], [4.0, 0.25], [3.0, 1.0]])  # block (2, 4): grid 3 x 2
    got = dequantize(QuantizedWeight(data, sinv, (2, 4))).float().numpy()
    grid = np.repeat(np.repeat(sinv.numpy(), 2, 0), 4, 1)[:5, :7]
    import ml_dtypes

    want = (data.float().numpy() * grid).astype(ml_dtypes.bfloat16).astype(np.float32)
    assert np.array_equal(got, want)
    q = QuantizedWeight(data, torch.tensor([0.125]))
    assert np.array_equal(dequantize(q).float().numpy(),
                          (data.float().numpy() * 0.125).astype(ml_dtypes.bfloat16).astype(np.float32))
    with pytest.raises(BridgeError, match="too small"):
        dequantize(QuantizedWeight(data, torch.ones(2, 2), (2, 4)))


def test_quantize_into_round_trips_within_fp8_precision():
    x = torch.linspace(-3, 5, 35).reshape(5, 7)
    for block in (None, (2, 4)):
        q = QuantizedWeight(torch.zeros(5, 7, dtype=torch.float8_e4m3fn),
                            torch.ones(1) if block is None else torch.ones(3, 2), block)
        quantize_into(q, x)
        back = q.data.float() * (q.scale_inv.reshape(()) if block is None else
                                 q.scale_inv.repeat_interleave(2, 0)[:5].repeat_interleave(4, 1)[:, :7])
        assert torch.allclose(back, x, rtol=2 ** -3, atol=1e-6)


def test_bind_optimizer_state_follows_backlinks_and_names_unmatched():
    geom = ParamGeometry("w", (2, 2))
    live = QuantizedWeight(torch.zeros(2, 2, dtype=torch.float8_e4m3fn), torch.ones(1))
    frag = OptimFragment(0, 4, *(torch.zeros(4) for _ in range(3)))
    out = bind_optimizer_state([("w", geom, live.dequantize())], [(live, frag)])
    assert out[0].optim is frag and out[0].weight is live
    other = torch.zeros(2, 2)
    other._debug_name = "decoder.orphan.weight"
    with pytest.raises(BridgeError, match="decoder.orphan.weight"):
        bind_optimizer_state([("w", geom, live.dequantize())], [(live, frag), (other, frag)])
    # identity of the dequantized copy is not the live param: without the backlink nothing binds
    copy = live.dequantize()
    del copy._gtp_dequant_src
    with pytest.raises(BridgeError, match="matches no model entry"):
        bind_optimizer_state([("w", geom, copy)], [(live, frag)])


def test_staging_splits_rows_and_writes_every_element_once():
    item = WriteItem("a", Box((2, 0), (7, 3)), torch.arange(15.0).reshape(5, 3))
    parts = list(split_rows(item, 4))
    assert [p.box for p in parts][0] == Box((2, 0), (3, 3)) and sum(p.box.size for p in parts) == 15
    tiny = list(split_rows(WriteItem("a", Box((0, 0), (1, 5)), torch.arange(5.0).reshape(1, 5)), 2))
    assert [str(p.box) for p in tiny] == ["[0:1, 0:2]", "[0:1, 2:4]", "[0:1, 4:5]"]
    out = np.zeros((7, 3), np.float32)

    class Sink:  # a writer that copies into `out`
        def write(self, name, box, data, donate=False):
            out[box.slices] = data

    StagedWriter(Sink(), 64, donate=False).write_items([item])
    assert np.array_equal(out[2:7], np.arange(15.0).reshape(5, 3))


def test_wire_blocks_keep_every_piece_aligned():
    """Odd-sized bf16 pieces next to fp32 ones, from two sources: every received view is aligned."""
    from bridge.layout.chunks import ArrayOwnership
    from bridge.live.export import _received_items
    from bridge.live.plan import ExportPlan, Source, Transfer
    from bridge.store.plan import ArraySpec

    cat = [ArraySpec(("model", "a"), (3, 1), "bfloat16"), ArraySpec(("params", "b"), (2, 1), "float32")]
    own = {c.name: ArrayOwnership(c.shape, c.shape, np.array([[1]], np.int32)) for c in cat}
    tr = []
    for src in (0, 2):
        tr.append(Transfer(Source("model.a", Box((0, 0), (3, 1)), src, 0, 0, 0), Box((0, 0), (3, 1)), 1))
        tr.append(Transfer(Source("params.b", Box((0, 0), (2, 1)), src, 1, 0, 0), Box((0, 0), (2, 1)), 1))
    plan = ExportPlan(3, cat, own, tr, {"model.a": 2, "params.b": 4})
    assert plan.recv_splits(1) == [16, 0, 16] and plan.payload_bytes(0, 1) == 14
    recv = torch.arange(32, dtype=torch.uint8)
    items = _received_items(plan, recv, 1, {"model.a": torch.bfloat16, "params.b": torch.float32})
    assert [(it.name, it.data.dtype) for it in items] == [("params.b", torch.float32), ("model.a", torch.bfloat16)] * 2
    assert items[2].data.view(torch.uint8).reshape(-1).tolist() == list(range(16, 24))  # second block starts at 16


@pytest.mark.parametrize("module", ["bridge.live.fp8", "bridge.live.fp8_scales", "bridge.live.exchange", "bridge.live.holdings", "bridge.live.plan",
                                    "bridge.live.staging", "bridge.live.reload", "bridge.live.export",
                                    "bridge.live.snapshot"])
def test_doctests(module):
    import doctest
    import importlib

    res = doctest.testmod(importlib.import_module(module), optionflags=doctest.ELLIPSIS)
    assert res.attempted > 0 and res.failed == 0, res


def test_staging_batches_fit_the_half_budget_with_aligned_slots():
    from bridge.live.staging import ALIGN, _batches, _slot

    items = [WriteItem("a", Box((0, 0), (3, 3)), torch.zeros(3, 3, dtype=torch.bfloat16)),   # 18 bytes -> slot 32
             WriteItem("b", Box((0,), (40,)), torch.zeros(40)),                              # 160 bytes: split
             WriteItem("c", Box((0,), (1,)), torch.zeros(1, dtype=torch.bfloat16))]
    half = 64
    batches = _batches(items, half)
    assert all(sum(_slot(p) for p in b) <= half for b in batches)
    assert all(_slot(p) % ALIGN == 0 for b in batches for p in b)
    got = {}
    for b in batches:
        for p in b:
            got[p.name] = got.get(p.name, 0) + p.box.size
    assert got == {"a": 9, "b": 40, "c": 1}


def test_reload_names_a_missing_array_and_a_wrong_shape(tmp_path):
    """Before reading anything, reload checks that every array it needs exists with its shape."""
    from bridge.testing.trainer import ReferenceTrainer
    from bridge.live.reload import _jobs, reload_state
    from bridge.store import save_checkpoint
    from bridge.format.tree import name_to_path

    tr = ReferenceTrainer(ParallelLayout(), init=False)
    run, params = tr.live_run(), tr.local_params()
    shapes = {tree_name(j.root, a): tuple(s) for p in params for j in _jobs(p, run, False)
              for a, s in j.param.geometry.logical_arrays().items()}
    arrays = {name_to_path(n): np.zeros(s, np.float32) for n, s in shapes.items()}
    gone, odd = list(arrays)[:2]
    save_checkpoint(str(tmp_path / "missing"), {p: a for p, a in arrays.items() if p != gone})
    with pytest.raises(BridgeError, match=f"has no array {'/'.join(gone)} needed by"):
        reload_state(str(tmp_path / "missing"), run, params)
    arrays[odd] = np.zeros((arrays[odd].shape[0] + 1,) + arrays[odd].shape[1:], np.float32)
    save_checkpoint(str(tmp_path / "shape"), arrays)
    with pytest.raises(BridgeError, match=f"{'/'.join(odd)}: checkpoint shape .* expected by"):
        reload_state(str(tmp_path / "shape"), run, params)
