"""JAX key paths <-> the bridge's string tree paths.

The logical checkpoint names every leaf by a tuple of strings (`("params", "decoder", "layers",
"mlp", "linear_fc2", "weight")`, Orbax name = `".".join(path)`). JAX names pytree leaves by key
paths (`DictKey`, `GetAttrKey`, `SequenceKey`); this module converts between the two and builds or
walks nested dicts by path. Pure apart from the JAX key classes.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Mapping

import jax

from bridge.format.tree import Path, path_str  # noqa: F401 - one path type and printer for the project


def key_name(key: Any) -> str:
    """One JAX key -> its string component.

    >>> from jax.tree_util import DictKey, GetAttrKey, SequenceKey
    >>> [key_name(k) for k in (DictKey("w"), GetAttrKey("mu"), SequenceKey(0))]
    ['w', 'mu', '0']
    """
    if isinstance(key, jax.tree_util.DictKey):
        return str(key.key)
    if isinstance(key, jax.tree_util.GetAttrKey):
        return key.name
    if isinstance(key, jax.tree_util.SequenceKey):
        return str(key.idx)
    if isinstance(key, jax.tree_util.FlattenedIndexKey):
        return str(key.key)
    raise TypeError(f"unsupported pytree key {key!r}")


def to_path(keypath: tuple) -> Path:
    """A JAX key path -> tuple of strings."""
    return tuple(key_name(k) for k in keypath)


def leaves_by_path(tree: Any, is_leaf: Callable[[Any], bool] | None = None) -> dict[Path, Any]:
    """Flatten a pytree into {string path: leaf}, in JAX's leaf order."""
    return {to_path(kp): leaf for kp, leaf in jax.tree_util.tree_leaves_with_path(tree, is_leaf=is_leaf)}


def nested_from_paths(flat: Mapping[Path, Any]) -> dict:
    """Build nested dicts from {path: value}.

    >>> nested_from_paths({("a", "b"): 1, ("a", "c"): 2, ("d",): 3})
    {'a': {'b': 1, 'c': 2}, 'd': 3}
    """
    out: dict = {}
    for path, value in flat.items():
        node = out
        for comp in path[:-1]:
            node = node.setdefault(comp, {})
            if not isinstance(node, dict):
                raise ValueError(f"path {path_str(path)} runs through a leaf")
        node[path[-1]] = value
    return out


def walk_nested(tree: Mapping, prefix: Path = ()) -> Iterator[tuple[Path, Any]]:
    """Yield (path, leaf) of nested dicts (non-dict values are leaves), sorted by key."""
    for k in sorted(tree):
        v = tree[k]
        if isinstance(v, Mapping):
            yield from walk_nested(v, prefix + (str(k),))
        else:
            yield prefix + (str(k),), v
