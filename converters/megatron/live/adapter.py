"""Megatron-Core adapter: a live `GPTModel` + `DistributedOptimizer` as the live exporter's input.

Duck-typed: `megatron` is imported only inside the functions that talk to a live run, so the
rest of the library (and the CPU tests) never need it. Two halves:

- **Pure mapping** (`EntryRecord`, `ParamRecord`, `map_params`, `adam_config_from_groups`): from
  what the model's `sharded_state_dict()` says about each entry (key, global shape and offsets,
  prepended layer / expert axes, factory) and what Megatron put on each parameter
  (`tensor_model_parallel`, `partition_dim`, `is_gtp_weight_remat`, `pad_length`), decide the
  logical key, the `ParamGeometry` (through `bridge.layout`) and the stacked-axes index. No
  tensors; the CPU tests run it on metadata recorded from real runs
  (`tests/fixtures/megatron/<run>/sharded_state_dict.json`).
- **Live binding** (`local_params`, `export_megatron`, `load_megatron`): reads the live
  parameters and the distributed optimizer's per-parameter state (`_get_model_param_range_map`,
  `_get_main_param_and_optimizer_states`, chained dense + expert optimizers) and produces the
  `LocalParam` list + `LiveRun` of `bridge.live.api`.

Binding rules (docs/megatron-layout.md §3, §7.6): a model entry stands for the live parameter
named by its backlink (`_gtp_dequant_src` on FP8 dequantized copies, `gtp_pad_src` on trimmed
GTP entries) or, without one, for the parameter whose state-dict name it carries; optimizer state
is keyed by the live parameter object. Checkpoint copies are never matched by tensor identity.
A parameter without an entry, or an entry naming no parameter, is a `BridgeError` naming it.

Pipeline stages (PP > 1): each stage passes its own model chunk and optimizer. Its layers are
named locally (`decoder.layers.0...` on every stage) but its model entries carry the global layer
offset (Megatron's `get_transformer_layer_offset`), so the stacked-axes index of every parameter
is global and the exporter / reload need no stage arithmetic: the logical checkpoint is the same
whatever PP (even or uneven split) wrote it. The embedding lives on the first stage, the final
norm and an untied output layer on the last; a tied output layer on the last stage is bound to
the embedding's key as a replica Megatron does not write (`replica_id[0] = 1`), so export leaves
it out and reload fills it.

Virtual pipeline (VPP > 1): each stage passes Megatron's `model` list, one chunk per virtual stage
(built with its own `vp_stage`), and the one DistributedOptimizer over all of them (one DDP buffer
per chunk). Each chunk is bound on its own (`map_chunks`: its layers are named locally again, its
entries carry the chunk's global layer offset), so, as for PP, the exporter / reload see global
stacked-axes indices and no chunk arithmetic. The embedding lives on chunk 0 of the first stage, the
final norm and output layer on the last chunk of the last stage.

Hybrid models (Mamba / Gated DeltaNet): megatron-core saves each fused SSM projection through a
factory that builds one key per section (`in_proj.weight.{z,x,B,C,dt}`, `conv1d.{weight,bias}.{x,B,C}`,
GDN `in_proj.weight.{query,key,value,z,beta,alpha}`, ...) while the model and its optimizer hold one
fused parameter. The entry's sections (`split_factory`) give the parameter's section table through
`format.split_spec`, the one table `convert` uses for the same keys, so both write the same arrays.

Writer election: one `LocalParam` carries both the weight (replicated across DP) and this rank's
optimizer fragment (unique to it), so Megatron's `replica_id` cannot become one `main_replica`
flag. Instead, for export, copies that are TP / GTP replicas (`replica_id[:2] != (0, 0)`: layer
norms on TP rank > 0, biases on GTP rank > 0; and any parameter GTP does not shard, on GTP rank
> 0, whose replica_id folds the GTP rank into the DP coordinate) are left out entirely,
weights and optimizer fragments alike: they need not equal the main copy (0.19.2 initialises some
GTP-replicated params, e.g. position embeddings, differently on each GTP rank), and Megatron's
own save keeps the main copy. DP replicas are identical; the exporter elects among them
(`main_replica=None`). Reload fills every copy.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Sequence

from bridge.errors import BridgeError
from bridge.layout.fused import FusedSpec
from bridge.layout.parallel import ParallelLayout
from bridge.layout.params import ParamGeometry
from bridge.renamed import renamed
from converters.megatron.plan.format import split_spec
from converters.megatron.plan.naming import SPLIT_SECTIONS, is_routed_expert, logical_key, module_of

if TYPE_CHECKING:
    from bridge.live.api import AdamConfig, LiveRun, LocalParam, ReloadResult
    from bridge.live.export import Exporter, ExportOptions, ExportReport
    from bridge.live.background import ExportHandle

__all__ = [
    "EntryRecord",
    "ParamRecord",
    "ModelDims",
    "ParamMapping",
    "map_params",
    "map_chunks",
    "adam_config_from_groups",
    "common_step",
    "merge_adam_configs",
    "pipeline_adam_config",
    "entries_from_description",
    "local_params",
    "export_megatron",
    "load_megatron",
]

# ------------------------------------------------------------------------------------------------
# Pure records


@dataclass(frozen=True)
class EntryRecord:
    """One model entry of `sharded_state_dict()` (a ShardedTensor or a factory), data left out.

    `name` is the entry's state-dict name (its place in the dict, e.g.
    `decoder.layers.0.pre_mlp_layernorm.weight`), `key` the checkpoint key (e.g.
    `decoder.layers.mlp.linear_fc1.layer_norm_weight`). For a factory the shape fields are those of
    its built sub-tensors (same global shape and stacked-axes offsets for every section).
    `backlink` names the live parameter a dequantized / trimmed copy points at, if any.
    `sections`: for a factory Megatron saves one key per section (Mamba / GDN `in_proj`, `conv1d`:
    `<key>.<section>`, naming.SPLIT_SECTIONS), each section's global rows along the instance's dim 0,
    in build order; the shape fields are then those of the whole fused parameter (`split_factory`).
    """

    name: str
    key: str
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    prepend_axis_num: int = 0
    replica_id: tuple[int, ...] = (0, 0, 0)
    factory: str | None = None
    allow_shape_mismatch: bool = False
    backlink: str | None = None
    sections: tuple[tuple[str, int], ...] = ()

    @property
    def prepend(self) -> tuple[int, ...]:
        """Sizes of the stacked (layer / expert) axes."""
        return tuple(self.global_shape[: self.prepend_axis_num])

    @property
    def index(self) -> tuple[int, ...]:
        """This entry's position on the stacked axes."""
        return tuple(self.global_offset[: self.prepend_axis_num])

    @property
    def model_parallel_main(self) -> bool:
        """Megatron writes this copy: no pipeline / TP / GTP replica coordinate (DP ones aside).

        >>> EntryRecord("n", "k", (4,), (0,), replica_id=(0, 1, 0)).model_parallel_main
        False
        """
        return all(int(r) == 0 for r in self.replica_id[:2])

    @property
    def stored_shape(self) -> tuple[int, ...]:
        """Global shape of one instance as stored (padded grid for 0.19.2 GTP saves)."""
        return tuple(self.global_shape[self.prepend_axis_num :])


