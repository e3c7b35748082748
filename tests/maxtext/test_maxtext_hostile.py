"""Hostile MaxText inputs (issue 29 items 3, 4 and 6): edited zarr.json, a negative Adam count, absurd
hyper-parameters on every way in, a broken sidecar. Each must end in one line naming what is wrong,
exit 1 or 2, nothing written; never an abort (std::bad_alloc was exit 134), never a traceback.

The damage is made with plain TensorStore on a copy of a checkpoint real MaxText 0.2.5 saved
(`tests/fixtures/maxtext/fresh_maxtext`, 284 KB) or of the llama fixture's logical checkpoint, so the
code under test is never used to make its own inputs.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import bridge  # noqa: F401  (the code under test: its PYTHONPATH is the one subprocesses use)

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/
CODE = os.path.dirname(os.path.dirname(os.path.abspath(bridge.__file__)))
FRESH = os.path.join(HERE, "fixtures", "maxtext", "fresh_maxtext")
LIVE = os.path.join(HERE, "fixtures", "maxtext", "llama", "live")
EMB = "params.params.token_embedder.embedding"
LOGITS = "params.params.decoder.logits_dense.kernel"
MOMENTS = ("opt_state.0.mu.params.", "opt_state.0.nu.params.")
HYPER = ["--lr", "1e-3"]


_LIMITED = ("import resource, runpy, sys; resource.setrlimit(resource.RLIMIT_AS, ({0}, {0})); "
            "sys.argv = ['gtp-bridge'] + sys.argv[1:]; runpy.run_module('bridge.cli', run_name='__main__')")


def cli_subprocess(*args: str, limit_gb: int = 6) -> subprocess.CompletedProcess:
    """`gtp-bridge ...` in a subprocess under an address-space limit (an abort is a negative return code)."""
    env = dict(os.environ, PYTHONPATH=CODE, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-c", _LIMITED.format(limit_gb << 30), *args], capture_output=True,
                          text=True, env=env, timeout=600, cwd=CODE)


def cli(*args: str) -> subprocess.CompletedProcess:
    """`gtp-bridge ...` in this process (the CLI's own error handling; stderr captured)."""
    import contextlib
    import io

    from bridge.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = main(list(args))
    return subprocess.CompletedProcess(args, rc, "", err.getvalue())


def assert_one_line(r: subprocess.CompletedProcess, *words: str) -> str:
    assert r.returncode in (1, 2), (r.returncode, r.stderr[-2000:])
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in r.stderr and "unexpected" not in r.stderr, r.stderr[-2000:]
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]


def _kv(root: str):
    import tensorstore as ts

    return ts.KvStore.open({"driver": "ocdbt", "base": f"file://{os.path.abspath(root)}/"}).result()


def edit_zarr(root: str, name: str, **fields) -> None:
    """Rewrite array `name`'s zarr.json inside the checkpoint's OCDBT database (plain TensorStore)."""
    kv = _kv(root)
    meta = json.loads(kv.read(f"{name}/zarr.json").result().value)
    meta.update(fields)
    kv.write(f"{name}/zarr.json", json.dumps(meta).encode()).result()


def write_scalar(root: str, name: str, value: int) -> None:
    """Store `value` into the 0-d array `name` with plain TensorStore (zarr3 inside OCDBT)."""
    import tensorstore as ts

    t = ts.open({"driver": "zarr3", "kvstore": {"driver": "ocdbt", "base": f"file://{os.path.abspath(root)}/",
                                                "path": name + "/"}}, open=True).result()
    t.write(np.asarray(value, t.dtype.numpy_dtype)).result()


@pytest.fixture
def fresh(tmp_path) -> str:
    shutil.copytree(FRESH, tmp_path / "fresh")
    return str(tmp_path / "fresh")


def items(root: str) -> str:
    return os.path.join(root, "1", "items")


# ------------------------------------------------------------------------------------------- item 3


@pytest.mark.slow
@pytest.mark.parametrize("shape", [[10**7, 10**5], [2 * 10**8, 24]])
def test_embedding_claiming_a_huge_shape_is_refused_not_an_abort(fresh, tmp_path, shape):
    """(at 20ceaea: std::bad_alloc, exit 134) the embedding's zarr.json alone claims the shape."""
    edit_zarr(items(fresh), EMB, shape=shape)
    r = cli_subprocess("from-maxtext", fresh, str(tmp_path / "out"), *HYPER)
    assert_one_line(r, "zarr.json")
    assert not os.path.exists(tmp_path / "out")


