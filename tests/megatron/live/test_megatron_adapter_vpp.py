"""The live adapter with virtual pipeline chunks (PP2 x VPP2) on the CPU: real PP1 fixture ranks re-cut.

No real PP save exists (it needs two GPUs: issue #23), and the fixture runs have 2 layers, too few
for 2 stages x 2 chunks of several layers. So each recorded PP1 run (`tests/fixtures/megatron/<run>`)
is first widened to 8 layers: layers 2c and 2c+1 are layers 0 and 1 with every value times 1, -1, 2
or -2 for copy c = 0..3 (weights, masters and moments alike: exact, weights stay bf16(masters), and no
layer equals another, so a chunk bound to the wrong layer shows). The 8-layer run is then
cut as megatron-core 0.19.2 builds an interleaved pipeline: stage p holds one model chunk per virtual
stage v, chunk v holding layers `PipelineSplit(pp=2, vpp=2).layers(8, p, v)` (`get_transformer_layer_offset`
with `vp_stage`: stage 0 = layers [0, 1] and [4, 5], stage 1 = [2, 3] and [6, 7]), each chunk naming its layers locally (`decoder.layers.0...`) while its model entries carry the
global layer offset; the embedding is on chunk 0 of stage 0, the final norm and output layer on the
last chunk of the last stage. Each chunk has its own DDP / DistOpt buffer (dense and expert), laid
out alone (`bridge.layout.distopt`), its fragments filled from the PP1 ranks' live-optimizer dumps.

Checked: (1) the adapter's `map_chunks` gives every chunk's parameters their global layer index and
refuses chunk lists that do not match the run; (2) `export_state` over a gloo world of 2·W ranks
writes, bit for bit, the conversion of the run's PP1 `dp_reshardable` save (`gtp-bridge convert`)
widened the same way; (3) `reload_state` fills every chunk's weights and fragments bit-exactly with
the dump's values; (4) `to-megatron --pp 2 --vpp 2 --format dp_reshardable` of the export (given the
PP1 conversion's parameter registration order, widened, as `extra`: the live export records none) is a
VPP save (one buffer per chunk) whose `convert` equals the live export and reloads into the chunks
exactly; (5) tied embeddings: the copy on the last chunk of the last stage is left out of the export
and reloaded; (6) virtual splits megatron-core refuses are refused naming the flags.
"""

from __future__ import annotations

import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from bridge.errors import BridgeError
from bridge.layout.distopt import BufferParam, buffer_layout, owners_of
from bridge.layout.parallel import ParallelLayout
from bridge.store.reader import open_checkpoint
from bridge.live.api import LocalParam, OptimFragment
from converters.megatron.live.adapter import EntryRecord, ParamRecord, entries_from_description, map_chunks
from converters.megatron.plan.naming import strip_wrappers
from converters.megatron.plan.convert_plan import PipelineSplit
from spawn_ranks import spawn
from test_megatron_adapter_pp import ROLES, Staged, _convert, _read_all
from test_megatron_adapter_pp_tied import embedding_main_copy

pytestmark = pytest.mark.slow

PP, VPP, LAYERS = 2, 2, 8
SPLIT = PipelineSplit(pp=PP, vpp=VPP)
LAYER = re.compile(r"^((?:module\.)*decoder\.layers\.)(\d+)\.")


def _scale(copy: int) -> float:
    """Widened copy `copy` (0..3) holds the PP1 values times this: exact in bf16 and fp32 (a sign and a
    power of two), and it keeps weights = bf16(masters), which to-megatron checks."""
    return (-1.0 if copy & 1 else 1.0) * (2.0 if copy & 2 else 1.0)


def mark_np(a: np.ndarray, copy: int) -> np.ndarray:
    """`a` as widened copy `copy` holds it (copy 0: unchanged)."""
    return (a.astype(np.float32) * np.float32(_scale(copy))).astype(a.dtype)


def mark_t(t: torch.Tensor, copy: int) -> torch.Tensor:
    return (t.float() * _scale(copy)).to(t.dtype)