@dataclass(frozen=True)
class ParamRecord:
    """A live parameter as this rank holds it: name (wrappers allowed), physical shape, attributes."""

    name: str
    shape: tuple[int, ...]
    tensor_model_parallel: bool = False
    partition_dim: int = -1
    gtp: bool = False  # is_gtp_weight_remat
    pad_length: int = 0

    @classmethod
    def from_attrs(cls, name: str, shape: Sequence[int], attrs: Mapping[str, Any]) -> "ParamRecord":
        """From the attribute dict Megatron puts on a parameter (JSON-able values)."""
        return cls(
            name=name,
            shape=tuple(int(s) for s in shape),
            tensor_model_parallel=bool(attrs.get("tensor_model_parallel", False)),
            partition_dim=int(attrs.get("partition_dim", -1)),
            gtp=bool(attrs.get("is_gtp_weight_remat", False)),
            pad_length=int(attrs.get("pad_length", 0) or 0),
        )


@dataclass(frozen=True)
class ModelDims:
    """What the fused qkv section table needs (TransformerConfig fields)."""

    num_attention_heads: int
    num_query_groups: int
    kv_channels: int

    @classmethod
    def from_config(cls, config: Any) -> "ModelDims":
        """From a Megatron `TransformerConfig` (duck-typed)."""
        heads = int(config.num_attention_heads)
        groups = int(getattr(config, "num_query_groups", None) or heads)
        kv = getattr(config, "kv_channels", None) or config.hidden_size // heads
        return cls(heads, groups, int(kv))


@dataclass(frozen=True)
class ParamMapping:
    """Where one live parameter goes: logical key, geometry (with its stacked-axes index)."""

    param: str  # live parameter name as given
    key: str  # logical key (checkpoint key without wrappers)
    geometry: ParamGeometry
    entry: str  # state-dict name of the model entry it was bound through
    model_parallel_main: bool = True  # False: a TP / GTP replica Megatron does not write

    @property
    def index(self) -> tuple[int, ...]:
        return self.geometry.index


def split_factory(key: str, built: Sequence[tuple[str, Sequence[int], int]]
                  ) -> tuple[tuple[int, ...], tuple[tuple[str, int], ...]]:
    """Global shape and sections of a factory from its built sub-tensors `(key, global_shape,
    prepend_axis_num)`: when every sub-tensor is a per-section key `<key>.<section>`, the sections
    are stacked along the instance's dim 0 (as `format.merge_split_keys` reads them from a save);
    otherwise (SwiGLU: every sub-tensor under the factory's own key) the first sub-tensor's shape
    and no sections.

    >>> split_factory("m.conv1d.bias", [("m.conv1d.bias.x", (8,), 0), ("m.conv1d.bias.B", (4,), 0),
    ...                                 ("m.conv1d.bias.C", (4,), 0)])
    ((16,), (('x', 8), ('B', 4), ('C', 4)))
    >>> split_factory("m.linear_fc1.weight", [("m.linear_fc1.weight", (2, 16, 8), 1)] * 2)
    ((2, 16, 8), ())
    """
    first, axis = tuple(built[0][1]), int(built[0][2])
    if not all(k.startswith(key + ".") and "." not in k[len(key) + 1:] for k, _s, _a in built):
        return first, ()
    rest = first[:axis] + first[axis + 1:]
    for k, shape, a in built:
        shape = tuple(shape)
        if int(a) != axis or len(shape) <= axis or shape[:axis] + shape[axis + 1:] != rest:
            raise BridgeError(f"factory {key}: its per-section sub-tensors differ outside dim {axis} "
                              f"({k}: {shape}, {built[0][0]}: {first}); unknown format")
    sections = tuple((k[len(key) + 1:], int(shape[axis])) for k, shape, _a in built)
    return first[:axis] + (sum(r for _s, r in sections),) + first[axis + 1:], sections


def _tp_kind(p: ParamRecord, key: str) -> str:
    if not p.tensor_model_parallel:
        return "replicated"
    if p.partition_dim == 0:
        return "vocab" if module_of(key) == "word_embeddings" else "column"
    if p.partition_dim == 1:
        return "row"
    raise BridgeError(f"{p.name}: tensor-parallel parameter with partition_dim={p.partition_dim}; "
                      "only dims 0 (column / vocab) and 1 (row) are supported")


