"""Optax state <-> the logical checkpoint's Adam state, by key path.

The checkpoint stores one Adam state: `opt_state/0/{count, mu/<param>, nu/<param>}`. A user's optax
optimizer may nest Adam anywhere (`adamw`, `adamw` with a schedule or a weight-decay mask, inside
`chain(clip_by_global_norm, ...)`, per-group `multi_transform`, `inject_hyperparams`). We never
hand-build optax tuples: the user passes `template = jax.eval_shape(tx.init, params)` and every
template leaf is classified by its key path:

- `...mu/<param path>` / `...nu/<param path>` (the `mu`/`nu` attribute of an optax state) -> moments;
- any `count` attribute (ScaleByAdamState, ScaleByScheduleState, InjectHyperparams...) -> the step;
- `hyperparams/<name>` of `inject_hyperparams` -> the manifest's hyper-parameters;
- anything else is refused (the checkpoint has nothing to fill it with).
Pure planning here; arrays are only placed, never computed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import jax

from bridge.errors import BridgeError
from bridge.format.schema import COUNT, MOMENTS, MU, NU
from bridge.jaxside.keypaths import Path, path_str, to_path

# The tree's Adam names are optax's own ScaleByAdamState fields (Orbax names leaves by attribute):
# bridge.format.schema's MU, NU, COUNT are both.
INJECTED = ("learning_rate", "b1", "b2", "eps", "eps_root", "weight_decay")


@dataclass(frozen=True)
class LeafRole:
    """What one optax template leaf holds: kind in {"mu", "nu", "count", "hyper"}, plus the
    parameter path (moments) or hyper-parameter name (hyper)."""

    kind: str
    param: Path = ()
    name: str = ""


def classify(keypath: tuple) -> LeafRole | None:
    """Role of an optax state leaf from its JAX key path; None when unknown.

    >>> from jax.tree_util import DictKey as D, GetAttrKey as A, SequenceKey as S
    >>> classify((S(1), S(0), A("mu"), D("decoder"), D("mu")))
    LeafRole(kind='mu', param=('decoder', 'mu'), name='')
    >>> classify((S(2), A("count"))).kind
    'count'
    """
    for i, key in enumerate(keypath):
        if isinstance(key, jax.tree_util.GetAttrKey):
            if key.name in MOMENTS:
                return LeafRole(key.name, to_path(keypath[i + 1:]))
            if key.name == "hyperparams" and i + 2 == len(keypath):
                return LeafRole("hyper", name=to_path(keypath[i + 1:])[0])
    last = keypath[-1] if keypath else None
    if isinstance(last, jax.tree_util.GetAttrKey) and last.name == COUNT:
        return LeafRole(COUNT)
    return None


def template_roles(template: Any) -> list[tuple[tuple, LeafRole, Any]]:
    """(keypath, role, leaf) for every leaf of an optax template; refuses unknown leaves."""
    out = []
    for kp, leaf in jax.tree_util.tree_leaves_with_path(template):
        role = classify(kp)
        if role is None:
            raise BridgeError(
                f"optimizer template leaf {path_str(to_path(kp))} has no counterpart in the checkpoint "
                f"(it stores Adam mu/nu/count only); build the template from optax.adamw / scale_by_adam")
        out.append((kp, role, leaf))
    return out


def check_template(template: Any, params: Mapping[Path, tuple[tuple[int, ...], Any]], strict: bool = True) -> None:
    """Refuse a template whose moments do not match the checkpoint's params (name, shape).

    `params` maps each checkpoint parameter path to (shape, dtype). With `strict`, every checkpoint
    parameter must have both moments in the template. Raises BridgeError naming the first
    differing path.
    """
    seen: dict[str, set[Path]] = {m: set() for m in MOMENTS}
    for kp, role, leaf in template_roles(template):
        if role.kind not in MOMENTS:
            continue
        where = path_str(to_path(kp))
        if role.param not in params:
            raise BridgeError(f"optimizer template has parameter {path_str(role.param)} (at {where}) that the "
                              f"checkpoint lacks; build the template from the checkpoint's parameter tree")
        shape = tuple(params[role.param][0])
        if tuple(leaf.shape) != shape:
            raise BridgeError(f"optimizer template shape {tuple(leaf.shape)} at {where} differs from the "
                              f"checkpoint's {shape} for {path_str(role.param)}; fix the model config or naming map")
        seen[role.kind].add(role.param)
    if strict:
        for kind in MOMENTS:
            missing = sorted(set(params) - seen[kind])
            if missing:
                raise BridgeError(f"optimizer template has no {kind} for parameter {path_str(missing[0])} "
                                  f"that the checkpoint holds; build the template from the full parameter tree")


def fill_template(template: Any, mu: Mapping[Path, Any], nu: Mapping[Path, Any], count: Any,
                  hyper: Mapping[str, float] | None = None,
                  place: Callable[[Any, Any], Any] = lambda value, leaf: value) -> Any:
    """A copy of `template` with every leaf filled from the checkpoint (see module docstring).

    `place(value, template_leaf)` puts a value where the template leaf wants it (dtype, sharding).
    """
    leaves = []
    for kp, role, leaf in template_roles(template):
        if role.kind == MU:
            value = mu[role.param]
        elif role.kind == NU:
            value = nu[role.param]
        elif role.kind == COUNT:
            value = count
        else:
            if hyper is None or role.name not in hyper:
                raise BridgeError(f"inject_hyperparams leaf {path_str(to_path(kp))} has no value in the manifest; "
                                  f"pass it explicitly or do not inject it")
            value = hyper[role.name]
        leaves.append(place(value, leaf))
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(template), leaves)


def extract_adam(opt_state: Any) -> tuple[dict[Path, Any], dict[Path, Any], Any]:
    """(mu, nu, count) by parameter path from any optax state holding Adam moments.

    Each parameter's moments must appear once (multi_transform groups are merged); all Adam
    counts must agree. Schedule counts are not returned (they equal the Adam count in adamw).
    """
    mu: dict[Path, Any] = {}
    nu: dict[Path, Any] = {}
    counts: list[tuple[str, Any]] = []
    for kp, role, leaf in template_roles(opt_state):
        where = path_str(to_path(kp))
        if role.kind in MOMENTS:
            dest = mu if role.kind == MU else nu
            if role.param in dest:
                raise BridgeError(f"optimizer state holds two {role.kind} for {path_str(role.param)} (second at "
                                  f"{where}); the checkpoint stores one Adam state per parameter")
            dest[role.param] = leaf
        elif role.kind == COUNT and _is_adam_count(kp, opt_state):
            counts.append((where, leaf))
    if not mu:
        raise BridgeError("optimizer state holds no Adam moments (mu/nu); save an optax.adamw/scale_by_adam state")
    if set(mu) != set(nu):
        odd = sorted(set(mu) ^ set(nu))[0]
        raise BridgeError(f"optimizer state has mu and nu for different parameters (first: {path_str(odd)})")
    values = {int(jax.device_get(c)) for _, c in counts}
    if len(values) > 1:
        raise BridgeError(f"Adam counts differ across groups ({sorted(values)} at {[w for w, _ in counts]}); "
                          f"the checkpoint stores one step count")
    return mu, nu, counts[0][1]


def _is_adam_count(keypath: tuple, tree: Any) -> bool:
    """True when the `count` leaf at keypath belongs to a state that also has `mu` (ScaleByAdamState)."""
    node = tree
    for key in keypath[:-1]:
        if isinstance(key, jax.tree_util.GetAttrKey):
            node = getattr(node, key.name)
        elif isinstance(key, jax.tree_util.DictKey):
            node = node[key.key]
        elif isinstance(key, jax.tree_util.SequenceKey):
            node = node[key.idx]
        else:
            return False
    return all(hasattr(node, m) for m in MOMENTS)