def widen(arrays: dict[str, np.ndarray], pp1_layers: int) -> dict[str, np.ndarray]:
    """A logical checkpoint's arrays with the layer axis widened to LAYERS: copy c of the PP1 layers,
    marked (`mark_np`), holds layers c·pp1_layers ...."""
    k = LAYERS // pp1_layers
    return {n: (np.concatenate([mark_np(a, c) for c in range(k)], axis=0) if ".decoder.layers." in f".{n}" else a)
            for n, a in arrays.items()}


class VStaged(Staged):
    """A PP1 fixture run widened to LAYERS layers and cut into PP x VPP chunks (rank = r + W·p)."""

    def __init__(self, name: str, split: PipelineSplit = SPLIT) -> None:
        super().__init__(name)
        assert LAYERS % self.layers == 0 and LAYERS // self.layers <= 4
        self.split = split

    def _place(self, name: str, p: int, v: int) -> list[tuple[str, int | None]]:
        """(local name in chunk (p, v), global layer or None) of each copy of PP1 param / entry `name`."""
        m = LAYER.match(name)
        if m is None:
            return [(name, None)] if self.split.holds(strip_wrappers(name), p, v) else []
        src = int(m.group(2))
        rng = self.split.layers(LAYERS, p, v)
        return [(f"{m.group(1)}{g - rng.start}." + name[m.end():], g) for g in rng if g % self.layers == src]

    def chunk_records(self, rank: int):
        """Per chunk: (entries, params), and {local name: (PP1 name, global layer or None)}."""
        r, p = self.source(rank)
        rec = self.run.ssd["ranks"][r]
        out = []
        for v in range(VPP):
            entries, params, origin = [], [], {}
            for e in entries_from_description(rec["formats"]["dp_reshardable"]["entries"]):
                for local, g in self._place(e.name, p, v):
                    shape, off = e.global_shape, e.global_offset
                    if g is not None:   # Megatron's (0, global layer, num_layers) sharded offset
                        assert e.prepend_axis_num >= 1 and shape[0] == self.layers
                        shape, off = (LAYERS,) + shape[1:], (g,) + off[1:]
                    entries.append(EntryRecord(local, e.key, shape, off, e.prepend_axis_num, e.replica_id,
                                               e.factory, e.allow_shape_mismatch, e.backlink))
            for n, d in rec["params"].items():
                for local, g in self._place(n, p, v):
                    params.append(ParamRecord.from_attrs(local, d["shape"], d["attrs"]))
                    origin[local] = (n, g)
            out.append(((entries, params), origin))
        return out

    def chunk_mappings(self, rank: int):
        recs = self.chunk_records(rank)
        maps = map_chunks([x for x, _o in recs], self.layout, self.run.dims, self.run.pad, rank, VPP)
        return maps, [o for _x, o in recs]

    def main_copy_of(self, key: str, index: tuple[int, ...]) -> tuple[int, str]:
        return self.main_copy(key, (index[0] % self.layers,) + index[1:] if index else index)

    def chunk_ranges(self, rank: int, cmaps, numels: dict[str, int]) -> dict[str, tuple[int, int]]:
        """This rank's fragment of each param of one chunk, in the chunk's own dense / expert buffer."""
        ranges = {}
        for expert in (False, True):
            mine = [m for m in cmaps if m.geometry.expert == expert]
            group = (self.layout.expert_distopt_group if expert else self.layout.distopt_group)(rank)
            if mine:
                buf = buffer_layout([BufferParam(m.param, numels[m.param], self.shared(m)) for m in mine], None,
                                    len(group))
                ranges.update({m.param: rng for m in mine for d, rng in owners_of(buf, m.param)
                               if d == group.index(rank)})
        return ranges

    def shared(self, m) -> bool:
        """Whether a param has a DDP bucket of its own (`shared_embedding`: tied, see TiedVStaged)."""
        return False

    def local_params(self, rank: int, zero: bool = False):
        """LocalParams of every chunk of a PP2 x VPP2 rank, each chunk's fragments cut from its own buffers."""
        r, _p = self.source(rank)
        ref = self.run.refs[r]
        maps, origins = self.chunk_mappings(rank)
        out, want, key_of = [], [], {}
        for v, (cmaps, origin) in enumerate(zip(maps, origins)):
            numels = {m.param: int(np.prod(ref["params"][origin[m.param][0]]["shape"])) for m in cmaps}
            ranges = self.chunk_ranges(rank, cmaps, numels)
            for m in cmaps:
                name, g = origin[m.param]
                src, sname = (r, name) if m.model_parallel_main else self.main_copy_of(m.key, m.index)
                live = self.run.refs[src]["params"][sname]["live"]
                full = self.full_state(src, sname, m.geometry.expert)
                if g is not None:   # the widened layers: copy g // layers of PP1 layer g % layers
                    c = g // self.layers
                    live, full = mark_t(live, c), {k: mark_t(t, c) for k, t in full.items()}
                f0, f1 = ranges.get(m.param, (0, 0))
                frag_want = {k: t[f0:f1].clone() for k, t in full.items()}
                want.append((v, m, live, frag_want))
                if zero:
                    w, st = torch.zeros_like(live), {k: torch.zeros(f1 - f0) for k in ROLES}
                else:
                    w, st = live, frag_want
                frag = OptimFragment(f0, f1, st["param"], st["exp_avg"], st["exp_avg_sq"]) if f1 > f0 else None
                if zero or m.model_parallel_main:
                    out.append(LocalParam(m.key, m.geometry, w, frag, index=m.index))
                key_of[strip_wrappers(name)] = m.key
        return out, self.live_run(rank, ref, key_of, zero), want


