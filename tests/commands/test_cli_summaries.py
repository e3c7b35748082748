"""`convert --dry-run` and the `--json` summaries of convert / to-megatron / verify (issue #30, item 6).

Each figure is checked against an independent read of what the real command then wrote:
- dry run: the directory listings (names, sizes, mtimes) of the source and of the destination's
  parent are the same before and after (nothing written, not even a claim); the bytes it announces
  equal what the real `convert` stores, measured by listing the checkpoint's OCDBT key-value store
  with plain TensorStore and summing the stored chunk values, and `du -b` of the data files (every
  file under a `d/` directory) is that plus OCDBT's B-tree nodes (compressed zarr.json and index
  pages: bounded here, not predicted); its array count and logical bytes equal Orbax's `_METADATA`
  tree and the shapes / dtypes in each array's zarr.json, read with plain TensorStore;
- `convert --json`: one JSON object on stdout, equal to the same independent reads; a flag the user
  passed is under `given`, not `inferred`; no "of N asked" when no --workers was given;
- `to-megatron --json`: the tracker file's step, the .distcp files on disk (their bytes);
- `verify --json`: arrays checked = Orbax's tree; a chunk damaged through TensorStore is named.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/
ROOT = os.path.dirname(HERE)
DEMO = os.path.join(ROOT, "bridge", "demo_data", "gtp2_local")   # real megatron-core 0.19.2, GTP=2


def cli(*args: str, cwd: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-m", "bridge.cli", *args], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=600)


def listing(top: str) -> dict[str, tuple[int, int]]:
    """Every file and directory under `top` (itself included): relative path -> (size, mtime_ns)."""
    out = {".": (0, os.stat(top).st_mtime_ns)}
    for d, dirs, files in os.walk(top):
        for n in dirs + files:
            p = os.path.join(d, n)
            st = os.lstat(p)
            out[os.path.relpath(p, top)] = (st.st_size if n in files else 0, st.st_mtime_ns)
    return out


def orbax_arrays(ckpt: str) -> list[str]:
    """The array leaves of Orbax's own tree record (`_METADATA`), plain JSON."""
    meta = json.load(open(os.path.join(ckpt, "_METADATA")))["tree_metadata"]
    return sorted(".".join(k["key"] for k in v["key_metadata"]) for v in meta.values()
                  if v["value_metadata"]["value_type"] == "jax.Array")


def kv_values(ckpt: str) -> dict[str, bytes]:
    """Every key of the checkpoint's OCDBT store and its stored value, read with plain TensorStore."""
    import tensorstore as ts

    kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{ckpt}/"}).result()
    return {k.decode(): kv.read(k).result().value for k in kv.list().result()}


def logical_bytes(values: dict[str, bytes]) -> int:
    """Elements x item size of every array, from the zarr.json documents TensorStore stored."""
    size = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8, "int32": 4, "int64": 8, "uint8": 1, "bool": 1}
    total = 0
    for k, v in values.items():
        if k.endswith("/zarr.json"):
            z = json.loads(v)
            total += int(np.prod(z["shape"], dtype=np.int64)) * size[z["data_type"]]
    return total


def du_data_files(ckpt: str) -> int:
    files = [os.path.join(d, f) for d, _, fs in os.walk(ckpt) if os.path.basename(d) == "d" for f in fs]
    out = subprocess.run(["du", "-cb", *files], capture_output=True, text=True, check=True).stdout
    return int(out.strip().splitlines()[-1].split()[0])


@pytest.mark.parametrize("workers", [None, pytest.param("2", marks=pytest.mark.slow)])  # 2: worker processes
def test_dry_run_writes_nothing_and_announces_the_bytes_convert_stores(tmp_path, workers):
    work = tmp_path / "work"
    work.mkdir()
    flags = ["--workers", workers, "--budget", "256k"] if workers else []
    src_before, work_before = listing(DEMO), listing(str(work))
    r = cli("convert", DEMO, "out", "--dry-run", "--json", *flags, cwd=str(work))
    assert r.returncode == 0, r.stderr
    assert listing(DEMO) == src_before and listing(str(work)) == work_before   # nothing, not even a claim
    plan = json.loads(r.stdout)
    assert plan["dry_run"] is True and plan["destination"] == str(work / "out")
    human = cli("convert", DEMO, "out", "--dry-run", *flags, cwd=str(work))
    assert human.returncode == 0 and "nothing written" in human.stdout and f"{plan['stored_bytes']:,}" in human.stdout
    assert listing(str(work)) == work_before

    r = cli("convert", DEMO, "out", *flags, cwd=str(work))
    assert r.returncode == 0, r.stderr
    out = str(work / "out")
    values = kv_values(out)
    chunks = sum(len(v) for k, v in values.items() if not k.endswith("zarr.json"))
    assert plan["stored_bytes"] == chunks
    assert plan["arrays"] == len(orbax_arrays(out)) == len(plan["plan"])
    assert plan["array_bytes"] == logical_bytes(values) == sum(a["bytes"] for a in plan["plan"])
    metadata = sum(len(v) for k, v in values.items() if k.endswith("zarr.json"))
    du = du_data_files(out)
    print(f"dry run {plan['stored_bytes']:,} B of chunks; TensorStore's stored values {chunks:,} B; du of the data "
          f"files {du:,} B (+{du - chunks:,}: B-tree nodes, zarr.json ({metadata:,} B uncompressed))")
    assert plan["stored_bytes"] - 1024 <= du <= plan["stored_bytes"] + metadata + (16 << 10)


