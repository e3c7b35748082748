"""The `maxtext` preset, pure half: Megatron's logical llama-style tree <-> MaxText's parameter tree.

MaxText (0.2.5) keeps a llama-family decoder as (scanned layers: the layer axis at position 1)

    token_embedder/embedding (V, E)          decoder/logits_dense/kernel (E, V)   (absent when tied)
    decoder/decoder_norm/scale (E,)          decoder/layers/{pre,post}_self_attention_layer_norm/scale (E, L)
    decoder/layers/self_attention/query/kernel (E, L, H, D), key|value/kernel (E, L, K, D), out/kernel (H, L, D, E)
    decoder/layers/mlp/wi_0|wi_1/kernel (E, L, F), wo/kernel (F, L, E)

and unscanned (`scan_layers=False`) the same leaves per layer under `decoder/layers_<i>/` without the L axis.
A mixture-of-experts model (X routed experts of hidden size F; `maxtext_moe` says which Megatron runs
qualify) has, in place of `mlp/`, MaxText's routed-experts module (`moe_block` in the qwen3_moe block,
`MoeBlock_0` in mixtral): `gate/kernel (E, L, X)`, `wi_0|wi_1 (X, L, E, F)`, `wo (X, L, F, E)`.
`TABLE` is the mapping, leaf by leaf, as data: each row names the logical (Megatron) leaf, its
layout as a pattern of named dims and the MaxText layout (`"L (H D) E" -> "E L H D"`: split the
fused head axis, move the layer axis to position 1). A pattern change is a reshape + transpose:
exact, and the same for the fp32 masters and both Adam moments.

Value transforms (`Options`), applied to masters and moments consistently:
- query scaling. Megatron scales the attention scores by 1/sqrt(D). MaxText's `llama2` decoder block
  has no such factor: it expects it folded into the query kernel (W/sqrt(D), its own converters do
  that). Folding is exact for the forward pass only: Adam is not invariant to it (mu scales by c,
  nu by c^2, the update m/sqrt(v) does not scale, so the folded kernel moves sqrt(D) times faster
  relative to its size). MaxText's `qwen2` decoder block is the same llama layer (RMSNorm, SwiGLU,
  GQA, RoPE; `attention_bias=false`, `use_qk_norm=false`) with the factor applied in the attention
  (`query_pre_attn_scalar = D**-0.5`), so with `decoder_block="qwen2"` (the default) nothing is
  folded and the state is carried over exactly. `decoder_block="llama2"` folds c = D**-0.5 into the
  kernel W' = c W; the gradient w.r.t. W' is g / c, so the moments a run in that parametrisation
  holds are mu / c and nu / c^2 (what is written), and the next update
  -lr * mu'/sqrt(nu') equals Megatron's update of W in absolute size: W moves 1/c = sqrt(D) times
  further than in Megatron (weight decay, proportional to W', stays consistent). Documented as not
  continuing the run exactly.
- RoPE layout: MaxText rotates halves (`x[:D/2]`, `x[D/2:]`), as Megatron does by default. A
  Megatron run with `rotary_interleaved` pairs (2i, 2i+1): its query/key rows (and moments) are
  permuted evens-then-odds per head (exact: Adam is elementwise).
- RMSNorm: both multiply by the scale (no `1 +` offset). A zero-centred-gamma run
  (`apply_layernorm_1p` / `layernorm_zero_centered_gamma`) is refused: shifting the masters by 1 is
  not exact in fp32 and weight decay would pull towards another point.
- tied embeddings: no `logits_dense`; MaxText gets `logits_via_embedding=true`.
- padded vocab: MaxText's `vocab_size` is the padded row count of the embedding.
No jax import here: numpy only.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import numpy as np

from bridge.errors import BridgeError
from bridge.format import schema
from bridge.format.manifest import check_hyperparameters
from bridge.jaxside.presets.maxtext_moe import DEFAULT_MOE_BLOCK, MOE_MODULES, check_block, moe_module, moe_overrides

Path = tuple[str, ...]

BLOCKS = ("qwen2", "llama2") + tuple(MOE_MODULES)
FOLDING_BLOCKS = ("llama2", "mixtral")   # the attention expects 1/sqrt(D) folded into the query kernel


def _split(s: str) -> Path:
    return tuple(c for c in s.split("/") if c)


def parse_pattern(pattern: str) -> list[tuple[str, ...]]:
    """`"L (H D) E"` -> `[("L",), ("H", "D"), ("E",)]` (one group per stored axis).

    >>> parse_pattern("L (H D) E")
    [('L',), ('H', 'D'), ('E',)]
    """
    groups, cur = [], None
    for tok in re.findall(r"\(|\)|[A-Za-z]+", pattern):
        if tok == "(":
            cur = []
        elif tok == ")":
            groups.append(tuple(cur))
            cur = None
        elif cur is not None:
            cur.append(tok)
        else:
            groups.append((tok,))
    return groups


def pattern_shape(pattern: str, sizes: Mapping[str, int]) -> tuple[int, ...]:
    """Stored shape of a pattern.

    >>> pattern_shape("L (H D) E", {"L": 2, "H": 4, "D": 6, "E": 24})
    (2, 24, 24)
    """
    return tuple(math.prod(sizes[d] for d in g) for g in parse_pattern(pattern))


def rearrange(x: Any, src: str, dst: str, sizes: Mapping[str, int]) -> Any:
    """Reshape + transpose `x` from pattern `src` to `dst` (dst has no groups); works on numpy-like arrays.

    >>> x = np.arange(2 * 6 * 3).reshape(2, 6, 3)          # L (H D) E with H=2, D=3, E=3
    >>> y = rearrange(x, "L (H D) E", "E L H D", {"L": 2, "H": 2, "D": 3, "E": 3})
    >>> y.shape, int(y[1, 0, 1, 2]) == int(x[0, 1 * 3 + 2, 1])
    ((3, 2, 2, 3), True)
    """
    groups = parse_pattern(src)
    flat = [d for g in groups for d in g]
    want = pattern_shape(src, sizes)
    if tuple(x.shape) != want:
        raise BridgeError(f"array has shape {tuple(x.shape)}, the {src!r} layout needs {want}")
    out = [g[0] for g in parse_pattern(dst)]
    if sorted(out) != sorted(flat):
        raise BridgeError(f"patterns {src!r} and {dst!r} name different dims")
    x = x.reshape(tuple(sizes[d] for d in flat))
    return x.transpose(tuple(flat.index(d) for d in out))


def unarrange(y: Any, src: str, dst: str, sizes: Mapping[str, int]) -> Any:
    """The exact inverse of `rearrange(x, src, dst, sizes)`.

    >>> x = np.arange(2 * 6 * 3).reshape(2, 6, 3)
    >>> s = {"L": 2, "H": 2, "D": 3, "E": 3}
    >>> bool((unarrange(rearrange(x, "L (H D) E", "E L H D", s), "L (H D) E", "E L H D", s) == x).all())
    True
    """
    flat = [d for g in parse_pattern(src) for d in g]
    out = [g[0] for g in parse_pattern(dst)]
    want = tuple(sizes[d] for d in out)
    if tuple(y.shape) != want:
        raise BridgeError(f"array has shape {tuple(y.shape)}, the {dst!r} layout needs {want}")
    x = y.transpose(tuple(out.index(d) for d in flat))
    return x.reshape(pattern_shape(src, sizes))


@dataclass(frozen=True)
class Leaf:
    """One row of the mapping table.

    `maxtext`: path under MaxText's `params/params` (scanned form, `layers` = the scanned block);
    `logical`: the logical leaf path, then accepted aliases (older / other spec key maps);
    `src` / `dst`: logical and MaxText layouts; `rope`: q/k (RoPE layout permutation of D);
    `query`: the query kernel (query-scale fold under the llama2 block); `untied`: only without tied embeddings.
    """

    maxtext: str
    logical: tuple[str, ...]
    src: str
    dst: str
    rope: bool = False
    query: bool = False
    untied: bool = False
    no_decay: bool = False  # Megatron's default no-decay rule (1-D own shape): the norms
    mlp: str = ""           # "dense" / "moe": a row of the dense MLP or of the routed experts ("": both)

    @property
    def layered(self) -> bool:
        return "L" in [g[0] for g in parse_pattern(self.dst)]


_ATT = "decoder/layers/self_attention"
_MOE = "decoder/layers/mlp"
TABLE: tuple[Leaf, ...] = (
    Leaf("token_embedder/embedding", ("embedding/word_embeddings/weight",), "V E", "V E"),
    Leaf("decoder/logits_dense/kernel", ("output_layer/weight",), "V E", "E V", untied=True),
    Leaf("decoder/decoder_norm/scale", ("decoder/final_layernorm/weight", "decoder/final_norm/weight"), "E", "E",
         no_decay=True),
    Leaf("decoder/layers/pre_self_attention_layer_norm/scale",
         (f"{_ATT}/linear_qkv/layer_norm_weight", "decoder/layers/input_layernorm/weight"), "L E", "E L", no_decay=True),
    Leaf("decoder/layers/post_self_attention_layer_norm/scale",
         ("decoder/layers/mlp/linear_fc1/layer_norm_weight", "decoder/layers/pre_mlp_layernorm/weight"), "L E", "E L",
         no_decay=True),
    Leaf("decoder/layers/self_attention/query/kernel", (f"{_ATT}/linear_qkv/weight/query",), "L (H D) E", "E L H D",
         rope=True, query=True),
    Leaf("decoder/layers/self_attention/key/kernel", (f"{_ATT}/linear_qkv/weight/key",), "L (K D) E", "E L K D",
         rope=True),
    Leaf("decoder/layers/self_attention/value/kernel", (f"{_ATT}/linear_qkv/weight/value",), "L (K D) E", "E L K D"),
    Leaf("decoder/layers/self_attention/out/kernel", (f"{_ATT}/linear_proj/weight",), "L E (H D)", "H L D E"),
    Leaf("decoder/layers/mlp/wi_0/kernel", ("decoder/layers/mlp/linear_fc1/weight/gate",), "L F E", "E L F",
         mlp="dense"),
    Leaf("decoder/layers/mlp/wi_1/kernel", ("decoder/layers/mlp/linear_fc1/weight/up",), "L F E", "E L F",
         mlp="dense"),
    Leaf("decoder/layers/mlp/wo/kernel", ("decoder/layers/mlp/linear_fc2/weight",), "L E F", "F L E", mlp="dense"),
    # routed experts ({moe}: the block's module, `maxtext_moe.moe_module`); Megatron's SequentialMLP /
    # grouped experts are one logical array per leaf with the experts on axis 1
    Leaf("decoder/layers/{moe}/gate/kernel", (f"{_MOE}/router/weight",), "L X E", "E L X", mlp="moe"),
    Leaf("decoder/layers/{moe}/wi_0", (f"{_MOE}/experts/experts/linear_fc1/weight/gate",), "L X F E", "X L E F",
         mlp="moe"),
    Leaf("decoder/layers/{moe}/wi_1", (f"{_MOE}/experts/experts/linear_fc1/weight/up",), "L X F E", "X L E F",
         mlp="moe"),
    Leaf("decoder/layers/{moe}/wo", (f"{_MOE}/experts/experts/linear_fc2/weight",), "L X E F", "X L F E", mlp="moe"),
)
_ROUTER, _EXPERT_GATE = f"{_MOE}/router/weight", f"{_MOE}/experts/experts/linear_fc1/weight/gate"


@dataclass(frozen=True)
class Dims:
    """Model sizes: layers L, hidden E, ffn F, heads H, query groups K, head dim D, padded vocab V;
    MoE: X routed experts (`experts`, 0: dense) of hidden size F, `topk` of them per token."""

    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool = False
    experts: int = 0
    topk: int = 0

    def sizes(self) -> dict[str, int]:
        return {"L": self.layers, "E": self.hidden, "F": self.ffn, "H": self.heads, "K": self.kv_heads,
                "D": self.head_dim, "V": self.vocab, "X": self.experts}

    @classmethod
    def from_logical(cls, shapes: Mapping[Path, tuple[int, ...]], head_dim: int, topk: int = 0) -> "Dims":
        """Sizes from the logical parameter shapes (paths without the `params/` prefix) and the head dim.

        >>> s = {("embedding", "word_embeddings", "weight"): (72, 24),
        ...      ("decoder", "layers", "self_attention", "linear_qkv", "weight", "query"): (2, 24, 24),
        ...      ("decoder", "layers", "self_attention", "linear_qkv", "weight", "key"): (2, 12, 24),
        ...      ("decoder", "layers", "mlp", "linear_fc1", "weight", "gate"): (2, 40, 24)}
        >>> Dims.from_logical(s, head_dim=6)
        Dims(layers=2, hidden=24, ffn=40, heads=4, kv_heads=2, head_dim=6, vocab=72, tied=True, experts=0, topk=0)
        """
        def get(path: str) -> tuple[int, ...]:
            p = _split(path)
            if p not in shapes:
                raise BridgeError(f"logical checkpoint has no {path}; the maxtext preset needs a llama-style "
                                  f"model (RMSNorm, SwiGLU, RoPE, no biases)")
            return tuple(shapes[p])

        v, e = get("embedding/word_embeddings/weight")
        layers, q_rows, _ = get(f"{_ATT}/linear_qkv/weight/query")
        _, k_rows, _ = get(f"{_ATT}/linear_qkv/weight/key")
        if _split(_ROUTER) in shapes:   # MoE: the expert count and size from the experts' own arrays
            _, experts, f, _ = get(_EXPERT_GATE)
        else:
            experts, topk = 0, 0
            _, f, _ = get("decoder/layers/mlp/linear_fc1/weight/gate")
        if q_rows % head_dim or k_rows % head_dim:
            raise BridgeError(f"query rows {q_rows} / key rows {k_rows} are not multiples of the head dim {head_dim}")
        return cls(layers=layers, hidden=e, ffn=f, heads=q_rows // head_dim, kv_heads=k_rows // head_dim,
                   head_dim=head_dim, vocab=v, tied=_split("output_layer/weight") not in shapes, experts=experts,
                   topk=topk)

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "ffn", "heads", "kv_heads", "head_dim", "vocab"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise BridgeError(f"model size {name}={v!r} is not a positive integer")
        for name, v in (("experts", self.experts), ("topk", self.topk)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
                raise BridgeError(f"model size {name}={v!r} is not a non-negative integer")
        if self.experts and not 1 <= self.topk <= self.experts:
            raise BridgeError(f"{self.topk} experts per token of {self.experts}: the number of experts per token "
                              f"(moe_router_topk / num_experts_per_tok) must be in 1..{self.experts}")
        if not isinstance(self.tied, bool):
            raise BridgeError(f"model size tied={self.tied!r} is not a boolean")

    @classmethod
    def from_maxtext(cls, shapes: Mapping[Path, tuple[int, ...]], topk: int = 0) -> tuple["Dims", bool]:
        """(sizes, scanned) from MaxText parameter shapes (paths under `params/params`); BridgeError when
        a leaf the sizes come from is missing or has the wrong number of axes. The tree does not hold
        the experts per token: `topk` (an MoE tree's `num_experts_per_tok`) comes from the caller."""
        try:
            return cls._from_maxtext(shapes, topk)
        except (KeyError, ValueError, TypeError, IndexError) as e:
            raise BridgeError(f"MaxText parameter tree is not a llama-family tree this preset reads (at {e}); "
                              f"is it a MaxText llama/qwen2 checkpoint?") from None

    @classmethod
    def _from_maxtext(cls, shapes: Mapping[Path, tuple[int, ...]], topk: int) -> tuple["Dims", bool]:
        scanned = _split("decoder/layers/self_attention/query/kernel") in shapes
        module = maxtext_moe_module(shapes)
        experts = 0
        if scanned:
            e, layers, h, d = shapes[_split("decoder/layers/self_attention/query/kernel")]
            k = shapes[_split("decoder/layers/self_attention/key/kernel")][2]
            if module:   # the expert count from the router (E, L, X), the expert size from wi_0 (X, L, E, F)
                experts = shapes[_split(f"decoder/layers/{module}/gate/kernel")][2]
                f = shapes[_split(f"decoder/layers/{module}/wi_0")][3]
            else:
                f = shapes[_split("decoder/layers/mlp/wi_0/kernel")][2]
        else:
            idx = sorted(int(p[1][len("layers_"):]) for p in shapes
                         if len(p) > 1 and p[0] == "decoder" and re.fullmatch(r"layers_\d+", p[1]))
            if not idx:
                raise BridgeError("MaxText tree has neither decoder/layers (scanned) nor decoder/layers_<i>; "
                                  "is it a llama-family MaxText checkpoint?")
            layers = idx[-1] + 1
            e, h, d = shapes[_split("decoder/layers_0/self_attention/query/kernel")]
            k = shapes[_split("decoder/layers_0/self_attention/key/kernel")][1]
            if module:
                experts = shapes[_split(f"decoder/layers_0/{module}/gate/kernel")][1]
                f = shapes[_split(f"decoder/layers_0/{module}/wi_0")][2]
            else:
                f = shapes[_split("decoder/layers_0/mlp/wi_0/kernel")][1]
        if _split("token_embedder/embedding") not in shapes:
            raise BridgeError("MaxText tree has no token_embedder/embedding; is it a llama-family MaxText checkpoint?")
        v = shapes[_split("token_embedder/embedding")][0]
        tied = _split("decoder/logits_dense/kernel") not in shapes
        if experts and not topk:
            raise BridgeError("MaxText tree has routed experts and the number of experts per token is not known "
                              "(no gtp-bridge sidecar); pass --num-experts-per-tok (MaxText's num_experts_per_tok)")
        return (cls(layers=layers, hidden=e, ffn=f, heads=h, kv_heads=k, head_dim=d, vocab=v, tied=tied,
                    experts=experts, topk=topk if experts else 0), scanned)


def maxtext_moe_module(shapes: Iterable[Path]) -> str:
    """The routed-experts module a MaxText parameter tree holds ("" for a dense tree; one line when two).

    >>> maxtext_moe_module([("decoder", "layers", "moe_block", "wi_0")]), maxtext_moe_module([("decoder",)])
    ('moe_block', '')
    """
    found = sorted({p[2] for p in shapes if len(p) > 2 and p[0] == "decoder" and p[2] in MOE_MODULES.values()
                    and (p[1] == "layers" or re.fullmatch(r"layers_\d+", p[1]))})
    if len(found) > 1:
        raise BridgeError(f"MaxText tree holds routed experts under both {found[0]} and {found[1]}; is it one model?")
    return found[0] if found else ""


def block_for(dims: "Dims", decoder_block: str | None) -> str:
    """The decoder block to use: the one named (checked against the model), else qwen2 for a dense model
    and qwen3_moe for an MoE model (both exact)."""
    block = decoder_block or (DEFAULT_MOE_BLOCK if dims.experts else "qwen2")
    check_block(dims.experts, block)
    return block


@dataclass(frozen=True)
class Options:
    """How the state is presented: MaxText decoder block, scanned layers, the source's RoPE layout."""

    decoder_block: str = "qwen2"
    scan_layers: bool = True
    rotary_interleaved: bool = False

    def __post_init__(self) -> None:
        if self.decoder_block not in BLOCKS:
            raise BridgeError(f"decoder_block {self.decoder_block!r} is not supported by the maxtext preset; "
                              f"use one of {list(BLOCKS)}")

    @property
    def fold_query_scale(self) -> bool:
        return self.decoder_block in FOLDING_BLOCKS


def rope_permutation(head_dim: int) -> np.ndarray:
    """Index of D that takes Megatron's interleaved RoPE pairs (2i, 2i+1) to MaxText's halves (i, i + D/2).

    >>> rope_permutation(6).tolist()
    [0, 2, 4, 1, 3, 5]
    """
    if head_dim % 2:
        raise BridgeError(f"head dim {head_dim} is odd; RoPE needs an even head dim")
    return np.concatenate([np.arange(0, head_dim, 2), np.arange(1, head_dim, 2)])


def query_scale(head_dim: int) -> np.float32:
    """The factor folded into the query kernel under the llama2 block: fp32(1/sqrt(D)).

    >>> float(query_scale(64))
    0.125
    """
    return np.float32(1.0 / math.sqrt(head_dim))


def fold_factor(kind: str, head_dim: int) -> np.float32:
    """What the llama2 fold multiplies a query-kernel leaf of `kind` by: the master by c, its gradient
    and first moment by 1/c, the second moment by 1/c^2 (c = fp32(1/sqrt(D))).

    >>> [float(fold_factor(k, 64)) for k in ("params", "grad", "mu", "nu")]
    [0.125, 8.0, 8.0, 64.0]
    """
    c = query_scale(head_dim)
    return {schema.PARAMS: c, "grad": 1 / c, schema.MU: 1 / c, schema.NU: 1 / (c * c)}[kind]


def _value_forward(x: np.ndarray, leaf: Leaf, kind: str, dims: Dims, opts: Options) -> np.ndarray:
    """Value transforms on a MaxText-layout array (D is the last axis of q/k)."""
    if leaf.rope and opts.rotary_interleaved:
        x = x[..., rope_permutation(dims.head_dim)]
    if leaf.query and opts.fold_query_scale:
        x = x * fold_factor(kind, dims.head_dim)
    return x


def _value_inverse(x: np.ndarray, leaf: Leaf, kind: str, dims: Dims, opts: Options) -> np.ndarray:
    if leaf.query and opts.fold_query_scale:
        x = x / fold_factor(kind, dims.head_dim)
    if leaf.rope and opts.rotary_interleaved:
        x = x[..., np.argsort(rope_permutation(dims.head_dim))]
    return x


def active_table(dims: Dims) -> list[Leaf]:
    """The rows that apply to this model (the output layer only when untied)."""
    mlp = "moe" if dims.experts else "dense"
    return [leaf for leaf in TABLE if not (leaf.untied and dims.tied) and leaf.mlp in ("", mlp)]


def _maxtext_paths(leaf: Leaf, dims: Dims, opts: Options) -> list[tuple[Path, int | None]]:
    """MaxText path(s) of a row: one (scanned / layerless) or one per layer (unscanned) with its index."""
    p = _split(leaf.maxtext.format(moe=moe_module(opts.decoder_block)) if leaf.mlp == "moe" else leaf.maxtext)
    if opts.scan_layers or not leaf.layered:
        return [(p, None)]
    i = p.index("layers")
    return [(p[:i] + (f"layers_{n}",) + p[i + 1:], n) for n in range(dims.layers)]


def _drop_l(pattern: str) -> str:
    """The pattern of one layer's slice.

    >>> _drop_l("L (H D) E")
    '(H D) E'
    """
    return " ".join(re.sub(r"\bL\b", "", pattern).split())


def find_logical(leaf: Leaf, tree: Mapping[Path, Any]) -> Path:
    """The logical path of a row present in `tree` (the first of its aliases)."""
    for name in leaf.logical:
        if _split(name) in tree:
            return _split(name)
    raise BridgeError(f"logical checkpoint has no {leaf.logical[0]} (needed for MaxText {leaf.maxtext}); the maxtext "
                      f"preset needs a llama-style model (RMSNorm, SwiGLU, GQA, RoPE, no biases)")


def check_llama(paths: Iterable[Path], dims: Dims) -> None:
    """Refuse logical trees the table does not cover (biases, LayerNorm betas, learned positions, MoE...)."""
    known = {_split(n) for leaf in active_table(dims) for n in leaf.logical}
    for p in sorted(paths):
        if p not in known:
            name = "/".join(p)
            what = (" (shared experts: MaxText's qwen3_moe / mixtral blocks have none)" if "shared_experts" in p
                    else " (a router bias: MaxText's qwen3_moe / mixtral routers have none)" if "router" in p
                    else "")
            raise BridgeError(f"logical array {name} has no MaxText counterpart in the maxtext preset{what} "
                              f"(llama-style models: RMSNorm, SwiGLU, GQA, RoPE, no biases; MoE: routed experts)")


def to_maxtext(tree: Mapping[Path, np.ndarray], kind: str, dims: Dims, opts: Options) -> dict[Path, np.ndarray]:
    """Logical leaves of one kind ("params", "mu", "nu" or "grad"; paths without that prefix) -> MaxText leaves
    (one table row each; refuses logical leaves the table does not know)."""
    check_llama(tree, dims)
    sizes = dims.sizes()
    out: dict[Path, np.ndarray] = {}
    for leaf in active_table(dims):
        x = np.asarray(tree[find_logical(leaf, tree)])
        for path, n in _maxtext_paths(leaf, dims, opts):
            if n is None:
                y = rearrange(x, leaf.src, leaf.dst, sizes)
            else:
                y = rearrange(x[n], _drop_l(leaf.src), _drop_l(leaf.dst), sizes)
            out[path] = np.ascontiguousarray(_value_forward(y, leaf, kind, dims, opts))
    return out


def from_maxtext(tree: Mapping[Path, np.ndarray], kind: str, dims: Dims, opts: Options) -> dict[Path, np.ndarray]:
    """The exact inverse of `to_maxtext` (the canonical logical names); refuses missing or extra leaves."""
    sizes = dims.sizes()
    expected = {p for leaf in active_table(dims) for p, _ in _maxtext_paths(leaf, dims, opts)}
    extra = sorted(set(tree) - expected)
    if extra:
        raise BridgeError(f"MaxText leaf {'/'.join(extra[0])} has no logical counterpart in the maxtext preset "
                          f"(llama-family, no biases; MoE: routed experts and router only)")
    out: dict[Path, np.ndarray] = {}
    for leaf in active_table(dims):
        parts = []
        for path, n in _maxtext_paths(leaf, dims, opts):
            if path not in tree:
                raise BridgeError(f"MaxText checkpoint lacks {'/'.join(path)}")
            y = _value_inverse(np.asarray(tree[path]), leaf, kind, dims, opts)
            if n is None:
                parts.append(unarrange(y, leaf.src, leaf.dst, sizes))
            else:
                parts.append(unarrange(y, _drop_l(leaf.src), _drop_l(leaf.dst), sizes))
        out[_split(leaf.logical[0])] = np.ascontiguousarray(parts[0] if len(parts) == 1 else np.stack(parts))
    return out


def maxtext_shapes(dims: Dims, opts: Options) -> dict[Path, tuple[int, ...]]:
    """The shape of every MaxText leaf of this model (paths under `params/params`; the same for mu and nu).

    >>> s = maxtext_shapes(Dims(2, 24, 40, 4, 2, 6, 72), Options())
    >>> s[("decoder", "layers", "self_attention", "query", "kernel")], s[("decoder", "logits_dense", "kernel")]
    ((24, 2, 4, 6), (24, 72))
    """
    sizes = dims.sizes()
    return {path: pattern_shape(leaf.dst if n is None else _drop_l(leaf.dst), sizes)
            for leaf in active_table(dims) for path, n in _maxtext_paths(leaf, dims, opts)}


def adamw_mask_patterns(no_decay_logical: Iterable[Path], dims: Dims, opts: Options) -> list[str]:
    """MaxText `adamw_mask` regexes (matched with re.search on MaxText's '/'-joined param path) that
    exclude exactly the leaves of Megatron's no-decay set from weight decay.

    >>> d = Dims(1, 2, 2, 1, 1, 2, 3)
    >>> adamw_mask_patterns([("decoder", "final_layernorm", "weight")], d, Options())
    ['(?:^|/)decoder/decoder_norm/scale$']
    """
    nd = {tuple(p) for p in no_decay_logical}
    pats = []
    for leaf in active_table(dims):
        if any(_split(n) in nd for n in leaf.logical):
            for path, _ in _maxtext_paths(leaf, dims, opts):
                # MaxText matches re.search against the '/'-joined optimizer-tree path, which
                # starts with `params/` (Linen) or the module name (NNX): anchor on a '/' or the start.
                pats.append("(?:^|/)" + re.escape("/".join(path)).replace("\\/", "/") + "$")
    return pats


def decayed(maxtext_path: Path, patterns: Iterable[str]) -> bool:
    """Whether MaxText's adamw mask (`maxtext.optimizers.optimizers.get_adamw_mask`) decays this leaf.

    `maxtext_path` is the full optimizer-tree path (starting with `params`).
    >>> pats = ["(?:^|/)decoder/decoder_norm/scale$"]
    >>> decayed(("params", "decoder", "decoder_norm", "scale"), pats), decayed(("decoder", "decoder_norm", "scale"), pats)
    (False, False)
    """
    s = "/".join(maxtext_path)
    return not any(re.search(p, s) for p in patterns)


@dataclass(frozen=True)
class Hyper:
    """AdamW settings MaxText's optimizer is configured with (from the logical manifest)."""

    lr: float
    b1: float
    b2: float
    eps: float
    weight_decay: float
    clip_grad: float | None = None
    no_decay: tuple[Path, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        # every way in (CLI flags, read_maxtext(hyper=), a sidecar, a manifest) builds a Hyper
        check_hyperparameters("AdamW settings", lr=self.lr, betas=(self.b1, self.b2), eps=self.eps,
                              weight_decay=self.weight_decay, clip_grad=self.clip_grad)


def maxtext_overrides(dims: Dims, opts: Options, hyper: Hyper, max_target_length: int | None = None,
                      norm_epsilon: float = 1e-5, rotary_base: float = 10000.0) -> dict[str, Any]:
    """MaxText config overrides (`key=value` on its command line) that build this model and optimizer.

    Constant learning rate: WSD with no warmup and no decay (the stable phase is
    `optax.constant_schedule(lr)`: the exact lr at every step). Gradient clipping: MaxText's
    `optax.clip_by_global_norm` divides by the norm where Megatron divides by (norm + 1e-6).
    """
    o: dict[str, Any] = {
        "decoder_block": opts.decoder_block,
        "base_emb_dim": dims.hidden, "base_num_query_heads": dims.heads, "base_num_kv_heads": dims.kv_heads,
        "head_dim": dims.head_dim, "base_mlp_dim": dims.ffn, "base_num_decoder_layers": dims.layers,
        "vocab_size": dims.vocab, "mlp_activations": ["silu", "linear"],
        "normalization_layer_epsilon": norm_epsilon, "rope_max_timescale": rotary_base, "rope_min_timescale": 1,
        "rope_type": "default", "attention_bias": False, "use_qk_norm": False,
        "logits_via_embedding": dims.tied, "normalize_embedding_logits": False, "enable_dropout": False,
        "scan_layers": opts.scan_layers, "weight_dtype": "float32",
        "opt_type": "adamw", "adam_b1": hyper.b1, "adam_b2": hyper.b2, "adam_eps": hyper.eps, "adam_eps_root": 0.0,
        "adam_weight_decay": hyper.weight_decay, "mu_dtype": "float32",
        "adamw_mask": adamw_mask_patterns(hyper.no_decay, dims, opts),
        "learning_rate": hyper.lr, "lr_schedule_type": "wsd", "warmup_steps_fraction": 0.0,
        "wsd_decay_steps_fraction": 0.0, "learning_rate_final_fraction": 1.0,
        "gradient_clipping_threshold": hyper.clip_grad or 0.0,
    }
    check_block(dims.experts, opts.decoder_block)
    if dims.experts:
        o.update(moe_overrides(dims.experts, dims.topk, dims.ffn))
    if max_target_length:
        o["max_target_length"] = max_target_length
    return o
