"""Same bytes on disk before and after a change (issue 32): digest what convert, convert
--orbax-step-dir, to-megatron, to-maxtext and a live export (2 gloo ranks) write from the test
fixtures, to a local directory and to the local S3 / GCS servers of tests/support/servers.py.

    PYTHONPATH=<tree A> python scripts/same_bytes.py digest a1.json   # twice on the old tree:
    PYTHONPATH=<tree A> python scripts/same_bytes.py digest a2.json   #   what varies by itself
    PYTHONPATH=<tree B> python scripts/same_bytes.py digest b.json
    python scripts/same_bytes.py compare a1.json a2.json b.json

Per case: the sha256 of every file / object (OCDBT's random 32-hex names masked), and of
every array read back (logical checkpoints through `open_checkpoint`; torch_dist iterations through
torch DCP's own `FileSystemReader`, objects copied to a local directory first). The fixtures are
copied to one fixed directory first, since a checkpoint records its source path. Files that differ
between two runs of the old tree (timestamps, random names) are reported apart.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

TREE = pathlib.Path(os.environ.get("PYTHONPATH", ".").split(":")[0]).resolve()
HEX = re.compile(r"[0-9a-f]{32}")
COPY = pathlib.Path(tempfile.gettempdir()) / "gtpb-same-bytes-fixtures"


def cli(*args: str) -> None:
    r = subprocess.run([sys.executable, "-m", "bridge.cli", *args], capture_output=True, text=True)
    assert r.returncode == 0, (args, r.stderr)


def read_all(root: str) -> dict[str, bytes]:
    """Every file under a directory / object under a prefix (with what both trees have)."""
    from bridge.store import open_storage

    storage = open_storage(root)
    return {k: storage.read_bytes(k) for k in storage.list_keys()}


def files(root: str, base: str) -> dict[str, str]:
    """Name -> digest; the files that share a name once random names are masked (OCDBT's data files)
    -> their digests, sorted. `base` (this run's output root) is masked in contents that name it
    (Orbax's commit_success.txt)."""
    out: dict[str, list[str]] = {}
    for k, v in read_all(root).items():
        v = v.replace(base.encode(), b"<base>")
        out.setdefault(HEX.sub("<hex>", k), []).append(hashlib.sha256(v).hexdigest()[:16])
    return {k: ",".join(sorted(v)) for k, v in out.items()}


def values(root: str) -> dict[str, str]:
    from bridge.store import open_checkpoint

    ck = open_checkpoint(root)
    return {"/".join(p): hashlib.sha256(ck.read(p).tobytes()).hexdigest()[:16] for p in sorted(ck.arrays())}


def dcp_values(root: str, tmp: str) -> dict[str, str]:
    import torch
    import torch.distributed.checkpoint as dcp

    local = os.path.join(tmp, "copy-" + hashlib.sha256(root.encode()).hexdigest()[:8])
    for k, v in read_all(root).items():
        os.makedirs(os.path.dirname(os.path.join(local, k)), exist_ok=True)
        pathlib.Path(local, k).write_bytes(v)
    it = next(str(p) for p in pathlib.Path(local).glob("iter_*"))
    md = dcp.FileSystemReader(it).read_metadata()
    sd = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in md.state_dict_metadata.items()
          if hasattr(m, "size")}
    dcp.load(sd, storage_reader=dcp.FileSystemReader(it), no_dist=True)
    return {k: hashlib.sha256(v.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]
            for k, v in sorted(sd.items())}


def digest(out: str) -> None:
    sys.path[:0] = [str(TREE / "tests/support"), str(TREE / "tests/live")]   # tests in folders (tests/README.md)
    from servers import remote_servers
    from test_live_export import _export_then_reload
    from spawn_ranks import spawn

    if not COPY.exists():
        COPY.mkdir()
        shutil.copytree(TREE / "tests/fixtures/megatron/dp2/fully_reshardable", COPY / "dp2")
        shutil.copytree(TREE / "tests/fixtures/maxtext/llama/live", COPY / "llama_live")
    res: dict[str, dict[str, str]] = {}
    tag = hashlib.sha256(out.encode() + os.urandom(4)).hexdigest()[:8]
    with tempfile.TemporaryDirectory() as tmp, remote_servers() as srv:
        locs = {"local": os.path.join(tmp, "out"), "s3": srv["s3"].url(f"same/{tag}"), "gs": srv["gs"].url(f"same/{tag}")}
        for name, base in locs.items():
            cli("convert", str(COPY / "dp2"), base + "/logical")
            res[f"convert-{name}"] = files(base + "/logical", base)
            res[f"convert-values-{name}"] = values(base + "/logical")
            cli("to-megatron", locs["local"] + "/logical", base + "/mg", "--tp", "2", "--no-scheduler")
            res[f"to-megatron-{name}"] = files(base + "/mg", base)
            res[f"to-megatron-values-{name}"] = dcp_values(base + "/mg", tmp)
            cli("convert", str(COPY / "dp2"), base + "/mgr", "--orbax-step-dir")
            res[f"convert-step-dir-{name}"] = files(base + "/mgr", base)
            cli("to-maxtext", str(COPY / "llama_live"), base + "/mt", "--decoder-block", "llama2")
            res[f"to-maxtext-{name}"] = files(base + "/mt", base)
            _, errors = spawn(2, _export_then_reload, (base + "/live", (1, 2, 1, 4), [], None), pathlib.Path(tmp))
            assert not errors, errors
            res[f"export-{name}"] = files(base + "/live", base)
            res[f"export-values-{name}"] = values(base + "/live")
    pathlib.Path(out).write_text(json.dumps(res, indent=0, sort_keys=True))


def compare(old1: str, old2: str, new: str) -> int:
    a, b, n = (json.loads(pathlib.Path(p).read_text()) for p in (old1, old2, new))
    bad = [f"cases {sorted(a.keys() ^ n.keys())}"] if a.keys() != n.keys() else []
    same = varying = 0
    for case in sorted(a.keys() & n.keys()):
        if a[case].keys() != n[case].keys():
            bad.append(f"{case}: names {sorted(a[case].keys() ^ n[case].keys())}")
        for k in sorted(a[case].keys() & n[case].keys()):
            if a[case][k] != b.get(case, {}).get(k):
                varying += 1
            elif a[case][k] == n[case][k]:
                same += 1
            else:
                bad.append(f"{case}: {k}")
    print(f"{len(a)} cases: {same} files / arrays identical, {len(bad)} different, {varying} vary between two "
          f"runs of the old tree (timestamps, random names)")
    for line in bad:
        print("DIFFERENT", line)
    return 1 if bad else 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["digest"]:
        digest(sys.argv[2])
    elif sys.argv[1:2] == ["compare"]:
        sys.exit(compare(*sys.argv[2:5]))
    else:
        sys.exit(__doc__)
