"""The live adapter at PP=2 on the CPU: real PP1 fixture ranks re-cut into two pipeline stages.

Runs: `tp2` (TP2), `dp2` (DP2: each stage's DistOpt buffer splits differently from the PP1 one),
`moe_ep2` (EP2, dense and expert buffers per stage). No real PP save exists yet (it needs two GPUs: issue #23), so each rank of a PP=2 run is rebuilt
from a recorded PP=1 fixture run (`tests/fixtures/megatron/<run>`) the way Megatron-Core 0.19.2
builds a stage: the stage keeps its own layers, named locally (`decoder.layers.0...` on every
stage) while their model entries keep the global layer offset (`TransformerBlock.sharded_state_dict`:
`sharded_offsets = ((0, layer_number - 1, num_layers),)`); the embedding stays on the first stage,
the final norm and the (untied) output layer on the last. Each stage has its own DistOpt buffer:
the fragments are cut from that stage's buffer laid out alone (`bridge.layout.distopt`), filled
from the masters / moments the PP1 ranks' reference dumps hold.

Checked: (1) the adapter's `map_params` gives every stage's parameter its global layer index;
(2) `export_state` over a gloo world of 2·W ranks (the stages' optimizer settings merged by
`pipeline_adam_config`, as `export_megatron` does) writes, bit for bit, what `gtp-bridge convert`
makes of the same run's PP1 `dp_reshardable` save; (3) `reload_state` of that converted checkpoint
fills every PP2 rank's weights and per-stage fragments bit-exactly with the PP1 dump's values.
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
from bridge.live.api import AdamConfig, LiveRun, LocalParam, OptimFragment
from converters.megatron.live.adapter import (EntryRecord, ParamRecord, adam_config_from_groups,
                                              entries_from_description, map_params, merge_adam_configs)
from converters.megatron.plan.naming import strip_wrappers
from spawn_ranks import spawn
from test_megatron_adapter import Run

pytestmark = pytest.mark.slow

PP = 2
LAYER = re.compile(r"^((?:module\.)*decoder\.layers\.)(\d+)\.")
ROLES = ("param", "exp_avg", "exp_avg_sq")  # the reference dump's names of a fragment's tensors


def _place(name: str, num_layers: int, p: int) -> str | None:
    """`name` as stage `p` of an even PP split names it, or None when another stage holds it."""
    m = LAYER.match(name)
    per = num_layers // PP
    if m is None:
        bare = strip_wrappers(name)
        first = bare.startswith("embedding.")
        return name if (p == 0) == first else None
    g = int(m.group(2))
    if not p * per <= g < (p + 1) * per:
        return None
    return f"{m.group(1)}{g - p * per}." + name[m.end():]


class Staged:
    """A PP1 fixture run seen as a PP=2 run of twice the world (order tp-cp-ep-dp-pp: rank = r + W·p)."""
    def __init__(self, name: str) -> None:
        self.run = Run(name)
        lay = self.run.layout
        self.w1 = lay.world
        self.layout = ParallelLayout(tp=lay.tp, gtp=lay.gtp, dp=lay.dp, ep=lay.ep, pp=PP)
        self.layers = self.run.info["sizes"]["num_layers"]

    def source(self, rank: int) -> tuple[int, int]:
        """(PP1 rank with the same TP / GTP / DP coordinates, stage)."""
        c = self.layout.coords(rank)
        r = rank % self.w1
        c1 = self.run.layout.coords(r)
        assert c.p == rank // self.w1 and (c1.t, c1.g, c1.d, c1.e) == (c.t, c.g, c.d, c.e)
        return r, c.p

    def mapping(self, rank: int):
        """The adapter's mapping of this stage rank, and {local param name: PP1 param name}."""
        r, p = self.source(rank)
        rec = self.run.ssd["ranks"][r]
        entries = []
        for e in entries_from_description(rec["formats"]["dp_reshardable"]["entries"]):
            local = _place(e.name, self.layers, p)
            if local is not None:  # the global offset is kept: Megatron's entries carry it
                entries.append(EntryRecord(local, e.key, e.global_shape, e.global_offset, e.prepend_axis_num,
                                           e.replica_id, e.factory, e.allow_shape_mismatch, e.backlink))
        params, origin = [], {}
        for n, d in rec["params"].items():
            local = _place(n, self.layers, p)
            if local is not None:
                params.append(ParamRecord.from_attrs(local, d["shape"], d["attrs"]))
                origin[local] = n
        return map_params(entries, params, self.layout, self.run.dims, self.run.pad, rank), origin

    def main_copy(self, key: str, index: tuple[int, ...]) -> tuple[int, str]:
        """(PP1 rank, param name) of the copy of a logical instance Megatron writes."""
        for r in range(self.w1):
            for m in self.run.mapping(r):
                if (m.key, m.index) == (key, index) and m.model_parallel_main:
                    return r, m.param
        raise AssertionError(f"no main copy of {key}{list(index)}")

    def full_state(self, r: int, pp1_name: str, expert: bool) -> dict[str, torch.Tensor]:
        """The flat fp32 master / moments of PP1 rank r's shard of a param, joined from its DistOpt group's dumps."""
        key = strip_wrappers(pp1_name)
        numel = int(np.prod(self.run.refs[r]["params"][pp1_name]["shape"]))
        out = {k: torch.full((numel,), float("nan")) for k in ROLES}
        lay = self.run.layout
        for peer in (lay.expert_distopt_group(r) if expert else lay.distopt_group(r)):
            for o in self.run.refs[peer]["optimizers"]:
                for n, rec in o["params"].items():
                    if strip_wrappers(n) == key:
                        f0, f1 = rec["range"]["param"]
                        for k in ROLES:
                            out[k][f0:f1] = rec[k].reshape(-1)
        assert not any(t.isnan().any() for t in out.values()), f"{key}: the PP1 dumps do not cover it"
        return out

    def stage_fragments(self, rank: int, maps, origin) -> dict[str, tuple[int, int]]:
        """This rank's fragment range of each param in its stage's own DistOpt buffers (dense, expert;
        one bucket each)."""
        r, _p = self.source(rank)
        numels = {m.param: int(np.prod(self.run.refs[r]["params"][origin[m.param]]["shape"])) for m in maps}
        out = {}
        for expert in (False, True):
            mine = [m for m in maps if m.geometry.expert == expert]
            group = (self.layout.expert_distopt_group if expert else self.layout.distopt_group)(rank)
            if mine:
                buf = buffer_layout([BufferParam(m.param, numels[m.param]) for m in mine], None, len(group))
                out.update({m.param: rng for m in mine for d, rng in owners_of(buf, m.param) if d == group.index(rank)})
        return out

    def local_params(self, rank: int, zero: bool = False) -> tuple[list[LocalParam], LiveRun, dict]:
        """LocalParams of a PP2 rank: the PP1 dump's data (or zeros, for reload) in the stage's shapes."""
        r, _p = self.source(rank)
        ref = self.run.refs[r]
        maps, origin = self.mapping(rank)
        ranges = self.stage_fragments(rank, maps, origin)
        out, want = [], {}
        for m in maps:
            # A TP / GTP replica Megatron does not write need not equal the main copy (module
            # docstring of converters.megatron.live.adapter); reload fills it with the main copy's values.
            src, name = (r, origin[m.param]) if m.model_parallel_main else self.main_copy(m.key, m.index)
            live = self.run.refs[src]["params"][name]["live"]
            full = self.full_state(src, name, m.geometry.expert)
            f0, f1 = ranges.get(m.param, (0, 0))
            want[m.param] = (live, {k: t[f0:f1].clone() for k, t in full.items()})
            if zero:
                w, st = torch.zeros_like(live), {k: torch.zeros(f1 - f0) for k in ROLES}
            else:
                w, st = live, want[m.param][1]
            frag = OptimFragment(f0, f1, st["param"], st["exp_avg"], st["exp_avg_sq"]) if f1 > f0 else None
            if zero or m.model_parallel_main:
                out.append(LocalParam(m.key, m.geometry, w, frag, index=m.index))
        key_of = {strip_wrappers(origin[m.param]): m.key for m in maps}
        return out, self.live_run(rank, ref, key_of, zero), want

    def live_run(self, rank: int, ref: dict, key_of: dict[str, str], zero: bool) -> LiveRun:
        """The rank's `LiveRun`: the PP1 dump's optimizer groups restricted to this stage's params
        (`key_of`: unwrapped parameter name -> checkpoint key); no optimizer for a reload target."""
        groups, keys = [], []
        for o in ref["optimizers"]:
            groups += o["param_groups"]
            keys += [[] for _ in o["param_groups"]]
            for n, rec in o["params"].items():
                if strip_wrappers(n) in key_of:  # this stage's params only
                    keys[len(keys) - len(o["param_groups"]) + rec["group_index"]].append(key_of[strip_wrappers(n)])
        return LiveRun(layout=self.layout, rank=rank, step=self.run.info["steps"],
                       optimizer=None if zero else adam_config_from_groups(groups, keys))


