"""The fuzz harness of tests/megatron/test_fuzz_dcp.py on remote sources (issue 29): fuzzed archives read by
byte ranges through the local S3 server, and random byte ranges of a real `.distcp` file.

Each fuzzed record (the harness's mutators over real tensor and object records and their re-zipped
pickles) is put on S3 at a random offset inside a larger object, sometimes cut short, and parsed as
convert's ranged paths parse it (`tensor_member`, the object archive's directory and small members,
through a `RangeReader` window); the same object is parsed as a local file. The two must agree exactly
(the same result, or the same one-line `BridgeError`), and nothing else may be raised. Random
`(offset, length)` items of a real `.distcp` read from S3 must equal the local file's bytes, or both
sides refuse them in the same words. Runs in a subprocess (a crash fails the test) for
GTP_FUZZ_REMOTE_SECONDS (default 8).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "support"))  # tests/support: shared helpers
from servers import remote_servers  # noqa: E402
import test_fuzz_dcp as F  # noqa: E402  (the harness: mutators, corpus)

DISTCP_RUN = F.CRC_BASE   # a real 0.19.2 save whose .distcp files the range fuzz reads


def _outcome(fn):
    from bridge.errors import BridgeError

    try:
        return ("ok", fn())
    except BridgeError as e:
        if "\n" in str(e):
            raise AssertionError(f"multi-line BridgeError: {str(e)[:300]!r}") from None
        return ("refused", str(e))


def fuzz_main(seconds: float, outdir: str, url: str) -> None:  # pragma: no cover - runs in the fuzz subprocess
    import random
    import time
    import traceback
    import zipfile
    import io

    import converters.megatron.read.dcp as R
    from bridge.store import kvstore
    from converters.megatron.read.records import Window
    from bridge.store.ranged import open_range
    from converters.megatron.read.dcp import DcpCheckpoint
    from converters.megatron.read.dcp_metadata import StorageRef
    from converters.megatron.read.object_layout import MAX_OBJECT_PICKLE

    out = Path(outdir)
    rng = random.Random(int(os.environ.get("GTP_FUZZ_SEED", "29")))
    inputs = F._fuzz_inputs(out)
    stats = {"executions": 0, "parsed": 0, "refused": 0, "failures": [], "by_target": {}}
    window = 64 << 10

    def record_parses(f, size: int, kind: str):
        """What convert's ranged paths take from a record in the seekable file `f`."""
        if kind == "tensor":
            return R.tensor_member(f, size, "fuzz record")
        members = R.archive_members(f, size, "fuzz record")
        return members, R.read_small_members(f, members, "fuzz record", MAX_OBJECT_PICKLE, "; too big")

    def run(target: str, fn) -> None:
        stats["executions"] += 1
        stats["by_target"][target] = stats["by_target"].get(target, 0) + 1
        try:
            verdict = fn()
            stats["parsed" if verdict == "ok" else "refused"] += 1
        except BaseException as e:  # noqa: BLE001 - anything else is a finding
            n = len(stats["failures"])
            stats["failures"].append({"target": target, "error": f"{type(e).__name__}: {str(e)[:300]}",
                                      "where": traceback.format_exc().splitlines()[-3][:200]})
            (out / f"failure_{n}.txt").write_text(traceback.format_exc())

    def fuzzed_record() -> tuple[bytes, str]:
        kind = rng.choice(["tensor", "object"])
        if rng.random() < 0.5:
            blob, member = rng.choice(inputs["tensor_pickle_in_zip" if kind == "tensor" else "pickle_in_zip"])
            pkl = zipfile.ZipFile(io.BytesIO(blob)).read(member)
            return F._rezip(blob, member, F.mutate(rng, pkl, [pkl])), kind
        corpus = inputs[kind]
        return F.mutate(rng, rng.choice(corpus), corpus), kind

    def remote_record() -> str:
        data, kind = fuzzed_record()
        if rng.random() < 0.3:   # records that straddle the read-ahead window
            data += bytes(rng.randrange(window // 2, 2 * window))
        pad = rng.choice([0, rng.randrange(1, window), rng.randrange(window, 4 * window)])
        blob = os.urandom(pad) + data + os.urandom(rng.choice([0, 0, rng.randrange(1, 3 * window)]))
        if rng.random() < 0.2:   # the object cut short: the record runs past its end
            blob = blob[:rng.randrange(pad, pad + len(data) + 1)]
        kvstore.write_bytes(url, "record.bin", blob)
        (out / "record.bin").write_bytes(blob)
        local_bytes = blob[pad:pad + len(data)]
        with open_range(out / "record.bin") as fd:   # the same parse over the local file
            want = _outcome(lambda: record_parses(Window(fd, pad, len(data)), len(data), kind))
        with open_range(f"{url}/record.bin") as fd:
            got = _outcome(lambda: record_parses(Window(fd, pad, len(data)), len(data), kind))
            buf = bytearray(len(data))
            n = fd.readinto(buf, pad)
        if got != want:
            raise AssertionError(f"ranged parse {str(got)[:200]} differs from the in-memory parse {str(want)[:200]}")
        if bytes(buf[:n]) != local_bytes:
            raise AssertionError(f"readinto of {len(data)} bytes at {pad} returned other bytes ({n} read)")
        return got[0]

    files = sorted(p.name for p in DISTCP_RUN.glob("*.distcp"))
    for name in files:
        kvstore.write_bytes(url, f"ck/{name}", (DISTCP_RUN / name).read_bytes())
    kvstore.write_bytes(url, "ck/.metadata", (DISTCP_RUN / ".metadata").read_bytes())
    local_ck, remote_ck = DcpCheckpoint(DISTCP_RUN), DcpCheckpoint(f"{url}/ck")
    sizes = {name: (DISTCP_RUN / name).stat().st_size for name in files}

    def remote_range() -> str:
        name = rng.choice(files)
        size = sizes[name]
        n = rng.choice([0, 1, rng.randrange(1, 512), window // 2 - 1, window // 2 + 1, rng.randrange(window // 2, window),
                        window - 1, window, window + 1, rng.randrange(window, 3 * window), size])
        off = rng.choice([0, rng.randrange(size), size - n, size - n + 1, size - 1, size, size + rng.randrange(1, 99)])
        ref = StorageRef(name, max(0, off), n)
        want = _outcome(lambda: bytes(local_ck.read_bytes(ref)))
        got = _outcome(lambda: bytes(remote_ck.read_bytes(ref)))
        if want[0] == "refused" and got[0] == "refused":
            # the same words, the file named by its URL instead of its path
            if want[1].replace(str(DISTCP_RUN), "") != got[1].replace(f"{url}/ck", ""):
                raise AssertionError(f"refusals differ: {want[1][:200]!r} / {got[1][:200]!r}")
        elif got != want:
            raise AssertionError(f"{name} [{ref.offset}, +{n}) of {size} bytes: S3 {str(got)[:120]}, "
                                 f"local {str(want)[:120]}")
        return got[0]

    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if rng.random() < 0.6:
            run("record", remote_record)
        else:
            run("range", remote_range)
    (out / "stats.json").write_text(json.dumps(stats, indent=1))
    print(json.dumps({k: v for k, v in stats.items() if k != "failures"} | {"failures": len(stats["failures"])}))


@pytest.mark.slow
def test_fuzz_remote_sources(tmp_path):
    """A bounded fuzz run through the S3 server: no crash, no traceback, ranged reads equal local ones."""
    seconds = float(os.environ.get("GTP_FUZZ_REMOTE_SECONDS", "8"))
    with remote_servers() as servers:
        url = servers["s3"].url("fuzz-remote")
        r = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--fuzz", str(seconds), str(tmp_path), url],
                           env=F._env(), capture_output=True, text=True, timeout=seconds + 600, cwd=str(F.CODE))
    assert r.returncode == 0, f"fuzz worker died (rc {r.returncode}): {r.stderr[-3000:]}"
    stats = json.loads((tmp_path / "stats.json").read_text())
    print(r.stdout)
    assert not stats["failures"], stats["failures"][:5]
    assert stats["by_target"].get("record", 0) > 10 and stats["by_target"].get("range", 0) > 10, stats
    assert stats["parsed"] > 0 and stats["refused"] > 0, stats


if __name__ == "__main__" and len(sys.argv) == 5 and sys.argv[1] == "--fuzz":
    sys.path.insert(0, str(F.ROOT))
    fuzz_main(float(sys.argv[2]), sys.argv[3], sys.argv[4])