@pytest.mark.slow
def test_consistently_forged_vocab_is_refused_by_the_stored_bytes(fresh, tmp_path):
    """Every leaf with a vocab axis claims 2e8 rows (the sizes agree with each other): the 19 GB each claims
    cannot come from a 284 KB checkpoint."""
    for pre in ("params.params.",) + MOMENTS:
        edit_zarr(items(fresh), pre + "token_embedder.embedding", shape=[2 * 10**8, 24])
        edit_zarr(items(fresh), pre + "decoder.logits_dense.kernel", shape=[24, 2 * 10**8])
    r = cli_subprocess("from-maxtext", fresh, str(tmp_path / "out"), *HYPER)
    assert_one_line(r, "bytes the checkpoint stores")
    assert not os.path.exists(tmp_path / "out")


@pytest.mark.slow
def test_logical_checkpoint_with_a_huge_zarr_shape_is_refused_by_its_manifest(tmp_path):
    """The same edit in a logical checkpoint: its manifest's record (verify's check) refuses it in to-maxtext
    (at 20ceaea: std::bad_alloc) and in any read through the public reader."""
    src = str(tmp_path / "logical")
    shutil.copytree(LIVE, src)
    edit_zarr(src, "params.embedding.word_embeddings.weight", shape=[10**7, 10**5])
    r = cli_subprocess("to-maxtext", src, str(tmp_path / "mt"))
    assert_one_line(r, "params/embedding/word_embeddings/weight", "manifest shape (72, 24)")
    assert not os.path.exists(tmp_path / "mt")
    read = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))\n"
            "from bridge.errors import IntegrityError\nfrom bridge.store.reader import open_checkpoint\n"
            "try:\n    open_checkpoint(sys.argv[1]).read(('params', 'embedding', 'word_embeddings', 'weight'))\n"
            "except IntegrityError as e:\n    print('REFUSED', e)\n")
    r = subprocess.run([sys.executable, "-c", read, src], capture_output=True, text=True, timeout=600, cwd=CODE,
                       env=dict(os.environ, PYTHONPATH=CODE, JAX_PLATFORMS="cpu"))
    assert r.returncode == 0 and r.stdout.startswith("REFUSED") and "!= manifest shape" in r.stdout, r


@pytest.mark.slow
def test_forged_chunk_shape_is_refused_by_inspect_verify_and_from_maxtext(fresh, tmp_path):
    """A zarr.json whose shape and chunk (the one TensorStore decodes whole for any read) both claim
    [1e7, 1e5] (at 20ceaea: `inspect --stats` aborted with std::bad_alloc)."""
    big = [10**7, 10**5]

    kv = _kv(items(fresh))
    meta = json.loads(kv.read(f"{EMB}/zarr.json").result().value)
    meta["shape"] = big
    meta["chunk_grid"]["configuration"]["chunk_shape"] = big
    meta["codecs"][0]["configuration"]["chunk_shape"] = big
    kv.write(f"{EMB}/zarr.json", json.dumps(meta).encode()).result()
    r = cli_subprocess("inspect", items(fresh), "--stats", "--only", "params/params/token_embedder/*")
    assert_one_line(r, "params/params/token_embedder/embedding", "bytes the checkpoint stores")
    r = cli_subprocess("verify", items(fresh))
    assert r.returncode == 1 and "DAMAGED params/params/token_embedder/embedding" in r.stdout, (r.stdout, r.stderr)
    r = cli_subprocess("from-maxtext", fresh, str(tmp_path / "out"), *HYPER)
    assert_one_line(r, "token_embedder")
    assert not os.path.exists(tmp_path / "out")


def test_float_array_redeclared_int32_is_refused(fresh, tmp_path):
    """(at 20ceaea: converted, exit 0, the float bits read as integers)"""
    edit_zarr(items(fresh), "params.params.decoder.layers.self_attention.query.kernel", data_type="int32")
    r = cli("from-maxtext", fresh, str(tmp_path / "out"), *HYPER)
    assert_one_line(r, "params/params/decoder/layers/self_attention/query/kernel", "int32")
    assert not os.path.exists(tmp_path / "out")


