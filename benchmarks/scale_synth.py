"""A Megatron-shaped `torch_dist` checkpoint of any size, written by streaming (for bench_scale.py).

A Llama-style GPT (GQA, SwiGLU, RMSNorm, no biases, untied embeddings; TP=1, DP=1 as a one-GPU
Megatron-Core run saves it): the model weights as bf16 chunks, one per stacked layer, and the
optimizer state either as `dp_reshardable` DDP bucket tensors (several buckets, 64-element aligned
parameter starts in reverse registration order, one chunk per parameter as megatron-core 0.19.2
writes them) or as `fully_reshardable` model-space fp32 chunks.

Why not `torch.distributed.checkpoint.save`: at world 1 it needs the whole state dict in memory.
Why not a logical checkpoint + `to-megatron`: the benchmark would then measure the converter on
data the bridge itself laid out. Instead, worker processes each append `torch.save` blobs of their
tasks (one layer's chunk, or one bucket) to their own `.distcp` file, exactly what DCP's
FileSystemWriter writes with several files, and the parent writes the one `.metadata` from what
the workers report. No process holds more than one task's tensors.

Every value is a function of (seed, role, key, layer): `stored()` regenerates any instance, so a
reader's output can be checked bit-exactly against an independent computation.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import pickle
import uuid
import zlib
from dataclasses import dataclass
from multiprocessing import get_context
from typing import Any, Iterator

import ml_dtypes
import numpy as np

ROLES = ("param", "exp_avg", "exp_avg_sq")  # Megatron's optimizer state names
DTYPE_KEY = "(torch.bfloat16, torch.float32)"
LR, BETAS, EPS, WD, STEP = 3e-4, (0.9, 0.95), 1e-8, 0.1, 2


@dataclass(frozen=True)
class Sizes:
    """GPT sizes; `stored` shapes are per stacked instance, as Megatron keys them."""

    hidden: int
    layers: int
    ffn: int
    heads: int
    groups: int
    vocab: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def params(self) -> list[tuple[str, tuple[int, ...], bool]]:
        """(key, per-instance shape, stacked) in registration order (local layer spec, RMSNorm).

        >>> [k for k, _, _ in Sizes(8, 2, 16, 4, 2, 32).params()][:3]
        ['embedding.word_embeddings.weight', 'decoder.layers.input_layernorm.weight', 'decoder.layers.self_attention.linear_proj.weight']
        """
        h, f, d = self.hidden, self.ffn, self.head_dim
        qkv = (self.heads + 2 * self.groups) * d
        return [("embedding.word_embeddings.weight", (self.vocab, h), False),
                ("decoder.layers.input_layernorm.weight", (h,), True),
                ("decoder.layers.self_attention.linear_proj.weight", (h, self.heads * d), True),
                ("decoder.layers.self_attention.linear_qkv.weight", (qkv, h), True),
                ("decoder.layers.pre_mlp_layernorm.weight", (h,), True),
                ("decoder.layers.mlp.linear_fc1.weight", (2 * f, h), True),
                ("decoder.layers.mlp.linear_fc2.weight", (h, f), True),
                ("decoder.final_layernorm.weight", (h,), False),
                ("output_layer.weight", (self.vocab, h), False)]

    def n_params(self) -> int:
        """
        >>> Sizes(2048, 16, 5632, 16, 4, 32000).n_params()  # the 0.85 B Megatron-Core probe model
        852559872
        """
        return sum(math.prod(s) * (self.layers if st else 1) for _, s, st in self.params())

    def state_bytes(self) -> int:
        """bf16 weight + fp32 master + two fp32 moments per parameter."""
        return 14 * self.n_params()

    @staticmethod
    def for_gib(gib: float) -> "Sizes":
        """The probe model's shape (hidden 2048 from 4 GiB up), layers chosen to reach `gib` of state.

        >>> s = Sizes.for_gib(12); (s.hidden, s.layers, round(s.state_bytes() / 2**30, 1))
        (2048, 18, 12.3)
        >>> s = Sizes.for_gib(0.25); (s.hidden, s.heads, s.groups)
        (512, 8, 2)
        """
        h = 2048 if gib >= 4 else 1024 if gib >= 1 else 512
        vocab = 32000 if h == 2048 else 8192
        f = 11 * h // 4
        heads = max(8, h // 128)  # >= 2 query groups, so TP=2 targets are possible
        one = Sizes(h, 1, f, heads, max(1, heads // 4), vocab)
        per_layer = one.n_params() - Sizes(h, 0, f, heads, max(1, heads // 4), vocab).n_params()
        fixed = one.n_params() - per_layer
        layers = max(2, round((gib * 2**30 / 14 - fixed) / per_layer))
        return Sizes(h, layers, f, heads, max(1, heads // 4), vocab)


def _seed(key: str, layer: int | None, role: str, seed: int) -> list[int]:
    return [seed, zlib.crc32(key.encode()), 1 + (-1 if layer is None else layer), ROLES.index(role)]


def stored(key: str, shape: tuple[int, ...], layer: int | None, role: str, seed: int = 0) -> np.ndarray:
    """One instance of `key` as Megatron stores it (fused qkv / fc1): fp32 for the optimizer roles
    (`param`, `exp_avg`, `exp_avg_sq`), bf16 (round-to-nearest-even of the master) for `model`."""
    if role == "model":
        return stored(key, shape, layer, "param", seed).astype(ml_dtypes.bfloat16)
    x = np.random.default_rng(_seed(key, layer, role, seed)).random(math.prod(shape), dtype=np.float32)
    if role == "param":
        x -= np.float32(0.5)
        x *= np.float32(0.04)
    elif role == "exp_avg":
        x -= np.float32(0.5)
        x *= np.float32(1e-3)
    else:
        x *= np.float32(1e-6)
    return x.reshape(shape)


# ---------------------------------------------------------------------------------------------
# DDP buckets (pure)


def buckets(sizes: Sizes, bucket_size: int) -> list[list[tuple[str, int | None, int, int]]]:
    """Megatron's bucketed grad buffer at DP=1: per bucket, (key, layer, start in bucket, numel).

    Parameters in reverse registration order, each start aligned to 64 elements; a bucket closes
    once it holds `bucket_size` elements, its end padded to a multiple of lcm(DP, 128) = 128.

    >>> [[(k.split('.')[-2], l, s, n) for k, l, s, n in b] for b in buckets(Sizes(8, 1, 16, 4, 2, 32), 300)]
    [[('output_layer', None, 0, 256), ('final_layernorm', None, 256, 8), ('linear_fc2', 0, 320, 128)], [('linear_fc1', 0, 0, 256), ('pre_mlp_layernorm', 0, 256, 8), ('linear_qkv', 0, 320, 128)], [('linear_proj', 0, 0, 64), ('input_layernorm', 0, 64, 8), ('word_embeddings', None, 128, 256)]]
    """
    inst = []
    plist = sizes.params()
    inst.append((plist[0][0], None, math.prod(plist[0][1])))
    for layer in range(sizes.layers):
        inst += [(k, layer, math.prod(s)) for k, s, st in plist if st]
    inst += [(k, None, math.prod(s)) for k, s, st in plist[1:] if not st]
    out: list[list] = [[]]
    pos = bstart = 0
    rev = list(reversed(inst))
    for i, (key, layer, n) in enumerate(rev):
        pos = -(-pos // 64) * 64
        out[-1].append((key, layer, pos - bstart, n))
        pos += n
        if pos - bstart >= bucket_size and i < len(rev) - 1:
            pos = bstart = -(-pos // 128) * 128
            out.append([])
    return out


def bucket_numels(b: list[tuple[str, int | None, int, int]]) -> tuple[int, int]:
    """(unpadded, padded to 128) element count of one bucket."""
    unp = max(s + n for _, _, s, n in b)
    return unp, -(-unp // 128) * 128


# ---------------------------------------------------------------------------------------------
# Streaming DCP writing


class _File:
    """Appends `torch.save` blobs to one `.distcp` file; records (fqn, offsets) -> (offset, length)."""

    def __init__(self, root: str, rel: str) -> None:
        import torch

        self.torch, self.rel = torch, rel
        self.f = open(os.path.join(root, rel), "wb")
        self.pos = 0
        self.chunks: list[tuple[str, tuple[int, ...] | None, tuple[int, ...], int, int]] = []

    def blob(self, fqn: str, offsets: tuple[int, ...] | None, obj: Any) -> None:
        buf = io.BytesIO()
        self.torch.save(obj, buf)
        data = buf.getbuffer()
        self.f.write(data)
        shape = tuple(obj.shape) if offsets is not None else ()
        self.chunks.append((fqn, offsets, shape, self.pos, len(data)))
        self.pos += len(data)

    def tensor(self, fqn: str, offsets: tuple[int, ...], a: np.ndarray) -> None:
        from bridge.dtypes import from_numpy

        self.blob(fqn, offsets, from_numpy(a))

    def close(self) -> None:
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()


def _tasks(sizes: Sizes, fmt: str, bucket_size: int) -> list[tuple]:
    """Independent write tasks with their byte weight: one stacked instance or one bucket each."""
    out = []
    per_role = 1 + (3 * 2 if fmt == "fully_reshardable" else 0)  # bf16 = 1 unit of 2 bytes, fp32 = 2
    for key, shape, st in sizes.params():
        for layer in (range(sizes.layers) if st else [None]):
            out.append((math.prod(shape) * 2 * per_role, ("model", key, layer)))
    if fmt == "dp_reshardable":
        for b, items in enumerate(buckets(sizes, bucket_size)):
            out.append((bucket_numels(items)[0] * 12, ("bucket", b)))
    return out


def _run_tasks(args: tuple) -> list:
    root, rel, sizes, fmt, bucket_size, seed, tasks = args
    shapes = {k: s for k, s, _ in sizes.params()}
    stacked = {k: st for k, _, st in sizes.params()}
    bks = buckets(sizes, bucket_size) if fmt == "dp_reshardable" else []
    f = _File(root, rel)
    for task in tasks:
        if task[0] == "model":
            _, key, layer = task
            shape = shapes[key]
            pre = (1,) if stacked[key] else ()
            offs = ((layer,) if stacked[key] else ()) + (0,) * len(shape)
            f.tensor(key, offs, stored(key, shape, layer, "model", seed).reshape(pre + shape))
            if fmt == "fully_reshardable":
                for role in ROLES:
                    f.tensor(f"optimizer.state.{role}.{key}", offs,
                             stored(key, shape, layer, role, seed).reshape(pre + shape))
        else:
            b = task[1]
            for role in ROLES:
                fqn = f"optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_{DTYPE_KEY}.bucket_idx_{b}.{role}"
                for key, layer, start, n in bks[b]:
                    f.tensor(fqn, (start,), stored(key, shapes[key], layer, role, seed).reshape(-1))
    f.close()
    return f.chunks


def _param_groups() -> list[dict]:
    base = {"lr": LR, "betas": BETAS, "eps": EPS, "lr_mult": 1.0, "step": STEP, "max_lr": LR, "min_lr": LR,
            "is_expert_parallel": False, "is_decoupled_lr": False, "default_config": True}
    return [dict(base, weight_decay=WD, wd_mult=1.0), dict(base, weight_decay=0.0, wd_mult=0.0)]


def common_state(sizes: Sizes, fmt: str) -> dict:
    """What a Megatron-LM training loop puts in `common_state` (the args the converter reads)."""
    import torch

    args = argparse.Namespace(
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1, data_parallel_size=1, world_size=1,
        num_layers=sizes.layers, hidden_size=sizes.hidden, ffn_hidden_size=sizes.ffn,
        num_attention_heads=sizes.heads, num_query_groups=sizes.groups, group_query_attention=True,
        kv_channels=sizes.head_dim, swiglu=True, padded_vocab_size=sizes.vocab, normalization="RMSNorm",
        add_bias_linear=False, position_embedding_type="rope", untie_embeddings_and_output_weights=True,
        params_dtype=torch.bfloat16, bf16=True, use_distributed_optimizer=True, iteration=STEP,
        lr=LR, adam_beta1=BETAS[0], adam_beta2=BETAS[1], adam_eps=EPS, weight_decay=WD, ckpt_format="torch_dist")
    cs: dict[str, Any] = {"args": args, "checkpoint_version": 3.0, "iteration": STEP,
                          "content_metadata": {"distrib_optim_sharding_type": fmt}}
    if fmt == "fully_reshardable":
        cs["optimizer"] = {"optimizer": {"param_groups": _param_groups()}, "param_state_sharding_type": fmt}
    else:
        cs["optimizer"] = {"param_state_sharding_type": fmt}
    return cs


def _balance(tasks: list[tuple], n: int) -> list[list]:
    """Greedy: heaviest task to the lightest worker (keeps each worker's file near total/n)."""
    loads = [0] * n
    out: list[list] = [[] for _ in range(n)]
    for w, t in sorted(tasks, key=lambda x: -x[0]):
        i = loads.index(min(loads))
        loads[i] += w
        out[i].append(t)
    return [o for o in out if o]


def write(path: str, sizes: Sizes, fmt: str = "dp_reshardable", bucket_size: int = 40_000_000, seed: int = 0,
          workers: int | None = None) -> dict:
    """Write the checkpoint at `path` (must not exist); returns a summary (tensor bytes, files, buckets)."""
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                       MetadataIndex, StorageMeta, TensorProperties,
                                                       TensorStorageMetadata)

    os.makedirs(path)
    workers = workers or min(8, os.cpu_count() or 1)
    groups = _balance(_tasks(sizes, fmt, bucket_size), workers)
    jobs = [(path, f"__0_{i}.distcp", sizes, fmt, bucket_size, seed, g) for i, g in enumerate(groups)]
    with get_context("spawn").Pool(len(jobs)) as pool:
        parts = pool.map(_run_tasks, jobs, chunksize=1)
    extra = _File(path, f"__0_{len(jobs)}.distcp")
    objects = {"common_state/shard_0_1": common_state(sizes, fmt)}
    bks = buckets(sizes, bucket_size)
    if fmt == "dp_reshardable":
        pre = "optimizer.distributed.dp_group_idx_0."
        nums = [bucket_numels(b) for b in bks]
        dt = (torch.bfloat16, torch.float32)
        objects[pre + "per_bucket_numel/shard_0_1"] = [{dt: [p for _, p in nums]}]
        objects[pre + "per_bucket_numel_unpadded/shard_0_1"] = [{dt: [u for u, _ in nums]}]
        objects[pre + "optimizer/shard_0_1"] = {"param_groups": [dict(g, params=[]) for g in _param_groups()]}
    for k, v in objects.items():
        extra.blob(k, None, [v])
    extra.close()
    parts.append(extra.chunks)
    rels = [j[1] for j in jobs] + [extra.rel]
    sdm: dict[str, Any] = {}
    storage = {}
    glob: dict[str, tuple[Any, tuple[int, ...]]] = {}
    for key, shape, st in sizes.params():
        full = ((sizes.layers,) if st else ()) + shape
        glob[key] = (torch.bfloat16, full)
        if fmt == "fully_reshardable":
            for role in ROLES:
                glob[f"optimizer.state.{role}.{key}"] = (torch.float32, full)
    if fmt == "dp_reshardable":
        for b, items in enumerate(bks):
            for role in ROLES:
                fqn = f"optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_{DTYPE_KEY}.bucket_idx_{b}.{role}"
                glob[fqn] = (torch.float32, (bucket_numels(items)[0],))
    chunks: dict[str, list] = {k: [] for k in glob}
    nbytes = 0
    for rel, part in zip(rels, parts):
        for fqn, offs, shape, off, n in part:
            if offs is None:
                sdm[fqn] = BytesStorageMetadata()
                storage[MetadataIndex(fqn)] = _StorageInfo(rel, off, n)
                continue
            chunks[fqn].append(ChunkStorageMetadata(torch.Size(offs), torch.Size(shape)))
            storage[MetadataIndex(fqn, torch.Size(offs))] = _StorageInfo(rel, off, n)
            nbytes += math.prod(shape) * (2 if glob[fqn][0] == torch.bfloat16 else 4)
    for fqn, (dt, shape) in glob.items():
        sdm[fqn] = TensorStorageMetadata(TensorProperties(dtype=dt), torch.Size(shape),
                                         sorted(chunks[fqn], key=lambda c: tuple(c.offsets)))
    md = Metadata(state_dict_metadata=sdm, planner_data=None, storage_data=storage,
                  storage_meta=StorageMeta(checkpoint_id=None, save_id=str(uuid.uuid4())), version="1.0.0")
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(md, f)
        f.flush()
        os.fsync(f.fileno())
    with open(os.path.join(path, "metadata.json"), "w") as f:
        json.dump({"sharded_backend": "torch_dist", "sharded_backend_version": 1}, f)
    return {"format": fmt, "tensor_bytes": nbytes, "files": len(rels), "buckets": len(bks) if fmt == "dp_reshardable"
            else 0, "params": sizes.n_params(), "state_bytes": sizes.state_bytes()}


