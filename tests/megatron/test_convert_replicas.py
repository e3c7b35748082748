"""Replica consistency on real Megatron-Core saves (issue #30, item 4).

Each TP (GTP) rank's DistributedOptimizer holds its own fp32 master and Adam moments of the
parameters the ranks replicate (norms, row-parallel biases, position embeddings); in the real TP2
and GTP2 fixtures they differ between ranks. `convert` must measure that, report it, record it in
the manifest, keep the main replica (TP rank 0, GTP rank 0) and refuse with `--strict-replicas`.
The expected figures are computed here from the runs' own per-rank optimizer dumps
(`reference_rank<r>.pt`, read with torch), independently of the converter's planning.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/
REPO = os.path.dirname(HERE)
FIX = os.path.join(HERE, "fixtures", "megatron")
ROLES = {"param": "params", "exp_avg": "mu", "exp_avg_sq": "nu"}
# the local layer spec saves these norms under the fused projection's keys (fixtures README)
LOCAL_SPEC_KEYS = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_",
                   "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}


def logical_name(ddp_name: str) -> tuple[str, int | None]:
    """(stacked logical array name, layer) of a DDP parameter name of the fixtures' GPTModel."""
    name = ddp_name.removeprefix("module.module.")
    m = re.match(r"decoder\.layers\.(\d+)\.(.*)", name)
    if not m:
        return name, None
    rest = m.group(2)
    for old, new in LOCAL_SPEC_KEYS.items():
        if rest.startswith(old):
            rest = new + rest[len(old):]
    return "decoder.layers." + rest, int(m.group(1))


def expected_differences(run: str, replicated) -> tuple[dict, dict, dict]:
    """From the dumps of the run's two ranks: per (parameter, role) the elements compared, the
    elements whose bits differ and the largest |rank0 - rank1|; and rank 0's values (the main replica)."""
    import torch

    dumps = [torch.load(os.path.join(FIX, run, f"reference_rank{r}.pt"), weights_only=True) for r in (0, 1)]
    stats: dict[tuple[str, str], list] = {}
    main: dict[tuple[str, str], dict[int | None, np.ndarray]] = {}
    for name, p0 in dumps[0]["optimizers"][0]["params"].items():
        if not replicated(dumps[0]["params"][name]["attrs"]):
            continue
        p1 = dumps[1]["optimizers"][0]["params"][name]
        assert p0["range"]["param"] == p1["range"]["param"] == [0, dumps[0]["params"][name]["live"].numel()]
        array, layer = logical_name(name)
        for state, role in ROLES.items():
            a, b = p0[state].numpy(), p1[state].numpy()
            differ = a.view(np.uint32) != b.view(np.uint32)
            s = stats.setdefault((array, role), [0, 0, 0.0])
            s[0] += a.size
            s[1] += int(differ.sum())
            s[2] = max(s[2], float(np.abs(a.astype(np.float64) - b.astype(np.float64)).max()))
            main.setdefault((array, role), {})[layer] = a
    return stats, main, dumps[0]


def tp_replicated(attrs) -> bool:
    return not attrs.get("tensor_model_parallel", False)


def gtp_replicated(attrs) -> bool:
    return not attrs.get("is_gtp_weight_remat", False)


def _convert(src: str, dst: str, **kw):
    from converters.megatron.convert import ConvertOptions
    from converters.megatron.convert_entry import convert

    return convert(src, dst, ConvertOptions(**kw))


