"""What a newcomer reads first matches what the tool does (issue #30, item 6).

- The README installs gtp-bridge from a clone (it is not on the package index): no `pip install` of
  `gtp-bridge` by name, and the install it shows names extras pyproject.toml defines.
- The demo checkpoint is described as `convert` reports it. What is true is read from the save
  itself with torch's own DCP reader: per-parameter Adam entries (`optimizer.state.exp_avg.<param>`,
  the model-space layout of `fully_reshardable`, not `dp_reshardable`'s flat buckets), and a
  GTP-sharded weight stored with more rows than the converted array holds (0.19.2's padded grid,
  rows read from the converted zarr.json with plain TensorStore). Both facts are one label.
- Every environment variable the notebooks read for a user's own checkpoint is in the README.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/
ROOT = os.path.dirname(HERE)
README = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
DEMO = os.path.join(ROOT, "bridge", "demo_data", "gtp2_local")


def bash_lines() -> list[str]:
    blocks = re.findall(r"^```bash[ \t]*\n(.*?)^```", README, flags=re.S | re.M)
    return [ln.split("#", 1)[0].strip() for b in blocks for ln in b.splitlines()]


def test_readme_installs_from_a_clone():
    import tomllib

    installs = [ln for ln in bash_lines() if re.search(r"\bpip install\b", ln)]
    assert installs, "the README shows how to install"
    by_name = [ln for ln in installs if re.search(r"(^|\s)['\"]?gtp-bridge(\[|['\"\s]|$)", ln.split("pip install", 1)[1])]
    assert not by_name, f"gtp-bridge is not on the package index: {by_name}"
    local = [ln for ln in installs if re.search(r"pip install (-e )?['\"]?\.(\[[a-z,]+\])?['\"]?", ln)]
    assert local, installs
    extras = set(tomllib.load(open(os.path.join(ROOT, "pyproject.toml"), "rb"))["project"]["optional-dependencies"])
    for ln in local:
        m = re.search(r"\.\[([a-z,]+)\]", ln)
        assert m is None or set(m.group(1).split(",")) <= extras, ln
    assert "not on PyPI" in README[:README.index("## Two commands")]


@pytest.mark.slow
def test_demo_is_described_as_convert_reports_it(tmp_path):
    pytest.importorskip("torch")
    import tensorstore as ts
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(DEMO).read_metadata().state_dict_metadata
    w = "decoder.layers.self_attention.linear_proj.weight"
    assert f"optimizer.state.exp_avg.{w}" in md and not any("dp_group_idx" in k for k in md)
    env = dict(os.environ, PYTHONPATH=ROOT)
    r = subprocess.run([sys.executable, "-m", "bridge.cli", "convert", DEMO, str(tmp_path / "out")],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr
    label = re.search(r"converted \S+ \((.*), TP=1 GTP=2", r.stdout).group(1)
    kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{tmp_path / 'out'}/"}).result()
    logical = json.loads(kv.read(b"params.decoder.layers.self_attention.linear_proj.weight/zarr.json").result().value)
    stored = tuple(md[w].size)
    assert stored[1] > logical["shape"][1]       # padded rows: 0.19.2's padded GTP grid
    assert label == "fully_reshardable (0.19.2 padded GTP grid)"
    demo_part = README[README.index("## Two commands"):README.index("### b.")]
    assert demo_part.count(label) >= 2, "the demo description and the walk-through's comment"
    assert label in open(os.path.join(ROOT, "bridge", "demo_data", "README.md")).read()


def test_notebook_environment_variables_are_in_the_readme():
    names = set()
    for nb in ("megatron_to_jax.ipynb", "inspect_checkpoint.ipynb"):
        text = open(os.path.join(ROOT, "notebooks", nb), encoding="utf-8").read()
        names |= set(re.findall(r"environ\.get\(\\\"(GTP_BRIDGE_\w+)", text))
    assert {"GTP_BRIDGE_MEGATRON_SRC", "GTP_BRIDGE_CKPT", "GTP_BRIDGE_CONVERT_FLAGS"} <= names
    notebooks = README[README.index("## Notebooks"):]
    notebooks = notebooks[:notebooks.index("\n## ")]
    assert not [n for n in sorted(names) if n not in notebooks]
