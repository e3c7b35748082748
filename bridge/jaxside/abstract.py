"""What a logical checkpoint holds, and abstract trees of `jax.ShapeDtypeStruct` to restore it.

`stored_arrays(path)` lists every stored array (full tree path -> shape, dtype) and the checkpoint's
custom metadata, read with the store's reader. `Target` turns a mesh + `ShardingRules`, or explicit
shardings, into a sharding for each logical array; `abstract_tree` builds the exact abstract tree
`ocp.StandardCheckpointer().restore(path, abstract)` needs (opt_state as `[{count, mu, nu}, None,
None]`, the structure Orbax records for `optax.adamw(...).init(params)`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding

from bridge.errors import BridgeError
from bridge.jaxside.keypaths import Path, leaves_by_path, nested_from_paths, path_str
from bridge.jaxside.sharding_rules import ShardingRules, default_spec
from bridge.format import schema
from bridge.format.schema import ADAM_PATH as ADAM, COUNT_PATH as COUNT, MODEL_PATH as MODEL, STEP_PATH as STEP
from bridge.format.schema import PARAMS_PATH as PARAMS  # noqa: F401 - tests and scripts take it from here
from bridge.jaxside.naming import Group

CASTABLE = (schema.PARAMS, schema.MODEL, schema.MU, schema.NU)   # roles `dtypes=` may cast, as messages list them


@dataclass(frozen=True)
class StoredArray:
    """One stored array: full tree path, global shape and dtype."""

    path: Path
    shape: tuple[int, ...]
    dtype: np.dtype


@dataclass
class StoredTree:
    """All arrays of a logical checkpoint, plus its custom metadata (the manifest lives there)."""

    directory: str
    arrays: dict[Path, StoredArray]
    custom_metadata: dict = field(default_factory=dict)
    #: the open checkpoint the arrays were listed from (`bridge.store.Checkpoint`): a restore reads
    #: through it rather than opening the checkpoint and every array a second time
    checkpoint: Any = field(default=None, repr=False, compare=False)

    def section(self, prefix: Path) -> dict[Path, StoredArray]:
        """Arrays under `prefix`, keyed by the path below it."""
        n = len(prefix)
        return {p[n:]: a for p, a in self.arrays.items() if p[:n] == prefix and len(p) > n}

    def has(self, prefix: Path) -> bool:
        return any(p[:len(prefix)] == prefix for p in self.arrays)


def stored_arrays(directory: str | os.PathLike, *, allow_edited_metadata: bool | None = None) -> StoredTree:
    """Read a checkpoint's array metadata with the store's reader (no data is read), from a local
    path or an s3:// / gs:// prefix alike.

    Opens by `bridge.store.reader.open_root`'s rules, the same as `open_checkpoint`: BridgeError
    for a missing, uncommitted or non-Orbax directory, IntegrityError for a damaged one or a bridge
    checkpoint whose `_METADATA` was edited after commit (unless `allow_edited_metadata`, or
    GTP_BRIDGE_ALLOW_EDITED_METADATA=1).
    """
    from bridge.dtypes import numpy_dtype
    from bridge.store import open_checkpoint

    ck = open_checkpoint(os.fspath(directory), allow_edited_metadata=allow_edited_metadata)
    arrays = {tuple(p): StoredArray(tuple(p), tuple(int(s) for s in info.shape), numpy_dtype(info.dtype))
              for p, info in ck.arrays().items()}
    custom = ck.metadata.get("custom_metadata") or {}
    return StoredTree(ck.root, arrays, dict(custom) if isinstance(custom, dict) else {}, checkpoint=ck)


ShardingSource = Callable[[Path, tuple[int, ...]], Sharding]


@dataclass
class Target:
    """Where restored arrays go: a mesh with `ShardingRules`, or explicit shardings.

    `shardings` is a nested dict (same paths as the parameter tree, JAX-facing names) of
    `Sharding`s, or `callable(path, shape) -> Sharding`. Scalars (count, step) are replicated on
    `mesh` (or on the mesh of the first explicit NamedSharding).
    """

    mesh: Mesh | None = None
    rules: ShardingRules = field(default_factory=ShardingRules)
    shardings: Mapping | ShardingSource | None = None

    def __post_init__(self) -> None:
        if self.mesh is None and self.shardings is None:
            raise BridgeError("no target: pass mesh= (with optional rules=) or shardings=")
        self._explicit: dict[Path, Sharding] | None = None
        if self.shardings is not None and not callable(self.shardings):
            self._explicit = leaves_by_path(self.shardings, is_leaf=lambda x: isinstance(x, Sharding))
            if self.mesh is None:
                named = [s for s in self._explicit.values() if isinstance(s, NamedSharding)]
                if not named:
                    raise BridgeError("explicit shardings hold no NamedSharding; also pass mesh=")
                self.mesh = named[0].mesh

    def sharding(self, path: Path, shape: tuple[int, ...]) -> Sharding:
        """Sharding of the array at (JAX-facing) parameter path `path`."""
        if self._explicit is not None:
            if path not in self._explicit:
                raise BridgeError(f"explicit shardings have no entry for {path_str(path)}; add one")
            s = self._explicit[path]
        elif callable(self.shardings):
            s = self.shardings(path, shape)
            if self.mesh is None and isinstance(s, NamedSharding):
                self.mesh = s.mesh  # scalars are replicated on the mesh the user's shardings use
        else:
            spec = self.rules.spec_for(path, shape, dict(self.mesh.shape))
            return NamedSharding(self.mesh, spec)
        try:
            s.shard_shape(shape)
        except Exception as e:  # noqa: BLE001 - jax raises ValueError/TypeError variants
            raise BridgeError(f"sharding {s} does not fit {path_str(path)} {shape}: {e}".splitlines()[0]) from None
        return s

    def group_shardings(self, g: "Group") -> list[Sharding]:
        """Target shardings of a naming group's outputs. Outputs no explicit rule names take the
        default spec of the logical array they come from, carried through the group (so a
        transposed `[in, out]` kernel keeps Megatron's column/row split)."""
        out = []
        for o in g.outputs:
            if self.shardings is None and not g.is_identity and self.rules.match(o) is None:
                sizes = dict(self.mesh.shape)
                if g.stacked:  # each section's own default, the new stacking axis replicated
                    spec = list(default_spec(g.sources[0], g.source_shapes[0], sizes, self.rules.axes))
                    spec.insert(g.join_axis, None)
                else:
                    spec = default_spec(g.logical_name, g.joined_shape, sizes, self.rules.axes)
                out.append(NamedSharding(self.mesh, PartitionSpec(*g.forward_spec(tuple(spec)))))
            else:
                out.append(self.sharding(o, g.out_shape))
        return out

    def replicated(self) -> NamedSharding:
        """Sharding for scalars (count, step)."""
        if self.mesh is None:
            raise BridgeError("cannot place count/step: explicit shardings named no mesh; also pass mesh=")
        return NamedSharding(self.mesh, PartitionSpec())


def abstract_tree(stored: StoredTree, target: Target, dtypes: Mapping[str, Any] | None = None,
                  items: tuple[str, ...] = schema.ROOTS) -> dict:
    """The abstract tree (ShapeDtypeStruct with shardings) restoring `items` of a stored checkpoint.

    Moments take their parameter's sharding; `dtypes` may cast "params", "model", "mu", "nu" on read.
    The result can be passed as-is to `ocp.StandardCheckpointer().restore(path, abstract)` when all
    items are requested, or with `partial_restore=True` otherwise.
    """
    dtypes = dict(dtypes or {})
    bad = set(dtypes) - set(CASTABLE)
    if bad:
        raise BridgeError(f"dtypes keys {sorted(bad)} unknown; use {', '.join(CASTABLE)}")
    flat: dict[Path, Any] = {}

    def add(role: str) -> None:
        prefix = schema.role_path(role)
        for p, a in stored.section(prefix).items():
            dt = np.dtype(dtypes[role]) if role in dtypes else a.dtype
            flat[prefix + p] = jax.ShapeDtypeStruct(a.shape, dt, sharding=target.sharding(p, a.shape))

    if schema.PARAMS in items:
        add(schema.PARAMS)
    if schema.MODEL in items and stored.has(MODEL):
        add(schema.MODEL)
    if schema.OPT_STATE in items:
        if not stored.has(ADAM):
            raise BridgeError(f"{stored.directory} holds no optimizer state; restore items without opt_state")
        add(schema.MU)
        add(schema.NU)
    for p in ((COUNT,) if schema.OPT_STATE in items else ()) + ((STEP,) if schema.STEP in items else ()):
        if p in stored.arrays:
            a = stored.arrays[p]
            flat[p] = jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=target.replicated())
    return to_orbax_structure(flat)


def to_orbax_structure(flat: Mapping[Path, Any]) -> dict:
    """Nested dicts from full paths, with opt_state as the list `[adam, None, None]` Orbax records."""
    tree = nested_from_paths(flat)
    if schema.OPT_STATE in tree:
        adam = tree[schema.OPT_STATE].get(schema.ADAM_INDEX, {})
        tree[schema.OPT_STATE] = [adam] + [None] * len(schema.ADAMW_EMPTY_INDICES)
    return tree
