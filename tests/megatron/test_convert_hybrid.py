"""Hybrid models (Mamba / Gated DeltaNet + attention + MLP layers), real megatron-core 0.19.2 saves.

`tests/fixtures/megatron/hybrid` (pattern `M*M-`) and `hybrid_gdn` (`MG*-`), made on the GPU by
`make_hybrid_fixture.sh`. Megatron saves each fused SSM projection as one key per section
(`_split_tensor_factory`: `in_proj.weight.{z,x,B,C,dt}`, `conv1d.{weight,bias}.{x,B,C}`; GDN
`in_proj.weight.{query,key,value,z,beta,alpha}`, `conv1d.weight.{query,key,value}`) while its
distributed optimizer holds the one fused parameter. `convert` of both formats is checked bit for
bit against the live dumps in test_convert_megatron.py (these runs are discovered there); here: the
command line, the section tables, `to-megatron` reproducing Megatron's own save, and a TP=2 target
laid out as the dumps' TP attributes say. That the to-megatron output loads in megatron-core 0.19.2
(bit-equal state, the run's next losses) was checked on the GPU: scripts/gpu/run_hybrid.sh,
results in records/gpu/2026-12-02_session9/hybrid_*.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

import convert_reference as cref
from bridge.cli import main
from bridge.format.manifest import MANIFEST_KEY, Manifest
from bridge.store.reader import open_checkpoint
from converters.megatron.convert import ConvertOptions
from converters.megatron.convert_entry import convert
from converters.megatron.read.dcp import DcpCheckpoint
from converters.megatron.plan.convert_plan import role_path
from converters.megatron.write.torch_dist import MegatronTarget
from converters.megatron.write.to_megatron import to_megatron
from test_convert_megatron import assert_matches
from test_convert_to_megatron import test_same_layout_reproduces_megatrons_own_save as same_layout_check

RUNS = [r for r in ("hybrid", "hybrid_gdn") if r in cref.available_runs()]
pytestmark = pytest.mark.skipif(not RUNS, reason="needs the hybrid fixtures")


def run_info(run: str) -> dict:
    return json.load(open(os.path.join(cref.FIXTURES, run, "run.json")))


@pytest.fixture(scope="module")
def logical(tmp_path_factory):
    """Each run's dp_reshardable save converted through the command line."""
    d = tmp_path_factory.mktemp("hybrid")
    out = {}
    for run in RUNS:
        out[run] = str(d / run)
        assert main(["convert", "--workers", "1", os.path.join(cref.FIXTURES, run, "dp_reshardable"), out[run]]) == 0
    return out


@pytest.mark.parametrize("run", RUNS)
def test_cli_convert_is_bit_exact(run, logical):
    ref, step = cref.load_reference(run)
    assert_matches(logical[run], ref, step)


def expected_sections(run: str) -> dict[str, list[list]]:
    """Section tables from the run's model facts (run.json), per fused parameter path."""
    info = run_info(run)
    a = info["layout"]["extra_args"]
    d_inner, gs, nh = a["mamba_num_heads"] * a["mamba_head_dim"], a["mamba_num_groups"] * a["mamba_state_dim"], \
        a["mamba_num_heads"]
    qk, nv = a["linear_num_key_heads"] * a["linear_key_head_dim"], a["linear_num_value_heads"]
    v = nv * a["linear_value_head_dim"]
    out = {}
    for i, kind in enumerate(info["layout"]["hybrid"]):
        p = f"decoder/layers/{i}"
        if kind == "M":
            out[f"{p}/mixer/in_proj/weight"] = [["z", d_inner], ["x", d_inner], ["B", gs], ["C", gs], ["dt", nh]]
            for leaf in ("weight", "bias"):
                out[f"{p}/mixer/conv1d/{leaf}"] = [["x", d_inner], ["B", gs], ["C", gs]]
        elif kind == "G":
            out[f"{p}/self_attention/in_proj/weight"] = [["query", qk], ["key", qk], ["value", v], ["z", v],
                                                         ["beta", nv], ["alpha", nv]]
            out[f"{p}/self_attention/conv1d/weight"] = [["query", qk], ["key", qk], ["value", v]]
    return out


