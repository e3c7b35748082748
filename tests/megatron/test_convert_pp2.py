"""Pipeline parallelism in `convert` / `to-megatron`: tied embeddings, uneven stages, virtual chunks.

CPU only. No real PP > 1 save exists (it needs two GPUs: issue #23); the sources are synthetic
Megatron-Core 0.19.2 saves (`convert_synth`: its own layout code, real `torch.distributed.checkpoint`
writes from real gloo ranks, one per rank). What megatron-core 0.19.2 does, read from its source:

- Tied embeddings at PP > 1 (`LanguageModule.tie_embeddings_and_output_weights_state_dict`): the last
  stage's `output_layer.weight` is saved under the key `embedding.word_embeddings.weight` with
  `replica_id = (1, 0, dp_rank)`, so it is never written; model-space optimizer state (fully_reshardable)
  takes the model entry's replica id, so it is not written either. Its DistOpt buffer does hold the
  copy's master and moments, and `setup_embeddings_and_output_layer` marks both the first stage's
  embedding and that copy `shared_embedding`, which gives each a DDP bucket of its own
  (`DistributedOptimizer._compute_per_buffer_param_layout`).
- Uneven stages: `decoder_first/last_pipeline_num_layers`, `account_for_embedding/loss_in_pipeline_split`
  (`get_num_layers_to_build`, `get_transformer_layer_offset`).

References: the synthetic logical state itself, and the conversion of the same state saved at PP1
(an independent path: no pipeline stages, no shared buckets).
"""

from __future__ import annotations

import numpy as np
import pytest

from bridge.cli import main
from bridge.errors import BridgeError
from bridge.store.reader import open_checkpoint
from converters.megatron.convert import ConvertOptions
from converters.megatron.convert_entry import convert
from converters.megatron.plan.format import Hints
import convert_reference as cref
import convert_synth as synth
from test_convert_megatron import assert_matches

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.slow

EMB = "embedding.word_embeddings.weight"


def cli(capsys, *argv: str) -> tuple[int, str]:
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out + out.err


def ref_of(st: dict) -> dict:
    return {r: dict(v) for r, v in st.items()}


@pytest.fixture(scope="module")
def saves(tmp_path_factory):
    """TP2 x PP2 dp_reshardable, 4 layers split 1 + 3, tied, several buckets; the same state at PP1."""
    d = tmp_path_factory.mktemp("pp2")
    with synth.dims(L=4):
        with synth.uneven(first=1):
            st = synth.make_checkpoint(str(d / "pp2"), "dp_reshardable", tp=2, pp=2, bucket_size=300, tied=True)
        st1 = synth.make_checkpoint(str(d / "pp1"), "dp_reshardable", tp=2, pp=1, bucket_size=300, tied=True)
    convert(str(d / "pp1"), str(d / "pp1_logical"), ConvertOptions(workers=1))
    return d, st, st1


def test_tied_uneven_pp2_converts_exactly(saves, tmp_path):
    """One logical word-embedding array (no output layer), every array bit-exact against the state and
    against the PP1 save's conversion."""
    d, st, st1 = saves
    res = convert(str(d / "pp2"), str(tmp_path / "a"), ConvertOptions(workers=1))
    assert res.layout["pp"] == 2 and not res.warnings
    assert_matches(str(tmp_path / "a"), ref_of(st), 3)
    assert not any("output_layer" in "/".join(p) for p in open_checkpoint(str(tmp_path / "a")).arrays())
    cref.assert_same_checkpoint(str(tmp_path / "a"), str(d / "pp1_logical"))


