"""`verify` exit codes (issue 17 item 9): 1 on any damage of the metadata, 2 only for bad usage.

Each damage is applied to a fresh checkpoint and checked through the CLI; the checkpoint is
written with `save_checkpoint`, which existed before the checksum covered every field, so the
same tests run against the old code.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from bridge.store import save_checkpoint


def _ck(tmp_path, name="ck"):
    rng = np.random.default_rng(0)
    return save_checkpoint(str(tmp_path / name), {("params", "w"): rng.standard_normal((8, 4)).astype(np.float32),
                                                  ("params", "b"): rng.standard_normal(4).astype(np.float32),
                                                  ("step",): np.array(3, np.int32)}, num_writers=2)


def _verify(path):
    r = subprocess.run([sys.executable, "-m", "bridge.cli", "verify", str(path)], capture_output=True, text=True)
    return r.returncode, r.stdout + r.stderr


def _edit(dst, fn):
    p = os.path.join(dst, "_METADATA")
    meta = json.load(open(p))
    meta = fn(meta)
    with open(p, "w") as f:
        json.dump(meta, f)


def _set(*keys, value):
    def fn(meta):
        d = meta
        for k in keys[:-1]:
            d = d[k]
        d[keys[-1]] = value
        return meta
    return fn


def _drop(*keys):
    def fn(meta):
        d = meta
        for k in keys[:-1]:
            d = d[k]
        del d[keys[-1]]
        return meta
    return fn


DAMAGES = {
    "gtp_bridge removed": _drop("custom_metadata", "gtp_bridge"),
    "custom_metadata removed": _drop("custom_metadata"),
    "custom_metadata emptied": _set("custom_metadata", value={}),
    "manifest a list": _set("custom_metadata", "gtp_bridge", value=[1, 2]),
    "manifest a string": _set("custom_metadata", "gtp_bridge", value="x"),
    "checksum removed": _drop("custom_metadata", "gtp_bridge_checksum"),
    "use_ocdbt edited": _set("use_ocdbt", value=False),
    "fill value flag edited": _set("store_array_data_equal_to_fill_value", value=False),
    "use_zarr3 removed": _drop("use_zarr3"),
    "new top-level field": _set("extra_field", value=1),
    "lr edited": _set("custom_metadata", "gtp_bridge", "optimizer", "lr", value=123.0),
    "betas edited": _set("custom_metadata", "gtp_bridge", "optimizer", "betas", value=[0.0, 0.0]),
    "digest edited": _set("custom_metadata", "gtp_bridge", "arrays", "params.b", "digest", value="0" * 16),
}


@pytest.mark.slow
@pytest.mark.parametrize("damage", list(DAMAGES))
def test_any_metadata_damage_exits_1(tmp_path, damage):
    dst = _ck(tmp_path)
    assert _verify(dst)[0] == 0
    _edit(dst, DAMAGES[damage])
    rc, out = _verify(dst)
    assert rc == 1, (damage, out)
    assert "DAMAGED" in out and "Traceback" not in out, out


def test_deleted_metadata_exits_1(tmp_path):
    dst = _ck(tmp_path)
    os.remove(os.path.join(dst, "_METADATA"))
    rc, out = _verify(dst)
    assert rc == 1 and "_METADATA is missing" in out, out


def test_metadata_not_json_exits_1(tmp_path):
    dst = _ck(tmp_path)
    open(os.path.join(dst, "_METADATA"), "w").write("[1, 2")
    assert _verify(dst)[0] == 1


def test_bad_usage_exits_2(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("x")
    for path in (tmp_path / "missing", tmp_path / "empty", tmp_path / "file"):
        rc, out = _verify(path)
        assert rc == 2 and out.count("\n") == 1 and out.startswith("gtp-bridge: error:"), (path, out)


def test_damaged_metadata_does_not_hide_damaged_data(tmp_path):
    """An edited manifest and missing data files are both reported."""
    big = np.random.default_rng(1).standard_normal((256, 256)).astype(np.float32)   # too big to be inlined
    dst = save_checkpoint(str(tmp_path / "ck"), {("params", "w"): big, ("params", "v"): big[:128]}, num_writers=2)
    _edit(dst, DAMAGES["lr edited"])
    d = os.path.join(dst, "ocdbt.process_1", "d")
    for f in os.listdir(d):
        os.remove(os.path.join(d, f))
    rc, out = _verify(dst)
    assert rc == 1 and "DAMAGED metadata" in out and "DAMAGED params/" in out, out