def _fused(p: ParamRecord, e: EntryRecord, key: str, rows: int, dims: ModelDims | None) -> FusedSpec | None:
    """Section table: SwiGLU from Megatron's factory, per-section keys (Mamba / GDN) from the factory's
    sub-tensors, qkv from the attention head layout."""
    if e.sections:
        spec = split_spec(e.sections)
        if spec is None:
            raise BridgeError(f"{p.name}: factory {e.key} saves sections {[s for s, _r in e.sections]}, which are no "
                              f"known per-section parameter ({', '.join(SPLIT_SECTIONS)}); unsupported")
        if spec.rows != rows:
            raise BridgeError(f"{p.name}: the sections of {e.key} ({dict(e.sections)}) add up to {spec.rows} rows, the "
                              f"live parameter has {rows}")
        return spec
    if e.factory is not None and "swiglu" in e.factory:
        if rows % 2:
            raise BridgeError(f"{p.name}: SwiGLU parameter with an odd row count {rows}")
        return FusedSpec.swiglu(rows // 2)
    if e.factory is not None:
        raise BridgeError(f"{p.name}: unsupported sharded-state-dict factory {e.factory!r} (key {e.key}); "
                          "only SwiGLU linear_fc1 and per-section (Mamba / GDN) factories are mapped")
    if module_of(key) == "linear_qkv" and key.split(".")[-1] in ("weight", "bias"):
        if dims is None:
            raise BridgeError(f"{p.name}: fused qkv needs the head layout; pass ModelDims (num_attention_heads, "
                              "num_query_groups, kv_channels)")
        spec = FusedSpec.qkv(dims.num_attention_heads, dims.num_query_groups, dims.kv_channels)
        if spec.rows != rows:
            raise BridgeError(f"{p.name}: {rows} qkv rows do not match heads={dims.num_attention_heads}, "
                              f"groups={dims.num_query_groups}, kv_channels={dims.kv_channels} ({spec.rows} rows)")
        return spec
    return None


def param_geometry(p: ParamRecord, e: EntryRecord, layout: ParallelLayout, dims: ModelDims | None,
                   pad_for_alignment: int, rank: int = 0) -> tuple[str, ParamGeometry]:
    """Logical key and geometry of live parameter `p` bound to model entry `e`.

    The logical per-instance shape comes from the live shard and Megatron's attributes (TP
    partition dim, GTP `pad_length`), then is checked against the entry's stored global shape,
    which is either logical or, for 0.19.2 GTP saves, the padded grid (§2.5 A).

    >>> p = ParamRecord("decoder.layers.1.self_attention.linear_proj.weight", (24, 12), True, 1)
    >>> e = EntryRecord(p.name, "decoder.layers.self_attention.linear_proj.weight", (2, 24, 24), (1, 0, 12), 1)
    >>> key, g = param_geometry(p, e, ParallelLayout(tp=2), None, 16)
    >>> key, g.shape, g.tp_kind, g.prepend, g.index
    ('decoder.layers.self_attention.linear_proj.weight', (24, 24), 'row', (2,), (1,))
    """
    key = logical_key(e.key)
    where = f"rank {rank}: {p.name}"
    expert = is_routed_expert(key)
    tp, gtp = layout.tp_gtp_sizes(expert)
    kind = _tp_kind(p, key)
    shape = tuple(p.shape)
    if not shape and kind != "replicated":
        raise BridgeError(f"{where}: 0-d tensor-parallel parameter")
    gtp_on = p.gtp and gtp > 1
    if p.gtp and gtp == 1:
        raise BridgeError(f"{where}: is_gtp_weight_remat is set but the layout has GTP=1; pass the run's GTP size")
    rows = shape[0] * gtp - p.pad_length if gtp_on else (shape[0] if shape else 1)
    if gtp_on and p.pad_length >= shape[0] * gtp:
        raise BridgeError(f"{where}: pad_length {p.pad_length} leaves no rows in {gtp} shards of {shape[0]}")
    if kind in ("column", "vocab"):
        logical = (rows * tp,) + shape[1:]
    elif kind == "row":
        logical = (rows, shape[1] * tp) + shape[2:]
    else:
        logical = ((rows,) + shape[1:]) if shape else ()
    stored = e.stored_shape
    if stored != logical:
        padded = None
        if gtp_on:  # 0.19.2's padded grid: TP blocks of P = L_local + pad rows (column) / G*S rows (row)
            padded = ((tp * shape[0] * gtp,) if kind in ("column", "vocab") else (shape[0] * gtp,)) + logical[1:]
        if stored != padded:
            raise BridgeError(f"{where}: model entry {e.key} has global shape {stored} per instance, the live shard "
                              f"{shape} with TP={tp}, GTP={gtp}, pad_length={p.pad_length} gives {logical}; "
                              "the layout sizes passed do not match the run")
    fused = _fused(p, e, key, logical[0] if logical else 1, dims)
    geom = ParamGeometry(key, logical, kind, gtp=p.gtp, pad_for_alignment=pad_for_alignment, prepend=e.prepend,
                         fused=fused, expert=expert, index=e.index)
    phys = geom.physical_shape(tp, gtp)
    if phys != shape:
        raise BridgeError(f"{where}: geometry gives a physical shard of {phys}, the rank holds {shape} "
                          f"(TP={tp}, GTP={gtp}, pad_for_alignment={pad_for_alignment}); pass the run's pad_for_alignment")
    return key, geom


def map_params(entries: Iterable[EntryRecord], params: Iterable[ParamRecord], layout: ParallelLayout,
               dims: ModelDims | None, pad_for_alignment: int = 16, rank: int = 0) -> list[ParamMapping]:
    """Bind every live parameter to its model entry and compute its logical key and geometry.

    Binding: an entry's backlink names its parameter; otherwise its state-dict name (wrappers
    stripped) equals the parameter's. Every parameter needs exactly one entry (BridgeError naming
    it); entries of non-parameters (buffers, `_extra_state`) are skipped.
    """
    params = list(params)
    by_name = {logical_key(p.name): p for p in params}
    if len(by_name) != len(params):
        raise BridgeError(f"rank {rank}: two parameters share a name once wrapper prefixes are removed")
    bound: dict[str, EntryRecord] = {}
    for e in entries:
        target = logical_key(e.backlink) if e.backlink else logical_key(e.name)
        if e.backlink and target not in by_name:
            raise BridgeError(f"rank {rank}: model entry {e.key} points (backlink) at {e.backlink}, which is not a "
                              "parameter of this model")
        if target not in by_name:
            continue
        if target in bound:
            raise BridgeError(f"rank {rank}: parameter {by_name[target].name} is bound to two model entries "
                              f"({bound[target].key}, {e.key})")
        bound[target] = e
    missing = [p.name for n, p in by_name.items() if n not in bound]
    if missing:
        raise BridgeError(f"rank {rank}: parameter {missing[0]} has no model sharded-state-dict entry "
                          f"({len(missing)} unmatched); every trained parameter must be checkpointed")
    out = []
    for n, p in by_name.items():
        e = bound[n]
        key, geom = param_geometry(p, e, layout, dims, pad_for_alignment, rank)
        tp, gtp, _t, g = geom.placement(layout, rank)
        # GTP peers of a GTP-replicated parameter are replicas whose replica_id may look like a DP
        # coordinate (modules without GTP params); Megatron writes GTP rank 0's copy.
        main = e.model_parallel_main and (g == 0 or geom.gtp_active(gtp))
        out.append(ParamMapping(p.name, key, geom, e.name, main))
    seen: dict[tuple[str, tuple[int, ...]], str] = {}
    for m in out:
        ident = (m.key, m.index)
        if ident in seen:
            raise BridgeError(f"rank {rank}: parameters {seen[ident]} and {m.param} map to the same logical "
                              f"instance {m.key}{list(m.index)}")
        seen[ident] = m.param
    return out


VPP_FLAGS = "--virtual-pipeline-model-parallel-size / --num-layers-per-virtual-pipeline-stage"


def map_chunks(chunks: Sequence[tuple[Iterable[EntryRecord], Iterable[ParamRecord]]], layout: ParallelLayout,
               dims: ModelDims | None, pad_for_alignment: int = 16, rank: int = 0,
               vpp: int | None = None) -> list[list[ParamMapping]]:
    """`map_params` of each model chunk of a rank (virtual pipeline: Megatron's `model` list).

    Chunks are bound separately: their parameters share local names (`decoder.layers.0...` in every
    chunk) and each chunk's entries carry its own global layer offset. `vpp` is the run's virtual
    pipeline size (None or 1: one chunk); the chunks passed must be all of them, and no two may hold
    the same logical instance (chunks built without their own `vp_stage` would).

    >>> p = ParamRecord("decoder.layers.0.norm.weight", (4,))
    >>> def chunk(layer):
    ...     return [EntryRecord(p.name, "decoder.layers.norm.weight", (4, 4), (layer, 0), 1)], [p]
    >>> [[m.index for m in ms] for ms in map_chunks([chunk(0), chunk(2)], ParallelLayout(pp=2), None, vpp=2)]
    [[(0,)], [(2,)]]
    """
    chunks = list(chunks)
    want = vpp or 1
    if want > 1 and layout.pp == 1:
        raise BridgeError(f"virtual pipeline size {want} without pipeline stages (PP=1): megatron-core interleaves "
                          f"model chunks over PP > 1 stages only; check {VPP_FLAGS}")
    if len(chunks) != want:
        raise BridgeError(f"rank {rank}: {len(chunks)} model chunk(s) passed, the run's virtual pipeline size is "
                          f"{want} ({VPP_FLAGS}); pass Megatron's whole `model` list, one chunk per virtual stage")
    out: list[list[ParamMapping]] = []
    held: dict[tuple[str, tuple[int, ...]], int] = {}
    for v, (entries, params) in enumerate(chunks):
        try:
            maps = map_params(entries, params, layout, dims, pad_for_alignment, rank)
        except BridgeError as e:
            raise BridgeError(f"model chunk {v}: {e}" if want > 1 else str(e)) from None
        for m in maps:
            other = held.setdefault((m.key, m.index), v)
            if other != v:
                raise BridgeError(f"rank {rank}: model chunks {other} and {v} both hold {m.key}{list(m.index)}; each "
                                  "chunk must be built with its own vp_stage (GPTModel(..., vp_stage=i)), as "
                                  "megatron's get_model does")
        out.append(maps)
    return out


def entries_from_description(records: Iterable[Mapping[str, Any]]) -> list[EntryRecord]:
    """Model `EntryRecord`s from the JSON description a fixture run recorded.

    Records are those of `tests/fixtures/megatron/tinygpt.describe_sharded`: top-level model
    tensors and factories (path `["model", <name>]`), the factories' built sub-tensors following
    them (path `["model", <name>, "<built>", i]`).
    """
    records = list(records)
    built: dict[str, list[Mapping[str, Any]]] = {}
    for r in records:
        path = r.get("path", [])
        if len(path) >= 3 and path[0] == "model" and path[2] == "<built>" and r.get("kind") == "tensor":
            built.setdefault(path[1], []).append(r)
    out = []
    for r in records:
        path = r.get("path", [])
        if len(path) != 2 or path[0] != "model" or r.get("kind") not in ("tensor", "factory"):
            continue
        shape_src, shape, sections = r, tuple(r.get("global_shape", ())), ()
        if r["kind"] == "factory":
            subs = built.get(path[1])
            if not subs:
                raise BridgeError(f"factory {r.get('key')} has no built sub-tensor in the description")
            shape_src = subs[0]
            shape, sections = split_factory(r["key"], [(b["key"], b["global_shape"], b["prepend_axis_num"])
                                                       for b in subs])
        out.append(EntryRecord(
            name=path[1], key=r["key"], global_shape=shape, sections=sections,
            global_offset=tuple(shape_src["global_offset"]), prepend_axis_num=int(shape_src["prepend_axis_num"]),
            replica_id=tuple(r["replica_id"]) if isinstance(r.get("replica_id"), list) else (r.get("replica_id"),),
            factory=r.get("build_fn") if r["kind"] == "factory" else None,
            allow_shape_mismatch=bool(shape_src.get("allow_shape_mismatch", False)),
            backlink=r.get("gtp_dequant_src")))
    return out


def adam_config_from_groups(groups: Sequence[Mapping[str, Any]], keys: Sequence[Sequence[str]],
                            extra: Mapping[str, Any] | None = None) -> "AdamConfig":
    """`AdamConfig` from Megatron's optimizer param groups and the logical keys in each.

    The effective values are what the groups hold (the scheduler writes `lr = base·lr_mult` and
    `weight_decay = base·wd_mult`): the base lr / weight decay come from groups with multiplier 1;
    keys in groups whose effective weight decay is 0 are `no_decay`; lr multipliers ≠ 1 are kept.

    >>> g = [dict(lr=0.01, betas=[0.9, 0.95], eps=1e-8, weight_decay=0.1, wd_mult=1.0, lr_mult=1.0),
    ...      dict(lr=0.01, betas=[0.9, 0.95], eps=1e-8, weight_decay=0.0, wd_mult=0.0, lr_mult=1.0)]
    >>> c = adam_config_from_groups(g, [["w"], ["b"]])
    >>> c.lr, c.betas, c.weight_decay, c.no_decay
    (0.01, (0.9, 0.95), 0.1, ('b',))
    """
    from bridge.live.api import AdamConfig

    if not groups:
        raise BridgeError("the optimizer has no parameter groups")
    betas = {tuple(float(b) for b in g.get("betas", (0.9, 0.999))) for g in groups}
    eps = {float(g.get("eps", 1e-8)) for g in groups}
    if len(betas) != 1 or len(eps) != 1:
        raise BridgeError(f"optimizer param groups disagree on betas {sorted(betas)} or eps {sorted(eps)}; "
                          "the logical checkpoint records one Adam configuration")
    base = [g for g in groups if float(g.get("lr_mult", 1.0)) == 1.0] or list(groups)
    lr = float(base[0]["lr"])
    wd_base = [g for g in groups if float(g.get("wd_mult", 1.0)) == 1.0 and float(g.get("weight_decay", 0)) > 0]
    wd = float(wd_base[0]["weight_decay"]) if wd_base else max(float(g.get("weight_decay", 0.0)) for g in groups)
    no_decay: set[str] = set()
    lr_mult: dict[str, float] = {}
    for g, ks in zip(groups, keys):
        if float(g.get("weight_decay", 0.0)) == 0.0:
            no_decay.update(ks)
        m = float(g.get("lr_mult", 1.0))
        if m != 1.0:
            lr_mult.update({k: m for k in ks})
    return AdamConfig(lr=lr, betas=next(iter(betas)), eps=next(iter(eps)), weight_decay=wd,
                      no_decay=tuple(sorted(no_decay)), lr_mult=lr_mult, extra=dict(extra or {}))


def merge_adam_configs(configs: Sequence["AdamConfig"]) -> "AdamConfig":
    """One `AdamConfig` for the whole run from each pipeline stage's (each stage's optimizer sees
    only its own parameters): no-decay keys and lr multipliers are united, the rest must agree.
    A stage holding only no-decay parameters reports weight decay 0; it does not count.

    >>> from bridge.live.api import AdamConfig
    >>> c = merge_adam_configs([AdamConfig(0.01, weight_decay=0.1, no_decay=("a",)),
    ...                         AdamConfig(0.01, weight_decay=0.0, no_decay=("b",), lr_mult={"c": 2.0})])
    >>> c.weight_decay, c.no_decay, dict(c.lr_mult)
    (0.1, ('a', 'b'), {'c': 2.0})
    """
    if not configs:
        raise BridgeError("no optimizer configuration to merge")
    first = configs[0]
    for c in configs[1:]:
        for f in ("lr", "betas", "eps", "clip_grad"):
            if getattr(c, f) != getattr(first, f):
                raise BridgeError(f"pipeline stages disagree on the optimizer's {f} ({getattr(first, f)} vs "
                                  f"{getattr(c, f)}); the logical checkpoint records one Adam configuration")
    wds = sorted({float(c.weight_decay) for c in configs if c.weight_decay})
    if len(wds) > 1:
        raise BridgeError(f"pipeline stages disagree on the weight decay {wds}; the logical checkpoint records one")
    lr_mult: dict[str, float] = {}
    for c in configs:
        for k, v in c.lr_mult.items():
            if lr_mult.setdefault(k, float(v)) != float(v):
                raise BridgeError(f"{k}: pipeline stages give lr multipliers {lr_mult[k]} and {v}")
    return replace(first, weight_decay=wds[0] if wds else 0.0, lr_mult=lr_mult,
                   no_decay=tuple(sorted({k for c in configs for k in c.no_decay})))


def pipeline_adam_config(adam: "AdamConfig", group: Any = None) -> "AdamConfig":
    """`merge_adam_configs` over every rank of `group` (collective; None: the world): at PP > 1
    each rank's optimizer knows only its stage's no-decay keys and lr multipliers."""
    import json

    import torch.distributed as dist

    mine = json.dumps({"lr": adam.lr, "betas": list(adam.betas), "eps": adam.eps, "weight_decay": adam.weight_decay,
                       "no_decay": list(adam.no_decay), "lr_mult": dict(adam.lr_mult), "clip_grad": adam.clip_grad})
    got: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(got, mine, group=group)
    configs = []
    for g in got:
        d = json.loads(g)
        configs.append(replace(adam, lr=d["lr"], betas=tuple(d["betas"]), eps=d["eps"], weight_decay=d["weight_decay"],
                               no_decay=tuple(d["no_decay"]), lr_mult=d["lr_mult"], clip_grad=d["clip_grad"]))
    return merge_adam_configs(configs)


def common_step(steps: Iterable[int | float], where: str = "optimizer") -> int:
    """The one completed-step count all optimizer groups / states agree on.

    >>> common_step([3, 3.0])
    3
    """
    s = {int(x) for x in steps}
    if len(s) > 1:
        raise BridgeError(f"{where}: parameter groups / states disagree on the step count {sorted(s)}")
    return s.pop() if s else 0


# ------------------------------------------------------------------------------------------------
# Live side (torch + megatron, imported lazily)


def _unwrap(m: Any) -> Any:
    """The innermost module under DDP / Float16Module wrappers (`.module` chain)."""
    while hasattr(m, "module") and not hasattr(m, "decoder") and not hasattr(m, "embedding"):
        m = m.module
    return m


def _chunks(model: Any) -> list[Any]:
    """The unwrapped model chunks: Megatron's `model` list (one per virtual stage) or one model."""
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    if not chunks:
        raise BridgeError("an empty model list was passed; pass Megatron's `model` (a module or its list of chunks)")
    return [_unwrap(m) for m in chunks]


def _clip_grad(optimizer: Any) -> float | None:
    """The run's global-norm clipping threshold (OptimizerConfig.clip_grad), None if it has none."""
    for opt in _optimizers(optimizer):
        v = getattr(getattr(opt, "config", None), "clip_grad", None)
        if isinstance(v, (int, float)):
            return float(v)
    return None


def _optimizers(optimizer: Any) -> list[Any]:
    opts = list(getattr(optimizer, "chained_optimizers", [optimizer]))
    for o in opts:
        for need in ("_get_model_param_range_map", "_get_main_param_and_optimizer_states", "model_param_gbuf_map"):
            if not hasattr(o, need):
                raise BridgeError(f"optimizer {type(o).__name__} is not a Megatron DistributedOptimizer (no {need}); "
                                  "use --use-distributed-optimizer")
    return opts


def live_layout() -> tuple[ParallelLayout, int]:
    """`ParallelLayout` and this rank, read from Megatron's `parallel_state`."""
    import torch
    from megatron.core import parallel_state as ps

    world = torch.distributed.get_world_size()
    gtp = ps.get_gtp_weight_remat_world_size() if hasattr(ps, "get_gtp_weight_remat_world_size") else 1
    egtp = (ps.get_expert_gtp_weight_remat_world_size()
            if hasattr(ps, "get_expert_gtp_weight_remat_world_size") else 1)
    tp = ps.get_tensor_model_parallel_world_size()
    pp = ps.get_pipeline_model_parallel_world_size()
    cp = ps.get_context_parallel_world_size()
    layout = ParallelLayout(tp=tp, gtp=gtp or 1, cp=cp, pp=pp, dp=world // (tp * (gtp or 1) * cp * pp),
                            ep=ps.get_expert_model_parallel_world_size(),
                            etp=ps.get_expert_tensor_parallel_world_size(), egtp=egtp or 1)
    return layout, torch.distributed.get_rank()


def live_vpp(chunks: Sequence[Any]) -> int:
    """The run's virtual pipeline size (model chunks per stage; 1 without virtual pipeline): from
    `parallel_state`, else (a library run that did not pass it there) the chunks' TransformerConfig."""
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() == 1:
        return 1
    vpp = ps.get_virtual_pipeline_model_parallel_world_size()
    if vpp is None:
        vpp = getattr(getattr(chunks[0], "config", None), "virtual_pipeline_model_parallel_size", None)
    return int(vpp or 1)


def _pad_for_alignment() -> int:
    try:
        from megatron.core.tensor_parallel.generalized_tensor_parallelism import GTP_CONFIG
    except Exception:  # noqa: BLE001 - no GTP in this megatron build
        return 16
    return int(GTP_CONFIG.pad_for_alignment)


def _backlink(t: Any) -> Any:
    for attr in ("_gtp_dequant_src", "gtp_pad_src"):
        src = getattr(t, attr, None)
        if src is not None:
            return src
    return None


def live_entries(inner: Any, metadata: Mapping[str, Any] | None = None) -> tuple[list[EntryRecord], dict[str, Any]]:
    """Model `EntryRecord`s of a live model, and each entry's data tensor by entry name."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    params = {id(p): n for n, p in inner.named_parameters()}
    sd = inner.sharded_state_dict(metadata=dict(metadata or {}))
    out, data = [], {}
    for name, x in sd.items():
        if isinstance(x, ShardedTensorFactory):
            built = x.build()
            subs = [v for v in (built.values() if isinstance(built, dict) else built) if isinstance(v, ShardedTensor)]
            if not subs:
                raise BridgeError(f"factory {x.key} built no ShardedTensor")
            t, st, factory = x.data, subs[0], getattr(x.build_fn, "__qualname__", repr(x.build_fn))
            shape, sections = split_factory(x.key, [(v.key, v.global_shape, v.prepend_axis_num) for v in subs])
        elif isinstance(x, ShardedTensor):
            t, st, factory = x.data, x, None
            shape, sections = tuple(x.global_shape), ()
        else:
            continue
        src = _backlink(t) if t is not None else None
        if src is None and hasattr(x, "gtp_pad_src"):
            src = getattr(x, "gtp_pad_src")
        backlink = None
        if src is not None:
            backlink = params.get(id(src))
            if backlink is None:
                raise BridgeError(f"model entry {x.key}: its backlink points at a tensor that is no parameter of the model")
        rid = x.replica_id if isinstance(x.replica_id, tuple) else (x.replica_id,)
        out.append(EntryRecord(name, x.key, shape, tuple(st.global_offset), int(st.prepend_axis_num),
                               tuple(int(r) for r in rid), factory, bool(st.allow_shape_mismatch), backlink,
                               sections))
        data[name] = t
    return out, data


def live_param_record(name: str, p: Any) -> ParamRecord:
    """`ParamRecord` of a live parameter from Megatron's attributes."""
    return ParamRecord(name, tuple(p.shape), bool(getattr(p, "tensor_model_parallel", False)),
                       int(getattr(p, "partition_dim", -1)), bool(getattr(p, "is_gtp_weight_remat", False)),
                       int(getattr(p, "pad_length", 0) or 0))


def _check_alias(name: str, entry: Any, p: Any, rank: int) -> None:
    """A non-backlinked entry must alias its parameter's live memory (a view, not a copy)."""
    if entry is p:
        return
    ptr, start = entry.data_ptr(), p.data_ptr()
    if entry.dtype != p.dtype or not start <= ptr < start + p.numel() * p.element_size():
        raise BridgeError(f"rank {rank}: model entry of {name} is a copy, not a view of the live parameter, and carries "
                          "no _gtp_dequant_src / gtp_pad_src backlink; cannot bind its optimizer state")


def local_params(model: Any, optimizer: Any, *, metadata: Mapping[str, Any] | None = None,
                 dims: ModelDims | None = None, pad_for_alignment: int | None = None,
                 group: Any = None, extra: Mapping[str, Any] | None = None,
                 for_export: bool = False) -> tuple[list["LocalParam"], "LiveRun"]:
    """This rank's `LocalParam`s (live tensors, filled in place on reload) and `LiveRun`.

    `model` is the (DDP / Float16Module wrapped) GPT model or Megatron's list of model chunks (with
    virtual pipeline, one per virtual stage, all of them);
    `optimizer` the Megatron optimizer (DistributedOptimizer or ChainedOptimizer of them).
    `for_export` leaves out TP / GTP replica copies Megatron would not write (module docstring).
    """
    import torch

    from bridge.live.api import LiveRun, OptimFragment
    from bridge.live.fp8 import bind_optimizer_state

    layout, rank = live_layout()
    chunks = _chunks(model)
    dims = dims or ModelDims.from_config(chunks[0].config)
    pad = _pad_for_alignment() if pad_for_alignment is None else pad_for_alignment
    # Per chunk: parameters (local names repeat across virtual chunks), entries and their data.
    named_c = [dict(inner.named_parameters()) for inner in chunks]
    live_c = [live_entries(inner, metadata) for inner in chunks]
    per_chunk = map_chunks([(entries, [live_param_record(n, p) for n, p in named.items()])
                            for named, (entries, _d) in zip(named_c, live_c)],
                           layout, dims, pad, rank, live_vpp(chunks))
    # (chunk, mapping) pairs, in chunk order: one LocalParam each.
    mappings = [(v, m) for v, maps in enumerate(per_chunk) for m in maps]

    # Optimizer fragments keyed by the live parameter object (what the DistributedOptimizer indexes).
    pairs, groups, group_keys, steps = [], [], [], []
    key_of = {id(named_c[v][m.param]): m.key for v, m in mappings}
    for opt in _optimizers(optimizer):
        for p in opt.model_param_gbuf_map:
            if id(p) not in key_of:
                raise BridgeError(f"rank {rank}: the optimizer holds a parameter of shape {tuple(p.shape)} that is not "
                                  "in the model passed; pass the model the optimizer was built for (with virtual "
                                  "pipeline: every chunk of Megatron's `model` list)")
            r = opt._get_model_param_range_map(p)["param"]
            st = opt._get_main_param_and_optimizer_states(p)
            for need in ("param", "exp_avg", "exp_avg_sq"):
                if need not in st:
                    raise BridgeError(f"rank {rank}: {key_of[id(p)]}: optimizer state has no {need!r} (Adam expected)")
            pairs.append((p, OptimFragment(int(r.start), int(r.end), st["param"], st["exp_avg"], st["exp_avg_sq"])))
            if "step" in st:
                steps.append(float(st["step"]))
        name_of = {id(p): key_of.get(id(p)) for p in opt.model_param_gbuf_map}
        for gi, g in enumerate(opt.optimizer.param_groups):
            groups.append({k: v for k, v in g.items() if k != "params"})
            group_keys.append([])
            if "step" in g:
                steps.append(float(g["step"]))
        for p, (gi, _go) in opt.model_param_group_index_map.items():
            if name_of.get(id(p)):
                group_keys[len(groups) - len(opt.optimizer.param_groups) + gi].append(name_of[id(p)])

    bind_entries, dequantized = [], set()
    by_entry = [{e.name: e for e in entries} for entries, _d in live_c]
    for v, m in mappings:
        e, t, p = by_entry[v][m.entry], live_c[v][1][m.entry], named_c[v][m.param]
        if e.backlink is None:
            _check_alias(m.param, t, p, rank)
            bind_entries.append((m.key, m.geometry, p))
        elif getattr(t, "_gtp_dequant_src", None) is not None:
            bind_entries.append((m.key, m.geometry, t))  # FP8: the bf16 copy binds through its backlink
            dequantized.add((v, m.param))
        else:
            bind_entries.append((m.key, m.geometry, p))  # trimmed GTP view (gtp_pad_src): the live shard
    out = bind_optimizer_state(bind_entries, pairs)
    for lp, (v, m) in zip(out, mappings):
        lp.index = m.index
        if (v, m.param) in dequantized:
            if not for_export:
                raise BridgeError(f"rank {rank}: {m.param} is a native FP8 parameter; the Megatron adapter loads "
                                  "into bf16 parameters only (reload the checkpoint into a bf16 run)")
            lp.weight = live_c[v][1][m.entry]  # export the dequantized bf16 copy, as Megatron's checkpoint does
    if for_export:
        out = [lp for lp, (_v, m) in zip(out, mappings) if m.model_parallel_main]
    step = common_step([int(s) for s in steps], f"rank {rank} optimizer")
    adam = replace(adam_config_from_groups(groups, group_keys), clip_grad=_clip_grad(optimizer))
    run = LiveRun(layout=layout, rank=rank, step=step, optimizer=adam, group=group,
                  device=torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None,
                  extra={"megatron_adapter": {"pad_for_alignment": pad}, **dict(extra or {})})
    return out, run


def _check_order(fn: str, dst: Any, model: Any, optimizer: Any) -> None:
    """A clear error for the old argument order `fn(model, optimizer, path)`."""
    if not isinstance(dst, (str, os.PathLike)):
        old = " (the old order: model, optimizer, path)" if isinstance(optimizer, (str, os.PathLike)) else ""
        raise BridgeError(f"{fn}: the checkpoint path comes first, like export_state / reload_state: "
                          f"{fn}(path, model, optimizer){old}")


def export_megatron(dst: str, model: Any, optimizer: Any, options: "ExportOptions | None" = None, *,
                    exporter: "Exporter | None" = None, on_stage: Callable[[str], None] | None = None,
                    metadata: Mapping[str, Any] | None = None, dims: ModelDims | None = None,
                    pad_for_alignment: int | None = None, group: Any = None,
                    extra: Mapping[str, Any] | None = None) -> "ExportReport":
    """Write the logical checkpoint of a live Megatron run to `dst` (collective over `group`'s ranks).

    As `bridge.live.export.export_state(dst, run, params, options, *, exporter, on_stage)`, with the
    live model and optimizer in place of `run` and `params`: `options` (`ExportOptions`) say how to
    write, `exporter` (`Exporter`) keeps the plan for the next export. The adapter's own keywords:
    `metadata` (the model's `sharded_state_dict` metadata), `dims` (qkv head layout; default from the
    model's config), `pad_for_alignment` (default: the run's), `group` (process group; None: the
    world), `extra` (recorded in the manifest). At PP > 1 every stage calls it with its own model
    chunk (virtual pipeline: its list of chunks) and optimizer; the stages' optimizer settings are
    merged (`pipeline_adam_config`).
    """
    from bridge.live.export import export_state

    params, run = _export_input("export_megatron", dst, model, optimizer, metadata, dims, pad_for_alignment, group,
                                extra)
    return export_state(dst, run, params, options, exporter=exporter, on_stage=on_stage)


def export_megatron_async(dst: str, model: Any, optimizer: Any, options: "ExportOptions | None" = None, *,
                          exporter: "Exporter | None" = None, on_stage: Callable[[str], None] | None = None,
                          on_commit: Callable[[str], None] | None = None, metadata: Mapping[str, Any] | None = None,
                          dims: ModelDims | None = None, pad_for_alignment: int | None = None, group: Any = None,
                          extra: Mapping[str, Any] | None = None) -> "ExportHandle":
    """`export_megatron` that returns once this rank's state is in host memory; an `ExportHandle`.

    As `bridge.live.export.Exporter.export_async`: the writes and the commit run in the background
    while training continues; pass the same `exporter` every time (it keeps the pinned staging slots
    and waits for the export in flight). For a training loop, `converters.megatron.live.async_save.AsyncSave`
    wraps it with Megatron-LM's run directory, tracker file and per-step finalize.
    """
    from bridge.live.export import Exporter

    params, run = _export_input("export_megatron_async", dst, model, optimizer, metadata, dims, pad_for_alignment,
                                group, extra)
    return (exporter or Exporter()).export_async(dst, run, params, options, on_stage=on_stage, on_commit=on_commit)


def _export_input(fn: str, dst: str, model: Any, optimizer: Any, metadata: Mapping[str, Any] | None,
                  dims: ModelDims | None, pad_for_alignment: int | None, group: Any,
                  extra: Mapping[str, Any] | None) -> tuple[list["LocalParam"], "LiveRun"]:
    """The exporter's input for a live Megatron model + optimizer (the stages' Adam settings merged at PP > 1)."""
    _check_order(fn, dst, model, optimizer)
    params, run = local_params(model, optimizer, for_export=True, metadata=metadata, dims=dims,
                               pad_for_alignment=pad_for_alignment, group=group, extra=extra)
    if run.layout.pp > 1:
        run = replace(run, optimizer=pipeline_adam_config(run.optimizer, group))
    return params, run


def _ensure_optimizer_state(optimizer: Any) -> None:
    """Allocate Adam moments where a fresh optimizer has none yet (they are filled in place)."""
    import torch

    for opt in _optimizers(optimizer):
        inner = opt.optimizer
        for g in inner.param_groups:
            for p in g["params"]:
                st = inner.state[p]
                if "exp_avg" not in st:
                    st["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                    st["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                    if isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
                        st["step"] = torch.zeros((), dtype=torch.float32)


def _set_step(optimizer: Any, step: int) -> None:
    import torch

    for opt in _optimizers(optimizer):
        inner = opt.optimizer
        for g in inner.param_groups:
            if "step" in g or not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
                g["step"] = int(step)
            for p in g["params"]:
                st = inner.state.get(p, {})
                if isinstance(st.get("step"), torch.Tensor):
                    st["step"].fill_(float(step))


def load_megatron(src: str, model: Any, optimizer: Any, *,
                  metadata: Mapping[str, Any] | None = None, dims: ModelDims | None = None,
                  pad_for_alignment: int | None = None, group: Any = None, extra: Mapping[str, Any] | None = None,
                  budget: int | None = None, inflight_bytes: int | None = None) -> "ReloadResult":
    """Fill a live Megatron model + DistributedOptimizer (any layout) from the logical checkpoint `src`.

    Each rank reads only the boxes of its own shards and fragments (`bridge.live.reload`). The
    bf16 weights, fp32 masters and moments are written in place; the step is set on every group /
    state. Training continues as after Megatron's own load. Arguments as `export_megatron`'s, and
    `budget` (and its deprecated former name `inflight_bytes`) as `bridge.live.reload.reload_state`'s.
    """
    from bridge.live.reload import reload_state

    _check_order("load_megatron", src, model, optimizer)
    _ensure_optimizer_state(optimizer)
    params, run = local_params(model, optimizer, metadata=metadata, dims=dims, pad_for_alignment=pad_for_alignment,
                               group=group, extra=extra)
    budget = renamed("load_megatron", "inflight_bytes", "budget", inflight_bytes, budget)
    result = reload_state(src, run, params, budget=budget)
    _set_step(optimizer, result.step)
    return result