def test_even_split_of_an_uneven_save_is_refused(saves, tmp_path):
    """A split flag the save was not made with is refused naming each stage's layers in the save (its
    model entries' layer offsets by writing rank) and in the plan, the pipeline flags and the split that
    fits; not the bucket-size flags (the buckets are not at fault). Nothing written."""
    d, _st, _ = saves
    with pytest.raises(BridgeError) as e:
        convert(str(d / "pp2"), str(tmp_path / "x"), ConvertOptions(workers=1, hints=Hints(pp_first=2)))
    msg = str(e.value)
    assert ("its model entries put stage 0: layers 0, stage 1: layers 1-3 (by writing rank), the split from the "
            "flags (--decoder-first-pipeline-num-layers 2) puts stage 0: layers 0-1, stage 1: layers 2-3") in msg, msg
    assert "--decoder-last-pipeline-num-layers" in msg and "--account-for-embedding-in-pipeline-split" in msg
    assert msg.endswith("the save fits --decoder-first-pipeline-num-layers 1") and "--bucket-size" not in msg, msg
    assert not (tmp_path / "x").exists()


def test_bucket_size_flag_fits_the_unbucketed_later_stages(saves, tmp_path):
    """Megatron-LM's training loop buckets only the first stage (training.py `per_chunk_bucket_sizes`);
    the run's --bucket-size must still convert the later stages' single-bucket buffers (dp_reshardable:
    checked against the saved bucket numels; dp_zero_gather_scatter: against the gathered total)."""
    d, st, _ = saves
    convert(str(d / "pp2"), str(tmp_path / "a"), ConvertOptions(workers=1, hints=Hints(bucket_size=300)))
    assert_matches(str(tmp_path / "a"), ref_of(st), 3)
    with synth.dims(L=4):
        st0 = synth.make_checkpoint(str(tmp_path / "zero"), "dp_zero_gather_scatter", tp=1, pp=2, bucket_size=300)
    res = convert(str(tmp_path / "zero"), str(tmp_path / "b"), ConvertOptions(workers=1, hints=Hints(bucket_size=300)))
    assert res.source_format == "dp_zero_gather_scatter"
    assert_matches(str(tmp_path / "b"), ref_of(st0), 3)


LIB_FACTS = ["--num-attention-heads", str(synth.NQ), "--num-query-groups", str(synth.NG), "--kv-channels",
             str(synth.HD), "--swiglu"]


@pytest.mark.parametrize("fmt", ["dp_reshardable", "dp_zero_gather_scatter"])
def test_library_save_infers_the_uneven_split(tmp_path, capsys, fmt):
    """A save without args (dist_checkpointing.save from a library) and no split flag: the uneven split
    is read from the save (each stage's model entries' layer offsets) and reported as inferred; the
    tied output layer is read from the keys (no output_layer entry). A wrong flag is refused naming
    the stages' layers and the fitting flag; the right one converts the same."""
    with synth.dims(L=4), synth.uneven(last=1):
        st = synth.make_checkpoint(str(tmp_path / "lib"), fmt, tp=2, pp=2, tied=True, with_args=False)
    facts = ["--tp", "2", "--pp", "2", *LIB_FACTS]
    rc, out = cli(capsys, "convert", str(tmp_path / "lib"), str(tmp_path / "out"), *facts)
    assert rc == 0, out
    assert ("pipeline split: --decoder-first-pipeline-num-layers 3 (stage 0: layers 0-2, stage 1: layers 3: the model "
            "entries' layer offsets by writing rank)") in out, out
    assert_matches(str(tmp_path / "out"), ref_of(st), 3)
    assert open_checkpoint(str(tmp_path / "out")).manifest.megatron.args["decoder_first_pipeline_num_layers"] == 3
    rc, out = cli(capsys, "convert", str(tmp_path / "lib"), str(tmp_path / "bad"), *facts,
                  "--decoder-last-pipeline-num-layers", "2")
    assert rc == 2 and "puts stage 0: layers 0-1, stage 1: layers 2-3" in out and \
        "the save fits --decoder-first-pipeline-num-layers 3" in out, out
    assert not (tmp_path / "bad").exists()
    rc, out = cli(capsys, "convert", str(tmp_path / "lib"), str(tmp_path / "flag"), *facts,
                  "--decoder-last-pipeline-num-layers", "1")
    assert rc == 0, out
    assert_matches(str(tmp_path / "flag"), ref_of(st), 3)


