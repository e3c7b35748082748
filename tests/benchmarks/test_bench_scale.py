"""The scale benchmark's streamed Megatron checkpoint is one the converter reads, and its conversion
holds exactly the values the generator regenerates independently (several DDP buckets, GQA + SwiGLU,
both optimizer formats). A tiny size: the benchmark itself runs at any size (benchmarks/bench_scale.py)."""

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

import scale_synth as ss  # noqa: E402

SIZES = ss.Sizes(hidden=64, layers=3, ffn=176, heads=8, groups=2, vocab=256)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["dp_reshardable", "fully_reshardable"])
def test_streamed_checkpoint_converts_to_the_regenerated_values(tmp_path, fmt):
    from bridge.store.reader import open_checkpoint
    from converters.megatron.convert import ConvertOptions
    from converters.megatron.convert_entry import convert

    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    bucket = SIZES.n_params() // 5
    info = ss.write(src, SIZES, fmt, bucket, workers=2)
    assert info["tensor_bytes"] == SIZES.state_bytes()
    if fmt == "dp_reshardable":
        assert info["buckets"] >= 3  # several DDP buckets
    convert(src, dst, ConvertOptions(workers=1, show_progress=False))
    ck = open_checkpoint(dst)
    roles = {"param": ("params",), "exp_avg": ("opt_state", "0", "mu"), "exp_avg_sq": ("opt_state", "0", "nu"),
             "model": ("model",)}
    checked = 0
    for key, layer in ss.instances(SIZES):
        for role, pre in roles.items():
            for sec, want in ss.logical(SIZES, key, layer, role).items():
                got = ck.read(pre + tuple(key.split(".")) + ((sec,) if sec else ()))
                got = got[layer] if layer is not None else got
                assert got.shape == want.shape and np.array_equal(got.view(np.uint8), want.view(np.uint8)), \
                    (key, layer, role, sec)
                checked += 1
    stacked = sum(1 for p in ck.paths() if "layers" in p)
    assert checked == (len(ck.paths()) - 2 - stacked) + stacked * SIZES.layers  # every array, every layer
    assert int(ck.read("step")) == ss.STEP
