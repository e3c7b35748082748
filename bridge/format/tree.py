"""Tree paths of the logical checkpoint and their Orbax names and `_METADATA` tree entries.

A path is a tuple of string components, e.g. ``("params", "decoder", "layers", "mlp", "linear_fc2",
"weight")``. Orbax names a leaf by joining its keys with ``.``, so components must not contain
``.`` (nor ``/``, which would escape into the key-value store's directory structure).
"""

from __future__ import annotations

from typing import Iterable, Sequence

from bridge.errors import BridgeError
from bridge.format.schema import OPT_STATE, Path

# Orbax key types (orbax/checkpoint/_src/tree/utils.py KeyType): 1 = sequence index, 2 = dict key.
KEY_SEQUENCE = 1
KEY_DICT = 2

WRAPPER_PREFIXES = ("module", "model")   # Megatron's DDP / Float16Module wrappers, not the model root


def validate_component(component: str, path: Sequence[str] = ()) -> None:
    """Raise BridgeError unless `component` is usable as one Orbax key.

    >>> validate_component("linear_fc1")
    >>> validate_component("a.b")
    Traceback (most recent call last):
    ...
    bridge.errors.BridgeError: bad tree name component 'a.b' in path ('a.b',): must not contain '.'; split it into nested keys
    """
    where = tuple(path) or (component,)
    if not isinstance(component, str):
        raise BridgeError(f"bad tree name component {component!r} in path {where}: must be a string")
    if component == "":
        raise BridgeError(f"empty tree name component in path {where}: remove it")
    if component in (".", ".."):
        raise BridgeError(f"bad tree name component {component!r} in path {where}: '.' and '..' are not allowed")
    for bad, why in (("." , "split it into nested keys"), ("/", "split it into nested keys"),
                     ("\\", "use another separator"), ("\x00", "remove it")):
        if bad in component:
            raise BridgeError(f"bad tree name component {component!r} in path {where}: must not contain {bad!r}; {why}")


def validate_path(path: Sequence[str]) -> Path:
    """Check every component and return the path as a tuple.

    >>> validate_path(["params", "w"])
    ('params', 'w')
    """
    path = tuple(path)
    if not path:
        raise BridgeError("empty tree path: every array needs at least one name component")
    for c in path:
        validate_component(c, path)
    return path


def path_to_name(path: Sequence[str]) -> str:
    """Orbax parameter name (= OCDBT key prefix) of a path.

    >>> path_to_name(("opt_state", "0", "mu", "w"))
    'opt_state.0.mu.w'
    """
    return ".".join(validate_path(path))


def name_to_path(name: str) -> Path:
    """Inverse of `path_to_name`.

    >>> name_to_path("params.decoder.w")
    ('params', 'decoder', 'w')
    """
    return validate_path(name.split("."))


def path_str(path: Sequence[str]) -> str:
    """Human-readable form used in messages: ``params/decoder/w``."""
    return "/".join(path)


def strip_wrappers(key: str) -> str:
    """Megatron key without its `module.` / `model.` wrapper prefixes (DDP, Float16Module, ...).

    The one implementation: the live exporter (core) and the Megatron converters both need it.

    >>> strip_wrappers("module.module.decoder.final_layernorm.weight")
    'decoder.final_layernorm.weight'
    """
    parts = key.split(".")
    while len(parts) > 1 and parts[0] in WRAPPER_PREFIXES:
        parts = parts[1:]
    return ".".join(parts)


def megatron_key_to_path(key: str) -> Path:
    """Megatron parameter key -> tree path (wrapper prefixes removed, split on '.').

    >>> megatron_key_to_path("module.module.decoder.layers.0.mlp.linear_fc2.weight")
    ('decoder', 'layers', '0', 'mlp', 'linear_fc2', 'weight')
    """
    return validate_path(strip_wrappers(key).split("."))


