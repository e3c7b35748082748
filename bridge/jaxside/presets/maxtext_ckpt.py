"""The `maxtext` preset, I/O half: logical checkpoint <-> MaxText train-state checkpoint.

    write_maxtext(src, dst_root)      # a logical (Megatron) checkpoint -> MaxText CheckpointManager step
    read_maxtext(src, dst)            # a MaxText checkpoint (a root, a step dir or its items/) -> logical

MaxText (0.2.5) saves its train state with Orbax's v1 `training.Checkpointer` as checkpointable
`items` of step `<n>`: `<root>/<n>/items/` holding the Linen layout `{params: {params: ...},
opt_state: (ScaleByAdamState(count, mu, nu), <weight-decay state: empty>, ScaleByScheduleState(count)),
step}` (+ `nnx_aux`, its NNX rng state, which it re-initialises when absent). We write exactly
that tree, with the optax state built by `optax.adamw` the way MaxText's optimizer builds it
(`bridge.jaxside.presets.maxtext.maxtext_overrides` are the settings), through the same Orbax API;
a JSON sidecar `<root>/<n>/gtp_bridge_maxtext.json` keeps the base manifest, the preset options and
the overrides so the way back restores hyper-parameters and Megatron's records. MaxText checkpoints
without it (a MaxText run of its own) are read with the hyper-parameters given by the caller.
`write_maxtext` / `read_maxtext` stream the arrays (`maxtext_stream`); `read_logical`, `read_maxtext_tree`
and `train_state` hold whole trees in memory (small checkpoints, tests).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import Any, Mapping

import numpy as np

from bridge.errors import BridgeError
from bridge.format import schema
from bridge.format.manifest import MAXTEXT_KEY, MEGATRON_KEY, Manifest, MegatronRecord, OptimizerConfig, SourceLayout
from bridge.jaxside.presets.maxtext import (Dims, Hyper, Options, active_table, adamw_mask_patterns, decayed,
                                           from_maxtext, maxtext_overrides, to_maxtext)
from bridge.location import local_path
from bridge.progress import progress

SIDECAR = "gtp_bridge_maxtext.json"
ITEMS = "items"
Path = tuple[str, ...]

# MaxText's own train-state tree (its Linen on-disk layout), spelled by MaxText, not by our format:
MT_PARAMS: Path = ("params", "params")   # foreign: maxtext (Linen `params` collection under TrainState.params)
MT_OPT = "opt_state"                     # foreign: maxtext (TrainState.opt_state)
MT_STEP = "step"                         # foreign: maxtext (TrainState.step)
MT_ADAM: Path = (MT_OPT, "0")            # optax.adamw's ScaleByAdamState
MT_COUNT: Path = MT_ADAM + ("count",)    # foreign: optax ScaleByAdamState.count
MT_MOMENT_ROOT = "params"                # foreign: maxtext (mu/nu mirror TrainState.params)
ROLES = schema.OPTIMIZER_ROLES           # the per-parameter trees moved: masters, mu, nu


@dataclass
class Written:
    """What `write_maxtext` wrote: the step directory, MaxText's step (= the Adam count), its config overrides."""

    step_dir: str
    step: int
    overrides: dict
    dims: Dims
    options: Options
    notes: tuple[str, ...] = ()


