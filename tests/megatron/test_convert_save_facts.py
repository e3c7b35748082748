"""Model facts and layout flags checked against the save, absurd sizes refused before any work
(issue 29 items 4, 5 and the `--dp` message of item 6).

The saves are real megatron-core ones (tests/fixtures/megatron) in every source format, and a
pipeline-parallel save written by to-megatron; the layer counts the tests expect come from the
model entries' stacked axes (read here through DCP's own metadata, not through convert).
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

import bridge
from bridge import cli
from bridge.errors import BridgeError
from converters.megatron.convert import ConvertOptions
from converters.megatron.convert_entry import convert
from converters.megatron.plan.format import Hints

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "megatron"
CODE = Path(bridge.__file__).resolve().parent.parent

#: one save of every source format: dp_reshardable, fully_reshardable, legacy padded GTP, release saves
#: (0.14 model space / bucket space, 0.19 dp_zero), MoE, hybrid (per-layer keys)
SAVES = ["dp2/dp_reshardable", "dp2/fully_reshardable", "gtp2_local/fully_reshardable", "moe_ep2/dp_reshardable",
         "release_0_14_0/fully_sharded_model_space", "release_0_14_0_bucket_space/fully_sharded_bucket_space",
         "release_0_19_2/dp_zero_gather_scatter", "hybrid/fully_reshardable"]


def layers_in(save: Path) -> int:
    """Decoder layers of a save, from torch's own reading of its .metadata (an independent reference)."""
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(save)).read_metadata()
    names = {k: k.split(".")[2] for k in md.state_dict_metadata if k.startswith("decoder.layers.")}
    stacked = {md.state_dict_metadata[k].size[0] for k, part in names.items()   # tensors (not _extra_state bytes)
               if not part.isdigit() and hasattr(md.state_dict_metadata[k], "size")}
    per_layer = {int(part) for part in names.values() if part.isdigit()}
    return max(per_layer) + 1 if per_layer else max(stacked)


def one_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("save", SAVES)
def test_num_layers_the_save_contradicts_is_refused(save, tmp_path, capsys):
    src = FIXTURES / save
    n = layers_in(src)
    rc = cli.main(["convert", str(src), str(tmp_path / "out"), "--num-layers", str(n + 1)])
    line = one_line(capsys)
    assert rc == 2 and f"--num-layers {n + 1}" in line and f"hold {n} layers" in line and f"--num-layers {n}" in line
    assert not (tmp_path / "out").exists()


def test_absurd_num_layers_refused(tmp_path, capsys):
    rc = cli.main(["convert", str(FIXTURES / "dp2/dp_reshardable"), str(tmp_path / "out"), "--num-layers", "100000000"])
    assert rc == 2 and "--num-layers 100000000" in one_line(capsys)


@pytest.mark.parametrize("save", SAVES)
def test_more_pipeline_stages_than_any_split_of_the_layers_is_refused(save, tmp_path):
    src = FIXTURES / save
    pp = layers_in(src) + 3   # even with the embedding and the loss counted, a stage would be empty
    with pytest.raises(BridgeError, match=f"--pp {pp} "):
        convert(str(src), str(tmp_path / "out"), ConvertOptions(workers=1, hints=Hints(pp=pp)))


@pytest.fixture(scope="module")
def pp2_save(tmp_path_factory) -> Path:
    """A fully_reshardable save with PP=2 (2 layers), written by to-megatron from a real save."""
    d = tmp_path_factory.mktemp("pp2")
    convert(str(FIXTURES / "dp2/fully_reshardable"), str(d / "logical"), ConvertOptions(workers=1))
    assert cli.main(["to-megatron", "--no-scheduler", str(d / "logical"), str(d / "run"), "--tp", "1", "--pp", "2", "--workers", "1"]) == 0
    return d / "run" / "iter_0000003"


def test_pp_flag_the_save_cannot_have_is_refused(pp2_save, tmp_path, capsys):
    rc = cli.main(["convert", str(pp2_save), str(tmp_path / "out"), "--pp", "4"])
    line = one_line(capsys)
    assert rc == 2 and "--pp 4" in line and "2 decoder layers" in line
    assert not (tmp_path / "out").exists()
    res = convert(str(pp2_save), str(tmp_path / "ok"), ConvertOptions(workers=1))   # as saved: converts
    assert res.layout["pp"] == 2 and res.layout["world"] == 2


def _convert_limited(src: Path, dst: Path, *flags: str) -> subprocess.CompletedProcess:
    """convert in a subprocess limited to 3 GiB (the old code took 7.6 GB for --pp 100000000)."""
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))

    return subprocess.run([sys.executable, "-m", "bridge.cli", "convert", str(src), str(dst), "--workers", "1", *flags],
                          env=dict(os.environ, PYTHONPATH=str(CODE), JAX_PLATFORMS="cpu"), capture_output=True,
                          text=True, timeout=300, preexec_fn=limit)


@pytest.mark.parametrize("flag", ["--pp", "--dp", "--tp"])
def test_sizes_no_run_has_are_refused_before_any_work(flag, tmp_path):
    r = _convert_limited(FIXTURES / "dp2/dp_reshardable", tmp_path / "out", flag, "100000000")
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1, r.stderr[-2000:]
    assert f"{flag} 100000000" in lines[0] and "more than any run has" in lines[0], lines[0]


def test_dp_that_does_not_fit_the_saved_padding_names_dp(tmp_path, capsys):
    """Was: 'rebuilt bucket numels [14336] do not match the saved per_bucket_numel_unpadded [14336]'."""
    rc = cli.main(["convert", str(FIXTURES / "dp2/dp_reshardable"), str(tmp_path / "out"), "--dp", "3"])
    line = one_line(capsys)
    assert rc == 2 and "per_bucket_numel [14336]" in line and "group of 3 ranks" in line and "--dp" in line
