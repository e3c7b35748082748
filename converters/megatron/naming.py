"""Megatron-Core parameter naming: wrapper prefixes, routed experts, module components.

The one place the converters read meaning out of a Megatron key. Wrapper stripping itself lives
in the core (`bridge.format.tree`), because the live exporter needs it too and the core never
imports `converters`; it is re-exported here so Megatron code has one naming module to import.
"""

from __future__ import annotations

from bridge.format.tree import WRAPPER_PREFIXES as WRAPPERS
from bridge.format.tree import megatron_key_to_path, path_to_name, strip_wrappers

__all__ = ["WRAPPERS", "strip_wrappers", "logical_key", "is_routed_expert", "module_of"]


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
