"""An independent reference of Megatron's GTP sharding and DistOpt fragments, used by the live tests.

Written from docs/megatron-layout.md §2.2-2.4, §4.2-4.3 and §6.1/6.3 with index arrays, without
`bridge.layout`: a rank's physical shard is `flat_logical[index]` where `index` holds the logical
flat position of every physical element (-1 for padding). The live tests build per-rank state with
this code and assemble what the ranks held with its inverse, so the exporter (which uses the
layout engine) is checked against a second computation. tests/live/test_live_sharding.py pins it to
the worked examples of the doc.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import lcm, prod

import numpy as np


@dataclass(frozen=True)
class RefParam:
    """A test parameter: logical sections (name -> shape) and how the run shards it.

    kind: "column" (TP dim 0, GTP dim 0), "row" (TP dim 1, GTP dim 0), "tp_only" (TP dim 0, no GTP,
    e.g. a column bias), "replicated" (neither). Fused params list several sections; TP splits
    each section, the TP-local tensor concatenates them (§6.1).
    """

    key: str
    sections: tuple[tuple[str | None, tuple[int, ...]], ...]
    kind: str = "column"

    @property
    def gtp(self) -> bool:
        return self.kind in ("column", "row")

    @property
    def fused(self) -> bool:
        return len(self.sections) > 1 or self.sections[0][0] is not None

    def array_names(self) -> list[str]:
        """Logical array names: the key, plus `.section` for fused params."""
        return [self.key if s is None else f"{self.key}.{s}" for s, _ in self.sections]

    def sizes(self) -> list[int]:
        return [prod(shape) for _, shape in self.sections]


def tp_local_index(p: RefParam, tp: int, t: int) -> np.ndarray:
    """Logical flat index (over the concatenated flattened sections) of the TP-local tensor."""
    blocks, base = [], 0
    for (_, shape), size in zip(p.sections, p.sizes()):
        idx = np.arange(size, dtype=np.int64).reshape(shape) + base
        base += size
        if p.kind in ("column", "tp_only"):
            n = shape[0] // tp
            blocks.append(idx[t * n:(t + 1) * n])
        elif p.kind == "row":
            k = shape[1] // tp
            blocks.append(idx[:, t * k:(t + 1) * k])
        else:
            blocks.append(idx)
    return np.concatenate(blocks, axis=0)


def physical_index(p: RefParam, tp: int, gtp: int, pad_for_alignment: int, t: int, g: int) -> np.ndarray:
    """Index array of the physical shard of (t, g): §2.2 padding at the tail, -1 marks pad rows."""
    local = tp_local_index(p, tp, t)
    if not p.gtp or gtp == 1:  # GTP (and its padding) is only active with more than one shard
        return local
    rows = local.shape[0]
    if pad_for_alignment > 0:
        a = pad_for_alignment * gtp
        pad = (a - rows % a) % a
    else:
        assert rows % gtp == 0
        pad = 0
    s = (rows + pad) // gtp
    padded = np.concatenate([local, np.full((pad,) + local.shape[1:], -1, np.int64)], axis=0)
    return padded[g * s:(g + 1) * s]


def distopt_ranges(numels: list[int], dp: int, d: int) -> list[tuple[int, int]]:
    """Flat range [f0, f1) of each param's physical shard owned by DP rank d (§4.2-4.3).

    One bucket, params laid out in reverse order with 64-element aligned starts, bucket padded to
    lcm(dp, 128); DP rank d owns [d*s, (d+1)*s).
    """
    starts, start = {}, 0
    for i in reversed(range(len(numels))):
        start = -(-start // 64) * 64
        starts[i] = start
        start += numels[i]
    div = lcm(dp, 128)
    total = -(-start // div) * div
    s = total // dp
    lo, hi = d * s, (d + 1) * s
    out = []
    for i, n in enumerate(numels):
        p0, p1 = starts[i], starts[i] + n
        a, b = max(p0, lo), min(p1, hi)
        out.append((a - p0, b - p0) if b > a else (0, 0))
    return out


def shard(flat_logical: np.ndarray, index: np.ndarray, pad_value) -> np.ndarray:
    """Gather the physical shard from the concatenated flat logical data; pads get `pad_value`."""
    out = flat_logical[np.where(index >= 0, index, 0)]
    out[index < 0] = pad_value
    return out


def scatter(dest_flat: np.ndarray, written: np.ndarray, index: np.ndarray, values: np.ndarray) -> None:
    """Inverse of `shard`: put non-pad `values` at their logical positions; replicas must agree."""
    keep = index >= 0
    pos, vals = index[keep], values[keep]
    seen = written[pos]
    if seen.any():
        prev = dest_flat[pos[seen]]
        same = prev.view(np.uint8).reshape(len(prev), -1) == vals[seen].view(np.uint8).reshape(len(prev), -1)
        assert same.all(), "two ranks hold different bytes for one logical element"
    dest_flat[pos] = vals
    written[pos] = True


# --- per-rank state of a synthetic model (independent of bridge.layout) -------------------------

def coords(rank: int, tp: int, gtp: int) -> tuple[int, int, int]:
    """(t, g, d) of a rank in Megatron's default order: r = t + TP*g + TP*G*d (§1.3)."""
    return rank % tp, (rank // tp) % gtp, rank // (tp * gtp)


@dataclass(frozen=True)
class RefModel:
    """Test parameters (layer-stacked ones appear once per layer) and a seed for their values."""

    params: tuple[RefParam, ...]
    layers: dict  # key -> number of stacked layers (absent: not stacked)
    seed: int = 0
    specials: tuple[str, ...] = ()  # keys whose params / mu / model get NaN, +-Inf, -0.0, a subnormal

    def instances(self) -> list[tuple[RefParam, tuple[int, ...]]]:
        out = []
        for p in self.params:
            n = self.layers.get(p.key, 0)
            out.extend((p, (i,)) for i in range(n)) if n else out.append((p, ()))
        return out

    def logical(self) -> dict[str, dict[str, np.ndarray]]:
        """root -> array name -> logical array (model bf16 as float32 values, params/mu/nu fp32)."""
        import ml_dtypes

        rng = np.random.default_rng(self.seed)
        out: dict[str, dict[str, np.ndarray]] = {r: {} for r in ("model", "params", "mu", "nu")}
        for p in self.params:
            n = self.layers.get(p.key, 0)
            for name, (_, shape) in zip(p.array_names(), p.sections):
                full = ((n,) if n else ()) + shape
                master = rng.standard_normal(full).astype(np.float32)
                out["params"][name] = master
                out["mu"][name] = (rng.standard_normal(full) * 1e-3).astype(np.float32)
                out["nu"][name] = (rng.random(full) * 1e-6).astype(np.float32)
                if p.key in self.specials:
                    vals = np.array([np.nan, np.inf, -np.inf, -0.0, 1e-40], np.float32)
                    master.reshape(-1)[:5] = vals
                    out["mu"][name].reshape(-1)[:5] = vals
                out["model"][name] = master.astype(ml_dtypes.bfloat16)
        return out


def flat_logical(arrays: dict[str, np.ndarray], p: RefParam, index: tuple[int, ...]) -> np.ndarray:
    """Concatenated flat logical data of one instance (the index space of `physical_index`)."""
    return np.concatenate([arrays[n][index].reshape(-1) if index else arrays[n].reshape(-1) for n in p.array_names()])


def fp8_quantize(x: np.ndarray, block: tuple[int, int] | None):
    """(fp8 data as torch.float8_e4m3fn, fp32 scale_inv) of a 2-D shard with current scaling."""
    import torch

    fmax = 448.0
    if block is None:
        amax = float(np.abs(x).max()) if x.size else 0.0
        sinv = np.array([amax / fmax if amax > 0 else 1.0], np.float32)
        grid = np.full(x.shape, sinv[0], np.float32)
    else:
        br, bc = block
        nb = (-(-x.shape[0] // br), -(-x.shape[1] // bc))
        sinv = np.ones(nb, np.float32)
        for i in range(nb[0]):
            for j in range(nb[1]):
                amax = float(np.abs(x[i * br:(i + 1) * br, j * bc:(j + 1) * bc]).max())
                sinv[i, j] = amax / fmax if amax > 0 else 1.0
        grid = np.repeat(np.repeat(sinv, br, 0), bc, 1)[:x.shape[0], :x.shape[1]]
    data = torch.from_numpy(np.clip(x / grid, -fmax, fmax).astype(np.float32)).to(torch.float8_e4m3fn)
    return data, torch.from_numpy(sinv)


def fp8_dequant_ref(data, sinv, block) -> np.ndarray:
    """numpy reference of the dequantized bf16 values (returned as float32)."""
    import ml_dtypes

    x = data.to(__import__("torch").float32).numpy()
    s = sinv.numpy()
    if block is None:
        grid = np.full(x.shape, s.reshape(-1)[0], np.float32)
    else:
        grid = np.repeat(np.repeat(s, block[0], 0), block[1], 1)[:x.shape[0], :x.shape[1]]
    return (x * grid).astype(ml_dtypes.bfloat16).astype(np.float32)


@dataclass
class RawParam:
    """What a rank holds of one instance, as plain arrays (for independent assembly)."""

    key: str
    index: tuple[int, ...]
    pindex: np.ndarray          # physical index array (-1 = pad)
    weight: np.ndarray          # model values as the checkpoint should see them (float32; FP8 dequantized)
    frag: tuple[int, int]
    master: np.ndarray
    mu: np.ndarray
    nu: np.ndarray


def rank_raw_state(model: RefModel, tp: int, gtp: int, dp: int, a: int, rank: int,
                   fp8: dict | None = None) -> tuple[list[RawParam], list]:
    """Every instance this rank holds: raw arrays + the torch objects for a LocalParam.

    Pad rows of weights and optimizer state get rank-specific garbage: the exporter must drop them.
    `fp8` maps param key -> block (None = per-tensor) for weights held as native FP8.
    """
    import ml_dtypes
    import torch

    fp8 = fp8 or {}
    logical = model.logical()
    t, g, d = coords(rank, tp, gtp)
    garbage = np.random.default_rng(1000 + rank)
    insts = model.instances()
    pidx = [physical_index(p, tp, gtp, a, t, g) for p, _ in insts]
    ranges = distopt_ranges([ix.size for ix in pidx], dp, d)
    raws, torch_objs = [], []
    for (p, index), ix, (f0, f1) in zip(insts, pidx, ranges):
        flats = {r: flat_logical(logical[r], p, index) for r in logical}
        gv = float(garbage.standard_normal())
        w = shard(flats["model"].astype(np.float32), ix, gv).astype(ml_dtypes.bfloat16)
        if p.key in fp8:
            data, sinv = fp8_quantize(w.astype(np.float32), fp8[p.key])
            wt = ("fp8", data, sinv, fp8[p.key])
            wvals = fp8_dequant_ref(data, sinv, fp8[p.key])
        else:
            wt = ("bf16", torch.from_numpy(w.view(np.int16).copy()).view(torch.bfloat16))
            wvals = w.astype(np.float32)
        st = {r: shard(flats[r], ix, gv).reshape(-1)[f0:f1].copy() for r in ("params", "mu", "nu")}
        raws.append(RawParam(p.key, index, ix, wvals, (f0, f1), st["params"], st["mu"], st["nu"]))
        torch_objs.append(wt)
    return raws, torch_objs


def assemble(model: RefModel, per_rank: list[list[RawParam]]) -> dict[str, dict[str, np.ndarray]]:
    """Logical arrays rebuilt from every rank's raw shards and fragments (replicas must agree)."""
    out: dict[str, dict[str, np.ndarray]] = {r: {} for r in ("model", "params", "mu", "nu")}
    for p, index in model.instances():
        size = sum(p.sizes())
        bufs = {r: (np.zeros(size, np.float32), np.zeros(size, bool)) for r in out}
        for raws in per_rank:
            for rp in raws:
                if rp.key != p.key or rp.index != index:
                    continue
                scatter(*bufs["model"], rp.pindex.reshape(-1), rp.weight.reshape(-1))
                f0, f1 = rp.frag
                sub = rp.pindex.reshape(-1)[f0:f1]
                for r, v in (("params", rp.master), ("mu", rp.mu), ("nu", rp.nu)):
                    scatter(*bufs[r], sub, v)
        n_layers = model.layers.get(p.key, 0)
        for r, (buf, written) in bufs.items():
            assert written.all(), f"{p.key}{index}: {r} not fully held by the ranks"
            off = 0
            for name, (_, shape) in zip(p.array_names(), p.sections):
                part = buf[off:off + prod(shape)].reshape(shape)
                off += prod(shape)
                if n_layers:
                    out[r].setdefault(name, np.zeros((n_layers,) + shape, np.float32))[index] = part
                else:
                    out[r][name] = part
    return out
