"""The live adapter at PP=2 with tied embeddings (`share_embeddings_and_output_weights`), on the CPU.

megatron-core 0.19.2 (`LanguageModule.tie_embeddings_and_output_weights_state_dict`): the last stage
holds a copy of the word embeddings as its `output_layer.weight` parameter; its model entry is keyed
`embedding.word_embeddings.weight` with `replica_id = (1, 0, dp_rank)` (a pipeline replica, never
written). So the adapter binds it to the embedding's logical array as a non-main copy: export leaves
it out (one logical array, written from the first stage) and reload fills it from that array, so
both stages' copies come back equal.

No real PP save exists (issue #23): as in test_megatron_adapter_pp, each PP2 rank is rebuilt from
the recorded `tp2` PP1 fixture run; the last stage's output-layer entry is replaced by the tied entry
Megatron makes. The fixture run itself was untied, so the references are its embedding's values.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bridge.layout.distopt import BufferParam, buffer_layout, owners_of
from bridge.layout.parallel import ParallelLayout
from bridge.store.reader import open_checkpoint
from converters.megatron.live.adapter import EntryRecord, ParamRecord, entries_from_description, map_params
from converters.megatron.plan.naming import strip_wrappers
from spawn_ranks import spawn
from test_megatron_adapter_pp import PP, Staged, _convert, _place, _read_all

pytestmark = pytest.mark.slow

EMB = "embedding.word_embeddings.weight"
OUT = "output_layer.weight"


def test_tied_output_layer_binds_to_the_embedding_as_a_replica():
    """Pure mapping: the last stage's output layer, entry keyed as the embedding with replica_id[0] = 1."""
    lay = ParallelLayout(tp=2, pp=2)
    rank = lay.rank(t=1, p=1)
    e = EntryRecord(OUT, EMB, (72, 24), (36, 0), 0, replica_id=(1, 0, 0), allow_shape_mismatch=True)
    [m] = map_params([e], [ParamRecord(OUT, (36, 24), True, 0)], lay, None, 16, rank)
    assert (m.param, m.key, m.index, m.geometry.tp_kind, m.model_parallel_main) == (OUT, EMB, (), "vocab", False)


def embedding_main_copy(staged: Staged, rank: int) -> tuple[int, str]:
    """The PP1 rank and name of the embedding's main copy holding `rank`'s vocab shard (the tied copy's values)."""
    t = staged.layout.coords(rank).t
    for r in range(staged.w1):
        for m in staged.run.mapping(r):
            if m.key == EMB and m.model_parallel_main and staged.run.layout.coords(r).t == t:
                return r, m.param
    raise AssertionError("no main copy of the embedding")


class TiedStaged(Staged):
    """`Staged` whose last stage's output layer is the tied copy of the word embeddings."""

    def mapping(self, rank: int):
        r, p = self.source(rank)
        rec = self.run.ssd["ranks"][r]
        d = self.layout.coords(rank).d
        entries = []
        for e in entries_from_description(rec["formats"]["dp_reshardable"]["entries"]):
            local = _place(e.name, self.layers, p)
            if local is None:
                continue
            key, rid, mismatch = e.key, e.replica_id, e.allow_shape_mismatch
            if strip_wrappers(e.key) == OUT:   # as tie_embeddings_and_output_weights_state_dict makes it
                key, rid, mismatch = EMB, (1, 0, d), True
            entries.append(EntryRecord(local, key, e.global_shape, e.global_offset, e.prepend_axis_num, rid,
                                       e.factory, mismatch, e.backlink))
        params, origin = [], {}
        for n, x in rec["params"].items():
            local = _place(n, self.layers, p)
            if local is not None:
                params.append(ParamRecord.from_attrs(local, x["shape"], x["attrs"]))
                origin[local] = n
        return map_params(entries, params, self.layout, self.run.dims, self.run.pad, rank), origin

    def local_params(self, rank: int, zero: bool = False):
        self._rank = rank
        return super().local_params(rank, zero)

    def main_copy(self, key: str, index: tuple[int, ...]) -> tuple[int, str]:
        return super().main_copy(key, index) if key != EMB else embedding_main_copy(self, self._rank)

    def stage_fragments(self, rank, maps, origin):
        """As Megatron lays out a tied stage: the embedding (first stage) and its copy (last stage)
        `shared_embedding`, each in a bucket of its own."""
        r, _p = self.source(rank)
        numels = {m.param: int(np.prod(self.run.refs[r]["params"][origin[m.param]]["shape"])) for m in maps}
        group = self.layout.distopt_group(rank)
        buf = buffer_layout([BufferParam(m.param, numels[m.param], m.key == EMB) for m in maps], None, len(group))
        return {m.param: rng for m in maps for d, rng in owners_of(buf, m.param) if d == group.index(rank)}


def test_reload_fills_both_stages_copies_from_the_one_embedding(tmp_path):
    from bridge.live.reload import reload_state

    s = TiedStaged("tp2")
    src = str(tmp_path / "converted_pp1")
    _convert(s.run, src)
    seen = {}
    for rank in range(s.layout.world):
        params, lrun, want = s.local_params(rank, zero=True)
        reload_state(src, lrun, params)
        maps, _ = s.mapping(rank)
        for lp, m in zip(params, maps):
            live, frag = want[m.param]
            what = f"PP2 rank {rank} {m.param}"
            assert lp.weight.view(torch.int16).equal(live.view(torch.int16)), what
            if lp.optim is not None:
                for k, t in lp.optim.tensors().items():
                    ref = frag[{"params": "param", "mu": "exp_avg", "nu": "exp_avg_sq"}[k]]
                    assert t.view(torch.int32).equal(ref.view(torch.int32)), f"{what} {k}"
            if m.key == EMB:
                seen.setdefault(s.layout.coords(rank).t, []).append(lp.weight.clone())
    # the tied copy (last stage) is the embedding's shard (first stage), per TP rank
    assert sorted(len(v) for v in seen.values()) == [2, 2]
    for ws in seen.values():
        assert ws[0].view(torch.int16).equal(ws[1].view(torch.int16))
    assert any(strip_wrappers(m.param) == OUT and m.key == EMB for rank in range(s.layout.world) for m in s.mapping(rank)[0])


def _export_worker(rank, world, dst):
    from dataclasses import replace

    from bridge.live.export import export_state
    from converters.megatron.live.adapter import pipeline_adam_config

    params, lrun, _ = TiedStaged("tp2").local_params(rank)
    lrun = replace(lrun, optimizer=pipeline_adam_config(lrun.optimizer))
    return {"bytes_written": export_state(dst, lrun, params).bytes_written}


def test_export_writes_one_embedding_array(tmp_path):
    """The tied copy is left out: the PP2 export equals the PP1 save's conversion without its output layer
    (the fixture run was untied) — one word-embedding array, written from the first stage."""
    s = TiedStaged("tp2")
    dst = str(tmp_path / "live")
    spawn(s.layout.world, _export_worker, (dst,), tmp_path, timeout_s=300)
    got = _read_all(dst)
    conv = str(tmp_path / "converted_pp1")
    _convert(s.run, conv)
    want = {n: v for n, v in _read_all(conv).items() if ".output_layer." not in f".{n}."}
    assert len(want) < len(_read_all(conv)) and set(got) == set(want)
    for n, v in want.items():
        assert got[n].dtype == v.dtype and got[n].tobytes() == v.tobytes(), n
    assert open_checkpoint(dst).manifest.source.pp == PP