def schedule_note(rec, count: int) -> str | None:
    """Why MaxText's constant learning rate departs from the Megatron run's schedule after `count`, or None.

    The preset continues at the recorded lr (MaxText's WSD with no warmup and no decay), which is exact
    only where Megatron's own lr and weight decay stay constant from `count` on.

    >>> from bridge.format.scheduler import SchedulerRecord
    >>> r = SchedulerRecord(1e-3, 1e-5, 800, 8000, "cosine", num_steps=1600, increment=8, at_count=200)
    >>> schedule_note(r, 200).startswith("the Megatron run decays its learning rate (cosine to 1e-05")
    True
    >>> schedule_note(r, 50).startswith("the Megatron run is still warming up")   # sample 400 of 800
    True
    >>> schedule_note(SchedulerRecord(1e-3, 1e-3, 0, 0, "constant", num_steps=80, increment=8, at_count=10), 10)
    """
    from bridge.lr_schedule import samples_at

    if rec is None:
        return None
    samples = samples_at(rec, count)
    if samples < float(rec.lr_warmup_steps):
        return (f"the Megatron run is still warming up its learning rate (sample {samples} of "
                f"{rec.lr_warmup_steps}); MaxText continues at the constant recorded lr instead")
    if rec.lr_decay_style != "constant" and samples < float(rec.lr_decay_steps):
        return (f"the Megatron run decays its learning rate ({rec.lr_decay_style} to {rec.min_lr} by sample "
                f"{rec.lr_decay_steps}, now {samples}); MaxText continues at the constant recorded lr instead "
                f"(set MaxText's lr schedule yourself to follow it)")
    if rec.wd_incr_style not in (None, "constant") and rec.wd_incr_steps and samples < float(rec.wd_incr_steps):
        return (f"the Megatron run changes its weight decay ({rec.wd_incr_style} to {rec.end_wd}); MaxText "
                f"continues at the constant recorded weight decay instead")
    return None


# ------------------------------------------------------------------------------------ logical side


def _megatron_args(man: Manifest | None) -> dict:
    meg = man.megatron if man is not None else None
    return dict((meg.args if meg is not None else None) or {})


def _head_dim(man: Manifest | None, args: Mapping) -> int:
    if man is not None:
        for spec in man.fused.values():
            info = spec.get("info") or {}
            if info.get("name") == "qkv" and info.get("head_dim"):
                return int(info["head_dim"])
    if args.get("kv_channels"):
        return int(args["kv_channels"])
    raise BridgeError("cannot tell the head dim: the manifest has no qkv section table and no kv_channels; "
                      "pass head_dim=")


def _check_megatron_args(args: Mapping) -> None:
    """Refuse Megatron settings the preset cannot carry exactly (when the source recorded them)."""
    if args.get("normalization") not in (None, "RMSNorm"):
        raise BridgeError(f"source model uses {args['normalization']}; the maxtext preset needs RMSNorm (llama-style)")
    if args.get("apply_layernorm_1p") or args.get("layernorm_zero_centered_gamma"):
        raise BridgeError("source model uses zero-centred RMSNorm gamma (apply_layernorm_1p); MaxText's llama "
                          "blocks multiply by the scale itself, and shifting fp32 masters by 1 is not exact")
    pos = args.get("position_embedding_type")
    if pos not in (None, "rope"):
        raise BridgeError(f"source model uses {pos} position embeddings; the maxtext preset needs RoPE")
    if args.get("rotary_percent", 1.0) not in (None, 1.0):
        raise BridgeError(f"source model applies RoPE to {args['rotary_percent']} of the head dim; the maxtext "
                          f"preset needs rotary_percent 1.0")
    if args.get("num_experts"):
        raise BridgeError("source model is a mixture of experts; the maxtext preset covers dense llama-style models")


def _nbytes(ck: Any, paths: list[Path]) -> int:
    infos = ck.arrays()
    return sum(int(np.prod(infos[p].shape)) * np.dtype(infos[p].dtype).itemsize for p in paths)


def read_logical(src: str) -> tuple[Manifest | None, dict[str, dict[Path, np.ndarray]], int, int]:
    """(manifest, {role: {param path: array}} for the masters and both moments, Adam count, step) of a
    logical checkpoint."""
    from bridge.store.reader import open_checkpoint

    ck = open_checkpoint(src)
    trees: dict[str, dict[Path, np.ndarray]] = {r: {} for r in ROLES}
    count = step = None
    wanted = [p for p in ck.paths() if (schema.split_role(p) or ("",))[0] in trees]
    with progress(_nbytes(ck, wanted), f"read {os.path.basename(os.path.abspath(src))}") as bar:
        for p in wanted:
            role, param = schema.split_role(p)
            trees[role][param] = ck.read(p)
            bar.update(trees[role][param].nbytes)
    for p in ck.paths():
        if p == schema.COUNT_PATH:
            count = int(ck.read(p))
        elif p == schema.STEP_PATH:
            step = int(ck.read(p))
    if not all(trees.values()) or count is None:
        raise BridgeError(f"{src} has no full Adam state (masters, both moments and the count); the maxtext preset "
                          f"writes the weights and the optimizer state together")
    return ck.manifest, trees, count, step if step is not None else count


