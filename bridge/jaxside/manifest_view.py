"""What the JAX side needs from a checkpoint's manifest: section orders and AdamW hyper-parameters.

`optimizer_from_manifest(manifest)` returns a ready `optax.adamw` with Megatron's betas, eps,
weight decay, learning rate (Megatron's recorded lr schedule when the converter found one, see
`bridge.lr_schedule`) and its no-decay parameter group as the weight-decay mask. The
no-decay set is, in order of preference: the manifest's `no_decay` list, the params of groups with
`wd_mult == 0`, else Megatron's default rule (`get_standard_config_overrides`: biases and
parameters whose own shape is 1-D, i.e. ignoring stacked-layer and expert axes).
With `clip_grad=True` (opt-in: it changes the optax state's tree) the manifest's recorded
`clip_grad` is applied first, with Megatron's formula (`megatron_clip_by_global_norm`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

from bridge.errors import BridgeError
from bridge.jaxside.keypaths import Path, to_path
from bridge.format.manifest import GROUP_PARAMS, Manifest, as_manifest  # noqa: F401 - as_manifest: one parser, re-exported
from bridge.jaxside.naming import Plan, leading_axes


def _split(key: str) -> Path:
    return tuple(c for c in key.replace(".", "/").split("/") if c)


def section_orders(manifest: Manifest | Mapping | None) -> dict[Path, list[str]]:
    """Fused parameter path -> its section names in fused order (from the manifest's section table).

    >>> m = Manifest(fused={"decoder/layers/mlp/linear_fc1/weight": {"kind": "swiglu", "sections": [["gate", 4], ["up", 4]]}})
    >>> section_orders(m)
    {('decoder', 'layers', 'mlp', 'linear_fc1', 'weight'): ['gate', 'up']}
    """
    m = as_manifest(manifest)
    if m is None:
        return {}
    out = {}
    for key, spec in m.fused.items():
        try:
            out[_split(key)] = [str(name) for name, _ in spec["sections"]]
        except (KeyError, TypeError, ValueError):
            raise BridgeError(f"manifest section table for {key} is malformed; re-export the checkpoint") from None
    return out


def param_paths(key: str, orders: Mapping[Path, list[str]]) -> list[Path]:
    """Logical parameter paths a manifest key names: a fused parameter's key (as the live adapter
    writes it) stands for all its sections (as the converter writes them).

    >>> orders = {("a", "qkv", "bias"): ["query", "key", "value"]}
    >>> param_paths("a/qkv/bias", orders)
    [('a', 'qkv', 'bias', 'query'), ('a', 'qkv', 'bias', 'key'), ('a', 'qkv', 'bias', 'value')]
    >>> param_paths("a.qkv.bias.key", orders), param_paths("a/ln/weight", orders)
    ([('a', 'qkv', 'bias', 'key')], [('a', 'ln', 'weight')])
    """
    path = _split(key)
    return [path + (name,) for name in orders[path]] if path in orders else [path]


@dataclass(frozen=True)
class AdamHParams:
    """AdamW hyper-parameters as optax names them; `no_decay` holds logical parameter paths."""

    lr: float | None
    b1: float
    b2: float
    eps: float
    weight_decay: float
    no_decay: frozenset[Path] | None
    clip_grad: float | None = None  # Megatron's global-norm clipping threshold (None / 0 = off)


def adam_hparams(manifest: Manifest | Mapping) -> AdamHParams:
    """AdamW hyper-parameters from a manifest, with Megatron's defaults for absent ones."""
    m = as_manifest(manifest)
    o = m.optimizer.with_defaults().check("checkpoint manifest")
    if o.name and o.name.lower() not in ("adam", "adamw", "fusedadam"):
        raise BridgeError(f"checkpoint optimizer is {o.name!r}, not Adam/AdamW; build the optax optimizer yourself")
    b1, b2 = o.betas
    no_decay: set[Path] | None = None
    orders = section_orders(m)
    if o.no_decay:
        no_decay = {p for k in o.no_decay for p in param_paths(k, orders)}
    elif any("wd_mult" in g and g.get(GROUP_PARAMS) for g in o.groups):
        no_decay = {p for g in o.groups if g.get("wd_mult", 1.0) == 0.0 for k in g.get(GROUP_PARAMS, [])
                    for p in param_paths(k, orders)}
    return AdamHParams(lr=o.lr, b1=float(b1), b2=float(b2), eps=float(o.eps), weight_decay=float(o.weight_decay),
                       no_decay=frozenset(no_decay) if no_decay is not None else None,
                       clip_grad=float(o.clip_grad) if o.clip_grad else None)


