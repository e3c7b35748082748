"""Uneven pipeline splits with virtual pipeline chunks, placed as megatron-core 0.19.2 places them.

`PipelineSplit` (converters/megatron/plan/convert_plan.py) against `megatron_pp_reference`: megatron-core's
`get_num_layers_to_build` / `get_transformer_layer_offset` and its `TransformerConfig` checks written
out line by line (and, where the repository's `.whl/` holds the 0.19.2 wheel, checked against the
wheel's own functions). Then `convert` of a synthetic uneven + VPP save (convert_synth, which places
layers with the same reference) and the round trip convert -> to-megatron --pp --vpp (uneven) ->
convert, the written buckets compared with what convert_synth computes for that layout.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

import convert_synth as synth
import megatron_pp_reference as ref
from bridge.cli import main
from bridge.errors import BridgeError
from converters.megatron.convert import ConvertOptions
from converters.megatron.convert_entry import convert
from converters.megatron.plan.convert_plan import PipelineSplit
from test_convert_megatron import assert_matches
from test_convert_pp2 import _assert_written, cli, ref_of

# (layers, PP, VPP, first, last, embedding in split, loss in split)
GRID = list(itertools.product(range(1, 17), (2, 3, 4), (None, 2, 3), (None, 1, 2, 3, 4, 6), (None, 1, 2, 3, 4, 6),
                              (False, True), (False, True)))


def ours(L, pp, vpp, first, last, emb, loss):
    """(stage, chunk) -> layers by PipelineSplit, or the BridgeError's message."""
    try:
        s = PipelineSplit(pp=pp, first=first, last=last, embedding_in_split=emb, loss_in_split=loss, vpp=vpp or 1)
        return {(p, v): s.layers(L, p, v) for p in range(pp) for v in range(vpp or 1)}
    except BridgeError as e:
        return f"refused: {e}"


def test_layer_placement_is_megatrons_and_refusals_are_megatrons():
    """Every split megatron-core accepts gets its exact placement; every split it refuses (ValueError,
    an assertion, the ZeroDivisionError of PP 2 with first, last and VPP) is refused, as is one it
    accepts but places badly (first + last > layers: overlapping stages)."""
    placed = refused = uneven_vpp = 0
    for L, pp, vpp, first, last, emb, loss in GRID:
        want = ref.placement(ref.Config(L, pp, vpp, first, last, emb, loss))
        if not isinstance(want, str) and sorted(x for r in want.values() for x in r) != list(range(L)):
            want = "broken"
        got = ours(L, pp, vpp, first, last, emb, loss)
        where = dict(L=L, pp=pp, vpp=vpp, first=first, last=last, emb=emb, loss=loss)
        if isinstance(want, str):
            assert isinstance(got, str), (where, want, got)
            refused += 1
        else:
            assert got == want, where
            placed += 1
            uneven_vpp += bool(vpp and (first or last or emb or loss))
    assert placed > 800 and refused > 10000 and uneven_vpp > 150, (placed, refused, uneven_vpp)


def test_counts_are_the_stage_totals():
    s = PipelineSplit(pp=3, vpp=2, first=2, last=2)
    assert s.counts(8) == [2, 4, 2]
    assert PipelineSplit(pp=2, vpp=2, embedding_in_split=True, loss_in_split=True).counts(6) == [3, 3]


def test_the_reference_is_megatrons_own_code():
    """The transliteration against the functions in the megatron-core 0.19.2 wheel (`.whl/`, when present)."""
    fns = ref.wheel_functions(str(Path(__file__).resolve().parents[2]))
    if fns is None:
        pytest.skip("no .whl/megatron_core-0.19.2-*.whl in this checkout")
    checked = 0
    for L, pp, vpp, first, last, emb, loss in GRID:
        c = ref.Config(L, pp, vpp, first, last, emb, loss)
        try:
            ref.post_init_check(c)
        except ValueError:
            continue
        for p in range(pp):
            for v in range(vpp or 1):
                vs = v if vpp else None
                outcome = []
                for f, mine in ((fns["get_num_layers_to_build"], ref.get_num_layers_to_build),
                                (fns["get_transformer_layer_offset"], ref.get_transformer_layer_offset)):
                    res = []
                    for fn in (f, mine):
                        try:
                            res.append(fn(c, vs, p))
                        except (AssertionError, ZeroDivisionError) as e:
                            res.append(type(e).__name__)
                    outcome.append(res)
                    assert res[0] == res[1], (c, p, v, fn.__name__, res)
                checked += 1
    assert checked > 1000


