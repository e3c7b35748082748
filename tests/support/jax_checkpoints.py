"""Helpers that make logical checkpoints for tests: store-written ones, and JAX-trained, JAX-saved ones.

For other engineers' tests (e.g. the torch-side reload of a JAX-saved checkpoint):

    expected = make_jax_checkpoint(dst)                      # tiny model, 3 optax.adamw steps, saved by JAX
    expected = make_jax_checkpoint(dst, params=my_logical)   # your own logical params {path tuple: np.ndarray}
    expected[("opt_state", "0", "mu", ...)]                  # numpy copies of everything that was saved

`make_jax_checkpoint` restores nothing from disk: it starts from given (or seeded) logical arrays,
trains with `optax.adamw` on an 8-device CPU mesh (needs XLA_FLAGS with 8 host devices, as
tests/conftest.py sets) and saves with `bridge.jaxside.save`. The returned dict holds exactly the
arrays the checkpoint must contain, gathered to host *before* saving (an independent reference).
"""

from __future__ import annotations

import os
from typing import Callable, Mapping

import numpy as np

Path = tuple[str, ...]

# ------------------------------------------------------------------ the tiny model (logical names)

VOCAB, HIDDEN, FFN, LAYERS, SEQ, BATCH = 32, 16, 24, 2, 8, 4
QKV = ("decoder", "layers", "self_attention", "linear_qkv", "weight")
FC1 = ("decoder", "layers", "mlp", "linear_fc1", "weight")


def tiny_params(seed: int = 0) -> dict[Path, np.ndarray]:
    """Logical fp32 params of a 2-layer GPT-style model (stacked layers, fused qkv / fc1 sections)."""
    rng = np.random.default_rng(seed)

    def w(*shape, scale=None):
        scale = scale if scale is not None else 1.0 / np.sqrt(shape[-1])
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    L, H, F, V = LAYERS, HIDDEN, FFN, VOCAB
    return {
        ("embedding", "word_embeddings", "weight"): w(V, H, scale=0.5),
        QKV + ("query",): w(L, H, H),
        QKV + ("key",): w(L, H, H),
        QKV + ("value",): w(L, H, H),
        ("decoder", "layers", "self_attention", "linear_qkv", "layer_norm_weight"): 1 + w(L, H, scale=0.1),
        ("decoder", "layers", "self_attention", "linear_proj", "weight"): w(L, H, H),
        ("decoder", "layers", "self_attention", "linear_proj", "bias"): w(L, H, scale=0.1),
        FC1 + ("gate",): w(L, F, H),
        FC1 + ("up",): w(L, F, H),
        ("decoder", "layers", "mlp", "linear_fc1", "layer_norm_weight"): 1 + w(L, H, scale=0.1),
        ("decoder", "layers", "mlp", "linear_fc2", "weight"): w(L, H, F),
        ("decoder", "final_layernorm", "weight"): 1 + w(H, scale=0.1),
        ("output_layer", "weight"): w(V, H),
    }


def tiny_fused() -> dict[str, dict]:
    """The manifest section tables of the tiny model."""
    from bridge.layout.fused import FusedSpec

    return {"/".join(QKV): FusedSpec.concat([("query", HIDDEN), ("key", HIDDEN), ("value", HIDDEN)]).to_json(),
            "/".join(FC1): FusedSpec.swiglu(FFN).to_json()}


def tiny_manifest(step: int = 0):
    """A manifest like a Megatron export of the tiny model would carry."""
    from bridge.format.manifest import Manifest, OptimizerConfig, SourceLayout

    # Megatron's default no-wd set, plus the embedding (as a custom no-wd condition would add),
    # so tests can tell the manifest's list from the default rule.
    no_decay = ["/".join(p) for p in tiny_params() if p[-1] in ("bias", "layer_norm_weight") or
                p[-2] == "final_layernorm" or p[0] == "embedding"]
    return Manifest(source=SourceLayout(framework="megatron", tp=2, gtp=2, dp=2, world_size=8, pad_for_alignment=32,
                                        optimizer_format="fully_reshardable"),
                    optimizer=OptimizerConfig(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, step=step,
                                              no_decay=no_decay),
                    fused=tiny_fused())