def check_tree_paths(paths: Iterable[Sequence[str]]) -> None:
    """Refuse duplicate paths and a path that is also the parent of another (names would collide)."""
    seen: set[Path] = set()
    for p in paths:
        p = validate_path(p)
        if p in seen:
            raise BridgeError(f"tree path {path_str(p)} appears twice; every leaf needs a unique path")
        seen.add(p)
    for p in seen:
        for i in range(1, len(p)):
            if p[:i] in seen:
                raise BridgeError(f"tree path {path_str(p[:i])} is a leaf and also the parent of {path_str(p)}; rename one")


def key_types(path: Sequence[str]) -> list[int]:
    """Orbax key type of each component: optax tuple positions under `opt_state` are sequence keys.

    Components directly below ``opt_state`` that are integers (nested optax chains included) are
    tuple positions; every other key is a dict key (optax NamedTuple fields count as dict keys).

    >>> key_types(("opt_state", "0", "mu", "layers", "0", "w"))
    [2, 1, 2, 2, 2, 2]
    >>> key_types(("opt_state", "1", "0", "count"))
    [2, 1, 1, 2]
    """
    types = []
    in_tuple = False
    for i, c in enumerate(path):
        if i == 0:
            in_tuple = c == OPT_STATE
            types.append(KEY_DICT)
        elif in_tuple and c.isdigit():
            types.append(KEY_SEQUENCE)
        else:
            in_tuple = False
            types.append(KEY_DICT)
    return types


def array_entry(path: Sequence[str], write_shape: Sequence[int] | None = None,
                types: Sequence[int] | None = None) -> tuple[str, dict]:
    """One `_METADATA["tree_metadata"]` item for an array leaf, as Orbax writes it.

    >>> array_entry(("step",), ())
    ("('step',)", {'key_metadata': [{'key': 'step', 'key_type': 2}], 'value_metadata': {'value_type': 'jax.Array', 'skip_deserialize': False, 'write_shape': []}})
    """
    path = validate_path(path)
    value: dict = {"value_type": "jax.Array", "skip_deserialize": False}
    if write_shape is not None:
        value["write_shape"] = [int(s) for s in write_shape]
    return _entry(path, value, types)


def empty_entry(path: Sequence[str], types: Sequence[int] | None = None) -> tuple[str, dict]:
    """Tree entry for an optax `EmptyState()` / `None` node (restored as an empty node)."""
    return _entry(validate_path(path), {"value_type": "None", "skip_deserialize": True}, types)


def _entry(path: Path, value: dict, types: Sequence[int] | None) -> tuple[str, dict]:
    types = list(types) if types is not None else key_types(path)
    if len(types) != len(path):
        raise BridgeError(f"key types {types} do not match path {path_str(path)}")
    keys = [{"key": k, "key_type": int(t)} for k, t in zip(path, types)]
    return str(tuple(path)), {"key_metadata": keys, "value_metadata": value}


def tree_metadata(arrays: Iterable[tuple[Sequence[str], Sequence[int] | None]],
                  empty: Iterable[Sequence[str]] = ()) -> dict:
    """`_METADATA["tree_metadata"]` for array leaves ``(path, write_shape)`` and empty nodes."""
    out = dict(array_entry(p, ws) for p, ws in arrays)
    for p in empty:
        k, v = empty_entry(p)
        if k in out:
            raise BridgeError(f"tree path {path_str(p)} is both an array and an empty node")
        out[k] = v
    return out


def parse_tree_metadata(tree: dict) -> tuple[dict[Path, dict], list[Path]]:
    """Split `_METADATA["tree_metadata"]` into array leaves (path -> value_metadata) and empty nodes."""
    arrays: dict[Path, dict] = {}
    empty: list[Path] = []
    for entry in tree.values():
        path = tuple(str(k["key"]) for k in entry["key_metadata"])
        value = entry.get("value_metadata", {})
        if value.get("value_type") == "None" or value.get("skip_deserialize"):
            empty.append(path)
        else:
            arrays[path] = value
    return arrays, empty