NAMES = ["tp2", "dp2", "moe_ep2"]


@pytest.mark.parametrize("name", NAMES)
def test_stage_params_get_global_layer_indices(name):
    s = Staged(name)
    seen: dict[tuple[str, tuple[int, ...]], int] = {}
    for rank in range(s.layout.world):
        r, p = s.source(rank)
        maps, origin = s.mapping(rank)
        assert maps
        for m in maps:
            g = LAYER.match(origin[m.param])
            if g is None:
                assert m.index == ()
                assert strip_wrappers(m.param).startswith("embedding.") == (p == 0), m.param
            else:  # local name on the stage, global index in the checkpoint
                per = s.layers // PP
                local = int(LAYER.match(m.param).group(2))
                assert local < per and m.index[0] == int(g.group(2)) == p * per + local, m.param
            seen[(m.key, m.index)] = seen.get((m.key, m.index), 0) + 1
    # Every logical instance of the PP1 run is held by the PP2 world, as often as PP1 held it.
    want: dict[tuple[str, tuple[int, ...]], int] = {}
    for r in range(s.w1):
        for m in s.run.mapping(r):
            want[(m.key, m.index)] = want.get((m.key, m.index), 0) + 1
    assert seen == want


def _export_worker(rank, world, name, dst):
    from bridge.live.export import export_state

    from dataclasses import replace

    from converters.megatron.live.adapter import pipeline_adam_config

    params, lrun, _ = Staged(name).local_params(rank)
    # As export_megatron at PP > 1: each stage's optimizer knows only its own no-decay keys.
    lrun = replace(lrun, optimizer=pipeline_adam_config(lrun.optimizer))
    rep = export_state(dst, lrun, params)
    return {"bytes_written": rep.bytes_written}


