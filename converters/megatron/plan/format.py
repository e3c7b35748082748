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
from converters.megatron.plan import model_facts
from converters.megatron.read.dcp import DcpCheckpoint
from converters.megatron.read.dcp_metadata import ChunkInfo, TensorInfo
from converters.megatron.read.inert import InertStub
from converters.megatron.plan.convert_plan import PipelineSplit, is_tied
from converters.megatron.plan.naming import (SPLIT_SECTIONS, is_gtp_weight, is_routed_expert, module_of,
                                             num_prepend_axes, split_kind, strip_wrappers, tp_kind_by_name)

OPT_STATE_RE = re.compile(r"^(?:chained_(\d+)\.)?optimizer\.state\.(param|fp32_param|exp_avg|exp_avg_sq)\.(.+)$")
DP_TENSOR_RE = re.compile(
    r"^(?:chained_(\d+)\.)?optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\.dtype_(\(.*\))"
    r"\.bucket_idx_(\d+)\.(param|exp_avg|exp_avg_sq)$")
DP_OBJECT_RE = re.compile(
    r"^(?:chained_(\d+)\.)?optimizer\.distributed\.dp_group_idx_(\d+)\."
    r"(optimizer|grad_scaler|per_bucket_numel|per_bucket_numel_unpadded|param_state)(?:/.*)?$")
DP_ZERO_RE = re.compile(r"^(?:chained_(\d+)\.)?optimizer\.distributed\.dp_group_idx_(\d+)\.param_state$")

#: megatron-core's `distrib_optim_sharding_type` values -> the releases that save them (read from
#: each release's DistributedOptimizer.sharded_state_dict and the saves in tests/fixtures/megatron/release_*)
SAVED_BY = {
    "fully_sharded_model_space": "megatron-core 0.14-0.15 (the default of DistributedOptimizer.sharded_state_dict "
                                 "there; 0.16+ refuse to save it)",
    "fully_sharded_bucket_space": "megatron-core <= 0.14 (deprecated)",
    "dp_zero_gather_scatter": "megatron-core 0.14-0.19 (gathered on DP rank 0)",
    "dp_reshardable": "megatron-core >= 0.15",
    "fully_reshardable": "megatron-core >= 0.15",
    "fsdp_dtensor": "Megatron-FSDP (megatron-core >= 0.14)",
}
#: optimizer formats convert reads (the rest are refused, naming what they are)
READABLE = ("fully_reshardable", "dp_reshardable", "fully_sharded_model_space", "dp_zero_gather_scatter",
            "fully_sharded_bucket_space")
#: formats whose DP-sharded state is stored per DDP bucket (flat), rebuilt through the buffer layout
BUCKETED = ("dp_reshardable", "fully_sharded_bucket_space", "dp_zero_gather_scatter")
STATE_ROLE = {**schema.STATE_ROLE, "fp32_param": schema.PARAMS}  # older saves name the fp32 master so


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
class DpZeroKey:
    """One dp_zero_gather_scatter object: a whole DistOpt group's state gathered on its DP rank 0."""

    key: str           # object name, without the /shard_ suffix
    chain: int
    dp_group_idx: int


@dataclass
class SourceCheckpoint:
    """Everything convert needs to know about a torch_dist checkpoint before reading data."""

    ck: DcpCheckpoint
    fmt: str                                        # one of READABLE, or model_only
    args: dict
    common: dict
    layout: ParallelLayout
    pad_for_alignment: int
    models: dict[str, ModelEntry]                   # logical name -> entry (registration order)
    opt_keys: dict[tuple[str, str], str] = field(default_factory=dict)   # (role, name) -> stored key
    dp_keys: list[DpBucketKey] = field(default_factory=list)
    zero_keys: list[DpZeroKey] = field(default_factory=list)
    chained: bool = False
    inferred: list[str] = field(default_factory=list)  # what was inferred (for the manifest / report)
    split: PipelineSplit = field(default_factory=PipelineSplit)   # layers per pipeline stage, tied output

    @property
    def legacy(self) -> bool:
        return any(m.legacy_padded for m in self.models.values())

    @property
    def format_label(self) -> str:
        """The optimizer format, and 0.19.2's padded GTP grid when the weights are stored in it (two facts
        of one save: a GTP `fully_reshardable` save is both)."""
        return f"{self.fmt} (0.19.2 padded GTP grid)" if self.legacy else self.fmt


