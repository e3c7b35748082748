"""The entries of a `torch_dist` checkpoint that are not tensors, as Megatron-LM's loader reads them:
`common_state` (the run's `args`, iteration, optimizer param groups, the scheduler's state), the
`_extra_state` objects of the linears, and the param groups of each chained optimizer (`optimizer_domains`).
"""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from bridge.format.manifest import Manifest, MegatronRecord, check_hyperparameters
from bridge.layout.parallel import ParallelLayout
from converters.megatron.plan.convert_plan import PipelineSplit
from converters.megatron.plan.naming import convention_key
from converters.megatron.plan.write_plan import ParamSpec

if TYPE_CHECKING:
    from converters.megatron.write.torch_dist import MegatronTarget


def optimizer_domains(params: Sequence[ParamSpec], lay: ParallelLayout) -> list[tuple[bool, list[ParamSpec]]]:
    """(expert?, params) per chained optimizer: dense first, experts last when EP > 1."""
    opt = [p for p in params if p.optimized]
    if lay.ep > 1 and any(p.geom.expert for p in opt):
        return [(False, [p for p in opt if not p.geom.expert]), (True, [p for p in opt if p.geom.expert])]
    return [(False, opt)]


def param_groups(man: Manifest, step: int, built: dict | None = None) -> list[dict]:
    """Megatron param groups (identifier keys + hyper-parameters) with `step` set. With scheduler state
    `built`, the default groups' `max_lr` / `min_lr` are its (the loading run's `--lr` / `--min-lr`, as
    its own `_get_param_groups` sets them, and as a Megatron source's groups already hold): 0.19.2 matches
    the checkpoint's groups to the run's by them (`param_group_identifier_keys`: KeyError otherwise)."""
    saved = man.megatron.param_groups if man.megatron else None
    flat = [dict(g) for gs in (saved or []) for g in gs]
    if not flat:
        o = man.optimizer.with_defaults()
        lr = o.lr if o.lr is not None else 0.0
        base = {"wd_mult": 1.0, "lr_mult": 1.0, "is_expert_parallel": False, "is_decoupled_lr": False,
                "default_config": True, "max_lr": lr, "min_lr": lr, "lr": lr, "betas": o.betas,
                "eps": o.eps, "weight_decay": o.weight_decay}
        flat = [base, dict(base, wd_mult=0.0, weight_decay=0.0 if o.no_decay else o.weight_decay)]
    out = []
    for i, g in enumerate(flat):
        g = {k: (tuple(v) if k == "betas" and isinstance(v, list) else v) for k, v in g.items()
             if k not in ("params", "num_params", "optimizer")}  # foreign: torch group keys
        check_hyperparameters(f"recorded Megatron param group {i}", lr=g.get("lr"), betas=g.get("betas"),
                              eps=g.get("eps"), weight_decay=g.get("weight_decay"))
        # An int: TransformerEngine's FusedAdam passes the group step to its kernel, which refuses a
        # float (seen with TE 2.20 after loading a float step); torch Adam's load path takes either.
        g["step"] = int(step)  # foreign: torch group key
        if built is not None and g.get("default_config", True):
            g.update(max_lr=built["max_lr"], min_lr=built["min_lr"])
        out.append(g)
    return out


def groups_for(groups: list[dict], expert: bool, chained: bool) -> list[dict]:
    """Groups of one chained optimizer (expert flag set), unique by Megatron's identifier keys."""
    out, seen = [], set()
    for g in groups:
        g = dict(g, is_expert_parallel=expert) if chained else dict(g)
        key = json.dumps({k: g.get(k) for k in sorted(g) if k != "step"},  # foreign: torch group key
                         sort_keys=True, default=str)
        if key not in seen:
            seen.add(key)
            out.append(g)
    return out


