"""Every reader of our checkpoints checks the metadata checksum (issue 17 item 7).

to-megatron, inspect, open_checkpoint (used by reload, restore's naming views, inspect) and the JAX
side's `stored_arrays` refuse a checkpoint whose `_METADATA` was edited after commit, in one line
that says how to override; `allow_edited_metadata=True` or GTP_BRIDGE_ALLOW_EDITED_METADATA=1 reads it.
"""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from bridge.errors import IntegrityError
from bridge.store import open_checkpoint, save_checkpoint

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/
FIXTURE = os.path.join(HERE, "fixtures", "megatron", "moe_ep1", "dp_reshardable")
LEGACY = os.path.join(HERE, "fixtures", "megatron_live", "dp2", "live")   # sealed by the older checksum


def _cli(*args, env=None):
    r = subprocess.run([sys.executable, "-m", "bridge.cli", *args], capture_output=True, text=True,
                       env={**os.environ, **(env or {})})
    return r.returncode, r.stdout + r.stderr


def _edit_optimizer(dst, **values):
    p = os.path.join(dst, "_METADATA")
    meta = json.load(open(p))
    meta["custom_metadata"]["gtp_bridge"]["optimizer"].update(values)
    json.dump(meta, open(p, "w"))


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    from converters.megatron.convert import ConvertOptions
    from converters.megatron.convert_entry import convert

    if not os.path.isdir(FIXTURE):
        pytest.skip("needs the moe_ep1 Megatron fixture")
    dst = str(tmp_path_factory.mktemp("conv") / "logical")
    convert(FIXTURE, dst, ConvertOptions(workers=1, show_progress=False))
    return dst


@pytest.mark.slow
def test_to_megatron_refuses_an_edited_manifest(converted, tmp_path):
    """The issue's case: lr=123, betas=(0, 0) in the manifest; verify says 1, to-megatron must not write."""
    src = str(tmp_path / "edited")
    shutil.copytree(converted, src)
    _edit_optimizer(src, lr=123.0, betas=[0.0, 0.0])
    assert _cli("verify", src)[0] == 1
    out_dir = str(tmp_path / "mc")
    rc, out = _cli("to-megatron", "--no-scheduler", src, out_dir, "--tp", "1")
    assert rc == 1 and out.count("\n") == 1, out
    assert "checksum mismatch" in out and "GTP_BRIDGE_ALLOW_EDITED_METADATA=1" in out, out
    assert not os.path.exists(out_dir) and not os.path.exists(out_dir + ".orbax-checkpoint-tmp")
    rc, out = _cli("inspect", src)
    assert rc == 1 and "checksum mismatch" in out, out
    # told to, it reads the edited values
    rc, out = _cli("to-megatron", "--no-scheduler", src, out_dir, "--tp", "1", env={"GTP_BRIDGE_ALLOW_EDITED_METADATA": "1"})
    assert rc == 0 and os.path.isdir(out_dir), out
    # the untouched conversion is accepted
    rc, out = _cli("to-megatron", "--no-scheduler", converted, str(tmp_path / "mc2"), "--tp", "1")
    assert rc == 0, out


def _small(tmp_path, name="ck"):
    return save_checkpoint(str(tmp_path / name), {("params", "w"): np.arange(12, dtype=np.float32).reshape(3, 4)})


def test_open_checkpoint_refuses_each_edit_unless_allowed(tmp_path, monkeypatch):
    dst = _small(tmp_path)
    meta_path = os.path.join(dst, "_METADATA")
    pristine = open(meta_path).read()
    edits = {
        "use_ocdbt": lambda m: m.update(use_ocdbt=False),
        "fill value flag": lambda m: m.update(store_array_data_equal_to_fill_value=False),
        "manifest removed": lambda m: m["custom_metadata"].pop("gtp_bridge"),
        "custom_metadata removed": lambda m: m.pop("custom_metadata"),
        "lr": lambda m: m["custom_metadata"]["gtp_bridge"]["optimizer"].update(lr=1.0),
    }
    for what, fn in edits.items():
        meta = json.loads(pristine)
        fn(meta)
        json.dump(meta, open(meta_path, "w"))
        monkeypatch.delenv("GTP_BRIDGE_ALLOW_EDITED_METADATA", raising=False)
        with pytest.raises(IntegrityError, match="allow_edited_metadata=True") as e:
            open_checkpoint(dst)
        assert "\n" not in str(e.value), what
        ck = open_checkpoint(dst, allow_edited_metadata=True)
        assert ck.metadata_problems, what
        if what != "use_ocdbt":  # reading the data needs the true storage layout
            assert np.array_equal(ck.read(("params", "w")), np.arange(12, dtype=np.float32).reshape(3, 4))
        monkeypatch.setenv("GTP_BRIDGE_ALLOW_EDITED_METADATA", "1")
        assert open_checkpoint(dst).metadata_problems, what
    open(meta_path, "w").write(pristine)
    monkeypatch.delenv("GTP_BRIDGE_ALLOW_EDITED_METADATA")
    assert open_checkpoint(dst).metadata_problems == []


@pytest.mark.skipif(not os.path.isdir(LEGACY), reason="needs the live-export fixture")
def test_checkpoints_sealed_by_the_older_checksum_still_open_and_their_edits_are_refused(tmp_path):
    assert open_checkpoint(LEGACY).metadata_problems == []
    copy = str(tmp_path / "legacy")
    shutil.copytree(LEGACY, copy)
    _edit_optimizer(copy, lr=5.0)
    with pytest.raises(IntegrityError, match="checksum mismatch"):
        open_checkpoint(copy)


def test_jax_stored_arrays_checks_the_checksum(tmp_path):
    from bridge.jaxside.abstract import stored_arrays

    dst = _small(tmp_path)
    assert ("params", "w") in stored_arrays(dst).arrays
    _edit_optimizer(dst, lr=7.0)
    with pytest.raises(IntegrityError, match="checksum mismatch"):
        stored_arrays(dst)
    assert stored_arrays(dst, allow_edited_metadata=True).custom_metadata["gtp_bridge"]["optimizer"]["lr"] == 7.0
