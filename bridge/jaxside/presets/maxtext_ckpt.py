"""The `maxtext` preset, I/O half: logical checkpoint <-> MaxText train-state checkpoint.

    maxtext_stream.write_maxtext(src, dst_root)   # a logical (Megatron) checkpoint -> MaxText CheckpointManager step
    maxtext_stream.read_maxtext(src, dst)         # a MaxText checkpoint (a root, a step dir or its items/) -> logical

MaxText (0.2.5) saves its train state with Orbax's v1 `training.Checkpointer` as checkpointable
`items` of step `<n>`: `<root>/<n>/items/` holding the Linen layout `{params: {params: ...},
opt_state: (ScaleByAdamState(count, mu, nu), <weight-decay state: empty>, ScaleByScheduleState(count)),
step}` (+ `nnx_aux`, its NNX rng state, which it re-initialises when absent). We write exactly
that tree, with the optax state built by `optax.adamw` the way MaxText's optimizer builds it
(`bridge.jaxside.presets.maxtext.maxtext_overrides` are the settings), through the same Orbax API;
a JSON sidecar `<root>/<n>/gtp_bridge_maxtext.json` keeps the base manifest, the preset options and
the overrides so the way back restores hyper-parameters and Megatron's records. MaxText checkpoints
without it (a MaxText run of its own) are read with the hyper-parameters given by the caller.
The two entry points `write_maxtext` / `read_maxtext` are in `maxtext_stream` (they stream the arrays
and build on this module's tree and sidecar); `read_logical`, `read_maxtext_tree` and `train_state` hold
whole trees in memory (small checkpoints, tests).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import Any, Mapping

import numpy as np

from bridge.dtypes import numpy_dtype
from bridge.errors import BridgeError, IntegrityError
from bridge.format import schema
from bridge.format.manifest import (MAXTEXT_KEY, MEGATRON_KEY, Manifest, MegatronRecord, OptimizerConfig,
                                   SourceLayout, check_step)
from bridge.jaxside.presets.maxtext import (Dims, Hyper, Options, adamw_mask_patterns, decayed, maxtext_moe_module,
                                           maxtext_shapes)
from bridge.jaxside.presets.maxtext_moe import block_of_module, check_moe_args
from bridge.location import absolute, basename, join
from bridge.progress import progress
from bridge.store import open_storage

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
    check_moe_args(args)


def _scalar(ck: Any, p: Path, name: str) -> int:
    """A step or Adam count: a 0-d integer array holding a value in [0, 2**31 - 1] (else one line naming it)."""
    info = ck.checked_info(p)
    where = f"{ck.root}: {'/'.join(p)}"
    if info.shape != () or not np.issubdtype(np.dtype(numpy_dtype(info.dtype)), np.integer):
        raise IntegrityError(f"{where} is a {info.dtype} array of shape {info.shape}, not an integer scalar; "
                             f"the checkpoint is damaged")
    return check_step(ck.read(p).item(), name, where)


def read_logical(src: str) -> tuple[Manifest | None, dict[str, dict[Path, np.ndarray]], int, int]:
    """(manifest, {role: {param path: array}} for the masters and both moments, Adam count, step) of a
    logical checkpoint."""
    from bridge.store import open_checkpoint

    ck = open_checkpoint(src)
    trees: dict[str, dict[Path, np.ndarray]] = {r: {} for r in ROLES}
    count = step = None
    wanted = [p for p in ck.paths() if (schema.split_role(p) or ("",))[0] in trees]
    total = sum(ck.checked_info(p).nbytes for p in wanted)  # shapes and dtypes as the manifest records them
    ck.check_read_bytes(total, "the masters and moments")  # before any read: every one is read whole
    with progress(total, f"read {os.path.basename(os.path.abspath(src))}") as bar:
        for p in wanted:
            role, param = schema.split_role(p)
            trees[role][param] = ck.read(p)
            bar.update(trees[role][param].nbytes)
    for p in ck.paths():
        if p == schema.COUNT_PATH:
            count = _scalar(ck, p, "Adam count")
        elif p == schema.STEP_PATH:
            step = _scalar(ck, p, "step")  # foreign: the name in messages
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


# ------------------------------------------------------------------------------------ the way back


def find_items(src: str) -> str:
    """The `items` directory of a MaxText checkpoint given as a root (latest step), a step directory or
    `items/` itself, on a file system or object storage alike (a path made absolute, or the URL): an
    items directory counts once its `_METADATA` is there (Orbax writes it last)."""
    storage = open_storage(src, "source")
    root = absolute(storage.root)
    if basename(root) == ITEMS and storage.exists("_METADATA"):
        return root
    if storage.exists(f"{ITEMS}/_METADATA"):
        return join(root, ITEMS)
    steps = _steps_holding(storage, f"{ITEMS}/_METADATA")
    if not steps:
        raise BridgeError(f"{src} is not a MaxText checkpoint (no items/ and no <step>/items/); pass its root, "
                          f"a step directory or the items directory")
    return join(root, str(steps[-1]), ITEMS)


def find_sidecar(items: str) -> str | None:
    """The sidecar of this step, else of the latest earlier step in the same root (the step gtp-bridge
    wrote that MaxText resumed from and saved after), else None; a path or a URL."""
    step_dir = _parent(items)
    if open_storage(step_dir, "source").exists(SIDECAR):
        return join(step_dir, SIDECAR)
    root, name = _parent(step_dir), basename(step_dir)
    if not name.isdigit():
        return None
    earlier = [n for n in _steps_holding(open_storage(root, "source"), SIDECAR) if n < int(name)]
    return join(root, str(earlier[-1]), SIDECAR) if earlier else None


def read_sidecar(items: str) -> Sidecar | None:
    """The sidecar `find_sidecar` finds for an items directory, parsed and checked (`load_sidecar`), or None."""
    path = find_sidecar(items)
    if path is None:
        return None
    raw = open_storage(_parent(path), "source").read_bytes(basename(path))
    return load_sidecar(path, raw if raw is not None else b"")


def _steps_holding(storage: Any, name: str) -> list[int]:
    """The step numbers `n`, ascending, of the keys `n/name` under a MaxText root.

    >>> import tempfile; root = tempfile.mkdtemp()
    >>> for k in ("3/items/_METADATA", "12/items/_METADATA", "7/other", "x/items/_METADATA"):
    ...     os.makedirs(os.path.dirname(os.path.join(root, k)), exist_ok=True); open(os.path.join(root, k), "w").close()
    >>> _steps_holding(open_storage(root), "items/_METADATA")
    [3, 12]
    """
    return sorted({int(k.split("/", 1)[0]) for k in storage.list_keys()
                   if k.split("/", 1)[0].isdigit() and k.split("/", 1)[1:] == [name]})


def _parent(where: str) -> str:
    """The directory holding a path or URL (`/a/b/items` -> `/a/b`)."""
    return where.rstrip("/").rsplit("/", 1)[0]


@dataclass(frozen=True)
class Sidecar:
    """`gtp_bridge_maxtext.json`, parsed and checked (`load_sidecar`)."""

    options: Options
    dims: Dims
    hyper: Hyper
    overrides: dict
    adam_count: int
    base_manifest: dict | None


SIDECAR_KEYS = ("format", "options", "dims", "hyper", "overrides", "adam_count", "base_manifest")
SIDECAR_FORMAT = 1


def _fields(d: Any, cls: type, what: str, types: Mapping[str, tuple]) -> dict:
    """`d` as the keyword arguments of dataclass `cls`: a JSON object with exactly its fields, each of `types`."""
    from dataclasses import MISSING, fields

    if not isinstance(d, dict):
        raise ValueError(f"{what} is a {type(d).__name__}, not a JSON object")
    names = [f.name for f in fields(cls)]
    # a field with a default may be absent (sidecars written before it existed: dense Dims have no experts)
    required = [f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING]
    missing, extra = [n for n in required if n not in d], sorted(set(d) - set(names))
    if missing or extra:
        raise ValueError(f"{what} " + (f"lacks {missing[0]!r}" if missing else f"has unknown key {extra[0]!r}"))
    for k, v in d.items():
        if k in types and not (isinstance(v, types[k]) and not (isinstance(v, bool) and bool not in types[k])):
            raise ValueError(f"{what}.{k} is {v!r}, not {' or '.join(t.__name__ for t in types[k])}")
    return dict(d)


def load_sidecar(path: str, raw: bytes | None = None) -> Sidecar:
    """Parse and check a sidecar (the file `path`, or its bytes `raw` read from object storage): one-line
    BridgeError naming the file and the cause on any defect (not JSON, not an object, a key missing or
    unknown, a value of the wrong type or out of range)."""
    num, opt_num = (int, float), (int, float, type(None))
    try:
        if raw is None:
            with open(path, "rb") as f:
                raw = f.read(64 << 20)
        d = json.loads(raw)
        if not isinstance(d, dict):
            raise ValueError(f"it is a JSON {type(d).__name__}, not an object")
        missing, extra = [k for k in SIDECAR_KEYS if k not in d], sorted(set(d) - set(SIDECAR_KEYS))
        if missing or extra:
            raise ValueError(f"key {missing[0]!r} is missing" if missing else f"key {extra[0]!r} is unknown")
        if d["format"] != SIDECAR_FORMAT or isinstance(d["format"], bool):
            raise ValueError(f"format {d['format']!r} is not {SIDECAR_FORMAT}")
        opts = Options(**_fields(d["options"], Options, "options",
                                 {"decoder_block": (str,), "scan_layers": (bool,), "rotary_interleaved": (bool,)}))
        dims = Dims(**_fields(d["dims"], Dims, "dims", {"tied": (bool,), **{k: (int,) for k in
                              ("layers", "hidden", "ffn", "heads", "kv_heads", "head_dim", "vocab", "experts", "topk")}}))
        h = _fields(d["hyper"], Hyper, "hyper", {"lr": num, "b1": num, "b2": num, "eps": num, "weight_decay": num,
                                                 "clip_grad": opt_num, "no_decay": (list,)})
        if not all(isinstance(q, list) and q and all(isinstance(c, str) for c in q) for q in h["no_decay"]):
            raise ValueError("hyper.no_decay is not a list of parameter paths (lists of names)")
        hyper = Hyper(**{**h, "no_decay": tuple(tuple(q) for q in h["no_decay"])})
        overrides = d["overrides"]
        if not isinstance(overrides, dict):
            raise ValueError(f"overrides is a {type(overrides).__name__}, not a JSON object")
        for key in ("rope_max_timescale", "normalization_layer_epsilon"):
            v = overrides.get(key, 1.0)
            if isinstance(v, bool) or not isinstance(v, num) or not 0 < v < float("inf"):
                raise ValueError(f"overrides.{key} is {v!r}, not a positive number")
        count = check_step(d["adam_count"], "adam_count", "sidecar")
        base = d["base_manifest"]
        if base is not None:
            Manifest.from_json(base).optimizer.check("base_manifest")  # malformed or out of range: below
    except OSError as e:
        raise BridgeError(f"{path}: cannot read the gtp-bridge MaxText sidecar ({e.strerror or e})") from None
    except (ValueError, TypeError, RecursionError, BridgeError) as e:  # JSONDecodeError is a ValueError
        cause = " ".join(str(e).split())[:300]
        raise BridgeError(f"{path}: malformed gtp-bridge MaxText sidecar: {cause}; restore the file that to-maxtext "
                          f"wrote, or remove it and give the AdamW settings (--lr, --betas, ...)") from None
    return Sidecar(opts, dims, hyper, dict(overrides), count, base)


def _check_tree(ck: Any, items: str, infos: Mapping[Path, Any], roles: Mapping[Path, tuple[str, Path]],
                side: Sidecar | None, topk: int = 0) -> None:
    """Every MaxText leaf read is checked from its zarr metadata alone, before any allocation: masters and
    moments are floating arrays of exactly the shapes the model's sizes give (sizes derived from the
    query, key, mlp and embedding leaves, and equal to the sidecar's when there is one), all of them
    together no more than the stored bytes can hold (the count and step: `_scalar`)."""
    from bridge.format.tree import path_str

    params = {role_p[1]: infos[p].shape for p, role_p in roles.items() if role_p[0] == schema.PARAMS}
    if not params:
        raise BridgeError(f"{items} has no MaxText parameter tree; is it a MaxText train-state checkpoint?")
    dims, scanned = Dims.from_maxtext(params, topk=side.dims.topk if side is not None else topk)
    if side is not None and side.dims != dims:
        raise IntegrityError(f"{items}: the stored parameter shapes give {dims}, its sidecar records {side.dims}; "
                             f"the checkpoint or its {SIDECAR} is damaged")
    module = maxtext_moe_module(params)
    want = maxtext_shapes(dims, Options(decoder_block=block_of_module(module) if module else "qwen2",
                                        scan_layers=scanned))
    seen: dict[str, set] = {r: set() for r in ROLES}
    for p, (role, param) in roles.items():
        info = infos[p]
        if param not in want:
            raise BridgeError(f"MaxText leaf {'/'.join(param)} ({role}) has no logical counterpart in the maxtext "
                              f"preset (llama-family, no biases; MoE: routed experts and router only)")
        if tuple(info.shape) != want[param]:
            raise IntegrityError(f"{items}: array {path_str(p)} has shape {tuple(info.shape)}, the model's sizes "
                                 f"({dims}) give {want[param]}; its zarr.json is damaged")
        if not np.issubdtype(np.dtype(numpy_dtype(info.dtype)), np.floating):
            raise IntegrityError(f"{items}: array {path_str(p)} is stored as {info.dtype}; masters and Adam "
                                 f"moments are floating point: its zarr.json is damaged")
        seen[role].add(param)
    for role in ROLES:
        lacking = sorted(set(want) - seen[role])
        if seen[role] and lacking:
            raise BridgeError(f"{items}: MaxText checkpoint lacks the {role} of {'/'.join(lacking[0])}")
    ck.check_read_bytes(sum(infos[p].nbytes for p in roles), "the MaxText masters and moments")


def read_maxtext_tree(items: str, side: Sidecar | None = None) -> tuple[dict[str, dict[Path, np.ndarray]], int, int]:
    """({role: {path under MaxText's params: array}} for masters and moments, Adam count, step) of an items dir.

    Every array's metadata is checked first (`_check_tree`), the count and step range-checked."""
    from bridge.store import open_checkpoint

    ck = open_checkpoint(items)
    trees: dict[str, dict[Path, np.ndarray]] = {r: {} for r in ROLES}
    moment_roots = {MT_ADAM + (m, MT_MOMENT_ROOT): m for m in schema.MOMENTS}
    count = step = None
    roles = {p: ((schema.PARAMS, p[2:]) if p[:2] == MT_PARAMS else (moment_roots[p[:4]], p[4:]))
             for p in ck.paths() if p[:2] == MT_PARAMS or p[:4] in moment_roots}
    infos = {p: ck.checked_info(p) for p in roles}
    _check_tree(ck, items, infos, roles, side)
    for p in ck.paths():
        if p == MT_COUNT:
            count = _scalar(ck, p, "Adam count")
        elif p == (MT_STEP,):
            step = _scalar(ck, p, "step")  # foreign: the name in messages
    if count is None or len({r for r, _ in roles.values()}) < len(ROLES):
        raise BridgeError(f"{items} holds no Adam state (moments and count); the maxtext preset needs MaxText's "
                          f"adamw state (opt_type=adamw)")
    with progress(sum(i.nbytes for i in infos.values()), f"read {os.path.basename(os.path.dirname(items))}") as bar:
        for p, (role, param) in roles.items():
            trees[role][param] = ck.read(p)
            bar.update(trees[role][param].nbytes)
    return trees, count, step if step is not None else count


def llama_args(dims: Dims, rotary_base: float = 10000.0, norm_epsilon: float = 1e-5) -> dict:
    """The Megatron-LM args of the llama-style model a MaxText tree describes (for to-megatron)."""
    return dict(num_layers=dims.layers, hidden_size=dims.hidden, ffn_hidden_size=dims.ffn,
                num_attention_heads=dims.heads, num_query_groups=dims.kv_heads,
                group_query_attention=dims.kv_heads != dims.heads, kv_channels=dims.head_dim, swiglu=True,
                padded_vocab_size=dims.vocab, untie_embeddings_and_output_weights=not dims.tied,
                normalization="RMSNorm", norm_epsilon=norm_epsilon, position_embedding_type="rope",
                rotary_base=rotary_base, rotary_percent=1.0, rotary_interleaved=False, add_bias_linear=False,
                bf16=True, optimizer="adam",
                **(dict(num_experts=dims.experts, moe_router_topk=dims.topk, moe_ffn_hidden_size=dims.ffn,
                        moe_router_pre_softmax=False, moe_grouped_gemm=False, moe_aux_loss_coeff=0.0)
                   if dims.experts else {}))


def _manifest_for(dims: Dims, hyper: Hyper, count: int, base: Mapping | None, opts: Options,
                  rotary_base: float, norm_epsilon: float) -> Manifest:
    from bridge.layout.fused import FusedSpec

    fused = {"decoder/layers/self_attention/linear_qkv/weight": FusedSpec.qkv(dims.heads, dims.kv_heads,
                                                                             dims.head_dim).to_json(),
             ("decoder/layers/mlp/experts/experts/linear_fc1/weight" if dims.experts
              else "decoder/layers/mlp/linear_fc1/weight"): FusedSpec.swiglu(dims.ffn).to_json()}
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