def _read_all(path: str) -> dict[str, np.ndarray]:
    ck = open_checkpoint(path)
    return {".".join(p): ck.read(p) for p in ck.paths()}


def _convert(run: Run, dst: str) -> None:
    res = subprocess.run([sys.executable, "-m", "bridge.cli", "convert", str(run.dir / "dp_reshardable"), dst],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr


@pytest.mark.parametrize("name", NAMES)
def test_pp2_export_equals_convert_of_pp1_save(name, tmp_path):
    s = Staged(name)
    dst = str(tmp_path / "live_pp2")
    spawn(s.layout.world, _export_worker, (name, dst), tmp_path, timeout_s=300)
    got = _read_all(dst)
    conv = str(tmp_path / "converted_pp1")
    _convert(s.run, conv)
    want = _read_all(conv)
    assert set(got) == set(want)
    for n, v in want.items():
        assert got[n].dtype == v.dtype and got[n].tobytes() == v.tobytes(), n
    live_m, conv_m = open_checkpoint(dst).manifest, open_checkpoint(conv).manifest
    assert live_m.source.pp == PP and live_m.source.world_size == s.layout.world
    assert live_m.optimizer.no_decay and sorted(live_m.optimizer.no_decay) == sorted(conv_m.optimizer.no_decay)


@pytest.mark.parametrize("name", NAMES)
def test_reload_pp1_checkpoint_into_pp2_stages(name, tmp_path):
    from bridge.live.reload import reload_state

    s = Staged(name)
    src = str(tmp_path / "converted_pp1")
    _convert(s.run, src)
    for rank in range(s.layout.world):
        params, lrun, want = s.local_params(rank, zero=True)
        res = reload_state(src, lrun, params)
        assert res.step == s.run.info["steps"]
        maps, _ = s.mapping(rank)
        for lp, m in zip(params, maps):
            live, frag = want[m.param]
            what = f"PP2 rank {rank} {m.param}"
            assert lp.weight.view(torch.int16).equal(live.view(torch.int16)), what
            if lp.optim is not None:
                for k, t in lp.optim.tensors().items():
                    ref = frag[{"params": "param", "mu": "exp_avg", "nu": "exp_avg_sq"}[k]]
                    assert t.numel() == ref.numel() > 0, f"{what} {k}"
                    assert t.view(torch.int32).equal(ref.view(torch.int32)), f"{what} {k}"


def test_stage_optimizer_settings_must_agree():
    a = AdamConfig(0.01, weight_decay=0.1, no_decay=("x",))
    with pytest.raises(BridgeError, match="pipeline stages disagree on the optimizer's betas"):
        merge_adam_configs([a, AdamConfig(0.01, betas=(0.9, 0.95), weight_decay=0.1)])
    with pytest.raises(BridgeError, match="disagree on the weight decay"):
        merge_adam_configs([a, AdamConfig(0.01, weight_decay=0.05)])
    with pytest.raises(BridgeError, match="lr multipliers 2.0 and 3.0"):
        merge_adam_configs([AdamConfig(0.01, lr_mult={"k": 2.0}), AdamConfig(0.01, lr_mult={"k": 3.0})])
