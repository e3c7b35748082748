"""Megatron-Core parameter naming: wrapper prefixes, routed experts, stacked axes, module components
and the TP kind / GTP sharding they imply.

The one place the converters read meaning out of a Megatron key. Wrapper stripping itself lives
in the core (`bridge.format.tree`), because the live exporter needs it too and the core never
imports `converters`; it is re-exported here so Megatron code has one naming module to import.
"""

from __future__ import annotations

import re

from bridge.errors import BridgeError
from bridge.format.tree import WRAPPER_PREFIXES as WRAPPERS
from bridge.format.tree import megatron_key_to_path, path_to_name, strip_wrappers

__all__ = ["WRAPPERS", "COLUMN_MODULES", "ROW_MODULES", "SPLIT_SECTIONS", "split_kind", "strip_wrappers", "logical_key", "is_routed_expert", "module_of",
           "num_prepend_axes", "tp_kind_by_name", "is_gtp_weight", "KEY_CONVENTIONS", "key_prefix", "convention_key",
           "check_one_convention"]


def logical_key(name: str) -> str:
    """`strip_wrappers`, checked to be usable as a tree path (the live adapter's keys become paths).

    >>> logical_key("module.module.decoder.layers.0.mlp.linear_fc1.weight")
    'decoder.layers.0.mlp.linear_fc1.weight'
    >>> logical_key("module.a..b")
    Traceback (most recent call last):
    ...
    bridge.errors.BridgeError: empty tree name component in path ('a', '', 'b'): remove it
    """
    return path_to_name(megatron_key_to_path(name))


def is_routed_expert(name: str) -> bool:
    """Routed-expert parameter (expert buffer, expert grid); shared experts are dense.

    >>> is_routed_expert("decoder.layers.mlp.experts.linear_fc1.weight"), is_routed_expert("decoder.layers.mlp.shared_experts.linear_fc1.weight")
    (True, False)
    """
    return ".experts." in name and ".shared_experts." not in name


def module_of(name: str) -> str:
    """The module component holding a parameter.

    >>> module_of("decoder.layers.mlp.linear_fc1.weight"), module_of("weight")
    ('linear_fc1', '')
    """
    parts = name.split(".")
    return parts[-2] if len(parts) >= 2 else ""


# Megatron module names -> TP kind (megatron-layout.md §2.1). Used when chunks cannot show it
# (a TP=1 source) and to decide what GTP shards.
COLUMN_MODULES = ("linear_qkv", "linear_fc1", "in_proj", "output_layer", "linear_q", "linear_kv",
                  "linear_q_proj", "linear_q_up_proj", "linear_kv_up_proj")
ROW_MODULES = ("linear_proj", "linear_fc2", "out_proj")


#: Fused parameters megatron-core 0.19.2 saves as one key per section (`_split_tensor_factory`,
#: ssm/utils.py): `<key>.<section>`, sections in this order along the TP-split dim 0 (each TP-split
#: separately). Mamba mixer (ssm/mamba_mixer.py) and Gated DeltaNet (ssm/gated_delta_net/common.py).
SPLIT_SECTIONS = {
    "mamba_in_proj": ("z", "x", "B", "C", "dt"),
    "mamba_conv1d": ("x", "B", "C"),
    "gdn_in_proj": ("query", "key", "value", "z", "beta", "alpha"),
    "gdn_conv1d": ("query", "key", "value"),
}

#: SSM parameters TP splits along dim 0 outside linear modules (per head / per channel): Mamba's
#: `A_log`, `dt_bias`, `D`, `conv1d.*`, `mixer.norm.weight`; GDN's `A_log`, `dt_bias`, `conv1d.*`
SSM_TP0_LEAVES = ("A_log", "dt_bias", "D")


def split_kind(sections: "list[str] | tuple[str, ...]") -> str | None:
    """The `SPLIT_SECTIONS` kind whose sections are exactly `sections` (any order), else None.

    >>> split_kind(["dt", "z", "x", "B", "C"]), split_kind(["gate", "up"])
    ('mamba_in_proj', None)
    """
    got = sorted(sections)
    return next((k for k, v in SPLIT_SECTIONS.items() if sorted(v) == got), None)


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