def megatron_default_no_decay(path: Path, shape: tuple[int, ...]) -> bool:
    """Megatron's default no-weight-decay rule: biases and parameters whose own shape is 1-D.

    >>> megatron_default_no_decay(("decoder", "layers", "input_layernorm", "weight"), (4, 64))
    True
    >>> megatron_default_no_decay(("decoder", "layers", "mlp", "linear_fc2", "weight"), (4, 64, 32))
    False
    """
    own = len(shape) - sum(leading_axes(path))
    return path[-1] == "bias" or own <= 1


def decay_mask(manifest: Manifest | Mapping, plan: Plan | None = None) -> Callable[[Any], Any]:
    """`mask(params) -> tree of bools` (True = apply weight decay) for optax.adamw.

    With a naming `plan`, a presented parameter is decayed iff its logical sources are.
    """
    import jax

    h = adam_hparams(manifest)
    sources = plan_sources(plan)

    def no_decay(path: Path, shape: tuple[int, ...]) -> bool:
        logical = sources.get(path, (path,))
        if h.no_decay is not None:
            return all(p in h.no_decay for p in logical)
        return megatron_default_no_decay(logical[0], shape if plan is None else plan_shape(plan, logical[0]))

    def mask(params: Any) -> Any:
        return jax.tree_util.tree_map_with_path(lambda kp, x: not no_decay(to_path(kp), tuple(x.shape)), params)

    return mask


def plan_sources(plan: Plan | None) -> dict[Path, tuple[Path, ...]]:
    """Presented path -> the logical source paths it is built from (empty without a plan)."""
    return {o: g.sources for g in plan.groups for o in g.outputs} if plan is not None else {}


def plan_shape(plan: Plan, source: Path) -> tuple[int, ...]:
    """Logical shape of a source array of a naming plan."""
    for g in plan.groups:
        if source in g.sources:
            return g.source_shapes[g.sources.index(source)]
    raise KeyError(source)


def scheduler_of(manifest: Manifest | Mapping | None):
    """The Megatron scheduler record (`extra.megatron.scheduler`) as a SchedulerRecord, or None."""
    from bridge.format.scheduler import SchedulerRecord

    m = as_manifest(manifest)
    meg = m.megatron if m is not None else None
    rec = meg.scheduler if meg is not None else None
    return None if rec is None else SchedulerRecord.from_json(rec)


