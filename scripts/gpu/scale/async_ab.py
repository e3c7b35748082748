"""Asynchronous live export at scale (issue 33): one process, the real 0.85 B run (bigpt.py), 12 GB of state.

Run with torch.distributed.run (one process) from the repository root: ARGS = WORKDIR OUT.json.
SP_DEADLINE_AT (epoch seconds) skips the steps that would not fit. In order:
  warm   the first asynchronous export (pays the pinned staging slots once: their size and cost)
  floor  every state tensor device -> host into those pinned slots, packed (the floor for blocking)
  plain  training step times without any export
  A B B A  A: synchronous `export_megatron`; B: `export_megatron_async`, then training steps until
         the background part is done (blocked time, background time, step times while writing; the
         writes run in the exporter's writer process);
         the first A and B are taken at the same step (B right after A): their digests must be equal
  Bthread  B with the writes on a thread of the training process (the GIL's effect on its steps)
  meg    Megatron-Core's own async save (caller blocked, then the rest), as async_probe.py measures it
  C      `export_async(...).wait()` without training (the asynchronous path run synchronously)
  raw    raw TensorStore write of the same bytes (the slots' content, one zarr3 uint8 array, 4 MiB
         chunks, fsync), twice
The page cache is dropped before every write. Every figure is in OUT.json (written after each step).
"""
import json
import os
import shutil
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import torch  # noqa: E402

import bigpt  # noqa: E402
import tinygpt  # noqa: E402
from scale_measure import drop_caches  # noqa: E402

