"""A bounded fuzz run of `from-maxtext`'s read path, with `verify` and `inspect --stats` on a share of the
inputs (issue 29): mutated zarr.json, sidecar, `_METADATA` and stored bytes of a checkpoint real MaxText 0.2.5 saved (`tests/fixtures/maxtext/fresh_maxtext`) and of
one `to-maxtext` wrote (with its sidecar).

Every input must convert or raise a one-line `BridgeError`: no other exception, no crash (the inputs run
in a subprocess, so an abort fails the test), no more memory than a bound (`RLIMIT_AS` in that
subprocess, as `tests/megatron/test_fuzz_dcp.py` does for Megatron sources).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import bridge  # noqa: F401  (the code under test; subprocesses run the same)

ROOT = Path(__file__).resolve().parents[2]
CODE = Path(bridge.__file__).resolve().parent.parent
FRESH = ROOT / "tests" / "fixtures" / "maxtext" / "fresh_maxtext"
LIVE = ROOT / "tests" / "fixtures" / "maxtext" / "llama" / "live"
SIDECAR = "gtp_bridge_maxtext.json"

ODD = [None, -1, 0, 1, 2 ** 31, 2 ** 63, 10 ** 30, 1.5, float("nan"), float("inf"), "x", "", [], [0], [10 ** 7, 10 ** 5],
       [2 * 10 ** 8, 24], {}, {"a": 1}, True, "int32", "float64", "bool", "uint8", "bfloat16"]


def _odd_json(rng: random.Random, obj, depth: int = 0):
    """`obj` with one value somewhere inside replaced, deleted or added (a structural JSON mutation)."""
    if isinstance(obj, dict) and obj and (depth < 4 and rng.random() < 0.7):
        k = rng.choice(sorted(obj))
        obj[k] = _odd_json(rng, obj[k], depth + 1)
        return obj
    if isinstance(obj, list) and obj and (depth < 4 and rng.random() < 0.6):
        i = rng.randrange(len(obj))
        obj[i] = _odd_json(rng, obj[i], depth + 1)
        return obj
    r = rng.random()
    if isinstance(obj, dict) and obj and r < 0.2:
        del obj[rng.choice(sorted(obj))]
        return obj
    if isinstance(obj, dict) and r < 0.3:
        obj["extra"] = rng.choice(ODD)
        return obj
    if isinstance(obj, (int, float)) and not isinstance(obj, bool) and r < 0.6:
        return rng.choice([-obj, obj * 1000, obj + 1, -5, 0, 10 ** 9])
    return rng.choice(ODD)


def _mutate_bytes(rng: random.Random, data: bytes) -> bytes:
    b = bytearray(data)
    for _ in range(rng.randint(1, 6)):
        i = rng.randrange(len(b) + 1)
        op = rng.randrange(4)
        if op == 0 and b:
            b[min(i, len(b) - 1)] ^= 1 << rng.randrange(8)
        elif op == 1 and b:
            b[min(i, len(b) - 1)] = rng.choice(b"09-.e\"[]{},:\x00\xff")
        elif op == 2:
            del b[i:i + rng.randint(1, 16)]
        else:
            b[i:i] = rng.choice([b"9" * 20, b"-", b"e999", b'"', b"[", b"]"])
    return bytes(b)


def _kv(items: Path):
    import tensorstore as ts

    return ts.KvStore.open({"driver": "ocdbt", "base": f"file://{items}/"}).result()


def fuzz_main(seconds: float, written: str, outdir: str) -> None:  # pragma: no cover - the fuzz subprocess
    import resource
    import tempfile
    import time
    import traceback

    import numpy  # noqa: F401  (imported, with TensorStore's threads started, before the memory limit)

    from bridge.errors import BridgeError
    from bridge.jaxside.presets.maxtext import Hyper
    from bridge.commands.inspect import inspect_report
    from bridge.jaxside.presets.maxtext_stream import read_maxtext
    from bridge.store.verify import verify_checkpoint

    out = Path(outdir)
    hyper = Hyper(lr=1e-3, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1)
    with tempfile.TemporaryDirectory() as tmpd:
        tmp = Path(tmpd)
        bases = {"fresh": FRESH, "written": Path(written)}
        read_maxtext(str(FRESH), str(tmp / "warm"), hyper=hyper)  # every module loaded before the limit
        verify_checkpoint(str(FRESH / "1" / "items"), show_progress=False)
        inspect_report(str(FRESH / "1" / "items"), stats=True)
        vsz = int(open("/proc/self/statm").read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        limit = vsz + (2 << 30)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        rng = random.Random(int(os.environ.get("GTP_FUZZ_SEED", "29")))
        stats = {"executions": 0, "converted": 0, "refused": 0, "failures": [], "by_target": {},
                 "address_space_limit_mib": limit >> 20}
        reasons: dict[str, int] = {}

        def case(target: str) -> None:
            base = rng.choice(["fresh", "written"] if target != "sidecar" else ["written"])
            src = tmp / "src"
            shutil.rmtree(src, ignore_errors=True)
            shutil.copytree(bases[base], src)
            step = next(p for p in sorted(src.iterdir()) if p.name.isdigit())
            items = step / "items"
            if target == "zarr.json":
                kv = _kv(items)
                keys = [k.decode() for k in kv.list().result() if k.endswith(b"zarr.json")]
                key = rng.choice(keys)
                raw = kv.read(key).result().value
                if rng.random() < 0.7:
                    data = json.dumps(_odd_json(rng, json.loads(raw))).encode()
                else:
                    data = _mutate_bytes(rng, raw)
                kv.write(key, data).result()
                what = f"{key}: {data[:300]!r}"
            elif target == "sidecar":
                f = step / SIDECAR
                raw = f.read_bytes()
                data = (json.dumps(_odd_json(rng, json.loads(raw))).encode() if rng.random() < 0.7
                        else _mutate_bytes(rng, raw))
                f.write_bytes(data)
                what = f"{SIDECAR}: {data[:300]!r}"
            elif target == "_METADATA":
                f = items / "_METADATA"
                raw = f.read_bytes()
                data = (json.dumps(_odd_json(rng, json.loads(raw))).encode() if rng.random() < 0.7
                        else _mutate_bytes(rng, raw))
                f.write_bytes(data)
                what = "_METADATA"
            else:  # stored bytes: OCDBT data files, b-tree nodes and manifests
                files = [p for p in items.rglob("*") if p.is_file() and "d" in p.parts[len(items.parts):-1]
                         or p.name == "manifest.ocdbt"]
                f = rng.choice(files)
                f.write_bytes(_mutate_bytes(rng, f.read_bytes()))
                what = str(f.relative_to(src))
            (out / "current.txt").write_text(f"{target} {base} {what}")
            stats["executions"] += 1
            stats["by_target"][target] = stats["by_target"].get(target, 0) + 1
            dst = tmp / "dst"
            shutil.rmtree(dst, ignore_errors=True)
            try:
                if rng.random() < 0.25:  # the other readers of the same input: verify never raises for damage
                    res = verify_checkpoint(str(items), show_progress=False)
                    if res.ok:
                        inspect_report(str(items), stats=True)
                read_maxtext(str(src), str(dst), hyper=hyper if base == "fresh" else None)
                stats["converted"] += 1
            except BridgeError as e:
                if "\n" in str(e):
                    raise AssertionError(f"multi-line BridgeError: {str(e)[:300]!r}") from None
                stats["refused"] += 1
                why = " ".join(str(e).replace(str(src), "SRC").split())[:70]
                reasons[why] = reasons.get(why, 0) + 1
            except BaseException as e:  # noqa: BLE001 - anything else is a finding
                stats["failures"].append({"target": target, "base": base, "input": what[:300],
                                          "error": f"{type(e).__name__}: {str(e)[:200]}",
                                          "where": traceback.format_exc().splitlines()[-3][:200]})

        end = time.monotonic() + seconds
        while time.monotonic() < end:
            case(rng.choices(["zarr.json", "sidecar", "_METADATA", "bytes"], [5, 3, 2, 2])[0])
        stats["top_refusals"] = sorted(reasons.items(), key=lambda kv: -kv[1])[:25]
    (out / "stats.json").write_text(json.dumps(stats, indent=1))
    print(json.dumps({k: v for k, v in stats.items() if k not in ("failures", "top_refusals")}
                     | {"failures": len(stats["failures"])}))


@pytest.mark.slow
def test_fuzz_maxtext_read_path(tmp_path):
    """A bounded fuzz run (GTP_FUZZ_MAXTEXT_SECONDS, default 12): no crash, no other exception, memory bounded."""
    from bridge.jaxside.presets.maxtext_stream import write_maxtext

    written = tmp_path / "written"
    write_maxtext(str(LIVE), str(written))
    seconds = float(os.environ.get("GTP_FUZZ_MAXTEXT_SECONDS", "12"))
    env = dict(os.environ, PYTHONPATH=str(CODE), JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--fuzz", str(seconds), str(written),
                        str(tmp_path)], env=env, capture_output=True, text=True, timeout=seconds + 600, cwd=str(CODE))
    current = tmp_path / "current.txt"
    assert r.returncode == 0, (f"fuzz worker died (rc {r.returncode}) on "
                               f"{current.read_text() if current.exists() else '?'}: {r.stderr[-3000:]}")
    stats = json.loads((tmp_path / "stats.json").read_text())
    print(r.stdout)
    assert not stats["failures"], stats["failures"][:5]
    assert stats["executions"] >= 8 and stats["refused"] > 0


if __name__ == "__main__" and len(sys.argv) == 5 and sys.argv[1] == "--fuzz":
    sys.path.insert(0, str(ROOT))
    fuzz_main(float(sys.argv[2]), sys.argv[3], sys.argv[4])
