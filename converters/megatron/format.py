"""What a Megatron-Core `torch_dist` checkpoint holds: key classes, format, geometry, hyper-parameters.

Pure interpretation of the DCP metadata (+ the `common_state` dict): no tensor data is read here.
Detection (megatron-layout.md §4.6, §5): `optimizer.state.<name>.<key>` entries are the
`fully_reshardable` format; `[chained_i.]optimizer.distributed.dp_group_idx_k.gbuf_idx_j.dtype_(..)
.bucket_idx_b.<name>` entries are `dp_reshardable`; a GTP run's `fully_reshardable` save stores
the padded grid (§2.5 A), detected by stored shapes that are not the logical ones.

Geometry comes from the layout engine (`ParamGeometry`); this module only decides, per key, the
TP kind, stacked axes, fused section table and GTP flag from what the checkpoint shows
(`args` when present, chunk offsets and shapes otherwise).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Iterable

from bridge.errors import BridgeError
from bridge.format import schema
from bridge.layout.fused import FusedSpec
from bridge.layout.parallel import ParallelLayout
from bridge.layout.params import ParamGeometry, gtp_shard_dim0
from converters.megatron.dcp_reader import DcpCheckpoint, InertStub, TensorInfo

OPT_STATE_RE = re.compile(r"^(?:chained_(\d+)\.)?optimizer\.state\.(param|fp32_param|exp_avg|exp_avg_sq)\.(.+)$")
DP_TENSOR_RE = re.compile(
    r"^(?:chained_(\d+)\.)?optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\.dtype_(\(.*\))"
    r"\.bucket_idx_(\d+)\.(param|exp_avg|exp_avg_sq)$")
DP_OBJECT_RE = re.compile(
    r"^(?:chained_(\d+)\.)?optimizer\.distributed\.dp_group_idx_(\d+)\."
    r"(optimizer|grad_scaler|per_bucket_numel|per_bucket_numel_unpadded|param_state)(?:/.*)?$")
WRAPPERS = ("module", "model")
STATE_ROLE = {**schema.STATE_ROLE, "fp32_param": schema.PARAMS}  # older saves name the fp32 master so

# Megatron module names -> TP kind (megatron-layout.md §2.1). Used when chunks cannot show it
# (a TP=1 source) and to decide what GTP shards.
COLUMN_MODULES = ("linear_qkv", "linear_fc1", "in_proj", "output_layer", "linear_q", "linear_kv",
                  "linear_q_proj", "linear_q_up_proj", "linear_kv_up_proj")
ROW_MODULES = ("linear_proj", "linear_fc2", "out_proj")


def strip_wrappers(key: str) -> str:
    """Megatron key without `module.` / `model.` wrapper prefixes.

    >>> strip_wrappers("module.module.decoder.final_layernorm.weight")
    'decoder.final_layernorm.weight'
    """
    parts = key.split(".")
    while len(parts) > 1 and parts[0] in WRAPPERS:
        parts = parts[1:]
    return ".".join(parts)


def is_routed_expert(name: str) -> bool:
    """Routed-expert parameter (expert buffer, expert grid); shared experts are dense.

    >>> is_routed_expert("decoder.layers.mlp.experts.linear_fc1.weight"), is_routed_expert("decoder.layers.mlp.shared_experts.linear_fc1.weight")
    (True, False)
    """
    return ".experts." in name and ".shared_experts." not in name


def num_prepend_axes(name: str) -> int:
    """Stacked leading axes of a key: the layer axis of `decoder.layers.<path>` and the expert axis.

    >>> num_prepend_axes("decoder.layers.mlp.experts.linear_fc1.weight"), num_prepend_axes("decoder.layers.3.mixer.in_proj.weight")
    (2, 0)
    """
    n = 0
    m = re.search(r"(^|\.)layers\.([^.]+)\.", name)
    if m and not m.group(2).isdigit():
        n += 1
    if is_routed_expert(name):
        parts = name.split(".")
        i = parts.index("experts")
        # `experts.local_experts.<i>` (per-expert keys) carry no expert axis
        if not (i + 2 < len(parts) and parts[i + 1] == "local_experts" and parts[i + 2].isdigit()):
            n += 1
    return n


def module_of(name: str) -> str:
    """The module component holding a parameter (`...linear_fc1.weight` -> `linear_fc1`)."""
    parts = name.split(".")
    return parts[-2] if len(parts) >= 2 else ""


def tp_kind_by_name(name: str) -> str:
    """TP kind from Megatron naming: column / row / vocab / replicated.

    >>> [tp_kind_by_name(n) for n in ("decoder.layers.linear_proj.weight", "decoder.layers.linear_proj.bias", "embedding.word_embeddings.weight")]
    ['row', 'replicated', 'vocab']
    """
    mod, leaf = module_of(name), name.split(".")[-1]
    if mod == "word_embeddings":
        return "vocab"
    if mod in COLUMN_MODULES and leaf in ("weight", "bias"):
        return "column"
    if mod in ROW_MODULES and leaf == "weight":
        return "row"
    return "replicated"


def is_gtp_weight(name: str) -> bool:
    """Parameters GTP shards in 0.19.2: the `weight` of wrapped linears and the vocab embedding."""
    mod, leaf = module_of(name), name.split(".")[-1]
    return leaf == "weight" and (mod in COLUMN_MODULES or mod in ROW_MODULES or mod == "word_embeddings")


def _as_dict(obj: Any) -> dict:
    """args Namespace (or stub) -> plain dict."""
    if obj is None:
        return {}
    if isinstance(obj, dict):
        return dict(obj)
    if isinstance(obj, InertStub):
        st = obj.stub_state
        return dict(st) if isinstance(st, dict) else {}
    return dict(vars(obj)) if hasattr(obj, "__dict__") else {}


#: args that size the layout: each must be a plain non-negative int when present
INT_ARGS = ("tensor_model_parallel_size", "gtp_weight_remat_size", "tensor_parallel_num_weight_shards",
            "expert_model_parallel_size", "expert_tensor_parallel_size", "data_parallel_size",
            "pipeline_model_parallel_size", "context_parallel_size", "world_size", "hidden_size",
            "num_attention_heads", "num_query_groups", "kv_channels", "ffn_hidden_size", "moe_ffn_hidden_size",
            "padded_vocab_size", "gtp_remat_pad_for_alignment", "iteration", "num_layers", "global_batch_size",
            "train_iters", "lr_wsd_decay_iters")
BOOL_ARGS = ("swiglu", "gated_linear_unit", "group_query_attention")
FLOAT_ARGS = ("clip_grad", "lr_warmup_init", "lr", "min_lr", "weight_decay", "adam_beta1", "adam_beta2", "adam_eps")


def checked_args(args: dict, root: Any) -> dict:
    """`args` with every layout size checked to be a plain int (a damaged or hostile file says otherwise).

    >>> checked_args({"hidden_size": 64, "lr": 0.1}, "ck")["hidden_size"]
    64
    """
    for names, ok, what in ((INT_ARGS, lambda v: type(v) is int and 0 <= v < 1 << 40, "a size"),
                            (BOOL_ARGS, lambda v: type(v) is bool, "a bool"),
                            (FLOAT_ARGS, lambda v: type(v) in (int, float), "a number")):
        for name in names:
            v = args.get(name)
            if v is not None and not ok(v):
                raise BridgeError(f"{root}: common_state args.{name} is {type(v).__name__} {str(v)[:40]!r}, not "
                                  f"{what}; the checkpoint is damaged (or pass the value as a flag)")
    return args


@dataclass
class ModelEntry:
    """One model tensor key of the checkpoint and its geometry."""

    key: str                     # as stored in the checkpoint
    name: str                    # logical name (wrappers stripped)
    info: TensorInfo
    npre: int
    geom: ParamGeometry
    legacy_padded: bool = False  # stored in 0.19.2's padded GTP grid (§2.5 A)

    @property
    def dtype(self):
        return self.info.dtype


@dataclass
class DpBucketKey:
    """One dp_reshardable bucket tensor key, parsed."""

    key: str
    chain: int
    dp_group_idx: int
    gbuf: int
    dtype: str
    bucket: int
    state: str


@dataclass
class SourceCheckpoint:
    """Everything convert needs to know about a torch_dist checkpoint before reading data."""

    ck: DcpCheckpoint
    fmt: str                                        # fully_reshardable | dp_reshardable | model_only
    args: dict
    common: dict
    layout: ParallelLayout
    pad_for_alignment: int
    models: dict[str, ModelEntry]                   # logical name -> entry (registration order)
    opt_keys: dict[tuple[str, str], str] = field(default_factory=dict)   # (role, name) -> stored key
    dp_keys: list[DpBucketKey] = field(default_factory=list)
    chained: bool = False
    inferred: list[str] = field(default_factory=list)  # what was inferred (for the manifest / report)

    @property
    def legacy(self) -> bool:
        return any(m.legacy_padded for m in self.models.values())

    @property
    def format_label(self) -> str:
        if self.fmt == "fully_reshardable" and self.legacy:
            return "legacy_padded_gtp"
        return self.fmt


@dataclass
class Hints:
    """User-supplied facts for what the checkpoint does not show (CLI flags)."""

    tp: int | None = None
    gtp: int | None = None
    dp: int | None = None
    ep: int | None = None
    pad_for_alignment: int | None = None
    num_attention_heads: int | None = None
    num_query_groups: int | None = None
    kv_channels: int | None = None
    swiglu: bool | None = None
    bucket_size: int | None = None


# ---------------------------------------------------------------------------------------------


def classify_keys(ck: DcpCheckpoint) -> tuple[list[str], dict[tuple[str, str], str], list[DpBucketKey], list[str]]:
    """Split tensor keys into model keys, fully_reshardable optimizer keys, dp buckets, unknown."""
    model, opt, dp, other = [], {}, [], []
    for key in ck.tensors:
        m = OPT_STATE_RE.match(key)
        if m:
            opt[(STATE_ROLE[m.group(2)], strip_wrappers(m.group(3)))] = key
            continue
        m = DP_TENSOR_RE.match(key)
        if m:
            dp.append(DpBucketKey(key, int(m.group(1) or 0), int(m.group(2)), int(m.group(3)), m.group(4),
                                  int(m.group(5)), m.group(6)))
            continue
        if key.startswith(("optimizer.", "chained_")) or key.startswith("rng_state"):
            other.append(key)
            continue
        model.append(key)
    return model, opt, dp, other


def _distinct_offsets(info: TensorInfo, axis: int) -> int:
    return len({c.offsets[axis] for c in info.chunks}) if info.chunks else 1


def infer_tp(infos: Iterable[tuple[str, TensorInfo, int]]) -> int:
    """TP from chunk offsets: the most pieces any row-parallel weight is cut into along dim 1,
    else the most along dim 0 of a column-parallel key (no GTP)."""
    row = col = 1
    for name, info, npre in infos:
        kind = tp_kind_by_name(name)
        if kind == "row" and len(info.shape) > npre + 1:
            row = max(row, _distinct_offsets(info, npre + 1))
        elif kind in ("column", "vocab") and len(info.shape) > npre and module_of(name) != "linear_fc1":
            # (SwiGLU fc1 stores gate and up halves as separate chunks: not a TP cut)
            col = max(col, _distinct_offsets(info, npre))
    return row if row > 1 else col


def fused_spec(name: str, rows: int, args: dict, hints: Hints, shapes: dict[str, tuple[int, ...]]) -> FusedSpec | None:
    """Section table of a fused projection (SwiGLU fc1, attention qkv), or None when not fused."""
    mod, leaf = module_of(name), name.split(".")[-1]
    if leaf not in ("weight", "bias"):
        return None
    if mod == "linear_fc1":
        gated = hints.swiglu if hints.swiglu is not None else args.get("swiglu", args.get("gated_linear_unit"))
        if gated is None:  # infer: fc1 has twice the rows of fc2's columns when gated
            fc2 = shapes.get(name.rsplit(".", 2)[0] + ".linear_fc2.weight")
            if fc2 is None:
                raise BridgeError(f"{name}: cannot tell whether linear_fc1 is gated (SwiGLU); pass --swiglu or --no-swiglu")
            gated = rows == 2 * fc2[-1]
        if not gated:
            return None
        if rows % 2:
            raise BridgeError(f"{name}: SwiGLU fc1 with an odd row count {rows}; pass --no-swiglu if it is not gated")
        return FusedSpec.swiglu(rows // 2)
    if mod == "linear_qkv":
        heads = hints.num_attention_heads or args.get("num_attention_heads")
        groups = hints.num_query_groups or (args.get("num_query_groups") if args.get("group_query_attention", True) else None)
        hd = hints.kv_channels or args.get("kv_channels")
        if heads and not groups and "group_query_attention" in args and not args["group_query_attention"]:
            groups = heads
        proj = shapes.get(name.rsplit(".", 2)[0] + ".linear_proj.weight")
        if hd is None and heads and proj is not None:
            hd = proj[-1] // heads
        if hd and heads is None and proj is not None:
            heads = proj[-1] // hd
        if hd and heads and groups is None:
            kv = rows - heads * hd
            groups = kv // (2 * hd) if kv > 0 and kv % (2 * hd) == 0 else None
        if not (heads and groups and hd):
            raise BridgeError(f"{name}: the checkpoint has no args, and {rows} qkv rows fit several head layouts; "
                              f"pass --kv-channels (head dim) or --num-query-groups")
        spec = FusedSpec.qkv(int(heads), int(groups), int(hd))
        if spec.rows != rows:
            raise BridgeError(f"{name}: {rows} qkv rows do not match heads={heads}, groups={groups}, head_dim={hd} "
                              f"({spec.rows} rows); pass the right --num-attention-heads/--num-query-groups/--kv-channels")
        return spec
    return None


def _layout_from(args: dict, hints: Hints, tp_inferred: int, world: int, inferred: list[str]) -> ParallelLayout:
    def pick(flag: str, *names: str, default: int | None = None) -> int | None:
        v = getattr(hints, flag)
        if v is not None:
            return int(v)
        for n in names:
            if args.get(n) is not None:
                return int(args[n])
        return default

    tp = pick("tp", "tensor_model_parallel_size")
    if tp is None:
        tp = tp_inferred
        inferred.append(f"tp={tp} (chunk offsets)")
    gtp = pick("gtp", "gtp_weight_remat_size")
    if gtp is None and args.get("tensor_parallel_num_weight_shards"):
        gtp = int(args["tensor_parallel_num_weight_shards"]) // tp
    gtp = gtp or 1
    ep = pick("ep", "expert_model_parallel_size", default=1)
    etp = pick("tp", "expert_tensor_parallel_size", default=tp)
    dp = pick("dp", "data_parallel_size")
    pp = int(args.get("pipeline_model_parallel_size") or 1)
    cp = int(args.get("context_parallel_size") or 1)
    if dp is None:
        model = tp * gtp * pp * cp
        w = int(args.get("world_size") or world)
        dp = max(1, w // model)
        inferred.append(f"dp={dp} (writer ranks)")
    try:
        return ParallelLayout(tp=tp, gtp=gtp, dp=dp, cp=cp, pp=pp, ep=ep, etp=etp)
    except BridgeError as e:
        raise BridgeError(f"the checkpoint's layout does not fit together ({e}); pass --tp/--dp/--ep") from None


def describe(ck: DcpCheckpoint, hints: Hints | None = None) -> SourceCheckpoint:
    """Interpret a DCP checkpoint as a Megatron-Core save (format, layout, geometry per key)."""
    hints = hints or Hints()
    if not ck.has_file("metadata.json"):
        raise BridgeError(f"{ck.root}: a DCP checkpoint without metadata.json, so not written by Megatron-Core "
                          f"dist_checkpointing (unknown format); convert reads torch_dist saves only")
    common = ck.common_state()
    args = checked_args(_as_dict(common.get("args")), ck.root)
    it = common.get("iteration")
    if it is not None and (type(it) is not int or it < 0):
        raise BridgeError(f"{ck.root}: common_state iteration is {type(it).__name__} {str(it)[:40]}, not a step count; "
                          f"the checkpoint is damaged")
    model_keys, opt, dp, _other = classify_keys(ck)
    if not model_keys and not opt and not dp:
        raise BridgeError(f"{ck.root}: a DCP checkpoint without Megatron model or optimizer entries "
                          f"(unknown format); only Megatron-Core torch_dist saves can be converted")
    if opt and dp:
        raise BridgeError(f"{ck.root}: holds both fully_reshardable and dp_reshardable optimizer entries; "
                          f"unknown format")
    fmt = "fully_reshardable" if opt else "dp_reshardable" if dp else "model_only"
    if not model_keys:
        raise BridgeError(f"{ck.root}: optimizer state without model weights; convert needs the model entries "
                          f"(save the model with the optimizer)")
    inferred: list[str] = []
    names = {strip_wrappers(k): k for k in model_keys}
    if len(names) != len(model_keys):
        raise BridgeError(f"{ck.root}: two model keys differ only by a module./model. prefix; unknown format")
    npres = {n: num_prepend_axes(n) for n in names}
    tp_inf = infer_tp((n, ck.tensors[k], npres[n]) for n, k in names.items())
    world = (max(ck.writer_ranks()) + 1) if ck.writer_ranks() else 1
    layout = _layout_from(args, hints, tp_inf, world, inferred)
    if layout.gtp == 1 and tp_inf > 1 and tp_inf != layout.tp:
        raise BridgeError(f"{ck.root}: the run's TP={layout.tp} (from args or --tp) disagrees with the chunk offsets, "
                          f"which show TP={tp_inf}; pass the right --tp")
    pad = hints.pad_for_alignment
    if pad is None:
        pad = args.get("gtp_remat_pad_for_alignment")
    pad_known = pad is not None
    pad = int(pad) if pad is not None else 16
    shapes = {n: tuple(ck.tensors[k].shape[npres[n]:]) for n, k in names.items()}
    models: dict[str, ModelEntry] = {}
    for n, k in names.items():
        info = ck.tensors[k]
        npre = npres[n]
        if len(info.shape) < npre:
            raise BridgeError(f"{k}: stored shape {info.shape} has fewer dims than its {npre} stacked axes")
        stored = tuple(info.shape[npre:])
        expert = is_routed_expert(n)
        tp, gtp = layout.tp_gtp_sizes(expert)
        gtp_w = is_gtp_weight(n) and gtp > 1
        logical = logical_shape(n, stored, args, layout, expert)
        # 0.19.2 stores every GTP-sharded weight in its padded grid (§2.5 A; SwiGLU fc1 scrambled, §6.3),
        # which equals the logical layout only when there is no padding and no fused halves
        legacy = logical != stored or (gtp_w and stored != ())
        kind = tp_kind_by_name(n)
        if kind != "replicated" and not stored:
            kind = "replicated"
        spec = None
        if stored:
            spec = fused_spec(n, logical[0], args, hints, shapes)
        geom = ParamGeometry(n, logical, kind, gtp=gtp_w, pad_for_alignment=pad,
                             prepend=tuple(info.shape[:npre]), fused=spec, expert=expert)
        if legacy:
            if not gtp_w:
                raise BridgeError(f"{k}: stored shape {stored} differs from the logical shape {logical} but the "
                                  f"parameter is not GTP-sharded; unknown format")
            pad = _check_legacy_pad(geom, stored, tp, gtp, pad, pad_known, k)
            geom = ParamGeometry(n, logical, kind, gtp=True, pad_for_alignment=pad, prepend=geom.prepend,
                                 fused=spec, expert=expert)
            pad_known = True
        models[n] = ModelEntry(k, n, info, npre, geom, legacy)
    src = SourceCheckpoint(ck, fmt, args, common, layout, pad, models, opt, dp,
                           chained=any(d.chain for d in dp) or any(m.geom.expert for m in models.values()),
                           inferred=inferred)
    missing = sorted({n for (_r, n) in opt} - set(models))
    if missing:
        raise BridgeError(f"{ck.root}: optimizer state for {missing[0]} has no model entry; unknown format")
    check_complete(src)
    return src


FULLY_ROLES = ((schema.PARAMS, "fp32 master (optimizer.state.param)"), (schema.MU, "exp_avg"), (schema.NU, "exp_avg_sq"))
DP_STATES = ("param", "exp_avg", "exp_avg_sq")


def check_complete(src: SourceCheckpoint) -> None:
    """Refuse a source whose optimizer state is partial; say so when there is none at all.

    Every parameter needs its fp32 master and both Adam moments (fully_reshardable: one entry per
    role and parameter; dp_reshardable: every bucket holds all three states and the buckets of each
    buffer are numbered without gaps), and every param group its `step`. A save with no optimizer
    tensors is `model_only` only if nothing else shows an optimizer was saved.
    """
    root = src.ck.root
    if src.fmt == "model_only":
        evidence = optimizer_evidence(src)
        if evidence:
            raise BridgeError(f"{root}: holds optimizer state ({evidence}) but none of the optimizer tensors that "
                              f"convert reads (fully_reshardable / dp_reshardable); unknown optimizer format, "
                              f"refusing rather than converting without it")
        src.inferred.append("model_only (no optimizer state in the checkpoint)")
        return
    if src.fmt == "fully_reshardable":
        for name in src.models:
            absent = [label for role, label in FULLY_ROLES if (role, name) not in src.opt_keys]
            if absent:
                raise BridgeError(f"{root}: parameter {name} has no {' / '.join(absent)} entry in .metadata while "
                                  f"other parameters have optimizer state: incomplete checkpoint; copy the complete "
                                  f"save (or re-save it)")
    else:
        buckets: dict[tuple, set[str]] = {}
        for d in src.dp_keys:
            buckets.setdefault((d.chain, d.dp_group_idx, d.gbuf, d.dtype, d.bucket), set()).add(d.state)
        for (chain, dpg, gbuf, dtype, bucket), states in sorted(buckets.items()):
            absent = [s for s in DP_STATES if s not in states]
            if absent:
                raise BridgeError(f"{root}: dp_reshardable bucket {bucket} of buffer {gbuf} {dtype} (dp_group_idx "
                                  f"{dpg}, optimizer {chain}) has no {' / '.join(absent)} entry in .metadata: "
                                  f"incomplete checkpoint; copy the complete save")
        per_buffer: dict[tuple, set[int]] = {}
        for chain, dpg, gbuf, dtype, bucket in buckets:
            per_buffer.setdefault((chain, dpg, gbuf, dtype), set()).add(bucket)
        for (chain, dpg, gbuf, dtype), have in sorted(per_buffer.items()):
            gap = sorted(set(range(max(have) + 1)) - have)
            if gap:
                raise BridgeError(f"{root}: dp_reshardable buffer {gbuf} {dtype} (dp_group_idx {dpg}, optimizer "
                                  f"{chain}) has no bucket {gap[0]} in .metadata: incomplete checkpoint")
    groups = optimizer_groups(src)
    if not groups:
        raise BridgeError(f"{root}: optimizer tensors without param_groups (no Adam step or hyper-parameters in "
                          f"common_state or the dp_group_idx objects): incomplete checkpoint")
    for ci, gs in enumerate(groups):
        for gi, g in enumerate(gs):
            if not isinstance(g, dict) or _plain(g.get("step")) is None:
                raise BridgeError(f"{root}: param group {gi} of optimizer {ci} has no 'step' (the Adam bias-correction "
                                  f"count): incomplete checkpoint")
            step = _plain(g["step"])
            if type(step) not in (int, float) or not 0 <= step < 1 << 53 or step != int(step):
                raise BridgeError(f"{root}: param group {gi} of optimizer {ci} has step {str(step)[:40]!r}, not a "
                                  f"step count; the checkpoint is damaged")


def optimizer_evidence(src: SourceCheckpoint) -> str:
    """What shows that an optimizer was saved (tensor or object keys, common_state's `optimizer`), or ''."""
    keys = [k for k in src.ck.tensors if k.startswith(("optimizer.", "chained_"))]
    keys += [k for k in src.ck.object_names() if k.startswith(("optimizer.", "chained_")) or DP_OBJECT_RE.match(k)]
    if keys:
        return f"entry {keys[0]}"
    if src.common.get("optimizer") is not None:
        return "common_state['optimizer']"
    return ""


def logical_shape(name: str, stored: tuple[int, ...], args: dict, layout: ParallelLayout, expert: bool) -> tuple[int, ...]:
    """Logical per-instance shape of a key; differs from `stored` only for the padded GTP grid.

    Needs the model dims from `args` when GTP > 1 (the padded grid hides them, §2.5 A).
    """
    tp, gtp = layout.tp_gtp_sizes(expert)
    if gtp == 1 or not is_gtp_weight(name) or not stored:
        return stored
    mod = module_of(name)
    h = args.get("hidden_size")
    want: int | None = None
    if mod == "linear_qkv":
        heads, groups = args.get("num_attention_heads"), args.get("num_query_groups") or args.get("num_attention_heads")
        hd = args.get("kv_channels") or (h // heads if h and heads else None)
        if heads and groups and hd:
            want = (heads + 2 * groups) * hd
    elif mod == "linear_fc1":
        f = args.get("moe_ffn_hidden_size") if expert and args.get("moe_ffn_hidden_size") else args.get("ffn_hidden_size")
        if f:
            want = f * (2 if args.get("swiglu", args.get("gated_linear_unit")) else 1)
    elif mod in ("linear_proj", "linear_fc2", "out_proj"):
        want = h
    elif mod in ("word_embeddings", "output_layer"):
        want = args.get("padded_vocab_size")
    if want is None:
        raise BridgeError(f"{name}: GTP={gtp} checkpoint without the model dims in common_state args; cannot tell "
                          f"padding from data (re-save through the training loop, which stores args)")
    return (int(want),) + stored[1:]


def _check_legacy_pad(geom: ParamGeometry, stored: tuple[int, ...], tp: int, gtp: int, pad: int, known: bool,
                      key: str) -> int:
    """pad_for_alignment that explains the stored padded rows (tries common values when unknown)."""
    local = geom.tp_local_shape(tp)[0]
    blocks = tp if geom.tp_kind in ("column", "vocab") else 1
    cands = [pad] if known else [pad, 16, 32, 8, 64, 128, 0]
    for a in cands:
        try:
            s, _p = gtp_shard_dim0(local, gtp, a, geom.name)
        except BridgeError:
            continue
        if s * gtp * blocks == stored[0]:
            return a
    raise BridgeError(f"{key}: stored rows {stored[0]} do not match the padded GTP grid of {geom.shape[0]} logical rows "
                      f"(TP={tp}, GTP={gtp}); pass --pad-for-alignment")


# ---------------------------------------------------------------------------------------------
# Optimizer hyper-parameters and step


def find_param_groups(obj: Any, depth: int = 0) -> list[list[dict]]:
    """Every `param_groups` list inside a (nested) optimizer state dict, in walk order."""
    out: list[list[dict]] = []
    if depth > 8:
        return out
    if isinstance(obj, dict):
        pg = obj.get("param_groups")
        if isinstance(pg, list) and all(isinstance(g, dict) for g in pg):
            out.append(pg)
        for k, v in obj.items():
            if k != "param_groups":
                out += find_param_groups(v, depth + 1)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            out += find_param_groups(v, depth + 1)
    return out


def optimizer_groups(src: SourceCheckpoint) -> list[list[dict]]:
    """Param groups per chained optimizer (fully_reshardable: common_state; dp: the dp_group_idx_0 objects)."""
    groups = find_param_groups(src.common.get("optimizer"))
    if not groups and src.fmt == "dp_reshardable":
        chains = sorted({d.chain for d in src.dp_keys})
        for c in chains:
            prefix = f"chained_{c}." if any(k.startswith("chained_") for k in src.ck.objects) else ""
            cands = [k for k in src.ck.object_names() if k.startswith(f"{prefix}optimizer.distributed.dp_group_idx_")
                     and k.endswith(".optimizer")]
            cands.sort(key=lambda k: int(re.search(r"dp_group_idx_(\d+)", k).group(1)))
            if cands:
                groups += find_param_groups(src.ck.read_object(cands[0]))
    return groups


def _plain(v: Any, depth: int = 0) -> Any:
    if isinstance(v, (bool, int, float, str)) or v is None:
        return v
    if isinstance(v, (list, tuple)) and depth < 8:
        return [_plain(x, depth + 1) for x in v]
    if hasattr(v, "item") and getattr(v, "numel", lambda: 2)() == 1:
        return v.item()
    return repr(v)


def step_of(src: SourceCheckpoint, groups: list[list[dict]]) -> int | None:
    """Completed optimizer steps: `step` of the param groups, else `iteration`."""
    steps = [int(_plain(g["step"])) for gs in groups for g in gs if "step" in g and _plain(g["step"]) is not None]
    if steps:
        return max(steps)
    it = src.common.get("iteration", src.args.get("iteration"))
    return int(it) if it is not None else None


HYPER_KEYS = ("lr", "max_lr", "min_lr", "weight_decay", "wd_mult", "lr_mult", "betas", "eps", "step", "bias_correction",
              "is_expert_parallel", "is_decoupled_lr", "pre_mult_wd", "default_config")


def parse_groups_hyper(groups: list[list[dict]]) -> dict:
    """lr, betas, eps, weight decay (largest over groups) and a per-group summary (no tensors).

    >>> parse_groups_hyper([[{"lr": 0.1, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "params": [0, 1]},
    ...                      {"lr": 0.1, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.0, "params": [2]}]])["weight_decay"]
    0.1
    """
    flat = [(ci, g) for ci, gs in enumerate(groups) for g in gs]
    if not flat:
        return {}
    first = flat[0][1]
    out: dict = {}
    if "lr" in first:
        out["lr"] = float(_plain(first["lr"]))
    if "betas" in first:
        out["betas"] = tuple(float(b) for b in _plain(first["betas"]))
    if "eps" in first:
        out["eps"] = float(_plain(first["eps"]))
    wds = [float(_plain(g["weight_decay"])) for _, g in flat if "weight_decay" in g]
    if wds:
        out["weight_decay"] = max(wds)
    summary = []
    for ci, g in flat:
        rec = {k: _plain(g[k]) for k in HYPER_KEYS if k in g}
        rec["optimizer"] = ci
        if isinstance(g.get("params"), (list, tuple)):
            rec["num_params"] = len(g["params"])
        summary.append(rec)
    out["groups"] = summary
    return out