CUDA = torch.cuda.is_available()


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def main() -> None:
    from bridge.live.export import Exporter
    from bridge.store import open_checkpoint
    from converters.megatron.live.adapter import export_megatron, export_megatron_async

    D, out = sys.argv[1], sys.argv[2]
    deadline = float(os.environ.get("SP_DEADLINE_AT", "inf"))
    res: dict = {"steps": []}

    def save() -> None:
        with open(out, "w") as f:
            json.dump(res, f, indent=1)

    def left() -> float:
        return deadline - time.time()

    tinygpt.setup_parallel(1)
    model, gpt, opt, _ = bigpt.build()
    it = [0]

    def train(n: int) -> list[float]:
        ts = []
        for _ in range(n):
            t = time.perf_counter()
            tinygpt.train_step(model, opt, it[0])  # ends in .item(): the step is done
            ts.append(time.perf_counter() - t)
            it[0] += 1
        return ts

    train(2)
    tensors = [p for p in gpt.parameters()]
    for o in tinygpt.optimizer_list(opt):
        for g in o.optimizer.param_groups:
            for p in g["params"]:
                tensors.append(p)
                tensors += [v for v in o.optimizer.state[p].values() if torch.is_tensor(v) and v.numel() > 1]
    res["state_bytes"] = sum(t.numel() * t.element_size() for t in tensors)
    res["tensors"] = len(tensors)
    exporter = Exporter()

    def digests(path: str) -> dict:
        return {k: r.digest for k, r in open_checkpoint(path).manifest.arrays.items()}

    def rm(path: str) -> None:
        shutil.rmtree(path, ignore_errors=True)

    # warm: the first asynchronous export allocates the slots
    drop_caches()
    t = time.perf_counter()
    h = export_megatron_async(os.path.join(D, "warm"), model, opt, exporter=exporter)
    st = h.staging
    res["warm"] = {"blocked_s": h.blocked_s, "slot_bytes": st.slot_bytes, "slots": st.slots,
                   "held_bytes": st.held_bytes, "pinned": st.pinned, "alloc_s": st.alloc_s,
                   "allocations": st.allocations, "copies": st.copies, "pieces": st.pieces}
    rep = h.wait()
    res["warm"].update(total_s=time.perf_counter() - t, bytes_written=rep.bytes_written, timings=rep.timings)
    rm(os.path.join(D, "warm"))
    res["steps"].append("warm")
    save()
    print("[step] warm", res["warm"], flush=True)

    # floor: every state tensor into the same pinned slots (packed), twice; the warm figure counts
    slots = exporter.slots.slots
    for name in ("floor_cold_s", "floor_s"):
        sync()
        t = time.perf_counter()
        k, off, copied = 0, 0, 0
        for x in tensors:
            src = x.detach().reshape(-1).view(torch.uint8)
            pos = 0
            while pos < src.numel() and k < len(slots):  # a tensor larger than a slot spans several
                n = min(src.numel() - pos, slots[k].numel() - off)
                slots[k][off:off + n].copy_(src[pos:pos + n], non_blocking=True)
                pos, off, copied = pos + n, off + n, copied + n
                if off == slots[k].numel():
                    k, off = k + 1, 0
        sync()
        res[name] = time.perf_counter() - t
    res["floor_bytes"] = copied
    res["step_plain_s"] = train(10)
    res["steps"].append("floor")
    save()
    print("[step] floor", res["floor_s"], "plain step", sorted(res["step_plain_s"])[5], flush=True)

    runs = []
    dig = {}
    for i, kind in enumerate("ABBA"):
        if left() < 60:
            res["steps"].append(f"SKIPPED {kind}{i}")
            break
        path = os.path.join(D, f"{kind}{i}")
        drop_caches()
        sync()
        if kind == "A":
            t = time.perf_counter()
            rep = export_megatron(path, model, opt, exporter=exporter)
            r = {"kind": "A", "step": it[0], "total_s": time.perf_counter() - t, "timings": rep.timings,
                 "bytes_written": rep.bytes_written}
        else:
            t = time.perf_counter()
            h = export_megatron_async(path, model, opt, exporter=exporter)
            t_ret = time.perf_counter()
            step = it[0]
            during = []
            while not h.done():
                during += train(1)
            t_seen = time.perf_counter()
            rep = h.wait()
            r = {"kind": "B", "step": step, "blocked_s": h.blocked_s, "call_s": t_ret - t,
                 "background_s": h.finished_at - t_ret, "done_seen_s": t_seen - t_ret, "step_during_s": during,
                 "timings": rep.timings, "bytes_written": rep.bytes_written,
                 "slot_allocations": h.staging.allocations, "alloc_s": h.staging.alloc_s,
                 "write_calls": rep.staging.write_calls, "writer_pid": exporter.writer.pid}
        runs.append(r)
        if i < 2:
            dig[kind] = digests(path)
        else:
            rm(path)
        if i == 1:
            res["digests_equal_same_step"] = dig["A"] == dig["B"] and len(dig["A"]) > 0
            res["digest_arrays"] = len(dig["A"])
            rm(os.path.join(D, "A0"))
            rm(os.path.join(D, "B1"))
        res["ab"] = runs
        save()
        print("[step]", kind, {k: v for k, v in r.items() if k not in ("timings", "step_during_s")}, flush=True)
    res["steps"].append("abba")

    # diagnostic: the same asynchronous export with the background writes on a thread of this process
    # (the writer-class seam selects the thread writer): the GIL's effect on the training steps
    if left() > 150:
        from bridge import _testing
        from bridge.store import CheckpointWriter

        path = os.path.join(D, "Bthread")
        drop_caches()
        sync()
        t = time.perf_counter()
        with _testing.seams(writer_class=CheckpointWriter):
            h = export_megatron_async(path, model, opt, exporter=exporter)
        t_ret = time.perf_counter()
        during = []
        while not h.done():
            during += train(1)
        rep = h.wait()
        res["b_thread"] = {"blocked_s": h.blocked_s, "background_s": h.finished_at - t_ret, "step_during_s": during}
        rm(path)
        save()
        print("[step] Bthread", {k: v for k, v in res["b_thread"].items() if k != "step_during_s"}, flush=True)

    # diagnostic: the synchronous export with the store's default digest step (before LIVE_DIGEST_STEP)
    if left() > 150:
        from bridge.live.export import ExportOptions
        from bridge.store import CheckpointWriter

        class DefaultStep(CheckpointWriter):
            def __init__(self, *a, **k):
                k["digest_step"] = None
                super().__init__(*a, **k)

        path = os.path.join(D, "Aold")
        drop_caches()
        sync()
        t = time.perf_counter()
        from bridge import _testing

        with _testing.seams(writer_class=DefaultStep):
            rep = export_megatron(path, model, opt, ExportOptions(), exporter=exporter)
        res["a_default_digest_step_s"] = time.perf_counter() - t
        rm(path)
        save()
        print("[step] Aold", res["a_default_digest_step_s"], flush=True)

    # diagnostic: the same asynchronous export without digests (what the digest threads cost the steps)
    if left() > 120:
        from bridge.live.export import ExportOptions

        path = os.path.join(D, "Bnd")
        drop_caches()
        sync()
        t = time.perf_counter()
        h = export_megatron_async(path, model, opt, ExportOptions(digest=False), exporter=exporter)
        t_ret = time.perf_counter()
        during = []
        while not h.done():
            during += train(1)
        rep = h.wait()
        res["b_nodigest"] = {"blocked_s": h.blocked_s, "background_s": h.finished_at - t_ret, "step_during_s": during}
        rm(path)
        save()
        print("[step] Bnd", res["b_nodigest"], flush=True)

    if left() > 90:
        from megatron.core import dist_checkpointing

        fmt = "dp_reshardable"
        md = {"distrib_optim_sharding_type": fmt, "singleton_local_shards": False, "chained_optim_avoid_prefix": True}
        p = os.path.join(D, "meg_async")
        os.makedirs(p, exist_ok=True)
        drop_caches()
        sd = bigpt.build_state_dict(model, gpt, opt, fmt, it[0])
        sync()
        t = time.perf_counter()
        try:
            req = dist_checkpointing.save(sd, p, content_metadata=md, async_sharded_save=True, async_strategy="mcore")
            sync()
            res["megatron_async_blocked_s"] = time.perf_counter() - t
            t = time.perf_counter()
            req.execute_sync()
            res["megatron_async_rest_s"] = time.perf_counter() - t
        except Exception as e:  # noqa: BLE001 (recorded: the CPU dry run may not support it)
            res["megatron_async_error"] = f"{type(e).__name__}: {e}"[:300]
        del sd
        rm(p)
        res["steps"].append("meg")
        save()
        print("[step] meg", res.get("megatron_async_blocked_s"), res.get("megatron_async_rest_s"), flush=True)

    res["c_s"] = []
    for i in range(2):
        if left() < 45:
            res["steps"].append(f"SKIPPED C{i}")
            break
        path = os.path.join(D, f"C{i}")
        drop_caches()
        sync()
        t = time.perf_counter()
        export_megatron_async(path, model, opt, exporter=exporter).wait()
        res["c_s"].append(time.perf_counter() - t)
        rm(path)
        save()
    res["steps"].append("C")

    import tensorstore as ts

    from bridge.store import fsync_tree

    res["raw_s"] = []
    total = sum(s.numel() for s in slots)
    for i in range(2):
        if left() < 30:
            res["steps"].append(f"SKIPPED raw{i}")
            break
        path = os.path.join(D, f"raw{i}")
        drop_caches()
        t = time.perf_counter()
        st = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": path + "/"},
                      "metadata": {"shape": [total], "data_type": "uint8",
                                   "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [4 << 20]}}}},
                     create=True).result()
        futs, off = [], 0
        for s in slots:
            futs.append(st[off:off + s.numel()].write(s.numpy()))
            off += s.numel()
        for f in futs:
            f.result()
        fsync_tree(path)
        res["raw_s"].append(time.perf_counter() - t)
        res["raw_bytes"] = total
        rm(path)
        save()
    res["steps"].append("raw")
    save()
    print("[step] done", {k: res[k] for k in ("c_s", "raw_s")}, flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