def megatron_clip_by_global_norm(max_norm: float):
    """Megatron's gradient clipping (`clip_grad_by_total_norm_fp32`) as an optax transformation.

    `coeff = max_norm / (||g||_2 + 1e-6)`; the grads are multiplied by `coeff` when it is below 1.
    (optax.clip_by_global_norm divides by the norm without the 1e-6 and clips at `norm >= max_norm`.)
    Its state is `optax.EmptyState()`, so templates and saved states keep their Adam leaves only.
    """
    import jax
    import jax.numpy as jnp
    import optax

    if not max_norm > 0:
        raise BridgeError(f"clip_grad must be > 0 (got {max_norm}); pass clip_grad=False for no clipping")

    def init(params: Any) -> Any:
        del params
        return optax.EmptyState()

    def update(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        del params
        norm = optax.tree.norm(updates) if hasattr(optax, "tree") else optax.global_norm(updates)
        coeff = jnp.float32(max_norm) / (norm.astype(jnp.float32) + jnp.float32(1e-6))
        scaled = jax.tree.map(lambda g: jnp.where(coeff < 1.0, g * coeff.astype(g.dtype), g), updates)
        return scaled, state

    return optax.GradientTransformation(init, update)


def optimizer_from_manifest(manifest: Manifest | Mapping, learning_rate: Any = None, plan: Plan | None = None,
                            clip_grad: bool | float = False):
    """A ready `optax.adamw` with the checkpoint's hyper-parameters and no-decay mask.

    `clip_grad=True` chains Megatron's global-norm clipping (`megatron_clip_by_global_norm`) at the
    manifest's recorded threshold before Adam (BridgeError when the manifest records none: never
    silently unclipped); a float clips at that threshold. The optimizer state is then
    `(EmptyState(), <adamw state>)`: build restore templates from this same optimizer.

    The learning rate is, in order: `learning_rate` (a float or an optax schedule), Megatron's
    recorded `OptimizerParamScheduler` (an optax schedule of the Adam count that continues the run's
    warmup/decay exactly, `bridge.lr_schedule`; its weight-decay increment too), else the
    manifest's constant lr. Param groups with an lr multiplier or, under the recorded schedule, their
    own `max_lr`/`min_lr` (and a `params` list) become `optax.multi_transform` groups of adamw.
    """
    import optax

    manifest = as_manifest(manifest)  # parse a JSON dict once, not in every helper below
    tx = _adamw_from_manifest(manifest, learning_rate, plan)
    if clip_grad is False or clip_grad is None:
        return tx
    if clip_grad is True:
        threshold = adam_hparams(manifest).clip_grad
        if threshold is None:
            raise BridgeError("manifest records no clip_grad (the run did not clip, or the writer predates the "
                              "record); pass clip_grad=<threshold> or clip_grad=False")
    else:
        threshold = float(clip_grad)
    return optax.chain(megatron_clip_by_global_norm(threshold), tx)


def _adamw_from_manifest(manifest: Manifest | Mapping, learning_rate: Any, plan: Plan | None):
    """optimizer_from_manifest without clipping."""
    import optax

    from bridge.lr_schedule import megatron_lr_schedule, megatron_wd_schedule

    h = adam_hparams(manifest)
    rec = scheduler_of(manifest) if learning_rate is None else None
    lr = learning_rate if learning_rate is not None else (megatron_lr_schedule(rec) if rec is not None else h.lr)
    if lr is None:
        raise BridgeError("manifest records no learning rate; pass learning_rate= (a float or an optax schedule)")
    wd = megatron_wd_schedule(rec) if rec is not None else None
    wd = h.weight_decay if wd is None or not callable(wd) else wd

    def own_range(g: dict) -> bool:  # a group on its own max_lr/min_lr under the recorded schedule
        return rec is not None and any(k in g and g[k] is not None and float(g[k]) != float(getattr(rec, k))
                                       for k in ("max_lr", "min_lr"))

    groups = [g for g in as_manifest(manifest).optimizer.groups
              if float(g.get("lr_mult", 1.0)) != 1.0 or own_range(g)]
    if not groups:
        return optax.adamw(lr, b1=h.b1, b2=h.b2, eps=h.eps, weight_decay=wd, mask=decay_mask(manifest, plan))

    def group_lr(g: dict):
        m = float(g.get("lr_mult", 1.0))
        base = megatron_lr_schedule(rec, g.get("max_lr"), g.get("min_lr")) if own_range(g) else lr
        if m == 1.0:
            return base
        return (lambda step: base(step) * m) if callable(base) else base * m

    return _grouped_adamw(manifest, h, lr, groups, plan, group_lr, wd)


def _grouped_adamw(manifest: Manifest | Mapping, h: AdamHParams, lr: Any, groups: list[dict], plan: Plan | None,
                   group_lr: Callable[[dict], Any], wd: Any):
    """Megatron param groups with their own lr -> optax.multi_transform of adamw per group."""
    import jax
    import optax

    orders = section_orders(manifest)
    label_of: dict[Path, str] = {}
    lrs: dict[str, Any] = {"default": lr}
    for i, g in enumerate(groups):
        if not g.get(GROUP_PARAMS):
            raise BridgeError(f"manifest param group {i} with its own lr (lr_mult {g.get('lr_mult')}, max_lr "
                              f"{g.get('max_lr')}) lists no params; build the optimizer yourself with optax.multi_transform")
        label = f"group{i}"
        lrs[label] = group_lr(g)
        for key in g[GROUP_PARAMS]:
            for p in param_paths(key, orders):
                label_of[p] = label
    sources = plan_sources(plan)

    def labels(params: Any) -> Any:
        def one(kp, _):
            logical = sources.get(to_path(kp), (to_path(kp),))
            return label_of.get(logical[0], "default")
        return jax.tree_util.tree_map_with_path(one, params)

    mask = decay_mask(manifest, plan)
    txs = {label: optax.adamw(glr, b1=h.b1, b2=h.b2, eps=h.eps, weight_decay=wd, mask=mask)
           for label, glr in lrs.items()}
    return optax.multi_transform(txs, labels)