def tiny_loss(params: dict, tokens):
    """Next-token cross-entropy of the tiny model; `params` is the nested logical tree (jax arrays)."""
    import jax
    import jax.numpy as jnp

    def norm(x, g):
        return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-5) * g

    d = params["decoder"]["layers"]
    h = params["embedding"]["word_embeddings"]["weight"][tokens[:, :-1]]
    T = h.shape[1]
    causal = jnp.tril(jnp.ones((T, T), bool))
    for i in range(LAYERS):
        a = d["self_attention"]
        x = norm(h, a["linear_qkv"]["layer_norm_weight"][i])
        qkv = a["linear_qkv"]["weight"]
        q, k, v = (x @ qkv[s][i].T for s in ("query", "key", "value"))
        att = jnp.where(causal, q @ jnp.swapaxes(k, -1, -2) / np.sqrt(HIDDEN), -1e9)
        h = h + jax.nn.softmax(att, -1) @ v @ a["linear_proj"]["weight"][i].T + a["linear_proj"]["bias"][i]
        m = d["mlp"]
        x = norm(h, m["linear_fc1"]["layer_norm_weight"][i])
        fc1 = m["linear_fc1"]["weight"]
        h = h + (jax.nn.silu(x @ fc1["gate"][i].T) * (x @ fc1["up"][i].T)) @ m["linear_fc2"]["weight"][i].T
    logits = norm(h, params["decoder"]["final_layernorm"]["weight"]) @ params["output_layer"]["weight"].T
    logp = jax.nn.log_softmax(logits, -1)
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], -1))


def generic_loss(params: dict, tokens):
    """A smooth loss for any parameter tree (for callers with their own param names)."""
    import jax
    import jax.numpy as jnp

    leaves = jax.tree.leaves(params)
    scale = jnp.mean(tokens.astype(jnp.float32)) / VOCAB
    return sum(jnp.mean(jnp.sin(x * (1.0 + scale) + i) ** 2) for i, x in enumerate(leaves))


