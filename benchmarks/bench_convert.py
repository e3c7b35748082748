"""Conversion throughput against anchors measured in the same run.

Builds a Megatron-shaped `fully_reshardable` torch_dist checkpoint (GQA + SwiGLU GPT, TP=1, written
with real `torch.distributed.checkpoint.save`), then times, one after the other:
  convert   gtp-bridge convert SRC DST (workers as given)
  dcp.load  torch DCP reading every tensor of SRC into preallocated tensors
  raw write writing the same number of bytes (the logical arrays) to plain files, fsynced
and reports convert time / (dcp.load + raw write) — below 1.0 means convert beats doing the read
and the write separately with the standard tools.

    python benchmarks/bench_convert.py --hidden 1024 --layers 4 --workers 2
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np
import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "support"))


def build_source(path: str, hidden: int, layers: int, vocab: int) -> int:
    """Write the checkpoint (model + fully_reshardable optimizer keys); returns its tensor bytes."""
    import convert_synth as cs

    cs.H, cs.L, cs.V, cs.F = hidden, layers, vocab, 4 * hidden
    cs.HD = 128 if hidden >= 256 else max(1, hidden // 4)
    cs.NQ = hidden // cs.HD
    cs.NG = max(1, cs.NQ // 4)
    cs.QKV = (cs.NQ + 2 * cs.NG) * cs.HD
    st = cs.state(0)
    sd: dict = {}
    nbytes = 0
    for role, prefix in (("model", ""), ("params", "optimizer.state.param."), ("mu", "optimizer.state.exp_avg."),
                         ("nu", "optimizer.state.exp_avg_sq.")):
        for key, full in cs.fuse(st[role]).items():
            t = cs._to_torch(np.ascontiguousarray(full)).clone()
            sd[prefix + key] = t
            nbytes += t.numel() * t.element_size()
    buf = io.BytesIO()
    torch.save([cs.common_state(1, 1, "fully_reshardable")], buf)
    sd["common_state"] = buf
    dcp.save(sd, checkpoint_id=path)
    with open(os.path.join(path, "metadata.json"), "w") as f:
        json.dump({"sharded_backend": "torch_dist", "sharded_backend_version": 1}, f)
    return nbytes


def time_convert(src: str, dst: str, workers: int, budget: int | None) -> float:
    """Wall time of convert with exactly `workers` writer processes (1 = in-process)."""
    from converters.megatron.convert import ConvertOptions
    from converters.megatron.convert_entry import convert

    shutil.rmtree(dst, ignore_errors=True)
    t0 = time.perf_counter()
    convert(src, dst, ConvertOptions(workers=workers, budget=budget, show_progress=False, min_worker_bytes=1))
    return time.perf_counter() - t0


def disk_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


def time_dcp_load(src: str) -> float:
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(src).read_metadata()
    target = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype)
              for k, v in md.state_dict_metadata.items() if hasattr(v, "size")}
    t0 = time.perf_counter()
    dcp.load(target, checkpoint_id=src)
    return time.perf_counter() - t0


def time_raw_write(dst_logical: str, out: str) -> tuple[float, int]:
    """Write the converted arrays' bytes to plain files (read beforehand, not timed)."""
    from bridge.store.reader import open_checkpoint

    ck = open_checkpoint(dst_logical)
    arrays = [np.ascontiguousarray(ck.read(p)) for p in ck.arrays()]
    os.makedirs(out)
    t0 = time.perf_counter()
    total = 0
    for i, a in enumerate(arrays):
        with open(os.path.join(out, f"a{i}.bin"), "wb") as f:
            f.write(a.tobytes())
            f.flush()
            os.fsync(f.fileno())
        total += a.nbytes
    return time.perf_counter() - t0, total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--budget", default=None, help="convert --budget, e.g. 64M (default: convert's default)")
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
    a = ap.parse_args()
    root = a.dir or tempfile.mkdtemp(prefix="bench-convert-")
    src, dst, raw = (os.path.join(root, n) for n in ("src", "dst", "raw"))
    for p in (src, dst, raw):
        shutil.rmtree(p, ignore_errors=True)
    nbytes = build_source(src, a.hidden, a.layers, a.vocab)
    t_load = time_dcp_load(src)
    from bridge.units import parse_size

    budget = parse_size(a.budget) if a.budget else None
    t_conv1 = time_convert(src, dst, 1, budget)
    disk1 = disk_bytes(dst)
    t_convn = time_convert(src, dst, a.workers, budget) if a.workers > 1 else None
    diskn = disk_bytes(dst)
    t_raw, raw_bytes = time_raw_write(dst, raw)
    mib = nbytes / 2**20
    anchor = t_load + t_raw
    print(f"checkpoint: hidden {a.hidden}, layers {a.layers}, vocab {a.vocab}: {mib:.0f} MiB of tensors "
          f"({raw_bytes / 2**20:.0f} MiB logical), {os.cpu_count()} cores")
    print("| step | seconds | MiB/s | ratio to dcp.load + raw write |")
    print("|---|---|---|---|")
    print(f"| convert, in-process | {t_conv1:.2f} | {mib / t_conv1:.0f} | {t_conv1 / anchor:.2f} |")
    if t_convn is not None:
        print(f"| convert, {a.workers} worker processes | {t_convn:.2f} | {mib / t_convn:.0f} | {t_convn / anchor:.2f} |")
    print(f"| dcp.load (anchor) | {t_load:.2f} | {mib / t_load:.0f} | |")
    print(f"| raw write of the logical bytes (anchor) | {t_raw:.2f} | {raw_bytes / 2**20 / t_raw:.0f} | |")
    print(f"on disk / logical bytes: {disk1 / raw_bytes:.2f} (in-process), {diskn / raw_bytes:.2f} "
          f"({a.workers} workers); budget {a.budget or 'default'}")
    if not a.dir:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