def test_library_virtual_pipeline_save_infers_the_split(tmp_path, capsys):
    """Virtual pipeline chunks without args: the chunk count from the save's gbuf_idx buffers, the
    interleaved uneven placement (megatron-core's, `megatron_pp_reference`) from the model entries."""
    with synth.dims(L=8), synth.uneven(first=2, last=2):
        st = synth.make_checkpoint(str(tmp_path / "lib"), "dp_reshardable", tp=1, pp=3, vpp=2, tied=True,
                                   with_args=False, bucket_size=300)
    rc, out = cli(capsys, "convert", str(tmp_path / "lib"), str(tmp_path / "out"), "--tp", "1", "--pp", "3", *LIB_FACTS)
    assert rc == 0, out
    # 0.19.2 places 8 layers, PP 3, VPP 2, first 2, last 2 as chunk 0 = [0] [1, 2] [3], chunk 1 = [4] [5, 6] [7]
    assert ("pipeline split: --decoder-first-pipeline-num-layers 2, --decoder-last-pipeline-num-layers 2, "
            "--virtual-pipeline-model-parallel-size 2 (stage 0: layers 0, 4, stage 1: layers 1-2, 5-6, stage 2: "
            "layers 3, 7:") in out, out
    assert_matches(str(tmp_path / "out"), ref_of(st), 3)


def test_recorded_virtual_pipeline_size_that_differs_is_refused(tmp_path):
    """args recording no virtual pipeline for a save with two model chunks per stage: refused naming the
    chunk counts and the split that fits, not the bucket flags."""
    with synth.dims(L=8):
        synth.make_checkpoint(str(tmp_path / "vpp"), "dp_reshardable", tp=1, pp=2, vpp=2, bucket_size=300,
                              extra_args={"virtual_pipeline_model_parallel_size": None})
    with pytest.raises(BridgeError) as e:
        convert(str(tmp_path / "vpp"), str(tmp_path / "x"), ConvertOptions(workers=1))
    msg = str(e.value)
    assert "its model entries put stage 0: layers 0-1, 4-5, stage 1: layers 2-3, 6-7" in msg, msg
    assert "the split from the checkpoint's args (the even split) puts stage 0: layers 0-3" in msg, msg
    assert msg.endswith("the save fits the even split, --virtual-pipeline-model-parallel-size 2"), msg
    assert "--bucket-size" not in msg and not (tmp_path / "x").exists()


def _tamper_tied_copy(entries: dict) -> None:
    """Change one element of the last stage's copy of the embedding master (bucket 0 of the last stage's
    TP rank 0 buffer: the copy is registered last, so it comes first, alone)."""
    key = ("optimizer.distributed.dp_group_idx_2.gbuf_idx_0.dtype_(torch.bfloat16, torch.float32)"
           ".bucket_idx_0.param")
    rank, off, data = entries[key][0]
    data = data.copy()
    data[5] += 1.0
    entries[key][0] = (rank, off, data)


@pytest.mark.parametrize("account", ["embedding", "loss"])
def test_embedding_or_loss_counted_in_the_split_converts_exactly(tmp_path, account):
    """account_for_embedding/loss_in_pipeline_split: 3 layers + the embedding (loss) over 2 stages = 2 each,
    so the first (last) stage holds one layer; compared with the same state saved at PP1."""
    with synth.dims(L=3):
        with synth.uneven(**{account: True}):
            st = synth.make_checkpoint(str(tmp_path / "pp2"), "dp_reshardable", tp=1, pp=2, bucket_size=200)
        synth.make_checkpoint(str(tmp_path / "pp1"), "dp_reshardable", tp=1, pp=1, bucket_size=200)
    convert(str(tmp_path / "pp2"), str(tmp_path / "a"), ConvertOptions(workers=1))
    convert(str(tmp_path / "pp1"), str(tmp_path / "b"), ConvertOptions(workers=1))
    assert_matches(str(tmp_path / "a"), ref_of(st), 3)
    cref.assert_same_checkpoint(str(tmp_path / "a"), str(tmp_path / "b"))
    flag = f"account_for_{account}_in_pipeline_split"
    with pytest.raises(BridgeError, match="3 layers do not split evenly over 2"):   # the flag left out
        convert(str(tmp_path / "pp2"), str(tmp_path / "x"),
                ConvertOptions(workers=1, hints=Hints(**{f"{account}_in_split": False})))
    assert flag in open_checkpoint(str(tmp_path / "a")).manifest.megatron.args