@pytest.mark.parametrize("run", RUNS)
def test_fused_ssm_projections_are_recorded_by_section(run, logical):
    meta = json.load(open(os.path.join(logical[run], "_METADATA")))
    fused = Manifest.from_json(meta["custom_metadata"][MANIFEST_KEY]).fused
    want = expected_sections(run)
    assert want and {p: fused[p]["sections"] for p in want if p in fused} == want
    arrays = set(open_checkpoint(logical[run]).arrays())
    for p, secs in want.items():
        name = p.replace("/", ".")
        for role in ("model", "params", "mu", "nu"):
            assert {role_path(role, f"{name}.{s}") for s, _ in secs} <= arrays, (role, p)
            assert role_path(role, name) not in arrays


@pytest.mark.parametrize("run", RUNS)
@pytest.mark.parametrize("fmt", ["dp_reshardable", "fully_reshardable"])
def test_same_layout_reproduces_megatrons_own_save(run, fmt, logical, tmp_path):
    """Megatron's per-section keys, shapes, bucket numels and (fully_reshardable) every value."""
    same_layout_check(run, fmt, MegatronTarget(tp=1, fmt=fmt), logical, tmp_path)


def tp_split_keys(run: str) -> dict[str, tuple[int, int]]:
    """Checkpoint key -> (TP partition dim, partition stride) of every parameter the dump says
    Megatron TP-splits (`tensor_model_parallel` attribute; stride 2: SwiGLU's gate and up halves are
    split separately); the per-section keys of a fused one inherit it."""
    info = run_info(run)
    ref = torch.load(os.path.join(cref.FIXTURES, run, "reference_rank0.pt"), weights_only=True)
    out = {}
    for name, p in ref["params"].items():
        if p["attrs"].get("tensor_model_parallel"):
            key, _ = cref.checkpoint_key(name, False, info["layout"]["hybrid"])
            out[key] = int(p["attrs"].get("partition_dim", 0)), int(p["attrs"].get("partition_stride", 1))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("run", RUNS)
def test_tp2_target_splits_what_megatron_splits(run, logical, tmp_path):
    """At TP=2 every key the dumps mark TP-split (SSM heads and channels included: A_log, D,
    dt_bias, conv1d, the gated norm) is stored as two halves along its partition dim, each section
    of a fused projection split on its own; torch's reader assembles the reference's arrays; and
    the output converts back to the same logical checkpoint."""
    mc = to_megatron(logical[run], str(tmp_path / "mc"), MegatronTarget(tp=2, fmt="dp_reshardable"))["dst"]
    ours = DcpCheckpoint(mc)
    split = tp_split_keys(run)
    ref, _ = cref.load_reference(run)
    checked = 0
    for key, info in ours.tensors.items():
        if key.startswith("optimizer."):
            continue
        base = key if key in split else key.rpartition(".")[0]
        offsets = {c.offsets for c in info.chunks}
        if base in split:
            dim, stride = split[base]
            step = info.shape[dim] // (2 * stride)
            assert sorted(o[dim] for o in offsets) == list(range(0, info.shape[dim], step)), key
            checked += 1
        else:
            assert offsets == {(0,) * len(info.shape)}, key
    assert checked >= len(split)
    want = {k: torch.zeros(t.shape, dtype=t.dtype.torch()) for k, t in ours.tensors.items()
            if not k.startswith("optimizer.")}
    dcp.load(want, checkpoint_id=mc)
    info = run_info(run)
    sizes = dict(info["sizes"], **info["layout"]["extra_args"])
    for k, t in want.items():   # fused keys (qkv, fc1) hold their sections as the reference splits them
        for name, arr in cref.sections(k, cref._np(t), sizes).items():
            assert np.array_equal(cref.bits(arr), cref.bits(ref["model"][name])), name
    convert(mc, str(tmp_path / "back"), ConvertOptions(workers=1))
    cref.assert_same_checkpoint(logical[run], str(tmp_path / "back"))
