"""The logical tree's schema: its roots, where the Adam state lives, and each role's tree path.

A logical checkpoint is the tree a JAX user restores::

    params/<param path>              fp32 master weights (what the optimizer updates)
    model/<param path>               the model's own weights (bf16 / dequantized FP8); optional
    opt_state/0/mu/<param path>      Adam first moment   (optax.adamw's ScaleByAdamState.mu)
    opt_state/0/nu/<param path>      Adam second moment  (ScaleByAdamState.nu)
    opt_state/0/count                completed Adam updates (ScaleByAdamState.count)
    opt_state/1, opt_state/2         adamw's two EmptyState() nodes
    step                             the training step

Every module names these through this one: the names are the on-disk format (Orbax keys), so a
second spelling anywhere would be a second format. A *role* names one per-parameter tree
("model", "params", "mu", "nu"): the converters, live export and reload move a parameter's data
role by role, and `role_path` says where each goes.
"""

from __future__ import annotations

from typing import Sequence

Path = tuple[str, ...]   # a tree path: one string per key, e.g. ("params", "decoder", "w")

# -- roots -----------------------------------------------------------------------------------------
PARAMS = "params"
MODEL = "model"
OPT_STATE = "opt_state"
STEP = "step"
ROOTS = (PARAMS, OPT_STATE, MODEL, STEP)   # the items `restore` can return, in its order

# optax.adamw is chain(scale_by_adam, add_decayed_weights, scale_by_learning_rate): its state is a
# 3-tuple whose element 0 is ScaleByAdamState(count, mu, nu) and elements 1, 2 are EmptyState().
ADAM_INDEX = "0"
MU = "mu"
NU = "nu"
COUNT = "count"
MOMENTS = (MU, NU)
ADAMW_EMPTY_INDICES = ("1", "2")

# -- paths -----------------------------------------------------------------------------------------
PARAMS_PATH: Path = (PARAMS,)
MODEL_PATH: Path = (MODEL,)
STEP_PATH: Path = (STEP,)
OPT_STATE_PATH: Path = (OPT_STATE,)
ADAM_PATH: Path = (OPT_STATE, ADAM_INDEX)
MU_PATH: Path = ADAM_PATH + (MU,)
NU_PATH: Path = ADAM_PATH + (NU,)
COUNT_PATH: Path = ADAM_PATH + (COUNT,)
SCALAR_PATHS = (COUNT_PATH, STEP_PATH)   # the step is read from the count first (completed updates)
SCALAR_DTYPE = "int32"                   # both 0-d: optax's count dtype, so a restored state matches adamw.init

# -- roles -----------------------------------------------------------------------------------------
ROLES = (MODEL, PARAMS, MU, NU)          # writers plan arrays in this order: it is _METADATA's tree order
OPTIMIZER_ROLES = (PARAMS, MU, NU)       # what an optimizer fragment holds (fp32 master, exp_avg, exp_avg_sq)
ROLE_ROOTS: dict[str, Path] = {MODEL: MODEL_PATH, PARAMS: PARAMS_PATH, MU: MU_PATH, NU: NU_PATH}

# torch's names of the Adam state (torch.optim.Adam's state keys, Megatron DistributedOptimizer's
# `optimizer.state.<name>.<param>` keys: the fp32 master is "param") -> role, and back.
STATE_ROLE = {"param": PARAMS, "exp_avg": MU, "exp_avg_sq": NU}
ROLE_STATE = {role: name for name, role in STATE_ROLE.items()}


def role_path(role: str, param: Sequence[str] = ()) -> Path:
    """Tree path of parameter path `param` in `role`'s tree.

    >>> role_path(MU, ("decoder", "w"))
    ('opt_state', '0', 'mu', 'decoder', 'w')
    >>> role_path(MODEL)
    ('model',)
    """
    try:
        root = ROLE_ROOTS[role]
    except KeyError:
        raise ValueError(f"unknown role {role!r}; one of {ROLES}") from None
    return root + tuple(param)


def split_role(path: Sequence[str]) -> tuple[str, Path] | None:
    """(role, parameter path) of a per-parameter array's tree path; None for count, step, others.

    >>> split_role(("opt_state", "0", "nu", "decoder", "w"))
    ('nu', ('decoder', 'w'))
    >>> split_role(("step",)) is None
    True
    """
    for role, root in ROLE_ROOTS.items():
        if in_role(path, role):
            return role, tuple(path[len(root):])
    return None


def in_role(path: Sequence[str], role: str) -> bool:
    """True when `path` is an array of `role`'s tree.

    >>> in_role(("model", "decoder", "w"), MODEL), in_role(("params", "decoder", "w"), MODEL)
    (True, False)
    """
    root = ROLE_ROOTS[role]
    return len(path) > len(root) and tuple(path[:len(root)]) == root


def has_role(paths, role: str) -> bool:
    """True when any of `paths` lies in `role`'s tree (e.g. whether a checkpoint has a model tree)."""
    return any(in_role(p, role) for p in paths)


def to_role(path: Sequence[str], role: str) -> Path:
    """The same parameter's array in another role (e.g. the fp32 master of a weight).

    >>> to_role(("model", "decoder", "w"), MU)
    ('opt_state', '0', 'mu', 'decoder', 'w')
    """
    found = split_role(path)
    if found is None:
        raise ValueError(f"{'/'.join(path)} is not a per-parameter array")
    return role_path(role, found[1])


def adamw_empty_paths(prefix: Sequence[str] = OPT_STATE_PATH) -> list[Path]:
    """Paths of the two `EmptyState()` nodes of `optax.adamw(lr_constant).init(params)`.

    >>> adamw_empty_paths()
    [('opt_state', '1'), ('opt_state', '2')]
    """
    return [tuple(prefix) + (i,) for i in ADAMW_EMPTY_INDICES]
