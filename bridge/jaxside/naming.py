"""Naming and orientation maps: present the logical tree the way a JAX model expects it.

The logical checkpoint keeps Megatron's view: fused projections as per-section sibling leaves
(`.../linear_fc1/weight/{gate,up}`), torch `[out, in]` kernels, stacked layers as a leading axis.
A `NamingMap` is an optional, declarative list of rules that presents another view:

- `JoinSections(pattern, sections=None, axis=None)`: concatenate a fused parameter's sections into
  one leaf named by the parent path (order from `sections` or the manifest's section table);
- `Unstack(pattern, at="layers", axis=0)`: split a stacked-layer axis into leaves
  `.../layers/<i>/...`;
- `Transpose(pattern, perm=None)`: permute axes (default: swap the last two, `[out, in]` -> `[in, out]`);
- `Rename(regex, replacement)`: rewrite the '/'-joined path.

Rules run in that fixed order (join, unstack, transpose, rename); each pattern is a glob over the
'/'-joined path *at that stage* (`re:` prefix for a regex). The plan (`NamingMap.plan`) is pure: it
groups source leaves into `Group`s, each with forward and inverse functions over a tiny array
backend (`NUMPY`, `TENSORSTORE` for lazy views, or `jax_backend()`), so the same plan is applied
lazily on read and inverted on save. No JAX import here.

>>> nm = NamingMap([JoinSections("*/linear_fc1/weight", ("gate", "up")), Unstack("decoder/layers/*"),
...                 Transpose("*/weight")])
>>> shapes = {("decoder", "layers", "mlp", "linear_fc1", "weight", "gate"): (2, 3, 4),
...           ("decoder", "layers", "mlp", "linear_fc1", "weight", "up"): (2, 3, 4)}
>>> plan = nm.plan(shapes)
>>> [("/".join(p), s) for p, s in plan.out_shapes().items()]
[('decoder/layers/0/mlp/linear_fc1/weight', (4, 6)), ('decoder/layers/1/mlp/linear_fc1/weight', (4, 6))]
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from bridge.errors import BridgeError
from bridge.format.schema import PARAMS_PATH

Path = tuple[str, ...]


def _join(path: Path) -> str:
    return "/".join(path)


def matches(pattern: str, path: Path) -> bool:
    """Glob (or `re:` regex) match on the '/'-joined path.

    >>> matches("*/linear_fc1/weight", ("decoder", "layers", "mlp", "linear_fc1", "weight"))
    True
    >>> matches("re:decoder/layers/\\\\d+/.*", ("decoder", "layers", "mlp"))
    False
    """
    s = _join(path)
    if pattern.startswith("re:"):
        return re.fullmatch(pattern[3:], s) is not None
    return fnmatch.fnmatchcase(s, pattern)


def leading_axes(path: Path) -> tuple[int, int]:
    """(stacked layer axes, expert axes) before a parameter's own dims in its logical shape.

    A homogeneous Megatron block stores `decoder.layers.<name>` with a leading layer axis; a
    hybrid block stores `decoder.layers.<i>.<name>` without one; routed experts add an axis.

    >>> leading_axes(("decoder", "layers", "mlp", "linear_fc1", "weight"))
    (1, 0)
    >>> leading_axes(("decoder", "layers", "3", "mlp", "experts", "linear_fc1", "weight"))
    (0, 1)
    """
    layers = 0
    for i, comp in enumerate(path[:-1]):
        if comp == "layers" and not path[i + 1].isdigit():
            layers = 1
    experts = 1 if "experts" in path[:-1] else 0
    return layers, experts


# ----------------------------------------------------------------------------- rules


@dataclass(frozen=True)
class JoinSections:
    """Concatenate the section leaves under a fused parameter path matching `pattern`.

    `axis=None` joins along the parameter's first own axis (after stacked-layer/expert axes).
    With `stack=True` equal-shaped sections are stacked on a new axis there instead
    (`[gate; up]` -> `[2, F, H]`, which a TP-sharded JAX model can split without mixing sections).
    """

    pattern: str
    sections: tuple[str, ...] | None = None
    axis: int | None = None
    stack: bool = False


@dataclass(frozen=True)
class Unstack:
    """Split the stacked-layer axis of leaves matching `pattern` into `.../<at>/<i>/...`."""

    pattern: str
    at: str = "layers"
    axis: int = 0


@dataclass(frozen=True)
class Transpose:
    """Permute the axes of leaves matching `pattern`; default swaps the last two axes."""

    pattern: str
    perm: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Rename:
    """Rewrite the '/'-joined path with `re.sub(regex, replacement, path)`."""

    regex: str
    replacement: str


Rule = JoinSections | Unstack | Transpose | Rename


# ----------------------------------------------------------------------------- backends


@dataclass(frozen=True)
class Backend:
    """The five array operations a plan needs."""

    concat: Callable[[Sequence[Any], int], Any]
    take: Callable[[Any, int, int], Any]          # x, axis, index -> x with that axis removed
    transpose: Callable[[Any, tuple[int, ...]], Any]
    stack: Callable[[Sequence[Any], int], Any]
    slice: Callable[[Any, int, int, int], Any]    # x, axis, start, stop


NUMPY = Backend(
    concat=lambda xs, axis: np.concatenate(xs, axis=axis),
    take=lambda x, axis, i: np.take(x, i, axis=axis),
    transpose=lambda x, perm: np.transpose(x, perm),
    stack=lambda xs, axis: np.stack(xs, axis=axis),
    slice=lambda x, axis, a, b: x[(slice(None),) * axis + (slice(a, b),)],
)


def _ts_backend() -> Backend:
    import tensorstore as ts

    return Backend(
        concat=lambda xs, axis: ts.concat(list(xs), axis=axis),
        take=lambda x, axis, i: x[(slice(None),) * axis + (i,)].translate_to[0],
        transpose=lambda x, perm: x[ts.d[:].transpose[list(perm)]].translate_to[0],
        stack=lambda xs, axis: ts.stack(list(xs), axis=axis),
        slice=lambda x, axis, a, b: x[(slice(None),) * axis + (slice(a, b),)].translate_to[0],
    )


class _LazyBackend:
    def __getattr__(self, name: str):
        return getattr(_ts_backend(), name)


TENSORSTORE = _LazyBackend()  # lazy TensorStore views: nothing is read until `.read()`


def jax_backend() -> Backend:
    """jax.numpy operations (use inside jit to control output shardings)."""
    import jax.numpy as jnp

    return Backend(
        concat=lambda xs, axis: jnp.concatenate(list(xs), axis=axis),
        take=lambda x, axis, i: jnp.take(x, i, axis=axis),
        transpose=lambda x, perm: jnp.transpose(x, perm),
        stack=lambda xs, axis: jnp.stack(list(xs), axis=axis),
        slice=lambda x, axis, a, b: x[(slice(None),) * axis + (slice(a, b),)],
    )


# ----------------------------------------------------------------------------- plan


@dataclass(frozen=True)
class Group:
    """Source leaves -> output leaves: join (optional) -> unstack (optional) -> transpose (optional)."""

    sources: tuple[Path, ...]
    source_shapes: tuple[tuple[int, ...], ...]
    outputs: tuple[Path, ...]
    join_axis: int | None = None
    unstack_axis: int | None = None
    perm: tuple[int, ...] | None = None
    stacked: bool = False  # join by stacking on a new axis instead of concatenating

    @property
    def joined_shape(self) -> tuple[int, ...]:
        first = self.source_shapes[0]
        if self.join_axis is None:
            return first
        ax = self.join_axis
        if self.stacked:
            return first[:ax] + (len(self.source_shapes),) + first[ax:]
        return first[:ax] + (sum(s[ax] for s in self.source_shapes),) + first[ax + 1:]

    @property
    def out_shape(self) -> tuple[int, ...]:
        shape = self.joined_shape
        if self.unstack_axis is not None:
            shape = shape[:self.unstack_axis] + shape[self.unstack_axis + 1:]
        if self.perm is not None:
            shape = tuple(shape[p] for p in self.perm)
        return shape

    @property
    def is_identity(self) -> bool:
        return self.join_axis is None and self.unstack_axis is None and self.perm is None

    def forward(self, sources: Sequence[Any], be: Backend = NUMPY) -> list[Any]:
        """Source arrays (in `sources` order) -> output arrays (in `outputs` order)."""
        if self.join_axis is None:
            x = sources[0]
        else:
            x = (be.stack if self.stacked else be.concat)(sources, self.join_axis)
        if self.unstack_axis is not None:
            parts = [be.take(x, self.unstack_axis, i) for i in range(self.joined_shape[self.unstack_axis])]
        else:
            parts = [x]
        if self.perm is not None:
            parts = [be.transpose(p, self.perm) for p in parts]
        return parts

    def inverse(self, outputs: Sequence[Any], be: Backend = NUMPY) -> list[Any]:
        """Output arrays -> source arrays: the exact inverse of `forward`."""
        parts = list(outputs)
        if self.perm is not None:
            inv = tuple(int(i) for i in np.argsort(self.perm))
            parts = [be.transpose(p, inv) for p in parts]
        x = be.stack(parts, self.unstack_axis) if self.unstack_axis is not None else parts[0]
        if self.join_axis is None:
            return [x]
        if self.stacked:
            return [be.take(x, self.join_axis, i) for i in range(len(self.sources))]
        out, start = [], 0
        for shape in self.source_shapes:
            stop = start + shape[self.join_axis]
            out.append(be.slice(x, self.join_axis, start, stop))
            start = stop
        return out

    @property
    def logical_name(self) -> Path:
        """The logical path the group presents: the fused parent for joins, else the source."""
        return self.sources[0][:-1] if self.join_axis is not None else self.sources[0]

    def forward_spec(self, joined_spec: Sequence[Any]) -> tuple:
        """A partition spec of the joined logical array carried to each output (drop the unstacked
        axis, apply the permutation).

        >>> Group((("w",),), ((4, 8, 6),), (("w0",),), unstack_axis=0, perm=(1, 0)).forward_spec((None, "tp", "fsdp"))
        ('fsdp', 'tp')
        """
        spec = list(joined_spec) + [None] * (len(self.joined_shape) - len(joined_spec))
        if self.unstack_axis is not None:
            del spec[self.unstack_axis]
        if self.perm is not None:
            spec = [spec[p] for p in self.perm]
        return tuple(spec)

    def source_spec(self, out_spec: Sequence[Any]) -> tuple:
        """A partition spec for the sources that makes `forward` need no data movement when it can.

        >>> g = Group((("w",),), ((4, 8, 6),), (("w0",),), unstack_axis=0, perm=(1, 0))
        >>> g.source_spec(("fsdp", "tp"))
        (None, 'tp', 'fsdp')
        """
        spec = list(out_spec) + [None] * (len(self.out_shape) - len(out_spec))
        if self.perm is not None:
            inv = np.argsort(self.perm)
            spec = [spec[int(i)] for i in inv]
        if self.unstack_axis is not None:
            spec.insert(self.unstack_axis, None)
        # A join axis keeps its split: each section is read already sharded (least bytes read) and
        # the concatenation under jit moves rows to their target devices; callers drop axes that
        # do not divide a section. A stacking axis does not exist in the sources.
        if self.join_axis is not None and self.stacked:
            del spec[self.join_axis]
        return tuple(spec)


@dataclass
class Plan:
    """The naming plan of one tree: groups in source order."""

    groups: list[Group] = field(default_factory=list)

    def out_shapes(self) -> dict[Path, tuple[int, ...]]:
        """Output path -> shape, in output order."""
        return {o: g.out_shape for g in self.groups for o in g.outputs}

    def apply(self, tree: Mapping[Path, Any], be: Backend = NUMPY) -> dict[Path, Any]:
        """{source path: array} -> {output path: array} (lazy with the TensorStore backend)."""
        out: dict[Path, Any] = {}
        for g in self.groups:
            out.update(zip(g.outputs, g.forward([tree[s] for s in g.sources], be)))
        return out

    def check(self, shapes: Mapping[Path, Sequence[int]]) -> None:
        """Refuse a presented tree ({output path: shape}) with missing/extra leaves or changed shapes."""
        expected = {o: g.out_shape for g in self.groups for o in g.outputs}
        missing, extra = sorted(set(expected) - set(shapes)), sorted(set(shapes) - set(expected))
        if missing or extra:
            which = f"lacks {_join(missing[0])}" if missing else f"has unexpected {_join(extra[0])}"
            raise BridgeError(f"tree to save {which} under the naming map; save the tree the map presents")
        for o, want in expected.items():
            if tuple(shapes[o]) != want:
                raise BridgeError(f"array {_join(o)} has shape {tuple(shapes[o])}, expected {want}; "
                                  f"it must keep the shape it was restored with")

    def invert(self, tree: Mapping[Path, Any], be: Backend = NUMPY) -> dict[Path, Any]:
        """{output path: array} -> {source path: array}; refuses a tree with missing or extra leaves."""
        self.check({p: a.shape for p, a in tree.items()})
        out: dict[Path, Any] = {}
        for g in self.groups:
            out.update(zip(g.sources, g.inverse([tree[o] for o in g.outputs], be)))
        return out


@dataclass(frozen=True)
class NamingMap:
    """An ordered list of rules (see module docstring); `plan(shapes)` makes the pure plan."""

    rules: Sequence[Rule] = ()

    def plan(self, shapes: Mapping[Path, Sequence[int]],
             sections: Mapping[Path, Sequence[str]] | None = None) -> Plan:
        """Plan the presentation of arrays `shapes` (source path -> shape).

        `sections` (fused param path -> ordered section names, from the manifest) orders joins
        whose rule gives no `sections`.
        """
        shapes = {tuple(p): tuple(int(d) for d in s) for p, s in shapes.items()}
        groups = self._plan_joins(shapes, sections or {})
        groups = [self._plan_rest(g) for g in groups]
        plan = Plan(groups)
        seen: dict[Path, Path] = {}
        for g in groups:
            for o in g.outputs:
                if o in seen:
                    raise BridgeError(f"naming map sends two arrays to {_join(o)}; fix the Rename rules")
                seen[o] = g.sources[0]
        return plan

    def _plan_joins(self, shapes: dict[Path, tuple[int, ...]], sections: Mapping[Path, Sequence[str]]) -> list[Group]:
        joins = [r for r in self.rules if isinstance(r, JoinSections)]
        used: set[Path] = set()
        groups: list[Group] = []
        parents = sorted({p[:-1] for p in shapes if len(p) > 1})
        for parent in parents:
            rule = next((r for r in joins if matches(r.pattern, parent)), None)
            if rule is None:
                continue
            names = rule.sections or sections.get(parent)
            children = [p for p in shapes if p[:-1] == parent]
            if names is None:
                raise BridgeError(f"no section order for fused {_join(parent)}; give JoinSections(sections=...) "
                                  f"or pass the manifest's section table")
            srcs = tuple(parent + (n,) for n in names)
            absent = [s for s in srcs if s not in shapes]
            if absent or len(children) != len(srcs):
                raise BridgeError(f"fused {_join(parent)} has sections {sorted(c[-1] for c in children)}, rule "
                                  f"expects {list(names)}; fix the JoinSections rule")
            sshapes = tuple(shapes[s] for s in srcs)
            axis = rule.axis if rule.axis is not None else sum(leading_axes(parent + ("x",)))
            axis = axis % (len(sshapes[0]) + (1 if rule.stack else 0))
            if rule.stack:
                if len(set(sshapes)) != 1:
                    raise BridgeError(f"sections of {_join(parent)} have shapes {list(sshapes)}; stacking needs "
                                      f"equal shapes, use JoinSections(stack=False)")
                groups.append(Group(srcs, sshapes, (parent,), join_axis=axis, stacked=True))
                used.update(srcs)
                continue
            for s in sshapes:
                if len(s) != len(sshapes[0]) or s[:axis] + s[axis + 1:] != sshapes[0][:axis] + sshapes[0][axis + 1:]:
                    raise BridgeError(f"sections of {_join(parent)} have shapes {list(sshapes)} that do not join "
                                      f"on axis {axis}; fix the JoinSections axis")
            groups.append(Group(srcs, sshapes, (parent,), join_axis=axis))
            used.update(srcs)
        for p in sorted(set(shapes) - used):
            groups.append(Group((p,), (shapes[p],), (p,)))
        return groups

    def _plan_rest(self, g: Group) -> Group:
        (name,) = g.outputs
        shape = g.joined_shape
        unstack_axis = None
        outputs: list[Path] = [name]
        rule = next((r for r in self.rules if isinstance(r, Unstack) and matches(r.pattern, name)), None)
        if rule is not None and rule.at in name and leading_axes(name)[0]:
            at = name.index(rule.at)
            unstack_axis = rule.axis
            outputs = [name[:at + 1] + (str(i),) + name[at + 1:] for i in range(shape[rule.axis])]
            shape = shape[:rule.axis] + shape[rule.axis + 1:]
        perm = None
        rule_t = next((r for r in self.rules if isinstance(r, Transpose) and matches(r.pattern, outputs[0])), None)
        if rule_t is not None and len(shape) >= 2:
            perm = rule_t.perm or tuple(range(len(shape) - 2)) + (len(shape) - 1, len(shape) - 2)
            if sorted(perm) != list(range(len(shape))):
                raise BridgeError(f"Transpose perm {perm} does not fit {_join(outputs[0])} of rank {len(shape)}")
        renames = [r for r in self.rules if isinstance(r, Rename)]
        final = []
        for o in outputs:
            s = _join(o)
            for r in renames:
                s = re.sub(r.regex, r.replacement, s)
            final.append(tuple(c for c in s.split("/") if c))
        return Group(g.sources, g.source_shapes, tuple(final), g.join_axis, unstack_axis, perm, g.stacked)


def named_views(directory: str, naming: NamingMap, prefix: Path = PARAMS_PATH) -> dict[Path, Any]:
    """Lazy TensorStore views of the arrays under `prefix` of a checkpoint, presented by `naming`.

    Nothing is read until a view's `.read()`; joins, transposes and unstacking are TensorStore
    index transforms / virtual concatenations, so a slice reads only the bytes it covers. Section
    orders come from the checkpoint's manifest.
    """
    from bridge.store import open_checkpoint

    ck = open_checkpoint(directory)
    n = len(prefix)
    sources = {p[n:]: p for p in ck.paths() if p[:n] == tuple(prefix) and len(p) > n}
    if not sources:
        raise BridgeError(f"checkpoint {directory} has no arrays under {_join(tuple(prefix))}; pick another prefix")
    views = {short: ck.open(full) for short, full in sources.items()}
    orders: dict[Path, list[str]] = {}
    if ck.manifest is not None:
        for key, spec in ck.manifest.fused.items():
            orders[tuple(c for c in key.replace(".", "/").split("/") if c)] = [str(s[0]) for s in spec["sections"]]
    plan = naming.plan({p: tuple(v.shape) for p, v in views.items()}, orders)
    return plan.apply(views, TENSORSTORE)
