"""Checks for the reference GTP trainer that do not trust `bridge.layout`: tests and GPU scripts use them.

- `dump_rank`: a rank's raw state (physical shards, FP8 bytes and scales, DistOpt fragments,
  buffer offsets measured from the tensors' memory, pre-reduction grads) as plain tensors.
- `assemble_global`: rebuild the unsharded model's tensors (Megatron's TP=1 fused order, no padding)
  from every rank's dump with the padding / TP / fused-section rules written out again here from
  `docs/megatron-layout.md` §2.2, §4.2-4.3, §6 (independent of `bridge.layout`), checking that DP
  fragments tile each shard exactly once and that replicas agree.
- `check_buffers`: every buffer's param offsets, buckets and DP-owned ranges against §4.2-4.3
  recomputed here, and that padding rows carry zero grads and no FP8 amax.
- `fill_from_logical`: fill a reload target (`ReferenceTrainer(..., init=False).local_params()`)
  from logical arrays, as a reload would (used to test `resume` + `step` without the store).
- `run_scenarios`: worker body for spawned gloo / NCCL process groups.
"""

from __future__ import annotations

import math
import os
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from bridge.errors import BridgeError
from bridge.testing.model import ModelConfig, ParamDef, param_table

__all__ = ["dump_rank", "assemble_global", "check_buffers", "padding_report", "compare", "fill_from_logical", "logical_state",
           "run_scenarios"]


# --- dumping ---------------------------------------------------------------------------------------------

def dump_rank(trainer) -> dict[str, Any]:
    """Raw state of one rank (CPU tensors, plain Python metadata)."""
    slots = []
    for s in trainer.slots:
        buf = s.buffer
        elem = buf.param_data.element_size()
        raw = s.storage
        slots.append({
            "name": s.name, "key": s.pdef.key, "index": list(s.index), "t": s.t, "g": s.g, "tp": s.tp, "gtp": s.gtp,
            "expert": s.geometry.expert, "dtype": str(s.dtype).replace("torch.", ""), "shape": list(s.shape),
            "start": s.start, "end": s.end, "buffer": trainer.buffers.index(buf),
            "offset": (raw.data_ptr() - buf.param_data.data_ptr()) // elem,
            "weight": trainer.weight_fp32(s).detach().cpu().clone(),
            "raw": raw.detach().reshape(-1).view(torch.uint8).cpu().clone() if s.quant is not None
            else raw.detach().cpu().clone(),
            "scale_inv": s.quant.scale_inv.detach().cpu().clone() if s.quant is not None else None,
            "frag": None if s.frag is None else {
                "f0": s.frag.f0, "f1": s.frag.f1, "master": s.frag.master.detach().cpu().clone(),
                "exp_avg": s.frag.exp_avg.detach().cpu().clone(), "exp_avg_sq": s.frag.exp_avg_sq.detach().cpu().clone()},
            "grad": trainer.last_grads[s.name].cpu().clone() if getattr(trainer, "last_grads", None) else None,
            "distopt_group": list(buf.group.ranks),
        })
    buffers = [{"param_dtype": b.key.param_dtype, "expert": b.key.expert, "numel": b.param_data.numel(),
                "buckets": [list(x) for x in b.layout.buckets], "group_rank": b.group.rank, "group_size": b.group.size,
                "order": [s.name for s in b.slots]} for b in trainer.buffers]
    return {"rank": trainer.rank, "layout": trainer.layout.to_json(), "step": trainer.step_count, "slots": slots,
            "buffers": buffers, "pad_for_alignment": trainer.config.pad_for_alignment,
            "bucket_size": trainer.config.bucket_size, "weights": trainer.config.weights}


# --- independent geometry (docs/megatron-layout.md, written out again) --------------------------------------

def _tp_local_rows(p: ParamDef, tp: int) -> int:
    rows = p.shape[1] if p.experts else p.shape[0]
    return rows // tp if p.tp in ("column", "vocab", "tp0") else rows


def _gtp_split(rows: int, gtp: int, a: int) -> tuple[int, int]:
    """(S, pad): §2.2 -- pad to a multiple of a*G at the tail, S = P / G (G = 1: no GTP at all)."""
    if gtp == 1:
        return rows, 0
    pad = (a * gtp - rows % (a * gtp)) % (a * gtp) if a > 0 else 0
    return (rows + pad) // gtp, pad