@dataclass
class Hints:
    """User-supplied facts for what the checkpoint does not show (CLI flags)."""

    tp: int | None = None
    gtp: int | None = None
    dp: int | None = None
    ep: int | None = None
    pp: int | None = None
    pad_for_alignment: int | None = None
    num_attention_heads: int | None = None
    num_query_groups: int | None = None
    kv_channels: int | None = None
    swiglu: bool | None = None
    bucket_size: int | None = None
    model_only: bool = False     # convert the weights only, leaving the optimizer state out on purpose
    hidden_size: int | None = None
    ffn_hidden_size: int | None = None
    moe_ffn_hidden_size: int | None = None
    vocab_size: int | None = None           # the embedding's rows (Megatron's padded vocab)
    num_layers: int | None = None
    num_experts: int | None = None
    model_config: str | None = None         # YAML / JSON file of Megatron-named model facts
    pp_first: int | None = None             # decoder_first_pipeline_num_layers (uneven pipeline stages)
    pp_last: int | None = None              # decoder_last_pipeline_num_layers
    embedding_in_split: bool | None = None  # account_for_embedding_in_pipeline_split
    loss_in_split: bool | None = None       # account_for_loss_in_pipeline_split

    def as_facts(self) -> dict[str, Any]:
        """The flags given, under Megatron argument names (`model_facts.FLAG_OF`)."""
        pairs = (("tensor_model_parallel_size", self.tp), ("gtp_weight_remat_size", self.gtp),
                 ("expert_model_parallel_size", self.ep), ("data_parallel_size", self.dp),
                 ("pipeline_model_parallel_size", self.pp),
                 ("gtp_remat_pad_for_alignment", self.pad_for_alignment),
                 ("num_attention_heads", self.num_attention_heads), ("num_query_groups", self.num_query_groups),
                 ("kv_channels", self.kv_channels), ("swiglu", self.swiglu), ("hidden_size", self.hidden_size),
                 ("ffn_hidden_size", self.ffn_hidden_size), ("moe_ffn_hidden_size", self.moe_ffn_hidden_size),
                 ("padded_vocab_size", self.vocab_size), ("num_layers", self.num_layers),
                 ("num_experts", self.num_experts), ("ddp_bucket_size", self.bucket_size),
                 ("decoder_first_pipeline_num_layers", self.pp_first),
                 ("decoder_last_pipeline_num_layers", self.pp_last),
                 ("account_for_embedding_in_pipeline_split", self.embedding_in_split),
                 ("account_for_loss_in_pipeline_split", self.loss_in_split))
        return {k: v for k, v in pairs if v is not None}


# ---------------------------------------------------------------------------------------------


def bucket_space_flat_chunks(key: str, info: TensorInfo, world_numel: int, dp: int) -> list[Any]:
    """A `fully_sharded_bucket_space` bucket tensor's chunks as 1-D ranges of the (padded) bucket.

    Legacy torch_dist saves store the bucket 1-D, `(world_numel,)`; megatron-core 0.14's reformulates
    flattened ranges as `(dp, world_numel // dp)`, each rank's pieces `(1, n)` at `(rank, start)`:
    row-major flat offset `rank * local + start`. Other shapes are refused.

    >>> from converters.megatron.read.dcp import ChunkInfo
    >>> info = TensorInfo("k", "torch.float32", (2, 8), [ChunkInfo((0, 0), (1, 3), None), ChunkInfo((1, 2), (1, 6), None)])
    >>> [(c.offsets, c.sizes) for c in bucket_space_flat_chunks("k", info, 16, 2)]
    [((0,), (3,)), ((10,), (6,))]
    """
    from converters.megatron.read.dcp_metadata import ChunkInfo

    if tuple(info.shape) == (world_numel,):
        return list(info.chunks)
    local = world_numel // dp
    if tuple(info.shape) != (dp, local) or local * dp != world_numel:
        raise BridgeError(f"{key}: stored shape {tuple(info.shape)} is neither the padded bucket ({world_numel},) nor "
                          f"its per-DP-rank reformulation ({dp}, {local}); pass --bucket-size / --pad-for-alignment")
    out = []
    for ch in info.chunks:
        (r, s), (nr, n) = ch.offsets, ch.sizes
        if nr != 1 and not (s == 0 and n == local):
            raise BridgeError(f"{key}: chunk at {ch.offsets} of shape {ch.sizes} is not a run of whole rows or "
                              f"part of one row; unknown format")
        out.append(ChunkInfo((r * local + s,), (nr * n,), ch.storage))
    return out


