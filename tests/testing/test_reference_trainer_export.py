"""Reference trainer through the real live exporter: export at one layout, reload at another,
and the next step matches continuing the original run (fp32 tolerance), FP8 and padding included."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as mp

pytest.importorskip("bridge.live.export")
pytest.importorskip("bridge.live.reload")

from bridge.testing.check import assemble_global, compare, padding_report, run_export_reload  # noqa: E402

ATOL = {"weight": 1e-5, "master": 1e-5, "exp_avg": 1e-7, "exp_avg_sq": 1e-9}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_export_at_gtp2_fp8_reload_at_tp2_next_step_matches(tmp_path):
    mp.spawn(run_export_reload, args=(2, f"tcp://127.0.0.1:{_port()}", str(tmp_path), "fp8", {"gtp": 2, "egtp": 2},
                                      {"tp": 2}), nprocs=2, join=True)
    src = [torch.load(tmp_path / f"src.rank{r}.pt", weights_only=True) for r in range(2)]
    dst = [torch.load(tmp_path / f"dst.rank{r}.pt", weights_only=True) for r in range(2)]
    assert padding_report(src)["nonzero_pad_values"] > 0  # the source really had (random) padding rows
    assert src[0]["step"] == dst[0]["step"] == 3
    assert dst[0]["losses"] == pytest.approx(src[0]["losses"], rel=1e-5)
    bad = compare(assemble_global(dst), assemble_global(src), ATOL)
    assert bad == [], bad[:5]