def tp_kind_by_name(name: str) -> str:
    """TP kind from Megatron naming: column / row / vocab / replicated.

    >>> [tp_kind_by_name(n) for n in ("decoder.layers.linear_proj.weight", "decoder.layers.linear_proj.bias", "embedding.word_embeddings.weight")]
    ['row', 'replicated', 'vocab']
    >>> [tp_kind_by_name("decoder.layers.0.mixer." + n) for n in ("A_log", "conv1d.weight", "norm.weight", "in_proj.layer_norm_weight")]
    ['column', 'column', 'column', 'replicated']
    """
    mod, leaf = module_of(name), name.split(".")[-1]
    if mod == "word_embeddings":
        return "vocab"
    if leaf in SSM_TP0_LEAVES or mod == "conv1d" or f".{name}".endswith(".mixer.norm.weight"):
        return "column"   # TP dim 0 (SSM_TP0_LEAVES); never GTP-sharded (not a linear)
    if mod in COLUMN_MODULES and leaf in ("weight", "bias"):
        return "column"
    if mod in ROW_MODULES and leaf == "weight":
        return "row"
    return "replicated"


def is_gtp_weight(name: str) -> bool:
    """Parameters GTP shards in 0.19.2: the `weight` of wrapped linears and the vocab embedding."""
    mod, leaf = module_of(name), name.split(".")[-1]
    return leaf == "weight" and (mod in COLUMN_MODULES or mod in ROW_MODULES or mod == "word_embeddings")


#: to-megatron's key conventions: the prefix of every model key, also inside `optimizer.state.<role>.<key>`.
#: `unwrapped` is what Megatron-LM's `load_checkpoint` builds (`generate_state_dict` over the unwrapped
#: model's `sharded_state_dict()`, as its training loop saves); `wrapped` is a DDP-wrapped model's
#: `sharded_state_dict()` (library users, Megatron-Bridge, NeMo: keys `module.decoder...`).
KEY_CONVENTIONS = {"unwrapped": "", "wrapped": "module."}


def key_prefix(convention: str) -> str:
    """The prefix a convention puts before every model key.

    >>> key_prefix("unwrapped"), key_prefix("wrapped")
    ('', 'module.')
    """
    if convention not in KEY_CONVENTIONS:
        raise BridgeError(f"unknown --key-convention {convention!r}; use one of {list(KEY_CONVENTIONS)}")
    return KEY_CONVENTIONS[convention]


def convention_key(key: str, convention: str) -> str:
    """A model key (a parameter name, or an `_extra_state/shard_<i>_<n>` object key, wrapped or not)
    in `convention`.

    >>> convention_key("module.decoder.layers.mlp.linear_fc1._extra_state/shard_0_2", "unwrapped")
    'decoder.layers.mlp.linear_fc1._extra_state/shard_0_2'
    >>> convention_key("decoder.final_layernorm.weight", "wrapped")
    'module.decoder.final_layernorm.weight'
    """
    head, sep, tail = key.partition("/")
    return key_prefix(convention) + strip_wrappers(head) + sep + tail


#: keys that name no model entry: the common state and the distributed optimizer's per-bucket state
_NOT_MODEL_KEYS = re.compile(r"^(common_state/|(chained_\d+\.)?optimizer\.distributed\.)")
_OPTIMIZER_STATE = re.compile(r"^(chained_\d+\.)?optimizer\.state\.[^.]+\.")


def check_one_convention(keys: "list[str]", convention: str, roots: "set[str]") -> None:
    """Refuse a key set that is not all in `convention`: every model key (and every parameter name
    inside an `optimizer.state.<role>.` key) must be the convention's prefix + an unwrapped key whose
    first component is one of the model's `roots` (e.g. decoder, embedding, output_layer).

    >>> check_one_convention(["decoder.a.weight", "optimizer.state.param.decoder.a.weight", "common_state/shard_0_1"],
    ...                      "unwrapped", {"decoder"})
    >>> check_one_convention(["module.decoder.a._extra_state/shard_0_1"], "unwrapped", {"decoder"})
    Traceback (most recent call last):
    ...
    bridge.errors.BridgeError: key module.decoder.a._extra_state/shard_0_1 is not in the unwrapped key convention (every model key decoder...); to-megatron cannot write one checkpoint with two conventions
    """
    prefix = key_prefix(convention)
    for key in keys:
        if _NOT_MODEL_KEYS.match(key):
            continue
        name = _OPTIMIZER_STATE.sub("", key, count=1)
        rest = name[len(prefix):] if name.startswith(prefix) else None
        if rest is None or strip_wrappers(rest.partition("/")[0]) != rest.partition("/")[0] \
                or rest.split(".", 1)[0] not in roots:
            want = " / ".join(sorted(f"{prefix}{r}..." for r in roots))
            raise BridgeError(f"key {key} is not in the {convention} key convention (every model key {want}); "
                              f"to-megatron cannot write one checkpoint with two conventions")