def megatron_args(meg: MegatronRecord, params: Sequence[ParamSpec], lay: ParallelLayout, fmt: str, step: int,
                  split: PipelineSplit | None = None) -> dict:
    """`common_state["args"]` for the target: the source's args, model dims the geometry shows when
    the source saved none, and everything Megatron-LM 0.19.2 reads back about the layout set to it.

    `load_checkpoint` compares num_layers / hidden_size / num_attention_heads (no default: they must
    be present), uses tensor/pipeline sizes, world_size and data_parallel_size to decide whether RNG
    and rerun state are loaded, and `load_args_from_checkpoint` may take the parallel sizes from here.
    """
    args = dict(meg.args or {})
    for p in params:  # model dims the fused section tables know (a library-style source saved no args)
        spec = p.geom.fused
        if spec is None:
            continue
        if spec.info.get("name") == "qkv":
            args.setdefault("num_attention_heads", spec.info["num_heads"])
            args.setdefault("num_query_groups", spec.info["num_query_groups"])
            args.setdefault("kv_channels", spec.info["head_dim"])
            args.setdefault("group_query_attention", spec.info["num_query_groups"] != spec.info["num_heads"])
        elif spec.info.get("name") == "swiglu" and not p.geom.expert:
            args.setdefault("swiglu", True)
            args.setdefault("ffn_hidden_size", spec.info["ffn_hidden"])
    by_name = {p.name: p.geom for p in params}
    layers = [g.prepend[0] for n, g in by_name.items() if n.startswith("decoder.layers.") and g.prepend]
    if layers:
        args.setdefault("num_layers", max(layers))
    emb = by_name.get("embedding.word_embeddings.weight")
    if emb is not None and len(emb.shape) == 2:
        args.setdefault("padded_vocab_size", emb.shape[0])
        args.setdefault("hidden_size", emb.shape[1])
    experts = [g.prepend[1] for g in by_name.values() if g.expert and len(g.prepend) >= 2]
    if experts:
        args.setdefault("num_experts", max(experts))
    recorded_iteration = meg.iteration
    gbs = args.get("global_batch_size")
    if recorded_iteration != step and isinstance(gbs, int) and not args.get("rampup_batch_size"):
        # Trained elsewhere since the source save: the data position follows the step.
        args["consumed_train_samples"] = step * gbs
    args.update(tensor_model_parallel_size=lay.tp, pipeline_model_parallel_size=lay.pp,
                virtual_pipeline_model_parallel_size=None, num_layers_per_virtual_pipeline_stage=None,
                context_parallel_size=1, gtp_weight_remat_size=lay.gtp,
                tensor_parallel_num_weight_shards=lay.tp * lay.gtp, expert_model_parallel_size=lay.ep,
                expert_tensor_parallel_size=lay.etp, expert_gtp_weight_remat_size=lay.egtp,
                expert_tensor_parallel_num_weight_shards=lay.etp * lay.egtp, data_parallel_size=lay.dp,
                world_size=lay.world, iteration=step, ckpt_format="torch_dist", use_dist_ckpt=True,
                dist_ckpt_optim_fully_reshardable=fmt == "fully_reshardable", use_distributed_optimizer=True,
                no_save_optim=False,
                # No RNG state is written (a logical checkpoint has none). With no_save_rng set,
                # load_checkpoint skips the RNG load at an unchanged TP/PP instead of failing on it.
                no_save_rng=True)
    # the target's pipeline split and whether the output layer is tied (Megatron-LM builds the model from these)
    args.update((split or PipelineSplit(pp=lay.pp)).to_args())
    return args


def common_objects(man: Manifest, params: Sequence[ParamSpec], lay: ParallelLayout, target: MegatronTarget,
             step: int, sched: dict | None = None) -> list[tuple[str, Any]]:
    """_extra_state objects (None, or TE's empty uint8 tensors, as the source saved them) and common_state."""
    import torch

    out: list[tuple[str, Any]] = []
    meg = man.megatron or MegatronRecord()
    extra_keys = list(meg.extra_state_keys or [])
    if not extra_keys:  # synthesise the keys a run would save for its linears (per stacked instance)
        seen = set()
        for p in params:
            mod = p.name.rsplit(".", 1)[0]
            if p.name.endswith(".weight") and p.geom.tp_kind in ("column", "row") and mod not in seen:
                seen.add(mod)
                for index in np.ndindex(*p.geom.prepend) if p.geom.prepend else [()]:
                    off = ".".join(str(i) for i in index) if index else "0"
                    shp = ".".join(str(n) for n in p.geom.prepend) if index else "1"
                    extra_keys.append(f"{mod}._extra_state/shard_{off}_{shp}")
    empty = meg.extra_state_payload == "empty_uint8_tensor"
    for k in extra_keys:  # recorded as the source saved them (wrapped or not): in the target's convention
        out.append((convention_key(k, target.key_convention), torch.empty(0, dtype=torch.uint8) if empty else None))
    domains = optimizer_domains(params, lay)
    chained = len(domains) > 1
    groups = param_groups(man, step, sched)
    args = megatron_args(meg, params, lay, target.fmt, step, target.split(params, meg))
    content = {"distrib_optim_sharding_type": target.fmt, "singleton_local_shards": False,
               "chained_optim_avoid_prefix": True}
    if target.fmt == "fully_reshardable":
        per = [{"optimizer": {"param_groups": groups_for(groups, ex, chained)},
                "param_state_sharding_type": target.fmt} for ex, _ in domains]
        optimizer: Any = per[0] if not chained else {i: s for i, s in enumerate(per)}
    else:
        optimizer = ({"param_state_sharding_type": target.fmt} if not chained else
                     {i: {"param_state_sharding_type": target.fmt} for i in range(len(domains))})
    common = {"args": argparse.Namespace(**args), "checkpoint_version": 3.0, "iteration": step,
              "optimizer": optimizer, "content_metadata": content}
    if sched is not None:  # Megatron-LM's load_checkpoint needs it to load the optimizer (KeyError otherwise)
        common["opt_param_scheduler"] = sched
    out.append(("common_state/shard_0_1", common))
    return out