def test_tied_copies_that_differ_are_refused(tmp_path):
    with synth.dims(L=2):
        st = synth.make_checkpoint(str(tmp_path / "bad"), "dp_reshardable", tp=2, pp=2, tied=True,
                                   edit=_tamper_tied_copy)
    with pytest.raises(BridgeError, match=r"tied word embeddings .* differs from the first stage's in 1 of"):
        convert(str(tmp_path / "bad"), str(tmp_path / "x"), ConvertOptions(workers=1))
    assert not (tmp_path / "x").exists()
    res = convert(str(tmp_path / "bad"), str(tmp_path / "forced"), ConvertOptions(workers=1, force=True))
    assert any(w.startswith("FORCED") and "tied word embeddings" in w for w in res.warnings)
    assert_matches(str(tmp_path / "forced"), ref_of(st), 3)   # the first stage's copy is kept


@pytest.mark.parametrize("fmt", ["dp_reshardable", "dp_zero_gather_scatter"])
def test_virtual_pipeline_chunks_convert_exactly(tmp_path, fmt):
    """Virtual pipeline (megatron-core 0.19.2): model-space keys carry global layer offsets, and the
    DistributedOptimizer chains the model chunks' buffers, so dp_reshardable names chunk v's buffer
    `gbuf_idx_v`; chunk v of stage p holds layers (v·pp + p)·n .. +n (n = layers / (pp·vpp)), the embedding
    the first chunk of the first stage, the final norm and the tied copy the last chunk of the last.
    dp_zero_gather_scatter gathers each group's buffers into one object, keyed by gbuf_idx likewise."""
    with synth.dims(L=8):
        st = synth.make_checkpoint(str(tmp_path / "vpp"), fmt, tp=1, pp=2, vpp=2, tied=True,
                                   bucket_size=500 if fmt == "dp_reshardable" else None)
    from converters.megatron.read.dcp import DcpCheckpoint

    if fmt == "dp_reshardable":
        assert any(".gbuf_idx_1." in k for k in DcpCheckpoint(str(tmp_path / "vpp")).tensors)
    res = convert(str(tmp_path / "vpp"), str(tmp_path / "out"), ConvertOptions(workers=1))
    assert res.source_format == fmt
    assert_matches(str(tmp_path / "out"), ref_of(st), 3)
    # a split the save was not made with (here 2 + 6 layers: Megatron accepts it with VPP 2) does not fit its buckets
    with pytest.raises(BridgeError, match=r"its model entries put stage 0: layers 0-1, 4-5, stage 1: layers 2-3, 6-7 "
                                          r"\(by writing rank\), the split from the flags .* puts stage 0: layers "
                                          r"0, 4, stage 1: layers 1-3, 5-7;"):
        convert(str(tmp_path / "vpp"), str(tmp_path / "x"), ConvertOptions(workers=1, hints=Hints(pp_first=2)))
    assert not (tmp_path / "x").exists()