@pytest.mark.parametrize("name,value", [("opt_state.0.count", -5), ("step", -1)])
def test_negative_adam_count_or_step_is_refused_by_from_maxtext(fresh, tmp_path, name, value):
    """(at 20ceaea: accepted, refused only later by to-megatron)"""
    write_scalar(items(fresh), name, value)
    r = cli("from-maxtext", fresh, str(tmp_path / "out"), *HYPER)
    assert_one_line(r, name.replace(".", "/"), str(value), "outside")
    assert not os.path.exists(tmp_path / "out")


def test_negative_adam_count_in_a_logical_checkpoint_is_refused_by_to_maxtext(tmp_path):
    src = str(tmp_path / "logical")
    shutil.copytree(LIVE, src)
    write_scalar(src, "opt_state.0.count", -5)
    r = cli("to-maxtext", src, str(tmp_path / "mt"))
    assert_one_line(r, "opt_state/0/count", "-5")
    assert not os.path.exists(tmp_path / "mt")


# ------------------------------------------------------------------------------------------- item 4


@pytest.mark.parametrize("flags,field", [(["--lr", "nan"], "lr"), (["--lr", "-1"], "lr"),
                                         (["--lr", "1e-3", "--betas", "5,-1"], "beta1"),
                                         (["--lr", "1e-3", "--betas", "0.9,1"], "beta2"),
                                         (["--lr", "1e-3", "--eps", "inf"], "eps"),
                                         (["--lr", "1e-3", "--eps", "0"], "eps"),
                                         (["--lr", "1e-3", "--weight-decay", "-0.1"], "weight_decay")])
def test_from_maxtext_refuses_out_of_range_hyper_parameters(tmp_path, flags, field):
    """(at 20ceaea: exit 0, and to-megatron wrote them into the run)"""
    r = cli("from-maxtext", FRESH, str(tmp_path / "out"), *flags)
    assert r.returncode == 2
    assert_one_line(r, "from-maxtext", field)
    assert not os.path.exists(tmp_path / "out")


def test_python_api_refuses_out_of_range_hyper_parameters(tmp_path):
    from bridge.errors import BridgeError
    from bridge.jaxside.presets import maxtext as mx
    from bridge.jaxside.presets.maxtext_stream import read_maxtext

    good = dict(lr=1e-3, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1)
    for bad in (dict(lr=math.nan), dict(lr=-1.0), dict(b1=5.0), dict(b2=-1.0), dict(eps=math.inf), dict(eps=0.0),
                dict(weight_decay=-0.1), dict(clip_grad=math.nan)):
        with pytest.raises(BridgeError, match=next(iter(bad)).replace("b1", "beta1").replace("b2", "beta2")):
            read_maxtext(FRESH, str(tmp_path / "out"), hyper=mx.Hyper(**{**good, **bad}))
    assert not os.path.exists(tmp_path / "out")


def test_bridge_save_refuses_out_of_range_hyper_parameters(tmp_path):
    pytest.importorskip("jax")
    import jax.numpy as jnp
    import optax

    import bridge
    from bridge.errors import BridgeError

    params = {"w": jnp.ones((2, 2), jnp.float32)}
    opt_state = optax.adamw(1e-3).init(params)
    for bad, field in (({"lr": math.nan}, "lr"), ({"betas": (0.9, 1.5)}, "beta2"), ({"eps": -1e-8}, "eps"),
                       ({"weight_decay": math.inf}, "weight_decay")):
        with pytest.raises(BridgeError, match=field):
            bridge.save(str(tmp_path / "ck"), params=params, opt_state=opt_state, step=0, hyperparams=bad)
        assert not os.path.exists(tmp_path / "ck")
    bridge.save(str(tmp_path / "ck"), params=params, opt_state=opt_state, step=0, hyperparams={"lr": 0.0})


def _reseal_with(src: str, **optimizer) -> None:
    """Put out-of-range values in a logical checkpoint's manifest and seal it again (an edit the checksum
    cannot see: what a buggy or hostile writer leaves)."""
    from bridge.format.seal import CHECKSUM_KEY, seal_metadata

    meta = json.load(open(os.path.join(src, "_METADATA")))
    meta["custom_metadata"]["gtp_bridge"]["optimizer"].update(optimizer)
    meta["custom_metadata"]["gtp_bridge"]["extra"].get("megatron", {}).pop("param_groups", None)
    checksum = seal_metadata(meta)
    with open(os.path.join(src, "_METADATA"), "w") as f:
        json.dump(meta, f)
    ck = json.load(open(os.path.join(src, "_CHECKPOINT_METADATA")))
    ck.setdefault("custom_metadata", {})[CHECKSUM_KEY] = checksum
    with open(os.path.join(src, "_CHECKPOINT_METADATA"), "w") as f:
        json.dump(ck, f)