def hyper_of(man: Manifest | None, shapes: Mapping[Path, tuple[int, ...]]) -> Hyper:
    """AdamW settings from a manifest (Megatron's defaults where absent; `shapes`: logical param shapes
    for Megatron's default no-decay rule when the manifest records no no-decay set)."""
    from bridge.jaxside.manifest_view import adam_hparams, megatron_default_no_decay

    if man is None:
        raise BridgeError("source checkpoint has no gtp-bridge manifest; hyper-parameters are unknown")
    h = adam_hparams(man)
    if h.lr is None:
        raise BridgeError("manifest records no learning rate; the MaxText optimizer needs one")
    no_decay = tuple(sorted(h.no_decay)) if h.no_decay is not None else ()
    if h.no_decay is None:
        no_decay = tuple(sorted(p for p, shape in shapes.items() if megatron_default_no_decay(p, tuple(shape))))
    return Hyper(lr=float(h.lr), b1=h.b1, b2=h.b2, eps=h.eps, weight_decay=h.weight_decay, clip_grad=h.clip_grad,
                 no_decay=no_decay)


# ------------------------------------------------------------------------------------ MaxText side


def maxtext_optimizer(hyper: Hyper, dims: Dims, opts: Options):
    """`optax.adamw` as MaxText's `get_optimizer` builds it for `maxtext_overrides(...)` (constant lr)."""
    import jax
    import optax

    patterns = adamw_mask_patterns(hyper.no_decay, dims, opts)

    def mask(params):
        from bridge.jaxside.keypaths import to_path

        return jax.tree_util.tree_map_with_path(lambda kp, _: decayed(to_path(kp), patterns), params)

    lr = optax.constant_schedule(hyper.lr)
    return optax.adamw(lr, b1=hyper.b1, b2=hyper.b2, eps=hyper.eps, eps_root=0.0, weight_decay=hyper.weight_decay,
                       mu_dtype=None, mask=mask if patterns else None)


def train_state(params: Mapping[Path, np.ndarray], mu: Mapping[Path, np.ndarray], nu: Mapping[Path, np.ndarray],
                count: int, step: int, hyper: Hyper, dims: Dims, opts: Options) -> dict:
    """MaxText's Linen train-state tree (step, params/params, opt_state) filled from numpy leaves."""
    import jax
    import jax.numpy as jnp
    import optax

    from bridge.jaxside.keypaths import nested_from_paths
    from bridge.jaxside.optax_state import classify

    tx = maxtext_optimizer(hyper, dims, opts)
    p_tree = {MT_MOMENT_ROOT: nested_from_paths({k: jnp.asarray(v) for k, v in params.items()})}
    template = jax.eval_shape(tx.init, p_tree)
    moments = {schema.MU: mu, schema.NU: nu}

    def fill(kp, leaf):
        role = classify(kp)
        if role is None:
            raise BridgeError(f"MaxText optimizer state leaf {jax.tree_util.keystr(kp)} is not an Adam leaf")
        if role.kind == schema.COUNT:
            return jnp.asarray(count, dtype=leaf.dtype)
        if role.kind in moments:
            return jnp.asarray(moments[role.kind][role.param[1:]], dtype=leaf.dtype)
        raise BridgeError(f"MaxText optimizer state leaf {jax.tree_util.keystr(kp)} is not an Adam leaf")

    opt_state = jax.tree_util.tree_map_with_path(fill, template)
    # MaxText's NNX train state stores every empty optax state as None (its opt_state's element 1), where
    # adamw's weight-decay mask would nest one as MaskedState(inner_state): same leaves, its tree.
    opt_state = tuple(optax.EmptyState() if not jax.tree_util.tree_leaves(s) else s for s in opt_state)
    return {MT_STEP: jnp.asarray(step, dtype=jnp.int32), MT_PARAMS[0]: p_tree, MT_OPT: opt_state}