def test_custom_pipeline_layout_bucketed_save_is_refused(tmp_path):
    with synth.dims(L=4):
        synth.make_checkpoint(str(tmp_path / "lay"), "dp_reshardable", tp=1, pp=2,
                              extra_args={"pipeline_model_parallel_layout": "Et|t|tt|tL"})
    with pytest.raises(BridgeError, match="pipeline_model_parallel_layout='Et|t|tt|tL': a custom layer layout"):
        convert(str(tmp_path / "lay"), str(tmp_path / "x"), ConvertOptions(workers=1))
    assert not (tmp_path / "x").exists()


# ---------------------------------------------------------------------------------------------
# to-megatron at PP2, uneven and tied: read back with torch dcp.load, compared with what convert_synth
# computes for the same layout


def _full(chunks: list) -> np.ndarray:
    shape = (0,) * chunks[0][2].ndim
    for _w, off, d in chunks:
        shape = tuple(max(a, o + s) for a, o, s in zip(shape, off, d.shape))
    out = np.zeros(shape, dtype=chunks[0][2].dtype)
    for _w, off, d in chunks:
        out[tuple(slice(o, o + s) for o, s in zip(off, d.shape))] = d
    return out


def _dcp_read(it: str, shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> dict[str, np.ndarray]:
    from torch.distributed.checkpoint import FileSystemReader, load

    sd = {k: torch.empty(s, dtype=dt) for k, (s, dt) in shapes.items()}
    load(sd, storage_reader=FileSystemReader(it), no_dist=True)
    return {k: (v.view(torch.int16).numpy() if v.dtype == torch.bfloat16 else v.numpy()) for k, v in sd.items()}


def _assert_written(it: str, want: dict, objects: dict):
    """The iteration directory holds exactly the tensors `want` (convert_synth's key -> chunks), bit for
    bit as torch dcp.load reads them, and the per-bucket numel objects of `objects`."""
    from converters.megatron.read.dcp import DcpCheckpoint

    ck = DcpCheckpoint(it)
    stored = {k for k in ck.tensors if not k.endswith("_extra_state")}
    assert stored == set(want), sorted(stored ^ set(want))
    full = {k: _full(v) for k, v in want.items()}
    got = _dcp_read(it, {k: (a.shape, torch.bfloat16 if a.dtype != np.float32 else torch.float32)
                         for k, a in full.items()})
    for k, a in full.items():
        assert np.array_equal(cref.bits(got[k]), cref.bits(a)), k
    for name, obj in objects.items():
        if "per_bucket_numel" in name:
            got_obj = ck.read_object(ck.object_key(name))
            if len(got_obj) == 1 and isinstance(got_obj[0], list):   # a ShardedObject payload, wrapped
                got_obj = got_obj[0]
            # (the dtype keys may come back as the safe reader's stand-ins for torch dtypes)
            assert [list(x.values()) for x in got_obj] == [list(x.values()) for x in obj], name
    return ck


@pytest.mark.parametrize("fmt", ["dp_reshardable", "fully_reshardable"])
def test_to_megatron_pp2_uneven_tied_matches_the_synthetic_save(saves, tmp_path, capsys, fmt):
    """to-megatron --tp 2 --pp 2 --pp-first-layers 1 of the PP1 save's conversion writes every tensor
    convert_synth computes for that layout (dp_reshardable: the stages' bucket tensors, shared-embedding
    buckets included, the first stage bucketed as Megatron-LM's training loop does; the per-bucket
    numels), records the split and the tied output layer in args, and converts back to the same
    logical arrays."""
    d, st, _ = saves
    rc, out = cli(capsys, "to-megatron", "--no-scheduler", str(d / "pp1_logical"), str(tmp_path / "run"), "--tp", "2", "--pp", "2",
                  "--pp-first-layers", "1", "--format", fmt, "--bucket-size", "300")
    assert rc == 0 and "PP=2" in out, out
    it = str(tmp_path / "run" / "iter_0000003")
    with synth.dims(L=4), synth.uneven(first=1):
        want = synth.model_space_entries(st, 2, fmt == "fully_reshardable", 1, 2)
        objects = {}
        if fmt == "dp_reshardable":
            e2, objects = synth.dp_buffers(st, 2, 1, 300, 2)
            want.update(e2)
    ck = _assert_written(it, want, objects)
    args = ck.common_state()["args"]
    assert args.decoder_first_pipeline_num_layers == 1 and args.decoder_last_pipeline_num_layers is None
    assert args.untie_embeddings_and_output_weights is False and args.pipeline_model_parallel_size == 2
    res = convert(it, str(tmp_path / "back"), ConvertOptions(workers=1))
    assert res.layout["pp"] == 2
    assert_matches(str(tmp_path / "back"), ref_of(st), 3)


def test_to_megatron_virtual_pipeline_matches_the_synthetic_save(saves, tmp_path, capsys):
    """--pp 2 --vpp 2: one DDP buffer per model chunk (gbuf_idx_v), chunk v of stage p holding layer
    2v + p, as convert_synth's own interleaving places them."""
    d, st, _ = saves
    rc, out = cli(capsys, "to-megatron", "--no-scheduler", str(d / "pp1_logical"), str(tmp_path / "run"), "--tp", "2", "--pp", "2",
                  "--vpp", "2", "--format", "dp_reshardable", "--bucket-size", "300")
    assert rc == 0, out
    it = str(tmp_path / "run" / "iter_0000003")
    with synth.dims(L=4):
        want = synth.model_space_entries(st, 2, False, 1, 2)
        e2, objects = synth.dp_buffers(st, 2, 1, 300, 2, vpp=2)
        want.update(e2)
    ck = _assert_written(it, want, objects)
    assert any(".gbuf_idx_1." in k for k in ck.tensors)
    assert ck.common_state()["args"].virtual_pipeline_model_parallel_size == 2
    convert(it, str(tmp_path / "back"), ConvertOptions(workers=1))
    assert_matches(str(tmp_path / "back"), ref_of(st), 3)


def test_to_megatron_refuses_a_split_megatron_refuses(saves, tmp_path, capsys):
    d, _st, _ = saves
    rc, out = cli(capsys, "to-megatron", "--no-scheduler", str(d / "pp1_logical"), str(tmp_path / "run"), "--tp", "2", "--pp", "3",
                  "--pp-first-layers", "3")
    assert rc == 2 and "4 layers do not split over 3 pipeline stages" in out, out
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------------------------------------
# GTP and EP at PP2: real PP1 fixture runs written at PP2 (each stage's DistOpt buffers, GTP-padded
# shards / local experts per stage) and converted back to the runs' live-optimizer references


@pytest.mark.parametrize("run,flags", [("gtp2_local", ["--tp", "1", "--gtp", "2"]),
                                       ("moe_ep2", ["--tp", "1", "--ep", "2", "--dp", "2"])])
def test_to_megatron_pp2_with_gtp_or_ep_round_trips(run, flags, tmp_path, capsys):
    import os

    src = os.path.join(cref.FIXTURES, run, "dp_reshardable")
    assert cli(capsys, "convert", src, str(tmp_path / "l"))[0] == 0
    rc, out = cli(capsys, "to-megatron", "--no-scheduler", str(tmp_path / "l"), str(tmp_path / "run"), *flags, "--pp", "2",
                  "--format", "dp_reshardable", "--bucket-size", "2000")
    assert rc == 0 and "PP=2" in out, out
    it = str(tmp_path / "run" / "iter_0000003")
    from converters.megatron.read.dcp import DcpCheckpoint

    groups = {k.split(".")[k.split(".").index("distributed") + 1] for k in DcpCheckpoint(it).tensors
              if ".distributed." in k}
    assert len(groups) >= 4, groups       # every stage has its own DistOpt groups
    res = convert(it, str(tmp_path / "back"), ConvertOptions(workers=1))
    assert res.layout["pp"] == 2
    ref, step = cref.load_reference(run)
    assert_matches(str(tmp_path / "back"), ref, step)
