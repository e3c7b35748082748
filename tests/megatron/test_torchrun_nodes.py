"""`convert` under torchrun across "nodes" (issue 34; s3:// and gs:// destinations are
test_convert_torchrun's).

- a launch of two "nodes" on this machine: two torchrun agents (`--nnodes 2 --node-rank 0/1`, two
  ranks each) meeting through a c10d rendezvous on localhost, as hosts meet through the first one's
  address; four ranks, one commit, bit-equal to the single-process conversion; rank 0 (on node 0)
  reports for all.
"""

from __future__ import annotations

import os

import pytest

from test_convert_torchrun import BUDGET, _ok, reference, source  # noqa: F401 - fixtures
from torchrun_cases import assert_same_arrays, plain_arrays, torchrun, two_nodes


@pytest.mark.slow
def test_two_nodes_convert_as_one_process(source, reference, tmp_path):  # noqa: F811
    d, _ = source
    dst = str(tmp_path / "out")
    node0, node1 = two_nodes(2, "convert", str(d / "src"), dst, "--budget", BUDGET)
    out = _ok(node0)
    _ok(node1)
    assert (node0.stdout + node1.stdout).count("converted ") == 1    # one report, by rank 0
    assert "ranks: 4 (4 writers)" in node0.stdout + node1.stdout
    assert sorted(n for n in os.listdir(dst) if n.startswith("ocdbt.process_")) == \
        [f"ocdbt.process_{r}" for r in range(4)], out
    assert_same_arrays(plain_arrays(dst), reference)


@pytest.mark.slow
def test_a_planning_error_is_told_by_every_rank(tmp_path):
    """Ranks plan before joining the launch (their writers start meanwhile); a source that is no
    checkpoint still ends every rank with the same one-line error naming the ranks, nothing written."""
    src = tmp_path / "not_a_checkpoint"
    src.mkdir()
    (src / "junk.txt").write_text("x")
    res = torchrun(2, "convert", str(src), str(tmp_path / "out"))
    assert res.returncode != 0
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("gtp-bridge: error:")]
    assert len(errors) == 2 and errors[0] == errors[1], res.stderr[-3000:]
    assert "rank 0 failed during planning" in errors[0] and "not a torch_dist checkpoint" in errors[0] \
        and "also ranks [1]" in errors[0], errors[0]
    assert not os.path.exists(tmp_path / "out")