def split_spec(sections: Iterable[tuple[str, int]]) -> FusedSpec | None:
    """The section table of a fused parameter Megatron saves one key per section (`<key>.<section>`,
    naming.SPLIT_SECTIONS), from each section's rows along the instance's dim 0; None when the
    section names are no such kind. The one table both `merge_split_keys` (convert) and the live
    adapter (`converters.megatron.live.adapter`) use, so both name the same arrays.

    >>> split_spec([("B", 4), ("x", 8), ("C", 4)]).to_json()["sections"]
    [['x', 8], ['B', 4], ['C', 4]]
    >>> split_spec([("gate", 8), ("up", 8)]) is None
    True
    """
    sections = list(sections)
    kind = split_kind([s for s, _ in sections])  # exactly the kind's names, none repeated
    if kind is None:
        return None
    rows = dict(sections)
    return FusedSpec.concat([(s, rows[s]) for s in SPLIT_SECTIONS[kind]], name=kind)


def merge_split_keys(ck: DcpCheckpoint) -> dict[str, FusedSpec]:
    """Read Megatron's per-section keys of a fused parameter (`<key>.<section>`, naming.SPLIT_SECTIONS:
    Mamba / GDN `in_proj`, `conv1d`) as the one tensor `<key>` the model and its optimizer hold.

    The sections are stacked along the instance's dim 0 in Megatron's order, each chunk shifted by
    its section's start: the fused logical layout `FusedSpec.concat` describes (TP rank t holds rows
    [t·n_k, (t+1)·n_k) of each section k), so the DistOpt buffer sees one parameter, as the run did.
    `ck.tensors` is rewritten in place (the merged entry where its first section was; idempotent,
    so every process opening the checkpoint applies it); returns `{merged key: section table}`
    (model keys and `optimizer.state.*` keys alike).
    """
    done = getattr(ck, "_split_specs", None)
    if done is not None:
        return done
    groups: dict[str, list[str]] = {}
    for key in ck.tensors:
        parent, _, sec = key.rpartition(".")
        if parent and any(sec in v for v in SPLIT_SECTIONS.values()):
            groups.setdefault(parent, []).append(sec)
    specs: dict[str, FusedSpec] = {}
    merged: dict[str, TensorInfo] = {}
    for parent, secs in groups.items():
        kind = split_kind(secs)
        if kind is None or len(secs) != len(SPLIT_SECTIONS[kind]) or parent in ck.tensors:
            continue
        parts = [ck.tensors[f"{parent}.{s}"] for s in SPLIT_SECTIONS[kind]]
        axis = num_prepend_axes(parent)
        first = parts[0]
        if any(len(t.shape) <= axis or t.dtype != first.dtype
               or t.shape[:axis] + t.shape[axis + 1:] != first.shape[:axis] + first.shape[axis + 1:] for t in parts):
            raise BridgeError(f"{parent}: its sections {list(SPLIT_SECTIONS[kind])} differ in dtype or in shape "
                              f"outside dim {axis} ({[tuple(t.shape) for t in parts]}); unknown format")
        chunks, start = [], 0
        for t in parts:
            for c in t.chunks:
                off = c.offsets[:axis] + (c.offsets[axis] + start,) + c.offsets[axis + 1:]
                chunks.append(ChunkInfo(off, c.sizes, c.storage))
            start += t.shape[axis]
        merged[parent] = TensorInfo(parent, first.dtype, first.shape[:axis] + (start,) + first.shape[axis + 1:], chunks)
        specs[parent] = split_spec([(s, t.shape[axis]) for s, t in zip(SPLIT_SECTIONS[kind], parts)])
    if merged:
        out: dict[str, TensorInfo] = {}
        for key, info in ck.tensors.items():
            parent = key.rpartition(".")[0]
            if parent in merged:
                if parent not in out:
                    out[parent] = merged[parent]
            else:
                out[key] = info
        ck.tensors = out
    ck._split_specs = specs
    return specs


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