def tokens_for(step: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng([seed, step]).integers(0, VOCAB, size=(BATCH, SEQ + 1)).astype(np.int32)


# ------------------------------------------------------------------ logical states and store checkpoints


def logical_state(params: Mapping[Path, np.ndarray], step: int = 100, seed: int = 1,
                  specials: bool = False, model: bool = True) -> dict[Path, np.ndarray]:
    """A full logical tree (params, Adam moments as after `step` steps, count, step, bf16 model).

    With `specials`, NaN, +-Inf, -0.0 and subnormals are planted in mu and the model weights.
    """
    import ml_dtypes

    rng = np.random.default_rng(seed)
    out: dict[Path, np.ndarray] = {}
    for p, a in params.items():
        a = np.asarray(a, np.float32)
        out[("params",) + p] = a
        out[("opt_state", "0", "mu") + p] = (rng.standard_normal(a.shape) * 1e-3).astype(np.float32)
        out[("opt_state", "0", "nu") + p] = (rng.random(a.shape) * 1e-6 + 1e-9).astype(np.float32)
        if model:
            out[("model",) + p] = a.astype(ml_dtypes.bfloat16)
    if specials:
        first = next(iter(params))
        mu = out[("opt_state", "0", "mu") + first].reshape(-1)
        mu[:5] = [np.nan, np.inf, -np.inf, -0.0, np.float32(1e-40)]
        if model:
            w = out[("model",) + first].reshape(-1)
            w[:4] = np.array([np.nan, -np.inf, -0.0, 1e-40], np.float32).astype(ml_dtypes.bfloat16)
    out[("opt_state", "0", "count")] = np.array(step, np.int32)
    out[("step",)] = np.array(step, np.int32)
    return out


def write_store_checkpoint(dst: str, arrays: Mapping[Path, np.ndarray], manifest=None, num_writers: int = 2) -> str:
    """Write `arrays` with the store's own writer (several writers, OCDBT merge, atomic commit)."""
    from bridge.store.commit import save_checkpoint
    from bridge.format.schema import adamw_empty_paths

    empty = adamw_empty_paths() if any(p[0] == "opt_state" for p in arrays) else []
    return save_checkpoint(dst, dict(arrays), manifest, num_writers=num_writers, empty_paths=empty)


def bits(a) -> np.ndarray:
    """Raw bits of an array (for bit-exact comparisons that treat NaN == NaN and -0.0 != 0.0)."""
    a = np.ascontiguousarray(np.asarray(a))
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


def read_with_tensorstore(ckpt: str, path: Path) -> np.ndarray:
    """Read one stored array with plain TensorStore (OCDBT root + zarr3/zarr), no bridge code."""
    import json

    import tensorstore as ts

    with open(os.path.join(ckpt, "_METADATA")) as f:
        meta = json.load(f)
    name = ".".join(path)
    kv = ({"driver": "ocdbt", "base": f"file://{os.path.abspath(ckpt)}/", "path": name + "/"}
          if meta.get("use_ocdbt", True) else {"driver": "file", "path": os.path.join(ckpt, name) + "/"})
    spec = {"driver": "zarr3" if meta.get("use_zarr3") else "zarr", "kvstore": kv}
    return np.asarray(ts.open(spec, open=True).result().read().result())


# ------------------------------------------------------------------ JAX training + save back


def train(params: dict, steps: int, tx, opt_state=None, loss: Callable | None = None, seed: int = 0,
          start_step: int = 0):
    """`steps` optax steps (jit) from `params`/`opt_state`; returns (params, opt_state)."""
    import jax
    import optax

    loss = loss or tiny_loss
    opt_state = tx.init(params) if opt_state is None else opt_state

    @jax.jit
    def step_fn(p, s, tokens):
        g = jax.grad(loss)(p, tokens)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    for i in range(steps):
        params, opt_state = step_fn(params, opt_state, tokens_for(start_step + i, seed))
    return params, opt_state


def make_jax_checkpoint(dst: str, params: Mapping[Path, np.ndarray] | None = None, steps: int = 3, seed: int = 0,
                        mesh_shape: tuple[int, int] = (2, 4), with_model: bool = True, manifest=None,
                        tx=None) -> dict[Path, np.ndarray]:
    """Train `steps` optax.adamw steps in JAX on a (fsdp, tp) mesh and save at `dst` with the bridge.

    `params` are logical fp32 arrays keyed by path (default: the tiny model); any other tree is
    trained on `generic_loss`. Returns {full path: numpy array} of everything saved.
    """
    import jax
    import ml_dtypes
    import optax
    from jax.sharding import Mesh, NamedSharding

    from bridge.jaxside.keypaths import leaves_by_path, nested_from_paths
    from bridge.jaxside.save import save
    from bridge.jaxside.sharding_rules import ShardingRules

    default = params is None
    flat = tiny_params(seed) if default else {tuple(p): np.asarray(a, np.float32) for p, a in params.items()}
    n = mesh_shape[0] * mesh_shape[1]
    mesh = Mesh(np.array(jax.devices()[:n]).reshape(mesh_shape), ("fsdp", "tp"))
    rules = ShardingRules()
    sharded = {p: jax.device_put(a, NamedSharding(mesh, rules.spec_for(p, a.shape, dict(mesh.shape))))
               for p, a in flat.items()}
    tree = nested_from_paths(sharded)
    if manifest is None and default:
        manifest = tiny_manifest()
    tx = tx or optax.adamw(3e-3, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1)
    tree, opt_state = train(tree, steps, tx, loss=tiny_loss if default else generic_loss, seed=seed)
    model = jax.tree.map(lambda x: x.astype(ml_dtypes.bfloat16), tree) if with_model else None

    from bridge.jaxside.optax_state import extract_adam

    mu, nu, count = extract_adam(opt_state)
    expected: dict[Path, np.ndarray] = {}
    for p, a in leaves_by_path(tree).items():
        expected[("params",) + p] = np.asarray(jax.device_get(a))
        expected[("opt_state", "0", "mu") + p] = np.asarray(jax.device_get(mu[p]))
        expected[("opt_state", "0", "nu") + p] = np.asarray(jax.device_get(nu[p]))
        if model is not None:
            expected[("model",) + p] = np.asarray(jax.device_get(leaves_by_path(model)[p]))
    expected[("opt_state", "0", "count")] = np.asarray(jax.device_get(count), np.int32)
    expected[("step",)] = np.array(steps, np.int32)
    save(dst, params=tree, opt_state=opt_state, step=steps, model=model, manifest=manifest, with_model=with_model)
    return expected