def test_dry_run_shows_each_fact_with_its_source(tmp_path):
    r = cli("convert", DEMO, str(tmp_path / "out"), "--dry-run", "--json", "--num-attention-heads", "4")
    assert r.returncode == 0, r.stderr
    facts = {f["name"]: f for f in json.loads(r.stdout)["facts"]}
    assert facts["num_attention_heads"]["source"] == "flag" and facts["num_attention_heads"]["value"] == 4
    assert facts["gtp"]["source"] == "save" and facts["gtp"]["value"] == 2
    assert facts["optimizer_format"]["value"] == "fully_reshardable" and facts["gtp_grid"]["source"] == "save"
    assert {f["source"] for f in facts.values()} <= {"flag", "save", "default"}
    assert not os.path.exists(tmp_path / "out")


def test_convert_json_and_given_flags(tmp_path):
    r = cli("convert", DEMO, str(tmp_path / "out"), "--json", "--num-attention-heads", "4")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)                       # stdout is the JSON object alone
    out = str(tmp_path / "out")
    values = kv_values(out)
    assert res["destination"] == out and res["arrays"] == len(orbax_arrays(out))
    assert res["array_bytes"] == logical_bytes(values)
    import tensorstore as ts

    step = ts.open({"driver": "zarr3", "kvstore": {"driver": "ocdbt", "base": f"file://{out}/", "path": "step/"}},
                   open=True).result().read().result()
    assert res["step"] == int(step) == 3
    assert res["given"] == ["num_attention_heads=4 (--num-attention-heads)"]
    assert not any("--num-attention-heads" in n for n in res["inferred"])
    assert "worker" in r.stderr and "asked" not in r.stderr  # no --workers given: none "asked"
    assert "given: num_attention_heads=4" in r.stderr and "inferred: num_attention" not in r.stderr


def test_convert_report_keeps_given_flags_apart(tmp_path):
    """The human report: a flag the user passed is "given", not "inferred"; no "of N asked" without --workers."""
    r = cli("convert", DEMO, str(tmp_path / "out"), "--num-attention-heads", "4")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert "given: num_attention_heads=4 (--num-attention-heads)" in lines
    assert not any(ln.startswith("inferred:") and "--num-attention-heads" in ln for ln in lines)
    assert lines[0].startswith("convert: 1 worker,") and "asked" not in r.stdout


@pytest.mark.slow
def test_to_megatron_and_verify_json(tmp_path):
    pytest.importorskip("torch")
    logical = str(tmp_path / "logical")
    assert cli("convert", DEMO, logical).returncode == 0
    r = cli("to-megatron", logical, str(tmp_path / "run"), "--tp", "2", "--dp", "2", "--json",
            "--lr", "3e-4", "--train-iters", "100", "--global-batch-size", "4")   # the loading run's scheduler
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["scheduler_written"] == "built"
    it = os.path.join(str(tmp_path / "run"), "iter_0000003")
    assert res["destination"] == it and res["run_dir"] == str(tmp_path / "run")
    assert open(os.path.join(res["run_dir"], "latest_checkpointed_iteration.txt")).read().strip() == str(res["step"]) == "3"
    distcp = [f for f in os.listdir(it) if f.endswith(".distcp")]   # one per writer thread
    assert res["layout"]["world"] == 4 and 1 <= len(distcp) <= res["workers"]
    assert res["bytes"] == sum(os.path.getsize(os.path.join(it, f)) for f in distcp)

    r = cli("verify", logical, "--json")
    assert r.returncode == 0, r.stderr
    v = json.loads(r.stdout)
    assert v["ok"] is True and v["damaged"] == {} and v["arrays_checked"] == len(orbax_arrays(logical))
    # damage one chunk through TensorStore's own kvstore (a flipped byte in the stored value)
    import tensorstore as ts

    kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{logical}/"}).result()
    key = b"params.decoder.final_layernorm.weight/c/0"
    blob = bytearray(kv.read(key).result().value)
    blob[0] ^= 0xFF
    kv.write(key, bytes(blob)).result()
    r = cli("verify", logical, "--json")
    assert r.returncode == 1
    v = json.loads(r.stdout)
    assert v["ok"] is False and list(v["damaged"]) == ["params/decoder/final_layernorm/weight"]