@pytest.mark.parametrize("edit,field", [({"lr": math.nan}, "lr"), ({"betas": [5, -1]}, "beta1"),
                                        ({"eps": math.inf}, "eps"), ({"weight_decay": -1}, "weight_decay")])
def test_to_megatron_refuses_a_manifest_with_out_of_range_hyper_parameters(tmp_path, edit, field):
    pytest.importorskip("torch")
    src = str(tmp_path / "logical")
    shutil.copytree(LIVE, src)
    _reseal_with(src, **edit)
    r = cli("to-megatron", src, str(tmp_path / "run"), "--tp", "1")
    assert r.returncode == 2
    assert_one_line(r, "recorded optimizer", field)
    assert not os.path.exists(tmp_path / "run")


# ------------------------------------------------------------------------------------------- item 6


def _sidecar_variants() -> dict[str, object]:
    return {"bad_json": "{not json", "a_list": [1, 2], "missing_key": ("del", "hyper"),
            "extra_key": ("set", "surprise", 1), "extra_option": ("sub", "options", "colour", "red"),
            "wrong_type": ("sub", "dims", "layers", "two"), "missing_hyper_field": ("subdel", "hyper", "lr"),
            "no_decay_not_paths": ("sub", "hyper", "no_decay", 7), "count_string": ("set", "adam_count", "3"),
            "bad_manifest": ("set", "base_manifest", {"format_version": "x"}),
            "lr_nan": ("sub", "hyper", "lr", math.nan), "count_negative": ("set", "adam_count", -5)}


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> str:
    """A MaxText checkpoint to-maxtext wrote (with its sidecar), made once."""
    root = str(tmp_path_factory.mktemp("written") / "mt")
    r = cli("to-maxtext", LIVE, root)
    assert r.returncode == 0, r.stderr
    return root


@pytest.mark.parametrize("variant", sorted(_sidecar_variants()))
def test_broken_sidecar_is_one_line_naming_the_file(tmp_path, written, variant):
    """(at 20ceaea: "unexpected JSONDecodeError / TypeError / KeyError" without the file)"""
    root = str(tmp_path / "mt")
    shutil.copytree(written, root)
    side = os.path.join(root, "2", "gtp_bridge_maxtext.json")
    d = json.load(open(side))
    how = _sidecar_variants()[variant]
    if isinstance(how, str):
        text = how
    elif isinstance(how, list):
        text = json.dumps(how)
    else:
        if how[0] == "del":
            del d[how[1]]
        elif how[0] == "set":
            d[how[1]] = how[2]
        elif how[0] == "sub":
            d[how[1]][how[2]] = how[3]
        elif how[0] == "subdel":
            del d[how[1]][how[2]]
        text = json.dumps(d)
    with open(side, "w") as f:
        f.write(text)
    r = cli("from-maxtext", root, str(tmp_path / "back"))
    assert r.returncode == 2
    assert_one_line(r, side, "sidecar")
    assert not os.path.exists(tmp_path / "back")


def _export_with(rank, world, dst, hyper):
    from live_model import MODEL, STEP, local_params

    from bridge.errors import BridgeError
    from bridge.layout import ParallelLayout
    from bridge.live.api import AdamConfig, LiveRun
    from bridge.live.export import export_state

    params, _ = local_params(MODEL, 1, 1, 1, 4, rank, None)
    run = LiveRun(ParallelLayout(tp=1, gtp=1, dp=1), rank, STEP, AdamConfig(**hyper))
    try:
        export_state(dst, run, params)
    except BridgeError as e:
        return {"error": str(e)}
    return {"error": None}


@pytest.mark.slow  # a spawned gloo rank: torch's import and a process group
def test_live_export_refuses_out_of_range_hyper_parameters(tmp_path):
    pytest.importorskip("torch")
    from spawn_ranks import spawn

    dst = str(tmp_path / "ck")
    results, errors = spawn(1, _export_with, (dst, {"lr": 1e-3, "betas": (0.9, 1.0)}), tmp_path, timeout_s=180)
    assert not errors, errors
    assert "beta2 1.0 is outside [0, 1)" in results[0]["error"] and "LiveRun.optimizer" in results[0]["error"]
    assert not os.path.exists(dst) and not os.path.exists(dst + ".orbax-checkpoint-tmp")