EMB, OUT = "embedding.word_embeddings.weight", "output_layer.weight"


class TiedVStaged(VStaged):
    """`VStaged` with tied embeddings (as test_megatron_adapter_pp_tied.TiedStaged does at PP2): the last
    chunk of the last stage holds the copy of the word embeddings as `output_layer.weight`, its entry keyed
    as the embedding with `replica_id = (1, 0, dp)`; both copies are `shared_embedding` (a DDP bucket of
    their own). The fixture run was untied: the references are its embedding's values."""

    def chunk_records(self, rank: int):
        out = super().chunk_records(rank)
        d = self.layout.coords(rank).d
        for (entries, _params), _origin in out:
            for i, e in enumerate(entries):
                if strip_wrappers(e.key) == OUT:   # as tie_embeddings_and_output_weights_state_dict makes it
                    entries[i] = EntryRecord(e.name, EMB, e.global_shape, e.global_offset, e.prepend_axis_num,
                                             (1, 0, d), e.factory, True, e.backlink)
        return out

    def shared(self, m) -> bool:
        return m.key == EMB

    def local_params(self, rank: int, zero: bool = False):
        self._rank = rank
        return super().local_params(rank, zero)

    def main_copy_of(self, key: str, index: tuple[int, ...]) -> tuple[int, str]:
        return super().main_copy_of(key, index) if key != EMB else embedding_main_copy(self, self._rank)


NAMES = ["tp2", "dp2", "moe_ep2"]