def write_maxtext(src: str, dst_root: str, *, decoder_block: str = "qwen2", scan_layers: bool = True,
                  max_target_length: int | None = None, stream=None) -> Written:
    """Write the logical checkpoint `src` as a step of MaxText checkpoint root `dst_root`.

    MaxText names a step directory by the index of the last step taken (`count - 1`) and stores
    `step = count` (the step it continues from), so Megatron's iteration n (n updates) becomes
    `<dst_root>/<n - 1>/` with `step = n`. Streamed chunk by chunk within a budget
    (`maxtext_stream.StreamOptions`: workers, budget, progress); local paths, s3:// or gs://.
    """
    from bridge.jaxside.presets.maxtext_stream import stream_to_maxtext

    return stream_to_maxtext(src, dst_root, decoder_block=decoder_block, scan_layers=scan_layers,
                             max_target_length=max_target_length, stream=stream)


# ------------------------------------------------------------------------------------ the way back


def find_items(src: str) -> str:
    """The `items` directory of a MaxText checkpoint given as a root (latest step), a step dir or `items/`."""
    src = os.path.abspath(src)
    if os.path.basename(src) == ITEMS and os.path.isdir(src):
        return src
    if os.path.isdir(os.path.join(src, ITEMS)):
        return os.path.join(src, ITEMS)
    steps = sorted(int(n) for n in (os.listdir(src) if os.path.isdir(src) else [])
                   if n.isdigit() and os.path.isdir(os.path.join(src, n, ITEMS)))
    if not steps:
        raise BridgeError(f"{src} is not a MaxText checkpoint (no items/ and no <step>/items/); pass its root, "
                          f"a step directory or the items directory")
    return os.path.join(src, str(steps[-1]), ITEMS)


def find_sidecar(items: str) -> str | None:
    """The sidecar of this step, else of the latest earlier step in the same root (the step gtp-bridge
    wrote that MaxText resumed from and saved after), else None."""
    step_dir = os.path.dirname(items)
    own = os.path.join(step_dir, SIDECAR)
    if os.path.exists(own):
        return own
    root, name = os.path.split(step_dir)
    if not name.isdigit():
        return None
    earlier = sorted((int(n) for n in os.listdir(root) if n.isdigit() and int(n) < int(name)
                      and os.path.exists(os.path.join(root, n, SIDECAR))), reverse=True)
    return os.path.join(root, str(earlier[0]), SIDECAR) if earlier else None


def read_maxtext_tree(items: str) -> tuple[dict[str, dict[Path, np.ndarray]], int, int]:
    """({role: {path under MaxText's params: array}} for masters and moments, Adam count, step) of an items dir."""
    from bridge.store.reader import open_checkpoint

    ck = open_checkpoint(items)
    trees: dict[str, dict[Path, np.ndarray]] = {r: {} for r in ROLES}
    moment_roots = {MT_ADAM + (m, MT_MOMENT_ROOT): m for m in schema.MOMENTS}
    count = step = None
    wanted = [p for p in ck.paths() if p[:2] == MT_PARAMS or p[:4] in moment_roots]
    with progress(_nbytes(ck, wanted), f"read {os.path.basename(os.path.dirname(items))}") as bar:
        for p in wanted:
            role, param = (schema.PARAMS, p[2:]) if p[:2] == MT_PARAMS else (moment_roots[p[:4]], p[4:])
            trees[role][param] = ck.read(p)
            bar.update(trees[role][param].nbytes)
    for p in ck.paths():
        if p == MT_COUNT:
            count = int(ck.read(p))
        elif p == (MT_STEP,):
            step = int(ck.read(p))
    if not trees[schema.PARAMS]:
        raise BridgeError(f"{items} has no MaxText parameter tree; is it a MaxText train-state checkpoint?")
    if not all(trees.values()) or count is None:
        raise BridgeError(f"{items} holds no Adam state (moments and count); the maxtext preset needs MaxText's "
                          f"adamw state (opt_type=adamw)")
    return trees, count, step if step is not None else count


