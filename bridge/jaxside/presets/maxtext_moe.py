"""The `maxtext` preset's mixture-of-experts half: which Megatron MoE runs MaxText's MoE blocks express.

MaxText 0.2.5 has two llama-style MoE decoder blocks whose routed experts are `moe.RoutedMoE`
(parameters `gate/kernel` (E, X), `wi_0` / `wi_1` (X, E F), `wo` (X, F, E); scanned: the layer axis
at position 1):

- `qwen3_moe` (module `moe_block`): the qwen2 attention (the 1/sqrt(D) score factor applied in the
  attention, `use_qk_norm=false`), so nothing is folded: the state is carried over exactly;
- `mixtral` (module `MoeBlock_0`): the llama2 attention (the factor folded into the query kernel,
  see `maxtext.Options`).

Routing in both (`RoutedMoE.get_topk`, neither a DeepSeek nor a llama4 block): the top-k of the
router logits, then a softmax over those k logits. That is Megatron's default top-k router
(`moe_router_pre_softmax=False`, score function softmax), dropless (`capacity_factor=-1`).
Megatron MoE features with no MaxText counterpart in these blocks are refused in one line naming
them (`check_moe_args`): shared experts, pre-softmax / sigmoid routers, expert bias, group-limited
routing, a top-k scaling factor, token dropping, dense layers between MoE layers, auxiliary / z losses
(MaxText's load-balance loss is not shown equal to Megatron's; a run trained with one would not continue
the same way).
"""

from __future__ import annotations

from typing import Any, Mapping

from bridge.errors import BridgeError

#: MaxText MoE decoder block -> the name of its routed-experts module in the parameter tree
MOE_MODULES: dict[str, str] = {"qwen3_moe": "moe_block", "mixtral": "MoeBlock_0"}
#: the MoE block used when none is named: exact (no query-scale fold)
DEFAULT_MOE_BLOCK = "qwen3_moe"

#: the logical router of a layer-stacked MoE tree (layers, experts, hidden)
ROUTER = ("decoder", "layers", "mlp", "router", "weight")
_ZERO = (None, 0, 0.0, False, "", "none", "None")

# Megatron-LM argument -> (the value(s) MaxText's routed-experts block agrees with, what it is)
_MUST_BE: tuple[tuple[str, tuple, str], ...] = (
    ("moe_shared_expert_intermediate_size", _ZERO, "shared experts (MaxText's qwen3_moe / mixtral blocks have none)"),
    ("moe_router_pre_softmax", _ZERO, "a pre-softmax router (MaxText softmaxes the k chosen logits)"),
    ("moe_router_score_function", (None, "softmax"), "a non-softmax router score function"),
    ("moe_router_enable_expert_bias", _ZERO, "a router expert bias (aux-loss-free balancing)"),
    ("moe_router_num_groups", _ZERO, "group-limited routing"),
    ("moe_router_group_topk", _ZERO, "group-limited routing"),
    ("moe_router_topk_scaling_factor", _ZERO + (1, 1.0), "a top-k scaling factor"),
    ("moe_expert_capacity_factor", _ZERO, "token dropping (an expert capacity factor)"),
    ("moe_z_loss_coeff", _ZERO, "a router z-loss"),
    ("moe_aux_loss_coeff", _ZERO, "an auxiliary load-balancing loss (not shown equal to MaxText's)"),
    ("moe_input_jitter_eps", _ZERO, "router input jitter"),
)


def moe_module(decoder_block: str) -> str:
    """The routed-experts module name of an MoE decoder block.

    >>> moe_module("qwen3_moe"), moe_module("mixtral")
    ('moe_block', 'MoeBlock_0')
    """
    if decoder_block not in MOE_MODULES:
        raise BridgeError(f"decoder block {decoder_block!r} has no routed experts; use one of {list(MOE_MODULES)}")
    return MOE_MODULES[decoder_block]


