"""Helpers for the tests that start offline commands under real `torchrun` (gloo on CPU).

`torchrun(n, *argv)` runs `gtp-bridge <argv>` as n ranks (`--standalone`: a rendezvous on a free
local port); `plain_arrays(dir)` reads every array of a logical checkpoint with plain TensorStore
(zarr3 over the root OCDBT database, no gtp-bridge code), the independent reference the tests
compare conversions with.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


def env(**extra: str) -> dict:
    """The environment of a launch: this worktree first on PYTHONPATH, no inherited launch variables."""
    e = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT")}
    e["PYTHONPATH"] = os.pathsep.join([REPO, HERE, os.environ.get("PYTHONPATH", "")])
    e.pop("XLA_FLAGS", None)
    e.update(extra)
    return e


def torchrun(n: int, *argv: str, extra_env: dict | None = None, script: str | None = None,
             timeout: float = 600) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc-per-node n -m bridge.cli argv` (or `script argv`); output captured."""
    target = [script] if script else ["-m", "bridge.cli"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", *target, *argv]
    return subprocess.run(cmd, env=env(**(extra_env or {})), capture_output=True, text=True, timeout=timeout)


def _kvstore(root: str) -> dict:
    if root.startswith("s3://"):
        bucket, _, prefix = root[len("s3://"):].partition("/")
        return {"driver": "s3", "bucket": bucket, "path": prefix.rstrip("/") + "/",
                "endpoint": os.environ["AWS_ENDPOINT_URL"], "aws_region": os.environ.get("AWS_REGION", "us-east-1")}
    if root.startswith("gs://"):   # the local GCS server: TensorStore reads TENSORSTORE_GCS_HTTP_URL
        bucket, _, prefix = root[len("gs://"):].partition("/")
        return {"driver": "gcs", "bucket": bucket, "path": prefix.rstrip("/") + "/"}
    return {"driver": "file", "path": root.rstrip("/") + "/"}


def plain_arrays(root: str) -> dict[str, np.ndarray]:
    """Every array of the checkpoint at `root` (a directory, s3:// or gs:// prefix), by its OCDBT key name."""
    import tensorstore as ts

    base = _kvstore(root)
    kv = ts.KvStore.open({"driver": "ocdbt", "base": base}).result()
    names = sorted({k.decode().split("/")[0] for k in kv.list().result() if k.endswith(b"/zarr.json")})
    out = {}
    for n in names:
        t = ts.open({"driver": "zarr3", "kvstore": {"driver": "ocdbt", "base": base, "path": n + "/"}}).result()
        out[n] = t.read().result()
    return out


def assert_same_arrays(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    """Same names, dtypes, shapes and bytes (bit for bit: NaN payloads and -0.0 included)."""
    assert sorted(got) == sorted(want)
    for name in want:
        a, b = got[name], want[name]
        assert (a.dtype, a.shape) == (b.dtype, b.shape), name
        assert a.tobytes() == b.tobytes(), name


def two_nodes(nproc: int, *argv: str, timeout: float = 600) -> list[subprocess.CompletedProcess]:
    """`gtp-bridge argv` as a launch of two "nodes" on this machine: two torchrun agents, `--nnodes 2
    --node-rank 0/1`, `nproc` ranks each, meeting through a c10d rendezvous on localhost (as two
    hosts do through the first one's address); both agents' results, node 0's first."""
    from servers import free_port

    port = free_port()
    procs = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--nproc-per-node={nproc}",
               f"--node-rank={node}", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
               f"--rdzv-id=gtpb-two-nodes-{port}", f"--rdzv-conf=is_host={1 - node}",
               "-m", "bridge.cli", *argv]
        procs.append(subprocess.Popen(cmd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    out = []
    for p in procs:
        try:
            so, se = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        out.append(subprocess.CompletedProcess(p.args, p.returncode, so, se))
    return out