def _physical_shape(p: ParamDef, tp: int, gtp: int, a: int) -> tuple[int, ...]:
    inst = p.shape[1:] if p.experts else p.shape
    rows = _tp_local_rows(p, tp)
    tail = list(inst[1:])
    if p.tp == "row":
        tail[0] //= tp
    S = _gtp_split(rows, gtp, a)[0] if p.gtp else rows
    return (S, *tail)


def _to_global(c: ModelConfig, p: ParamDef, locals_by_t: list[torch.Tensor]) -> torch.Tensor:
    """TP-local tensors (t order) -> the unsharded tensor in Megatron's TP=1 (fused) order."""
    tp = len(locals_by_t)
    if p.tp == "replicated":
        for x in locals_by_t[1:]:
            if not torch.equal(x, locals_by_t[0]):
                raise AssertionError(f"{p.key}: TP replicas differ")
        return locals_by_t[0]
    if p.tp == "row":
        return torch.cat(locals_by_t, dim=1)
    if p.fused and p.fused != "qkv":  # concat kinds: every section TP-split separately (§6.1)
        out, off = [], 0
        for _, rows in c.fused_sections(p.fused):
            n = rows // tp
            out.append(torch.cat([x[off:off + n] for x in locals_by_t], dim=0))
            off += n
        return torch.cat(out, dim=0)
    return torch.cat(locals_by_t, dim=0)  # column / vocab / tp0 / qkv (whole query groups per TP rank)


def _slot_index(dumps: Sequence[dict]) -> dict[str, list[tuple[dict, dict]]]:
    out: dict[str, list[tuple[dict, dict]]] = {}
    for d in dumps:
        for s in d["slots"]:
            out.setdefault(s["name"], []).append((d, s))
    return out


def assemble_global(dumps: Sequence[dict], c: ModelConfig = ModelConfig()) -> dict[str, dict[str, torch.Tensor]]:
    """Per param name: unsharded `weight` (fp32 of what the ranks hold), `master`, `exp_avg`,
    `exp_avg_sq`, rebuilt from all ranks' dumps without `bridge.layout`. Raises AssertionError when
    shapes, padding, fragment tiling or replica agreement is wrong."""
    a = dumps[0]["pad_for_alignment"]
    by_name = _slot_index(dumps)
    out: dict[str, dict[str, torch.Tensor]] = {}
    for p in param_table(c):
        for e in range(max(p.experts, 1)):
            name = p.key + (str(e) if p.experts else "")
            entries = by_name[name]
            tp, gtp = entries[0][1]["tp"], entries[0][1]["gtp"]
            rows = _tp_local_rows(p, tp)
            G = gtp if p.gtp else 1
            S, pad = _gtp_split(rows, G, a)
            shape = _physical_shape(p, tp, G, a)
            numel = math.prod(shape)
            state: dict[str, dict[tuple[int, int], torch.Tensor]] = {k: {} for k in ("weight", "master", "exp_avg", "exp_avg_sq")}
            frags: dict[tuple, list[dict]] = {}
            for d, s in entries:
                if tuple(s["shape"]) != shape:
                    raise AssertionError(f"{name} rank {d['rank']}: shard shape {s['shape']} != expected {shape}")
                tg = (s["t"], s["g"])
                w = s["weight"].float()
                if tg in state["weight"]:
                    if not torch.equal(state["weight"][tg], w):
                        raise AssertionError(f"{name} rank {d['rank']}: weight differs from its replica (t, g) = {tg}")
                else:
                    state["weight"][tg] = w
                if s["frag"] is not None:
                    frags.setdefault((tg, tuple(s["distopt_group"])), []).append(s["frag"])
            for (tg, group), fl in frags.items():
                fl = sorted(fl, key=lambda f: f["f0"])
                pos = 0
                for f in fl:
                    if f["f0"] != pos:
                        raise AssertionError(f"{name} {tg} DistOpt group {group}: fragments leave a gap/overlap at {pos} "
                                             f"(next starts at {f['f0']})")
                    pos = f["f1"]
                if pos != numel:
                    raise AssertionError(f"{name} {tg} DistOpt group {group}: fragments end at {pos}, shard has {numel}")
                for k in ("master", "exp_avg", "exp_avg_sq"):
                    full = torch.cat([f[k] for f in fl]).view(shape)
                    if tg in state[k] and not torch.equal(state[k][tg], full):
                        raise AssertionError(f"{name} {tg}: {k} differs between DistOpt groups (GTP / DP replicas)")
                    state[k][tg] = full
            res = {}
            for k, per_tg in state.items():
                locs = []
                for t in range(tp):
                    shards = [per_tg[(t, g)] for g in range(G)] if (t, 0) in per_tg else None
                    if shards is None:
                        raise AssertionError(f"{name}: no rank holds TP rank {t}'s {k}")
                    locs.append(torch.cat(shards, dim=0)[:rows])  # §2.2: padding = the last `pad` rows
                res[k] = _to_global(c, p, locs)
            out[name] = res
    return out