def block_of_module(module: str) -> str:
    """The MoE decoder block whose tree holds `module` (the inverse of `moe_module`)."""
    return {m: b for b, m in MOE_MODULES.items()}[module]


def check_block(experts: int, decoder_block: str) -> None:
    """Refuse a dense decoder block for an MoE model and an MoE block for a dense one (one line each)."""
    if experts and decoder_block not in MOE_MODULES:
        raise BridgeError(f"the model has {experts} routed experts; MaxText's {decoder_block} decoder block has none: "
                          f"use --decoder-block qwen3_moe (exact) or mixtral (query scale folded)")
    if not experts and decoder_block in MOE_MODULES:
        raise BridgeError(f"the model is dense; MaxText's {decoder_block} decoder block routes to experts: use "
                          f"--decoder-block qwen2 (exact) or llama2")


def check_moe_args(args: Mapping[str, Any]) -> None:
    """Refuse Megatron MoE settings MaxText's routed-experts blocks cannot express (names the setting)."""
    if not args.get("num_experts"):
        return
    for key, ok, what in _MUST_BE:
        if args.get(key) not in ok:
            raise BridgeError(f"source model uses {what} ({key}={args[key]!r}); the maxtext preset carries routed "
                              f"top-k softmax experts only")
    freq = args.get("moe_layer_freq", 1)
    if freq not in (None, 1) and not (isinstance(freq, list) and all(f == 1 for f in freq)):
        raise BridgeError(f"source model mixes dense and MoE layers (moe_layer_freq={freq!r}); the maxtext preset "
                          f"needs every layer an MoE layer")


def topk_of(args: Mapping[str, Any], experts: int) -> int:
    """Megatron's `moe_router_topk` for an MoE model of `experts` experts (checked in [1, experts]).

    >>> topk_of({"moe_router_topk": 2}, 4)
    2
    """
    k = args.get("moe_router_topk")
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= experts:
        raise BridgeError(f"experts per token {k!r} for {experts} experts: the maxtext preset needs the source's "
                          f"moe_router_topk in 1..{experts} (recorded in its args, or --num-experts-per-tok)")
    return k


def logical_topk(shapes: Mapping[tuple[str, ...], tuple[int, ...]], args: Mapping[str, Any], given: int = 0) -> int:
    """Experts per token of a logical tree: 0 when dense (no router), else `given` (a flag) or Megatron's
    recorded `moe_router_topk` (checked against the router's expert count and each other: one line)."""
    router = shapes.get(ROUTER)
    if router is None:
        if given:
            raise BridgeError(f"--num-experts-per-tok {given}: the logical checkpoint is a dense model "
                              f"(no {'/'.join(ROUTER)})")
        return 0
    if len(router) != 3:
        raise BridgeError(f"logical array {'/'.join(ROUTER)} has shape {tuple(router)}; a layer-stacked router "
                          f"is (layers, experts, hidden)")
    recorded = args.get("moe_router_topk")
    if given and recorded is not None and given != recorded:
        raise BridgeError(f"--num-experts-per-tok {given}: the source run records moe_router_topk={recorded!r}")
    return topk_of({"moe_router_topk": given or recorded}, router[1])


def moe_overrides(experts: int, topk: int, ffn: int) -> dict[str, Any]:
    """MaxText config overrides for `experts` routed experts of hidden size `ffn`, top-`topk` softmax
    routing, dropless (mixtral sizes its experts by `base_mlp_dim`, qwen3_moe by `base_moe_mlp_dim`).

    >>> moe_overrides(4, 2, 40)["num_experts_per_tok"]
    2
    """
    # routed_score_func stays at its default "" (softmax): an empty value on the command line parses as None
    return {"num_experts": experts, "num_experts_per_tok": topk, "base_moe_mlp_dim": ffn, "capacity_factor": -1.0,
            "load_balance_loss_weight": 0.0, "routed_bias": False,
            "norm_topk_prob": False, "interleave_moe_layer_step": 1}