# ---------------------------------------------------------------------------------------------
# The logical arrays a converter must produce (independent of the bridge's layout code)


def logical(sizes: Sizes, key: str, layer: int | None, role: str, seed: int = 0) -> dict[str, np.ndarray]:
    """Logical section name ('' for unfused) -> one instance's logical array (qkv -> query/key/value,
    fc1 -> gate/up), split from `stored()` by Megatron's fused layouts."""
    shape = dict((k, s) for k, s, _ in sizes.params())[key]
    a = stored(key, shape, layer, role, seed)
    if key.endswith("linear_fc1.weight"):
        return {"gate": a[:sizes.ffn], "up": a[sizes.ffn:]}
    if key.endswith("linear_qkv.weight"):
        d, g = sizes.head_dim, sizes.groups
        q = sizes.heads // g * d
        per = a.reshape(g, q + 2 * d, sizes.hidden)
        return {"query": per[:, :q].reshape(-1, sizes.hidden), "key": per[:, q:q + d].reshape(-1, sizes.hidden),
                "value": per[:, q + d:].reshape(-1, sizes.hidden)}
    return {"": a}


def instances(sizes: Sizes) -> Iterator[tuple[str, int | None]]:
    for key, _, st in sizes.params():
        for layer in (range(sizes.layers) if st else [None]):
            yield key, layer


def main() -> None:
    ap = argparse.ArgumentParser(description="write a synthetic Megatron torch_dist checkpoint (streaming)")
    ap.add_argument("dst")
    ap.add_argument("--gib", type=float, default=0.25)
    ap.add_argument("--format", default="dp_reshardable", choices=["dp_reshardable", "fully_reshardable"])
    ap.add_argument("--bucket-size", type=int, default=None)
    a = ap.parse_args()
    s = Sizes.for_gib(a.gib)
    print(json.dumps(write(a.dst, s, a.format, a.bucket_size or default_bucket_size(s))))


def default_bucket_size(sizes: Sizes) -> int:
    """Megatron's default (40 M elements), smaller for small models so there are >= 6 buckets."""
    return min(40_000_000, max(1, sizes.n_params() // 6))


if __name__ == "__main__":
    main()
