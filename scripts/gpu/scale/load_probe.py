"""load_megatron from a converted checkpoint vs from the live export (GPU, torchrun, 1 process).

    python3 -m torch.distributed.run --standalone --nproc-per-node 1 scripts/gpu/scale/load_probe.py \
        --conv D/conv --live D/live --json OUT

Two fresh models (the bigpt.py GPT): model 1 <- load_megatron(--conv), model 2 <- load_megatron(--live).
One untimed warm-up load (model 1 from --conv: the process's first load pays for TensorStore's and
the GPU allocator's first use), then the order --order (default conv,live,live,conv: A B B A), each
timed with the page cache dropped first, with TensorStore's file-bytes-read counter around it; then
the two models' weights, fp32 masters and moments are compared bit-exactly on the GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(HERE))))  # repository root

import torch  # noqa: E402

import bigpt  # noqa: E402
import tinygpt  # noqa: E402
from torch_side import RssSampler, drop_caches, sync  # noqa: E402


def ts_bytes_read() -> int:
    import tensorstore as ts

    total = 0
    for m in ts.experimental_collect_matching_metrics("/tensorstore/kvstore/file/bytes_read"):
        total += sum(int(v.get("value", 0)) for v in m["values"])
    return total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--conv", required=True)
    ap.add_argument("--live", required=True)
    ap.add_argument("--json", required=True)
    ap.add_argument("--order", default="conv,live,live,conv")
    ap.add_argument("--no-warmup", dest="warmup", action="store_false")
    a = ap.parse_args()
    from converters.megatron.live.adapter import load_megatron

    res: dict = {"loads": []}
    tinygpt.setup_parallel(1)
    m1, _, o1, _ = bigpt.build()
    m2, _, o2, _ = bigpt.build()
    n = sum(p.numel() for p in m1.parameters())
    runs = {"conv": ("load_megatron_from_converted", m1, o1, a.conv),
            "live": ("load_megatron_from_live_export", m2, o2, a.live)}
    order = (["warmup"] if a.warmup else []) + a.order.split(",")
    for pos, which in enumerate(order):
        name, model, opt, src = runs["conv" if which == "warmup" else which]
        if which == "warmup":
            name += "_warmup"
        rec = {"name": name, "position": pos, "src": src, "dropped_caches": drop_caches(), "state_bytes": n * 14}
        sync()
        b0 = ts_bytes_read()
        with RssSampler() as s:
            t0 = time.perf_counter()
            try:
                r = load_megatron(src, model, opt)
                sync()
                rec["ok"], rec["step"] = True, r.step
            except Exception as e:  # noqa: BLE001
                rec["ok"], rec["error"] = False, f"{type(e).__name__}: {e}"[:1500]
                rec["traceback_tail"] = traceback.format_exc()[-2500:]
            rec["seconds"] = time.perf_counter() - t0
        rec["file_bytes_read"] = ts_bytes_read() - b0
        rec["read_over_state"] = rec["file_bytes_read"] / (n * 14)
        rec.update(rss_before=s.base, rss_peak=s.peak, rss_growth=s.peak - s.base)
        print(f"[op] {name}: {rec['seconds']:.2f} s ok={rec['ok']} read {rec['file_bytes_read'] / 1e9:.1f} GB "
              f"({rec['read_over_state']:.2f}x state) rss +{rec['rss_growth'] / 2**30:.2f} GiB", flush=True)
        res["loads"].append(rec)
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1, default=str)
    times: dict = {}
    for r in res["loads"]:
        if r["ok"] and not r["name"].endswith("_warmup"):
            times.setdefault(r["name"], []).append(r["seconds"])
    c, l_ = times.get("load_megatron_from_converted"), times.get("load_megatron_from_live_export")
    if c and l_:
        res["ratio_of_means_converted_over_live"] = (sum(c) / len(c)) / (sum(l_) / len(l_))
        print(f"converted / live (means): {res['ratio_of_means_converted_over_live']:.3f}", flush=True)
    res["converted_vs_live"] = bigpt.compare_states(bigpt.state_tensors(m1, o1), bigpt.state_tensors(m2, o2))
    print("converted vs live:", res["converted_vs_live"]["ok"], res["converted_vs_live"]["tensors"],
          res["converted_vs_live"]["mismatch"][:3], flush=True)
    with open(a.json, "w") as f:
        json.dump(res, f, indent=1, default=str)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