@pytest.mark.parametrize("kw,say", [
    (dict(pp=2, vpp=2, first=2, last=2), r"--decoder-first-pipeline-num-layers and --decoder-last-pipeline-num-layers "
                                         r"together with --virtual-pipeline-model-parallel-size .* need PP > 2"),
    (dict(pp=3, vpp=2, first=1), r"--decoder-first-pipeline-num-layers 1 does not split into 2 virtual"),
    (dict(pp=3, vpp=2, first=2), r"3 layers on each middle pipeline stage do not split into 2 virtual"),
    (dict(pp=2, vpp=3, embedding_in_split=True), r"5 layers per pipeline stage do not split into 3 virtual.*"
                                                 r"--account-for-embedding-in-pipeline-split"),
    (dict(pp=2, first=0), r"--decoder-first-pipeline-num-layers 0 must be a positive integer"),
    (dict(pp=2, first=2, loss_in_split=True), r"cannot be combined with --account-for-embedding"),
])
def test_refusals_name_the_flags(kw, say):
    with pytest.raises(BridgeError, match=say):
        PipelineSplit(**kw).counts(8 if "embedding_in_split" not in kw else 9)


# ---------------------------------------------------------------------------------------------
# convert and to-megatron with uneven virtual pipeline splits (synthetic 0.19.2 saves, real dcp writes)

# 8 layers, VPP 2: case -> (PP, convert_synth.uneven(...), to-megatron flags); (stage, chunk) layers by
# Megatron's formulas: chunk 0 of every stage, then chunk 1 of every stage
SPLITS = {
    "first_last": (3, dict(first=2, last=2), ["--pp-first-layers", "2", "--pp-last-layers", "2"]),
    # [0] | [1, 2] | [3]  then  [4] | [5, 6] | [7]
    "last": (3, dict(last=4), ["--decoder-last-pipeline-num-layers", "4"]),
    # [0] | [1] | [2, 3]  then  [4] | [5] | [6, 7]
    "emb_loss": (5, dict(embedding=True, loss=True), ["--account-for-embedding-in-pipeline-split",
                                                      "--account-for-loss-in-pipeline-split"]),
    # 10 "layers", one per chunk: [] (embedding only) | [0] | [1] | [2] | [3]  then  [4] ... [7] | [] (loss)
}


@pytest.fixture(scope="module")
def pp1(tmp_path_factory):
    """The same tied 8-layer state saved at PP1 and converted (the to-megatron source)."""
    d = tmp_path_factory.mktemp("vpp_uneven")
    with synth.dims(L=8):
        st = synth.make_checkpoint(str(d / "pp1"), "dp_reshardable", tp=1, pp=1, tied=True)
    assert main(["convert", "--workers", "1", str(d / "pp1"), str(d / "pp1_logical")]) == 0
    return d, st


@pytest.mark.slow
@pytest.mark.parametrize("case", ["first_last", "last"])
def test_uneven_virtual_pipeline_save_converts_exactly(case, tmp_path):
    pp, split, _flags = SPLITS[case]
    with synth.dims(L=8), synth.uneven(**split):
        st = synth.make_checkpoint(str(tmp_path / "save"), "dp_reshardable", tp=1, pp=pp, vpp=2, tied=True,
                                   bucket_size=300)
    res = convert(str(tmp_path / "save"), str(tmp_path / "out"), ConvertOptions(workers=1))
    assert res.layout["pp"] == pp
    assert_matches(str(tmp_path / "out"), ref_of(st), 3)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["first_last", "last", "emb_loss"])
def test_to_megatron_uneven_virtual_pipeline_round_trips(pp1, case, tmp_path, capsys):
    """to-megatron --pp P --vpp 2 with an uneven split writes the buckets of each (stage, chunk)
    convert_synth computes from Megatron's placement, records the split in args, and converts back
    to the same logical arrays."""
    d, st = pp1
    pp, split, flags = SPLITS[case]
    rc, out = cli(capsys, "to-megatron", "--no-scheduler", str(d / "pp1_logical"), str(tmp_path / "run"), "--tp", "1", "--pp", str(pp),
                  "--vpp", "2", *flags, "--format", "dp_reshardable", "--bucket-size", "300")
    assert rc == 0 and f"PP={pp}" in out, out
    it = str(tmp_path / "run" / "iter_0000003")
    with synth.dims(L=8), synth.uneven(**split):
        want = synth.model_space_entries(st, 1, False, 1, pp)
        e2, objects = synth.dp_buffers(st, 1, 1, 300, pp, vpp=2)
        want.update(e2)
    ck = _assert_written(it, want, objects)
    args = ck.common_state()["args"]
    assert args.virtual_pipeline_model_parallel_size == 2
    assert (args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers) == \
        (split.get("first"), split.get("last"))
    assert (args.account_for_embedding_in_pipeline_split, args.account_for_loss_in_pipeline_split) == \
        (split.get("embedding", False), split.get("loss", False))
    res = convert(it, str(tmp_path / "back"), ConvertOptions(workers=1))
    assert res.layout["pp"] == pp
    assert_matches(str(tmp_path / "back"), ref_of(st), 3)