@pytest.mark.parametrize("run,replicated,label", [("tp2", tp_replicated, "tp1"), ("gtp2_local", gtp_replicated, "gtp1")])
def test_reported_differences_equal_the_ranks_dumps(tmp_path, run, replicated, label):
    from bridge import open_checkpoint
    from bridge.format.schema import role_path
    from bridge.format.tree import megatron_key_to_path

    stats, main, _ = expected_differences(run, replicated)
    res = _convert(os.path.join(FIX, run, "dp_reshardable"), str(tmp_path / "out"))
    ck = open_checkpoint(str(tmp_path / "out"))
    rec = ck.manifest.replicas
    assert rec is not None and rec.version == 1 and ck.manifest.extra["replicas"]["version"] == 1
    assert rec.kept == "tp0.gtp0" and rec.copies == 2
    assert rec.compared == len(stats)
    assert rec.elements_compared == sum(s[0] for s in stats.values())
    want = {k: s for k, s in stats.items() if s[1]}
    assert want, "the fixture's replicated copies are known to differ"
    got = {(d.param, d.role): d for d in rec.differ}
    assert sorted(got) == sorted(want)
    for k, (elements, differ, mx) in want.items():
        d = got[k]
        assert (d.elements, d.differ, d.max_abs_diff, d.replicas, d.nonfinite) == (elements, differ, mx, [label], 0), k
    # reported on stderr (as warnings of the result), one line per differing parameter
    params = {p for p, _ in want}
    assert len(res.warnings) == 1 + len(params) and all(any(p in w for w in res.warnings) for p in params)
    # the main replica (rank 0's copy) is what was written (fused biases, stored per section, aside)
    paths = set(ck.paths())
    checked = 0
    for (array, role), layers in main.items():
        path = role_path(role, megatron_key_to_path(array))
        if path not in paths:
            continue
        checked += 1
        stored = ck.read(path)
        ref = np.stack([layers[i] for i in sorted(layers)]) if None not in layers else layers[None]
        assert np.array_equal(stored.reshape(ref.shape).view(np.uint32), ref.view(np.uint32)), (array, role)
    assert checked >= 3 * len(params)


def test_fully_reshardable_holds_one_copy_and_records_it(tmp_path):
    res = _convert(os.path.join(FIX, "tp2", "fully_reshardable"), str(tmp_path / "out"), strict_replicas=True)
    assert res.replicas["copies"] == 1 and res.replicas["compared"] == 0 and not res.replicas["differ"]
    assert not res.warnings


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "bridge.cli", *args], env=dict(os.environ, PYTHONPATH=REPO),
                          capture_output=True, text=True, timeout=300)


def test_strict_replicas_refuses_in_one_line_and_writes_nothing(tmp_path):
    stats, _, _ = expected_differences("tp2", tp_replicated)
    worst = max((s[2], k) for k, s in stats.items())
    dst = str(tmp_path / "out")
    r = _cli("convert", os.path.join(FIX, "tp2", "dp_reshardable"), dst, "--strict-replicas")
    assert r.returncode == 2, r.stderr
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and "--strict-replicas" in err[0]
    assert worst[1][0] in err[0] and f"{worst[0]:.3g}" in err[0], (worst, err[0])
    assert sorted(os.listdir(tmp_path)) == []


def test_inspect_shows_the_record(tmp_path):
    stats, _, _ = expected_differences("tp2", tp_replicated)
    dst = str(tmp_path / "out")
    _convert(os.path.join(FIX, "tp2", "dp_reshardable"), dst)
    r = _cli("inspect", dst)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    head = next(line for line in lines if line.startswith("replicas:"))
    n_differ = sum(1 for s in stats.values() if s[1])
    assert f"{len(stats)} parameter states compared" in head and f"{n_differ} differ" in head and "kept tp0.gtp0" in head
    pos = stats[("embedding.position_embeddings.weight", "params")]
    assert any(line.strip().startswith("embedding.position_embeddings.weight") and
               f"master: {pos[1]} of {pos[0]} elements differ, max |diff| {pos[2]:.3g}" in line for line in lines)


@pytest.mark.slow
def test_worker_processes_report_the_same_record(tmp_path):
    """Blocks compared in three writer processes (small budget: many blocks) sum to the same record."""
    src = os.path.join(FIX, "tp2", "dp_reshardable")
    one = _convert(src, str(tmp_path / "one"))
    three = _convert(src, str(tmp_path / "three"), workers=3, min_worker_bytes=1, budget=1 << 20)
    assert three.workers == 3 and three.replicas == one.replicas and one.replicas["differ"]