def infer_tp(infos: Iterable[tuple[str, TensorInfo, int]], fused: dict[str, FusedSpec] | None = None) -> int:
    """TP from chunk offsets: the most pieces any row-parallel weight is cut into along dim 1,
    else (no row-parallel weight at all) the most along dim 0 of a column-parallel key. Dim 0 of
    column keys is also where GTP cuts, so it is not used when row-parallel weights show TP.
    `fused`: keys merged from per-section keys (`merge_split_keys`), cut once per section."""
    row = col = 1
    seen_row = False
    fused = fused or {}
    for name, info, npre in infos:
        kind = tp_kind_by_name(name)
        if kind == "row" and len(info.shape) > npre + 1:
            seen_row = True
            row = max(row, _distinct_offsets(info, npre + 1))
        elif kind in ("column", "vocab") and len(info.shape) > npre and module_of(name) != "linear_fc1":
            # (SwiGLU fc1 stores gate and up halves as separate chunks: not a TP cut)
            spec = fused.get(name)
            col = max(col, _distinct_offsets(info, npre) // (len(spec.sections) if spec else 1))
    return row if row > 1 or seen_row else col


def infer_gtp(infos: Iterable[tuple[str, TensorInfo, int]]) -> int:
    """GTP from chunk offsets: 0.19.2 saves each GTP rank's shard of a dense row-parallel weight as
    its own chunk along dim 0, which TP never cuts (TP cuts dim 1)."""
    g = 1
    for name, info, npre in infos:
        if tp_kind_by_name(name) == "row" and not is_routed_expert(name) and len(info.shape) > npre + 1:
            g = max(g, _distinct_offsets(info, npre))
    return g


def infer_ep(src_dp: list["DpBucketKey"], zero: list["DpZeroKey"], layout: ParallelLayout, has_expert: bool) -> int | None:
    """EP from a bucketed save's expert optimizer (the last of a chain): one dp_group_idx per
    (expert TP, EP, GTP, PP) rank, so EP = their count / (ETP·EGTP·PP). None when it does not show."""
    chains = sorted({d.chain for d in src_dp} | {z.chain for z in zero})
    if not has_expert:
        return 1
    if not chains:
        return None
    if len(chains) == 1:   # EP=1: experts share the dense buffer, one optimizer
        return 1
    idx = {d.dp_group_idx for d in src_dp if d.chain == chains[-1]} | {z.dp_group_idx for z in zero
                                                                        if z.chain == chains[-1]}
    per = layout.etp * layout.egtp * layout.pp
    return len(idx) // per if idx and len(idx) % per == 0 else None


def fused_spec(name: str, rows: int, args: dict, hints: Hints, shapes: dict[str, tuple[int, ...]],
               split: dict[str, FusedSpec] | None = None) -> FusedSpec | None:
    """Section table of a fused projection (SwiGLU fc1, attention qkv; `split`: the tables of keys
    merged from per-section keys, Mamba / GDN), or None when not fused."""
    if split and name in split:
        return split[name]
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
            need = [n for n, v in (("num_attention_heads", heads), ("num_query_groups", groups),
                                   ("kv_channels", hd)) if not v]
            raise model_facts.missing(f"{name}: {rows} qkv rows fit several head layouts", need)
        spec = FusedSpec.qkv(int(heads), int(groups), int(hd))
        if spec.rows != rows:
            raise BridgeError(f"{name}: {rows} qkv rows do not match heads={heads}, groups={groups}, head_dim={hd} "
                              f"({spec.rows} rows); pass the right --num-attention-heads/--num-query-groups/--kv-channels")
        return spec
    return None


def recorded_sharding_types(obj: Any, depth: int = 0) -> set[str]:
    """Every `param_state_sharding_type` in the common state's (possibly chained) optimizer dicts.

    >>> sorted(recorded_sharding_types({"optimizer": {0: {"param_state_sharding_type": "dp_reshardable"}}}))
    ['dp_reshardable']
    """
    out: set[str] = set()
    if depth > 6:
        return out
    if isinstance(obj, dict):
        v = obj.get("param_state_sharding_type")
        if v is not None:
            out.add(v if isinstance(v, str) else repr(v)[:60])
        for k, x in obj.items():
            if k not in ("param_groups", "state", "param_state", "param_state_sharding_type"):
                out |= recorded_sharding_types(x, depth + 1)
    elif isinstance(obj, (list, tuple)):
        for x in obj[:64]:
            out |= recorded_sharding_types(x, depth + 1)
    return out


def zero_keys_of(ck: DcpCheckpoint) -> list[DpZeroKey]:
    """The dp_zero_gather_scatter `param_state` objects of a checkpoint."""
    out = []
    for name in dict.fromkeys(ck.object_names()):
        m = DP_ZERO_RE.match(name)
        if m:
            out.append(DpZeroKey(name, int(m.group(1) or 0), int(m.group(2))))
    return out


def format_by_keys(opt: dict[tuple[str, str], str], dp: list[DpBucketKey], zero: list[DpZeroKey],
                   stored_opt_keys: Iterable[str]) -> str:
    """The optimizer format the entry names show (bucket tensors of dp_reshardable and
    fully_sharded_bucket_space look alike: the recorded type tells them apart)."""
    kinds = [k for k, there in (("opt", opt), ("dp", dp), ("zero", zero)) if there]
    if len(kinds) > 1:
        raise BridgeError(f"holds optimizer entries of several formats ({', '.join(kinds)}); unknown format")
    if opt:
        return "fully_sharded_model_space" if any(".fp32_param." in k for k in stored_opt_keys) else "fully_reshardable"
    if dp:
        return "dp_reshardable"
    if zero:
        return "dp_zero_gather_scatter"
    return "model_only"


def decide_format(root: Any, recorded: set[str], by_keys: str, evidence: str, model_only: bool,
                  inferred: list[str]) -> str:
    """The format to convert, or a refusal that says what the checkpoint looks like.

    A checkpoint with optimizer state never converts without it unless asked (`--model-only`).

    >>> decide_format("ck", {"dp_reshardable"}, "dp_reshardable", "", False, [])
    'dp_reshardable'
    >>> decide_format("ck", {"fully_sharded_bucket_space"}, "dp_reshardable", "", False, [])
    'fully_sharded_bucket_space'
    """
    unknown = sorted(t for t in recorded if t not in READABLE)
    if model_only:
        what = (next(iter(recorded)) if len(recorded) == 1 else by_keys) if (recorded or by_keys != "model_only") \
            else ""
        inferred.append(f"model_only: optimizer state ({what or evidence or 'none'}) left out (--model-only)")
        return "model_only"
    if unknown:
        t = unknown[0]
        raise BridgeError(f"{root}: optimizer state saved as {t!r} ({SAVED_BY.get(t, 'not a megatron-core format')}), "
                          f"which convert cannot read; re-save with dp_reshardable, or pass --model-only to convert "
                          f"the weights without the optimizer state")
    if len(recorded) > 1:
        raise BridgeError(f"{root}: optimizers saved in several formats {sorted(recorded)}; unknown format")
    if recorded:
        t = next(iter(recorded))
        same = t == by_keys or (t == "fully_sharded_bucket_space" and by_keys == "dp_reshardable")
        if not same:
            have = "no optimizer entries" if by_keys == "model_only" else f"entries of {by_keys}"
            raise BridgeError(f"{root}: holds optimizer state ({evidence or 'common_state'}) but, while common_state "
                              f"records optimizer format {t!r} ({SAVED_BY.get(t, '?')}), the checkpoint holds {have}: "
                              f"incomplete or mixed checkpoint, refusing rather than converting without it; copy the "
                              f"complete save, or pass --model-only to convert the weights alone")
        return t
    if by_keys == "model_only" and evidence:
        raise BridgeError(f"{root}: holds optimizer state ({evidence}) but none of the optimizer entries of a known "
                          f"format ({', '.join(READABLE)}); unknown optimizer format, refusing rather than converting "
                          f"without it (pass --model-only to convert the weights alone)")
    return by_keys


def _layout_from(args: dict, hints: Hints, tp_inferred: int, world: int, inferred: list[str],
                 gtp_inferred: int = 1) -> ParallelLayout:
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
    if gtp is None and gtp_inferred > 1:
        gtp = gtp_inferred
        inferred.append(f"gtp={gtp} (chunk offsets: row-parallel weights cut along dim 0)")
    gtp = gtp or 1
    ep = pick("ep", "expert_model_parallel_size", default=1)
    etp = pick("tp", "expert_tensor_parallel_size", default=tp)
    dp = pick("dp", "data_parallel_size")
    pp = pick("pp", "pipeline_model_parallel_size", default=1)
    cp = int(args.get("context_parallel_size") or 1)
    if dp is None:
        model = tp * gtp * pp * cp
        w = int(args.get("world_size") or world)
        dp = max(1, w // model)
        inferred.append(f"dp={dp} (writer ranks)")
    try:
        return ParallelLayout(tp=tp, gtp=gtp, dp=dp, cp=cp, pp=pp, ep=ep, etp=etp)
    except BridgeError as e:
        given = ", ".join(f"--{f} {getattr(hints, f)}" for f in ("tp", "gtp", "dp", "pp", "ep") if getattr(hints, f))
        raise BridgeError(f"the checkpoint's layout does not fit together ({e}); pass the run's --tp/--gtp/--dp/--pp/--ep"
                          + (f" (given: {given})" if given else "")) from None


def describe(ck: DcpCheckpoint, hints: Hints | None = None) -> SourceCheckpoint:
    """Interpret a DCP checkpoint as a Megatron-Core save (format, layout, geometry per key)."""
    hints = hints or Hints()
    if not ck.has_file("metadata.json"):
        raise BridgeError(f"{ck.root}: a DCP checkpoint without metadata.json, so not written by Megatron-Core "
                          f"dist_checkpointing (unknown format); convert reads torch_dist saves only")
    common = ck.common_state()
    saved_args = checked_args(_as_dict(common.get("args")), ck.root)
    facts = model_facts.gather(ck.root, saved_args, hints.as_facts(), hints.model_config)
    args = checked_args(facts.values, ck.root)
    it = common.get("iteration")
    if it is not None and (type(it) is not int or it < 0):
        raise BridgeError(f"{ck.root}: common_state iteration is {type(it).__name__} {str(it)[:40]}, not a step count; "
                          f"the checkpoint is damaged")
    split = merge_split_keys(ck)
    model_keys, opt, dp, _other = classify_keys(ck)
    zero = zero_keys_of(ck)
    if not model_keys and not opt and not dp and not zero:
        raise BridgeError(f"{ck.root}: a DCP checkpoint without Megatron model or optimizer entries "
                          f"(unknown format); only Megatron-Core torch_dist saves can be converted")
    try:
        by_keys = format_by_keys(opt, dp, zero, opt.values())
    except BridgeError as e:
        raise BridgeError(f"{ck.root}: {e}") from None
    inferred: list[str] = facts.notes()
    fmt = decide_format(ck.root, recorded_sharding_types(common.get("optimizer")), by_keys,
                        _evidence(ck, common), hints.model_only, inferred)
    if fmt == "model_only":
        opt, dp, zero = {}, [], []
    if not model_keys:
        raise BridgeError(f"{ck.root}: optimizer state without model weights; convert needs the model entries "
                          f"(save the model with the optimizer)")
    names = {strip_wrappers(k): k for k in model_keys}
    if len(names) != len(model_keys):
        raise BridgeError(f"{ck.root}: two model keys differ only by a module./model. prefix; unknown format")
    npres = {n: num_prepend_axes(n) for n in names}
    split_names = {strip_wrappers(k): spec for k, spec in split.items()}
    tp_inf = infer_tp(((n, ck.tensors[k], npres[n]) for n, k in names.items()), split_names)
    world = (max(ck.writer_ranks()) + 1) if ck.writer_ranks() else 1
    gtp_inf = infer_gtp((n, ck.tensors[k], npres[n]) for n, k in names.items())
    has_expert = any(is_routed_expert(n) for n in names)
    if has_expert and hints.ep is None and args.get("expert_model_parallel_size") is None:
        probe = _layout_from(args, hints, tp_inf, world, [], gtp_inf)
        ep = infer_ep(dp, zero, probe, True)
        if ep is not None:
            args = dict(args, expert_model_parallel_size=ep)
            inferred.append(f"ep={ep} (" + ("one optimizer: experts in the dense buffer" if ep == 1 else
                                             "dp_group_idx of the expert optimizer") + ")")
        elif fmt in BUCKETED:
            raise model_facts.missing(f"{ck.root}: expert-parallel size", ["expert_model_parallel_size"])
        else:
            inferred.append(f"ep unknown ({fmt} stores experts globally, so it is not needed to convert); "
                            f"recorded as 1")
    layout = _layout_from(args, hints, tp_inf, world, inferred, gtp_inf)
    split = pipeline_split(ck.root, args, layout, fmt, [strip_wrappers(k) for k in model_keys])
    if split.tied and layout.pp > 1 and fmt in BUCKETED:
        inferred.append("tied output layer: the last pipeline stage's copy of the word embeddings is checked "
                        "equal to the first stage's, one array written")
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
        logical = logical_shape(n, stored, args, layout, expert, shapes, inferred)
        # 0.19.2 stores every GTP-sharded weight in its padded grid (§2.5 A; SwiGLU fc1 scrambled, §6.3),
        # which equals the logical layout only when there is no padding and no fused halves
        legacy = logical != stored or (gtp_w and stored != ())
        kind = tp_kind_by_name(n)
        if kind != "replicated" and not stored:
            kind = "replicated"
        spec = None
        if stored:
            spec = fused_spec(n, logical[0], args, hints, shapes, split_names)
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
    src = SourceCheckpoint(ck, fmt, args, common, layout, pad, models, opt, dp, zero,
                           chained=any(d.chain for d in dp) or any(z.chain for z in zero)
                           or any(m.geom.expert for m in models.values()),
                           inferred=inferred, split=split)
    missing = sorted({n for (_r, n) in opt} - set(models))
    if missing:
        raise BridgeError(f"{ck.root}: optimizer state for {missing[0]} has no model entry; unknown format")
    check_complete(src)
    return src


def pipeline_split(root: Any, args: dict, layout: ParallelLayout, fmt: str, names: list[str]) -> PipelineSplit:
    """The run's pipeline split (`args` / flags: layers per stage, virtual chunks) and tied output
    layer (args, else the keys).

    Only the bucketed formats need it: model-space entries carry global layer offsets whatever the
    split. With virtual pipeline chunks each model chunk has its own DDP buffer (`gbuf_idx` = chunk);
    a custom `pipeline_model_parallel_layout` is refused there."""
    try:
        split = PipelineSplit.from_args(args, layout.pp, is_tied(names, args.get("untie_embeddings_and_output_weights")))
    except BridgeError as e:
        raise BridgeError(f"{root}: {e}") from None
    if layout.pp > 1 and fmt in BUCKETED and args.get("pipeline_model_parallel_layout"):
        raise BridgeError(f"{root}: {fmt} saved with pipeline_model_parallel_layout="
                          f"{str(args['pipeline_model_parallel_layout'])[:60]!r}: a custom layer layout places the "
                          f"layers in each stage's DDP buffers otherwise; re-save as fully_reshardable")
    return split


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
        if not any(x.startswith("model_only") for x in src.inferred):
            src.inferred.append("model_only (no optimizer state in the checkpoint)")
        return
    if src.fmt == "dp_zero_gather_scatter":
        pass  # one object per DistOpt group; its buffers are checked against the rebuilt layout
    elif src.fmt in ("fully_reshardable", "fully_sharded_model_space"):
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
            if not isinstance(g, dict) or plain_value(g.get("step")) is None:
                raise BridgeError(f"{root}: param group {gi} of optimizer {ci} has no 'step' (the Adam bias-correction "
                                  f"count): incomplete checkpoint")
            step = plain_value(g["step"])
            if type(step) not in (int, float) or not 0 <= step < 1 << 53 or step != int(step):
                raise BridgeError(f"{root}: param group {gi} of optimizer {ci} has step {str(step)[:40]!r}, not a "
                                  f"step count; the checkpoint is damaged")


def optimizer_evidence(src: SourceCheckpoint) -> str:
    """What shows that an optimizer was saved (tensor or object keys, common_state's `optimizer`), or ''."""
    return _evidence(src.ck, src.common)


def _evidence(ck: DcpCheckpoint, common: dict) -> str:
    keys = [k for k in ck.tensors if k.startswith(("optimizer.", "chained_"))]
    keys += [k for k in ck.object_names() if k.startswith(("optimizer.", "chained_")) or DP_OBJECT_RE.match(k)]
    if keys:
        return f"entry {keys[0]}"
    if common.get("optimizer") is not None:
        return "common_state['optimizer']"
    return ""


def _sibling(shapes: dict[str, tuple[int, ...]], name: str, module: str) -> tuple[int, ...] | None:
    """Stored per-instance shape of `module`.weight in the same block as `name`."""
    return shapes.get(name.rsplit(".", 2)[0] + f".{module}.weight")


def _hidden(shapes: dict[str, tuple[int, ...]]) -> int | None:
    """The hidden size from a weight whose column axis is the model width and never padded."""
    for n, s in shapes.items():
        if module_of(n) in ("word_embeddings", "linear_qkv", "linear_fc1") and n.endswith(".weight") and len(s) == 2:
            return s[1]
    return None


def logical_shape(name: str, stored: tuple[int, ...], args: dict, layout: ParallelLayout, expert: bool,
                  shapes: dict[str, tuple[int, ...]] | None = None, inferred: list[str] | None = None) -> tuple[int, ...]:
    """Logical per-instance shape of a key; differs from `stored` only for the padded GTP grid.

    The padded grid hides the row count of every GTP-sharded weight (§2.5 A), so it comes from the
    model facts, else from an unpadded axis of another weight (the width from embedding / qkv / fc1
    columns, the FFN size from fc2's columns, the head dim from linear_proj's columns); a fact
    neither recorded nor inferable is an error naming the flag that supplies it.
    """
    tp, gtp = layout.tp_gtp_sizes(expert)
    if gtp == 1 or not is_gtp_weight(name) or not stored:
        return stored
    shapes = shapes or {}
    notes = inferred if inferred is not None else []

    def note(fact: str) -> None:
        if fact not in notes:
            notes.append(fact)

    mod = module_of(name)
    h = args.get("hidden_size")
    if h is None and (h := _hidden(shapes)) is not None:
        note(f"hidden_size={h} (embedding / qkv / fc1 columns)")
    want: int | None = None
    if mod == "linear_qkv":
        heads = args.get("num_attention_heads")
        groups = args.get("num_query_groups") if args.get("group_query_attention", True) else heads
        hd = args.get("kv_channels")
        proj = _sibling(shapes, name, "linear_proj")
        if hd is None and heads and proj is not None:
            hd = proj[-1] // heads
            note(f"kv_channels={hd} (linear_proj columns / heads)")
        if not (heads and groups and hd):
            need = [n for n, v in (("num_attention_heads", heads), ("num_query_groups", groups), ("kv_channels", hd))
                    if not v]
            raise model_facts.missing(f"{name} (GTP={gtp} padded rows)", need)
        want = (heads + 2 * groups) * hd
    elif mod == "linear_fc1":
        fname = "moe_ffn_hidden_size" if expert and args.get("moe_ffn_hidden_size") else "ffn_hidden_size"
        f = args.get(fname)
        fc2 = _sibling(shapes, name, "linear_fc2")
        if f is None and fc2 is not None:
            f = fc2[-1]
            note(f"{fname}={f} (linear_fc2 columns)")
        if not f:
            raise model_facts.missing(f"{name} (GTP={gtp} padded rows)", [fname])
        gated = args.get("swiglu", args.get("gated_linear_unit"))
        if gated is None:
            # padding adds fewer rows than the FFN size except in toy models: say so
            gated = stored[0] >= 2 * f
            note(f"swiglu={gated} (linear_fc1 rows {stored[0]} vs ffn {f})")
        want = f * (2 if gated else 1)
    elif mod in ("linear_proj", "linear_fc2", "out_proj"):
        if h is None:
            raise model_facts.missing(f"{name} (GTP={gtp} padded rows)", ["hidden_size"])
        want = h
    elif mod in ("word_embeddings", "output_layer"):
        want = args.get("padded_vocab_size")
        if want is None:
            raise model_facts.missing(f"{name} (GTP={gtp} padded rows)", ["padded_vocab_size"])
    if want is None:
        raise BridgeError(f"{name}: GTP={gtp} padded rows of an unknown module; cannot tell padding from data")
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
    if not groups and src.fmt in BUCKETED:
        chains = sorted({d.chain for d in src.dp_keys} | {z.chain for z in src.zero_keys})
        for c in chains:
            prefix = f"chained_{c}." if any(k.startswith("chained_") for k in src.ck.objects) else ""
            cands = [k for k in src.ck.object_names() if k.startswith(f"{prefix}optimizer.distributed.dp_group_idx_")
                     and k.endswith(".optimizer")]
            cands.sort(key=lambda k: int(re.search(r"dp_group_idx_(\d+)", k).group(1)))
            if cands:
                groups += find_param_groups(src.ck.read_object(cands[0]))
    return groups


def plain_value(v: Any, depth: int = 0) -> Any:
    """A common-state value as plain Python: scalars kept, one-element tensors `.item()`-ed, lists
    recursed (bounded depth: the file is untrusted), anything else its `repr`.

    >>> plain_value([1, (2.5, "a")]), plain_value({"a": 1})
    ([1, [2.5, 'a']], "{'a': 1}")
    """
    if isinstance(v, (bool, int, float, str)) or v is None:
        return v
    if isinstance(v, (list, tuple)) and depth < 8:
        return [plain_value(x, depth + 1) for x in v]
    if hasattr(v, "item") and getattr(v, "numel", lambda: 2)() == 1:
        return v.item()
    return repr(v)


def step_of(src: SourceCheckpoint, groups: list[list[dict]]) -> int | None:
    """Completed optimizer steps: `step` of the param groups, else `iteration`."""
    steps = [int(plain_value(g["step"])) for gs in groups for g in gs if "step" in g and plain_value(g["step"]) is not None]
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
        out["lr"] = float(plain_value(first["lr"]))
    if "betas" in first:
        out["betas"] = tuple(float(b) for b in plain_value(first["betas"]))
    if "eps" in first:
        out["eps"] = float(plain_value(first["eps"]))
    wds = [float(plain_value(g["weight_decay"])) for _, g in flat if "weight_decay" in g]
    if wds:
        out["weight_decay"] = max(wds)
    summary = []
    for ci, g in flat:
        rec = {k: plain_value(g[k]) for k in HYPER_KEYS if k in g}
        rec["optimizer"] = ci
        if isinstance(g.get("params"), (list, tuple)):
            rec["num_params"] = len(g["params"])
        summary.append(rec)
    out["groups"] = summary
    return out
