"""Live export from a gloo run straight to object storage (issue 20): every rank writes its chunks
under the S3 prefix, the commit barrier meets through report objects, then the ranks reload at
another layout and compare with the state assembled independently from their raw shards."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "support"))  # tests/support: shared helpers
from servers import remote_servers  # noqa: E402


@pytest.fixture(scope="module")
def stores():
    with remote_servers() as servers:
        yield servers


@pytest.mark.slow
def test_export_world2_to_s3_and_reload_at_another_layout(stores, tmp_path):
    pytest.importorskip("torch.distributed")
    from test_live_export import _export_then_reload
    from spawn_ranks import spawn

    dst = stores["s3"].url("live/export")
    results, errors = spawn(2, _export_then_reload, (dst, (1, 2, 1, 4), [(2, 1, 1, 4)], None), tmp_path)
    assert not errors and all(r["checked"] > 0 for r in results), errors
    keys = stores["s3"].list_keys("live/export/")
    assert "live/export/_METADATA" in keys and not any("_gtp_bridge_writers" in k or "_gtpb_claim" in k for k in keys)
    assert not any(p.name.startswith("live") for p in tmp_path.iterdir())
