"""The small synthetic model the live-export tests share, and its rank-local inputs and expected state.

Per-rank state comes from the independent sharding reference (`live_reference`); `geometry` is what
the exporter is told about each parameter (bridge.layout's description of it).
"""

from __future__ import annotations

from live_reference import RefModel, RefParam, assemble, rank_raw_state

MODEL = RefModel(
    params=(
        RefParam("decoder.layers.mlp.linear_fc1.weight", (("gate", (12, 12)), ("up", (12, 12)))),
        RefParam("decoder.layers.self_attention.linear_proj.weight", ((None, (8, 24)),), kind="row"),
        RefParam("embedding.word_embeddings.weight", ((None, (20, 10)),)),
        RefParam("decoder.final_layernorm.weight", ((None, (8,)),), kind="replicated"),
        RefParam("output_layer.bias", ((None, (8,)),), kind="tp_only"),
    ),
    layers={"decoder.layers.mlp.linear_fc1.weight": 2, "decoder.layers.self_attention.linear_proj.weight": 2},
    seed=7,
    specials=("decoder.layers.self_attention.linear_proj.weight",),
)
FP8 = {"decoder.layers.mlp.linear_fc1.weight": (2, 4), "embedding.word_embeddings.weight": None}
SPECIAL = "decoder.layers.self_attention.linear_proj.weight"  # carries NaN / Inf / -0.0 / subnormals
STEP = 3


def geometry(p: RefParam, a: int, layers: int, index: tuple[int, ...]):
    from bridge.layout import FusedSpec, ParamGeometry

    kind = {"column": "column", "row": "row", "tp_only": "column", "replicated": "replicated"}[p.kind]
    fused = FusedSpec.concat([(s, shape[0]) for s, shape in p.sections]) if p.fused else None
    rows = sum(shape[0] for _, shape in p.sections)
    shape = (rows,) + p.sections[0][1][1:]
    return ParamGeometry(p.key, shape, kind, gtp=p.gtp, pad_for_alignment=a, prepend=(layers,) if layers else (),
                         fused=fused, index=index)


def local_params(model: RefModel, tp: int, gtp: int, dp: int, a: int, rank: int, fp8: dict | None, *, zeros=False):
    """LocalParams of `rank` (export input, or zero targets for reload with `zeros`)."""
    import torch

    from bridge.live.api import LocalParam, OptimFragment, QuantizedWeight

    raws, objs = rank_raw_state(model, tp, gtp, dp, a, rank, fp8)
    out = []
    for rp, obj in zip(raws, objs):
        p = next(q for q in model.params if q.key == rp.key)
        geom = geometry(p, a, model.layers.get(p.key, 0), rp.index)
        shape = rp.pindex.shape
        f0, f1 = rp.frag
        if zeros:
            if obj[0] == "fp8":
                w = QuantizedWeight(torch.zeros(shape, dtype=torch.float8_e4m3fn), torch.ones_like(obj[2]), obj[3])
            else:
                w = torch.zeros(shape, dtype=torch.bfloat16)
            opt = OptimFragment(f0, f1, *(torch.zeros(f1 - f0) for _ in range(3)))
        else:
            w = QuantizedWeight(obj[1].reshape(shape), obj[2], obj[3]) if obj[0] == "fp8" else obj[1].reshape(shape)
            opt = OptimFragment(f0, f1, *(torch.from_numpy(x) for x in (rp.master, rp.mu, rp.nu)))
        out.append(LocalParam(rp.key, geom, w, opt if f1 > f0 else None))
    return out, raws


def expected_state(model, tp, gtp, dp, a, fp8):
    world = tp * gtp * dp
    return assemble(model, [rank_raw_state(model, tp, gtp, dp, a, r, fp8)[0] for r in range(world)])