def llama_args(dims: Dims, rotary_base: float = 10000.0, norm_epsilon: float = 1e-5) -> dict:
    """The Megatron-LM args of the llama-style model a MaxText tree describes (for to-megatron)."""
    return dict(num_layers=dims.layers, hidden_size=dims.hidden, ffn_hidden_size=dims.ffn,
                num_attention_heads=dims.heads, num_query_groups=dims.kv_heads,
                group_query_attention=dims.kv_heads != dims.heads, kv_channels=dims.head_dim, swiglu=True,
                padded_vocab_size=dims.vocab, untie_embeddings_and_output_weights=not dims.tied,
                normalization="RMSNorm", norm_epsilon=norm_epsilon, position_embedding_type="rope",
                rotary_base=rotary_base, rotary_percent=1.0, rotary_interleaved=False, add_bias_linear=False,
                bf16=True, optimizer="adam")


def _manifest_for(dims: Dims, hyper: Hyper, count: int, base: Mapping | None, opts: Options,
                  rotary_base: float, norm_epsilon: float) -> Manifest:
    from bridge.layout.fused import FusedSpec

    fused = {"decoder/layers/self_attention/linear_qkv/weight": FusedSpec.qkv(dims.heads, dims.kv_heads,
                                                                             dims.head_dim).to_json(),
             "decoder/layers/mlp/linear_fc1/weight": FusedSpec.swiglu(dims.ffn).to_json()}
    if base is not None:
        man = Manifest.from_json(base)
        man.arrays = {}
        man.digest_algorithm = ""
        man.optimizer.step = count
        man.fused = {**fused, **man.fused}
        man.extra = dict(man.extra)
        man.extra[MAXTEXT_KEY] = {"options": asdict(opts)}
        return man
    no_decay = ["/".join(p) for p in hyper.no_decay]
    return Manifest(source=SourceLayout(framework="maxtext", optimizer_format="maxtext"),
                    optimizer=OptimizerConfig(name="adamw", lr=hyper.lr, betas=(hyper.b1, hyper.b2), eps=hyper.eps,
                                              weight_decay=hyper.weight_decay, step=count, no_decay=no_decay,
                                              clip_grad=hyper.clip_grad),
                    fused=fused,
                    extra={MEGATRON_KEY: MegatronRecord(args=llama_args(dims, rotary_base, norm_epsilon)).to_json(),
                           MAXTEXT_KEY: {"options": asdict(opts)}})


def read_maxtext(src: str, dst: str, *, hyper: Hyper | None = None, options: Options | None = None,
                 rotary_base: float | None = None, norm_epsilon: float | None = None, stream=None) -> dict:
    """Write a MaxText checkpoint (root / step dir / items dir) as the logical checkpoint `dst`.

    A checkpoint `write_maxtext` made carries its sidecar (preset options, hyper-parameters, the base
    manifest: Megatron's records come back). Any other MaxText checkpoint needs `hyper` (its AdamW
    settings; the no-decay set defaults to the norms, Megatron's rule) and, for the llama2 block,
    `options=Options(decoder_block="llama2")` (the query scale is unfolded). Streamed chunk by chunk
    within a budget (`maxtext_stream.StreamOptions`); local paths, s3:// or gs://.
    """
    from bridge.jaxside.presets.maxtext_stream import stream_from_maxtext

    return stream_from_maxtext(src, dst, hyper=hyper, options=options, rotary_base=rotary_base,
                               norm_epsilon=norm_epsilon, stream=stream)