@pytest.mark.parametrize("name", NAMES)
def test_chunks_get_global_layer_indices(name):
    s = VStaged(name)
    seen: dict[tuple[str, tuple[int, ...]], int] = {}
    for rank in range(s.layout.world):
        _r, p = s.source(rank)
        maps, origins = s.chunk_mappings(rank)
        assert len(maps) == VPP
        for v, (cmaps, origin) in enumerate(zip(maps, origins)):
            assert cmaps
            # get_transformer_layer_offset with vp_stage, written out: chunk v of stage p starts at
            # v·L/vpp + p·L/(pp·vpp) and holds L/(pp·vpp) layers
            n = LAYERS // (PP * VPP)
            start = v * (LAYERS // VPP) + p * n
            assert {m.index[0] for m in cmaps if m.index} == set(range(start, start + n))
            for m in cmaps:
                bare = strip_wrappers(m.param)
                if not m.index:
                    if bare.startswith("embedding."):
                        assert (p, v) == (0, 0), m.param
                    else:
                        assert (p, v) == (PP - 1, VPP - 1), m.param
                else:
                    assert int(LAYER.match(m.param).group(2)) == m.index[0] - start   # named locally
                    assert origin[m.param][1] == m.index[0]
                seen[(m.key, m.index)] = seen.get((m.key, m.index), 0) + 1
    # Every logical instance of the widened run is held as often as the PP1 run held its original.
    want: dict[tuple[str, tuple[int, ...]], int] = {}
    for r in range(s.w1):
        for m in s.run.mapping(r):
            for g in (range(m.index[0], LAYERS, s.layers) if m.index else [None]):
                ident = (m.key, (g,) + m.index[1:] if m.index else ())
                want[ident] = want.get(ident, 0) + 1
    assert seen == want


def test_chunk_lists_that_do_not_match_the_run_are_refused():
    s = VStaged("tp2")
    recs = [x for x, _o in s.chunk_records(0)]
    lay, dims, pad = s.layout, s.run.dims, s.run.pad
    with pytest.raises(BridgeError, match="1 model chunk.*virtual pipeline size is 2 "
                                          r"\(--virtual-pipeline-model-parallel-size"):
        map_chunks(recs[:1], lay, dims, pad, 0, VPP)
    with pytest.raises(BridgeError, match="without pipeline stages.*--virtual-pipeline-model-parallel-size"):
        map_chunks(recs, ParallelLayout(tp=2), dims, pad, 0, VPP)
    # Chunks built without their own vp_stage carry the same layer offsets: two chunks, one layer.
    with pytest.raises(BridgeError, match=r"model chunks 0 and 1 both hold decoder\.layers\..*\[4\]; .*vp_stage"):
        map_chunks([recs[1], recs[1]], lay, dims, pad, 0, VPP)
    # A mapping error inside a chunk names the chunk.
    (entries, params) = recs[1]
    with pytest.raises(BridgeError, match=r"model chunk 1: rank 0: parameter .* has no model"):
        map_chunks([recs[0], ([e for e in entries if "linear_proj" not in e.name], params)], lay, dims, pad, 0, VPP)


def _export_worker(rank, world, name, dst, extra=None, tied=False, first=None):
    from dataclasses import replace

    from bridge.live.export import export_state
    from converters.megatron.live.adapter import pipeline_adam_config

    split = SPLIT if first is None else PipelineSplit(pp=PP, vpp=VPP, first=first)
    params, lrun, _ = (TiedVStaged if tied else VStaged)(name, split).local_params(rank)
    # As export_megatron at PP > 1: each stage's optimizer knows only its own no-decay keys.
    lrun = replace(lrun, optimizer=pipeline_adam_config(lrun.optimizer), extra=dict(extra or {}))
    return {"bytes_written": export_state(dst, lrun, params).bytes_written}


def widened_record(conv: str, pp1_layers: int) -> dict:
    """The Megatron record `convert` wrote for the PP1 save (registration order, args), widened to LAYERS.

    `to-megatron --format dp_reshardable` needs it; the live export records none of its own, so the
    export passes it on as `extra` (what `export_megatron(extra=...)` does)."""
    rec = open_checkpoint(conv).manifest.megatron.to_json()
    for p in rec["params"]:
        if p["prepend"]:
            assert p["prepend"][0] == pp1_layers
            p["prepend"][0] = LAYERS
    rec["args"]["num_layers"] = LAYERS
    return {"megatron": rec}


@pytest.fixture(scope="module", params=NAMES)
def exported(request, tmp_path_factory):
    """(VStaged, the PP2 x VPP2 live export, the widened conversion of the PP1 save, that conversion)."""
    name = request.param
    d = tmp_path_factory.mktemp(f"vpp_{name}")
    s = VStaged(name)
    conv = str(d / "converted_pp1")
    _convert(s.run, conv)
    spawn(s.layout.world, _export_worker, (name, str(d / "live"), widened_record(conv, s.layers)), d, timeout_s=300)
    return s, str(d / "live"), widen(_read_all(conv), s.layers), conv


def test_vpp_export_equals_the_widened_convert_of_the_pp1_save(exported):
    s, live, want, conv = exported
    got = _read_all(live)
    assert set(got) == set(want)
    for n, v in want.items():
        assert got[n].dtype == v.dtype and got[n].shape == v.shape and got[n].tobytes() == v.tobytes(), n
    live_m, conv_m = open_checkpoint(live).manifest, open_checkpoint(conv).manifest
    assert live_m.source.pp == PP and live_m.source.world_size == s.layout.world
    assert live_m.optimizer.no_decay and sorted(live_m.optimizer.no_decay) == sorted(conv_m.optimizer.no_decay)


def _assert_reloaded(s: VStaged, src: str) -> list:
    """Reload `src` into every rank's zeroed chunks; every weight and fragment equals the dump's.
    Returns each rank's (rank, LocalParams, references)."""
    from bridge.live.reload import reload_state

    out = []
    for rank in range(s.layout.world):
        params, lrun, want = s.local_params(rank, zero=True)
        assert reload_state(src, lrun, params).step == s.run.info["steps"]
        assert len(params) == len(want)
        chunks_filled = set()
        for lp, (v, m, live, frag) in zip(params, want):
            what = f"PP2xVPP2 rank {rank} {m.key}{list(m.index)}"
            assert lp.weight.view(torch.int16).equal(live.view(torch.int16)), what
            if lp.optim is not None:
                for k, t in lp.optim.tensors().items():
                    ref = frag[{"params": "param", "mu": "exp_avg", "nu": "exp_avg_sq"}[k]]
                    assert t.numel() == ref.numel() > 0, f"{what} {k}"
                    assert t.view(torch.int32).equal(ref.view(torch.int32)), f"{what} {k}"
            if m.index:
                chunks_filled.add(v)
        assert chunks_filled == set(range(VPP))   # every chunk's layers were filled on this rank
        out.append((rank, params, want))
    return out


def test_reload_fills_every_chunk(exported):
    s, live, _want, _conv = exported
    _assert_reloaded(s, live)


@pytest.mark.parametrize("exported", ["tp2"], indirect=True)
def test_tied_vpp_exports_one_embedding_and_reloads_both_copies(exported, tmp_path):
    """Tied: the copy on the last chunk of the last stage is left out of the export (one word-embedding
    array, from chunk 0 of stage 0) and filled on reload, equal to the first stage's copy."""
    s, live, want, _conv = exported
    t = TiedVStaged(s.run.dir.name)
    dst = str(tmp_path / "tied")
    spawn(t.layout.world, _export_worker, ("tp2", dst, None, True), tmp_path, timeout_s=300)
    got = _read_all(dst)
    want = {n: v for n, v in want.items() if f".{OUT}" not in f".{n}"}
    assert len(want) < len(_read_all(live)) and set(got) == set(want)
    for n, v in want.items():
        assert got[n].tobytes() == v.tobytes(), n
    copies: dict[int, list[tuple[int, int, torch.Tensor]]] = {}
    for rank, params, want_r in _assert_reloaded(t, dst):
        for lp, (v, m, _live, _frag) in zip(params, want_r):
            if m.key == EMB:
                copies.setdefault(t.layout.coords(rank).t, []).append((t.source(rank)[1], v, lp.weight))
    assert sorted(copies) == [0, 1]
    for ws in copies.values():   # per TP rank: chunk 0 of stage 0 and the tied copy on chunk 1 of stage 1
        assert sorted((p, v) for p, v, _w in ws) == [(0, 0), (PP - 1, VPP - 1)]
        assert ws[0][2].view(torch.int16).equal(ws[1][2].view(torch.int16))


@pytest.mark.parametrize("exported", ["tp2"], indirect=True)
def test_to_megatron_vpp_save_converts_to_the_live_export(exported, tmp_path):
    """A VPP save at the same layout (to-megatron --tp 2 --pp 2 --vpp 2: a DDP buffer per chunk) converts
    to what the live export wrote, and that conversion reloads into the chunks exactly."""
    s, live, _want, _conv = exported
    run = tmp_path / "run"
    res = subprocess.run([sys.executable, "-m", "bridge.cli", "to-megatron", "--no-scheduler", live, str(run), "--tp", "2", "--pp", "2",
                          "--vpp", "2", "--format", "dp_reshardable"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    from converters.megatron.read.dcp import DcpCheckpoint

    it = next(run.glob("iter_*"))
    assert any(".gbuf_idx_1." in k for k in DcpCheckpoint(str(it)).tensors)
    back = str(tmp_path / "back")
    res = subprocess.run([sys.executable, "-m", "bridge.cli", "convert", str(it), back], capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    got, want = _read_all(back), _read_all(live)
    assert set(got) == set(want)
    for n, v in want.items():
        assert got[n].tobytes() == v.tobytes(), n
    _assert_reloaded(s, back)


@pytest.mark.parametrize("exported", ["tp2"], indirect=True)
@pytest.mark.parametrize("flags,say", [
    (["--pp", "2", "--vpp", "3"], r"4 layers per pipeline stage do not split into 3 virtual chunks: .*--vpp"),
    (["--pp", "1", "--vpp", "2"], r"needs pipeline stages \(PP > 1\): to-megatron's --vpp needs --pp > 1"),
    (["--pp", "2", "--vpp", "2", "--pp-first-layers", "1"],
     r"--decoder-first-pipeline-num-layers 1 does not split into 2 virtual pipeline chunks"),
    (["--pp", "2", "--vpp", "2", "--pp-first-layers", "4", "--pp-last-layers", "4"],
     r"together with --virtual-pipeline-model-parallel-size .*need PP > 2"),
])
def test_impossible_virtual_splits_name_the_flags(exported, flags, say, tmp_path, capsys):
    from bridge.cli import main

    _s, live, _want, _conv = exported
    rc = main(["to-megatron", "--no-scheduler", live, str(tmp_path / "run"), "--tp", "2", "--format", "fully_reshardable", *flags])
    out = capsys.readouterr()
    assert rc == 2 and re.search(say, out.err + out.out), out.err
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------------------------------------
# An uneven virtual split: PP2 x VPP2 with --decoder-first-pipeline-num-layers 2 (megatron-core 0.19.2
# refuses first + last together at PP2 with VPP). Stage 0 holds one layer per chunk, stage 1 three.

UNEVEN_FIRST = 2


@pytest.fixture(scope="module")
def exported_uneven(tmp_path_factory):
    """(VStaged cut unevenly, its live export, the widened conversion of the PP1 save)."""
    d = tmp_path_factory.mktemp("vpp_uneven")
    s = VStaged("tp2", PipelineSplit(pp=PP, vpp=VPP, first=UNEVEN_FIRST))
    conv = str(d / "converted_pp1")
    _convert(s.run, conv)
    spawn(s.layout.world, _export_worker, ("tp2", str(d / "live"), widened_record(conv, s.layers), False,
                                           UNEVEN_FIRST), d, timeout_s=300)
    return s, str(d / "live"), widen(_read_all(conv), s.layers)


def test_uneven_chunks_hold_megatrons_layers(exported_uneven):
    """Every chunk's parameters carry the global layers megatron-core's own placement gives them
    (`megatron_pp_reference`, a transliteration of get_transformer_layer_offset /
    get_num_layers_to_build), named locally from 0."""
    import megatron_pp_reference as mref

    s, _live, _want = exported_uneven
    placed = mref.placement(mref.Config(LAYERS, PP, VPP, UNEVEN_FIRST, None, False, False))
    assert not isinstance(placed, str), placed
    assert [list(placed[(p, v)]) for p in range(PP) for v in range(VPP)] == [[0], [4], [1, 2, 3], [5, 6, 7]]
    for rank in range(s.layout.world):
        _r, p = s.source(rank)
        maps, origins = s.chunk_mappings(rank)
        for v, (cmaps, origin) in enumerate(zip(maps, origins)):
            layers = sorted({m.index[0] for m in cmaps if m.index})
            assert layers == list(placed[(p, v)]), (rank, v, layers)
            for m in cmaps:
                if m.index:
                    assert int(LAYER.match(m.param).group(2)) == m.index[0] - layers[0]
                    assert origin[m.param][1] == m.index[0]


def test_uneven_vpp_export_equals_the_widened_convert_of_the_pp1_save(exported_uneven):
    s, live, want = exported_uneven
    got = _read_all(live)
    assert set(got) == set(want)
    for n, v in want.items():
        assert got[n].dtype == v.dtype and got[n].shape == v.shape and got[n].tobytes() == v.tobytes(), n
    assert open_checkpoint(live).manifest.source.pp == PP


def test_uneven_vpp_reload_fills_every_chunk(exported_uneven):
    s, live, _want = exported_uneven
    _assert_reloaded(s, live)