def padding_report(dumps: Sequence[dict], c: ModelConfig = ModelConfig()) -> dict[str, int]:
    """Count padding elements and check them: zero pre-reduction grads, and (§2.2) padding only in
    the tail rows. Returns {"pad_elements": n, "nonzero_pad_grads": m, "nonzero_pad_values": k}."""
    a = dumps[0]["pad_for_alignment"]
    params = {p.key: p for p in param_table(c)}
    n = bad = nonzero = 0
    for d in dumps:
        for s in d["slots"]:
            p = params[s["key"]]
            if not p.gtp or s["gtp"] == 1:
                continue
            rows = _tp_local_rows(p, s["tp"])
            S, pad = _gtp_split(rows, s["gtp"], a)
            keep = max(0, min(S, rows - s["g"] * S))
            k = math.prod(s["shape"][1:])
            if s["grad"] is not None:
                bad += int((s["grad"][keep * k:] != 0).sum())
            n += (S - keep) * k
            nonzero += int((s["weight"].reshape(-1)[keep * k:] != 0).sum())
    return {"pad_elements": n, "nonzero_pad_grads": bad, "nonzero_pad_values": nonzero}


def check_buffers(dump: dict, c: ModelConfig = ModelConfig()) -> list[str]:
    """Problems with one rank's DistOpt buffers vs §4.2-4.3 recomputed here ([] = none)."""
    a, bucket_size = dump["pad_for_alignment"], dump["bucket_size"]
    params = {p.key: p for p in param_table(c)}
    problems: list[str] = []
    slots = {s["name"]: s for s in dump["slots"]}
    # group by (param dtype, expert) in first-appearance (registration) order
    groups: dict[tuple[str, bool], list[dict]] = {}
    for s in dump["slots"]:
        pdt = "uint8" if s["dtype"].startswith("float8") else s["dtype"]
        groups.setdefault((pdt, s["expert"]), []).append(s)
    if [(b["param_dtype"], b["expert"]) for b in dump["buffers"]] != list(groups):
        problems.append(f"rank {dump['rank']}: buffers {[(b['param_dtype'], b['expert']) for b in dump['buffers']]} "
                        f"!= expected {list(groups)}")
        return problems
    for bi, (buf, members) in enumerate(zip(dump["buffers"], groups.values())):
        dp = buf["group_size"]
        div = math.lcm(dp, 128)
        start = bstart = 0
        in_bucket = 0
        end = 0
        buckets, index = [], {}
        for s in reversed(members):
            p = params[s["key"]]
            numel = math.prod(_physical_shape(p, s["tp"], s["gtp"] if p.gtp else 1, a))
            start = -(-start // 64) * 64
            end = start + numel
            index[s["name"]] = (start, end, len(buckets))
            in_bucket += 1
            if bucket_size is not None and end - bstart >= bucket_size:
                bend = -(-end // div) * div
                buckets.append((bstart, bend))
                bstart = start = bend
                in_bucket = 0
            else:
                start = end
        if in_bucket:
            buckets.append((bstart, -(-end // div) * div))
        if [tuple(b) for b in buf["buckets"]] != buckets:
            problems.append(f"rank {dump['rank']} buffer {bi}: buckets {buf['buckets']} != expected {buckets}")
        if buf["numel"] != buckets[-1][1]:
            problems.append(f"rank {dump['rank']} buffer {bi}: numel {buf['numel']} != {buckets[-1][1]}")
        r = buf["group_rank"]
        for name, (p0, p1, b) in index.items():
            s = slots[name]
            if (s["start"], s["end"], s["offset"]) != (p0, p1, p0):
                problems.append(f"rank {dump['rank']} {name}: at [{s['start']}, {s['end']}) offset {s['offset']}, "
                                f"expected [{p0}, {p1})")
            b0, b1 = buckets[b]
            sz = (b1 - b0) // dp
            w0, w1 = b0 + r * sz, b0 + (r + 1) * sz
            lo, hi = max(p0, w0), min(p1, w1)
            want = (lo - p0, hi - p0) if hi > lo else None
            got = None if s["frag"] is None else (s["frag"]["f0"], s["frag"]["f1"])
            if got != want:
                problems.append(f"rank {dump['rank']} {name}: owns {got}, expected {want}")
    return problems


def compare(got: Mapping[str, Mapping[str, torch.Tensor]], want: Mapping[str, Mapping[str, torch.Tensor]],
            atol: Mapping[str, float], rtol: float = 1e-5) -> list[str]:
    """Mismatches between two `assemble_global` results, per state kind with its own `atol`."""
    bad = []
    for name, kinds in want.items():
        for k, w in kinds.items():
            g = got[name][k]
            if g.shape != w.shape:
                bad.append(f"{name}.{k}: shape {tuple(g.shape)} != {tuple(w.shape)}")
                continue
            diff = (g - w).abs()
            tol = atol[k] + rtol * w.abs()
            if (diff > tol).any():
                i = int((diff - tol).argmax())
                bad.append(f"{name}.{k}: max |diff| {float(diff.max()):.3g} ({int((diff > tol).sum())} elements "
                           f"over tolerance; worst got {float(g.view(-1)[i]):.6g} want {float(w.view(-1)[i]):.6g})")
    return bad


# --- reload without the store -------------------------------------------------------------------------------

def logical_state(trainer) -> dict[str, dict[str, np.ndarray]]:
    """World-size-1 trainer -> logical arrays per tree root (`model`, `params`, `mu`, `nu`), fp32.

    Uses `bridge.layout` (this is the export direction at TP = GTP = DP = 1: no padding, one fragment)."""
    from bridge.layout.assemble import split_local

    if trainer.layout.world != 1:
        raise BridgeError("logical_state needs the world-size-1 trainer; assemble sharded runs with assemble_global")
    out: dict[str, dict[str, np.ndarray]] = {k: {} for k in ("model", "params", "mu", "nu")}
    for lp, s in zip(trainer.local_params(), trainer.slots):
        src = {"model": trainer.weight_fp32(s).reshape(-1), "params": s.frag.master, "mu": s.frag.exp_avg,
               "nu": s.frag.exp_avg_sq}
        for root, flat in src.items():
            for array, box, data in split_local(lp.geometry.shard_pieces(1, 1, 0, 0, lp.index), flat.detach().cpu().numpy()):
                full_shape = lp.geometry.logical_arrays()[array]
                arr = out[root].setdefault(array, np.zeros(full_shape, np.float32))
                arr[box.slices] = data
    return out


def fill_from_logical(trainer, arrays: Mapping[str, Mapping[str, np.ndarray]]) -> None:
    """Fill `trainer.local_params()` in place from logical arrays, padding as zeros (what a reload does)."""
    from bridge.layout.assemble import assemble_fragment, assemble_shard
    from bridge.live.api import QuantizedWeight
    from bridge.live.fp8 import quantize_into

    for lp, s in zip(trainer.local_params(), trainer.slots):
        g = lp.geometry
        model = lambda a, b: arrays["model"][a][b.slices]  # noqa: E731
        shard = torch.from_numpy(assemble_shard(g, s.tp, s.gtp, s.t, s.g, model, np.float32, lp.index))
        if isinstance(lp.weight, QuantizedWeight):
            quantize_into(lp.weight, shard)
        else:
            lp.weight.copy_(shard.to(lp.weight.dtype))
        if lp.optim is not None:
            for root, t in (("params", lp.optim.master), ("mu", lp.optim.exp_avg), ("nu", lp.optim.exp_avg_sq)):
                read = lambda a, b, root=root: arrays[root][a][b.slices]  # noqa: E731
                t.copy_(torch.from_numpy(assemble_fragment(g, s.tp, s.gtp, s.t, s.g, lp.optim.f0, lp.optim.f1, read,
                                                           np.float32, lp.index)))


# --- spawned workers --------------------------------------------------------------------------------------------


def _init_worker(rank: int, world: int, init_method: str, backend: str) -> "torch.device":
    """Join the process group of a spawned worker; one GPU per rank under NCCL."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world)
    return device

def run_scenarios(rank: int, world: int, init_method: str, scenarios: Sequence[dict], outdir: str,
                  backend: str = "gloo") -> None:
    """Worker body: for each scenario train (or reload + continue) and dump `<name>.rank<r>.pt` to `outdir`.

    A scenario: {"name", "layout": ParallelLayout kwargs, "config": TrainerConfig kwargs (model
    kwargs under "model"), "steps", "reload": path of a `logical_state` file + "reload_step"}.
    """
    import torch.distributed as dist

    from bridge.layout import ParallelLayout
    from bridge.testing.collectives import RankGroups
    from bridge.testing.trainer import ReferenceTrainer, TrainerConfig, step

    device = _init_worker(rank, world, init_method, backend)
    try:
        for sc in scenarios:
            layout = ParallelLayout(**sc["layout"])
            cfg = dict(sc.get("config", {}))
            if "model" in cfg:
                cfg["model"] = ModelConfig(**cfg["model"])
            config = TrainerConfig(**cfg)
            groups = RankGroups.build(layout, backend)
            if sc.get("reload"):
                arrays = {root: {k: v.numpy() for k, v in d.items()}
                          for root, d in torch.load(sc["reload"], weights_only=True).items()}
                trainer = ReferenceTrainer(layout, config, init=False, device=device, groups=groups)
                fill_from_logical(trainer, arrays)
                trainer.resume(sc["reload_step"])
            else:
                trainer = ReferenceTrainer(layout, config, device=device, groups=groups)
            losses = step(trainer, sc["steps"])
            d = dump_rank(trainer)
            d["losses"] = losses
            torch.save(d, os.path.join(outdir, f"{sc['name']}.rank{rank}.pt"))
            dist.barrier()
    finally:
        dist.destroy_process_group()


def run_export_reload(rank: int, world: int, init_method: str, outdir: str, weights: str, source: dict, target: dict,
                      steps: int = 2, backend: str = "gloo") -> None:
    """Worker body: train at `source`, `export_state`, continue one step; a second trainer at
    `target` (zeroed, `init=False`) is filled by `reload_state`, resumes and steps once. Dumps
    `src.rank<r>.pt` (source after the extra step) and `dst.rank<r>.pt` (target after its step)."""
    import torch.distributed as dist

    from bridge.layout import ParallelLayout
    from bridge.live.export import export_state
    from bridge.testing.collectives import RankGroups
    from bridge.testing.trainer import ReferenceTrainer, TrainerConfig, step, train
    from bridge.live.reload import reload_state

    device = _init_worker(rank, world, init_method, backend)
    try:
        cfg = TrainerConfig(weights=weights)
        src_layout, dst_layout = ParallelLayout(**source), ParallelLayout(**target)
        src_groups, dst_groups = RankGroups.build(src_layout, backend), RankGroups.build(dst_layout, backend)
        st = train(src_layout, steps, cfg.seed, cfg, device=device, groups=src_groups)
        export_state(os.path.join(outdir, "ckpt"), st.run, st.params)
        cont = step(st.trainer, 1)
        tgt = ReferenceTrainer(dst_layout, cfg, init=False, device=device, groups=dst_groups)
        res = reload_state(os.path.join(outdir, "ckpt"), tgt.live_run(), tgt.local_params())
        tgt.resume(res.step)
        after = step(tgt, 1)
        for tag, tr, losses in (("src", st.trainer, cont), ("dst", tgt, after)):
            d = dump_rank(tr)
            d["losses"] = losses
            torch.save(d, os.path.join(outdir, f"{tag}.rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()
