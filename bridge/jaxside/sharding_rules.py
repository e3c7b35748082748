"""PartitionSpecs for logical arrays: user rules by path pattern, with sensible defaults.

Planning only (no I/O): given a logical array's path (without the `params`/`mu`/`nu` prefix, so the
optimizer moments always follow their parameter) and global shape, return a `PartitionSpec` for a
mesh. Defaults mirror Megatron's tensor parallelism on the logical `[out, in]` layout:

- stacked layers (`.../layers/<name>/...`, no layer index in the path): leading layer axis replicated;
- routed experts (`.../experts/...`): next leading axis split over the expert mesh axis;
- 2-D column-parallel weights (`linear_qkv`, `linear_fc1`, `in_proj`, `output_layer`,
  `word_embeddings`): `[out, in]` -> `(tp, fsdp)`; row-parallel (`linear_proj`, `linear_fc2`,
  `out_proj`) -> `(fsdp, tp)`; other 2-D -> `(tp, fsdp)`;
- 1-D arrays and scalars: replicated.
A default axis is dropped (replicated) when it does not divide the dimension; an explicit rule that
does not divide raises `BridgeError`.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence, Union

from jax.sharding import PartitionSpec

from bridge.errors import BridgeError
from bridge.jaxside.naming import leading_axes
from bridge.jaxside.keypaths import Path, path_str

SpecLike = Union[PartitionSpec, Sequence, None]
RuleValue = Union[SpecLike, Callable[[Path, tuple[int, ...]], SpecLike]]

COLUMN_PARALLEL = ("linear_qkv", "linear_fc1", "in_proj", "output_layer", "word_embeddings",
                   "linear_q", "linear_kv", "linear_q_down_proj", "linear_q_up_proj",
                   "linear_kv_down_proj", "linear_kv_up_proj")
ROW_PARALLEL = ("linear_proj", "linear_fc2", "out_proj")


@dataclass(frozen=True)
class MeshAxes:
    """Which mesh axis plays which role; the first name present in the mesh wins."""

    tp: tuple[str, ...] = ("tp", "model", "tensor")  # foreign: mesh axis names
    fsdp: tuple[str, ...] = ("fsdp", "data", "dp")
    expert: tuple[str, ...] = ("ep", "expert", "experts")

    def resolve(self, axis_names: Sequence[str]) -> dict[str, str | None]:
        """Role -> mesh axis name (or None when the mesh has no such axis).

        >>> MeshAxes().resolve(("data", "model"))
        {'tp': 'model', 'fsdp': 'data', 'expert': None}
        """
        names = set(axis_names)
        pick = lambda cands: next((c for c in cands if c in names), None)  # noqa: E731
        return {"tp": pick(self.tp), "fsdp": pick(self.fsdp), "expert": pick(self.expert)}


def _module_kind(path: Path) -> str:
    comps = set(path)
    if comps & set(ROW_PARALLEL):
        return "row"
    return "column"


def default_spec(path: Path, shape: Sequence[int], axis_sizes: Mapping[str, int],
                 axes: MeshAxes = MeshAxes()) -> PartitionSpec:
    """The default PartitionSpec of a logical array (see module docstring).

    >>> sizes = {"fsdp": 2, "tp": 4}
    >>> default_spec(("decoder", "layers", "mlp", "linear_fc2", "weight"), (2, 16, 64), sizes)
    P(None, 'fsdp', 'tp')
    >>> default_spec(("embedding", "word_embeddings", "weight"), (10, 8), sizes)  # 10 % tp: replicated
    P(None, 'fsdp')
    """
    role = axes.resolve(tuple(axis_sizes))
    n_layers, n_experts = leading_axes(path)
    lead = n_layers + n_experts
    if len(shape) < lead:
        lead, n_experts = 0, 0
    spec: list = [None] * len(shape)
    if n_experts:
        spec[n_layers] = role["expert"]
    base = len(shape) - lead
    if base == 2:
        first, second = ("fsdp", "tp") if _module_kind(path) == "row" else ("tp", "fsdp")
        spec[lead], spec[lead + 1] = role[first], role[second]
    # Drop any default axis that does not divide its dimension (replicate instead).
    for d, ax in enumerate(spec):
        if ax is not None and shape[d] % axis_sizes[ax] != 0:
            spec[d] = None
    return PartitionSpec(*spec)


def _axis_product(entry, axis_sizes: Mapping[str, int], where: str) -> int:
    names = entry if isinstance(entry, tuple) else (entry,)
    size = 1
    for n in names:
        if n not in axis_sizes:
            raise BridgeError(f"{where}: mesh has no axis {n!r} (axes: {sorted(axis_sizes)}); fix the sharding rule")
        size *= axis_sizes[n]
    return size


def checked_spec(spec: SpecLike, path: Path, shape: Sequence[int], axis_sizes: Mapping[str, int]) -> PartitionSpec:
    """Normalise a user spec (pad with None to the array's rank) and check it divides the shape."""
    where = f"array {path_str(path)} {tuple(shape)}"
    entries = tuple(spec) if spec is not None else ()
    if len(entries) > len(shape):
        raise BridgeError(f"{where}: PartitionSpec {PartitionSpec(*entries)} has more entries than dims; shorten it")
    entries = entries + (None,) * (len(shape) - len(entries))
    for d, entry in enumerate(entries):
        if entry is None:
            continue
        size = _axis_product(entry, axis_sizes, where)
        if shape[d] % size:
            raise BridgeError(f"{where}: dim {d} ({shape[d]}) is not divisible by mesh axes {entry!r} ({size}); "
                              f"pick another PartitionSpec for it")
    return PartitionSpec(*entries)


@dataclass(frozen=True)
class ShardingRules:
    """Ordered (pattern, spec) rules; the first pattern matching a path wins, else `default_spec`.

    A pattern is a glob over the '/'-joined path (`"*/linear_fc2/weight"`) or, prefixed with `re:`,
    a regular expression (`"re:.*experts/.*"`) matched with `re.fullmatch`. A spec is a
    `PartitionSpec`/tuple (padded with None) or `callable(path, shape) -> spec`.

    >>> r = ShardingRules([("*/bias", ("tp",))])
    >>> r.spec_for(("decoder", "final_layernorm", "bias"), (8,), {"tp": 2})
    P('tp',)
    """

    rules: Sequence[tuple[str, RuleValue]] = ()
    axes: MeshAxes = field(default_factory=MeshAxes)

    def match(self, path: Path) -> RuleValue | None:
        """The first rule value whose pattern matches `path`, or None."""
        s = path_str(path)
        for pattern, value in self.rules:
            ok = re.fullmatch(pattern[3:], s) if pattern.startswith("re:") else fnmatch.fnmatchcase(s, pattern)
            if ok:
                return value
        return None

    def spec_for(self, path: Path, shape: Sequence[int], axis_sizes: Mapping[str, int]) -> PartitionSpec:
        """PartitionSpec for one logical array (path without the params/mu/nu prefix)."""
        value = self.match(path)
        if value is None:
            return default_spec(path, shape, axis_sizes, self.axes)
        if callable(value):
            value = value(path, tuple(shape))
        return checked_spec(value, path, shape, axis_sizes)
