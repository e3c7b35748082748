"""ParallelLayout against a line-by-line transliteration of megatron-core 0.19.2's
`generate_masked_orthogonal_rank_groups` / `RankGenerator` (parallel_state.py:269-557), over random
sizes and orders (the recorded oracle covers 9 fixed tables)."""

from hypothesis import given, settings, strategies as st

from bridge.layout import ParallelLayout
from bridge.layout.parallel import inject_gtp_axis


def megatron_groups(world, parallel_size, mask):
    def prefix_product(a, init=1):
        r = [init]
        for v in a:
            init = init * v
            r.append(init)
        return r

    def inner_product(a, b):
        return sum([x * y for x, y in zip(a, b)])

    def decompose(index, shape, stride=None):
        if stride is None:
            stride = prefix_product(shape)
        return [(index // d) % s for s, d in zip(shape, stride)]

    masked_shape = [s for s, m in zip(parallel_size, mask) if m]
    unmasked_shape = [s for s, m in zip(parallel_size, mask) if not m]
    global_stride = prefix_product(parallel_size)
    masked_stride = [d for d, m in zip(global_stride, mask) if m]
    unmasked_stride = [d for d, m in zip(global_stride, mask) if not m]
    group_size = prefix_product(masked_shape)[-1]
    ranks = []
    for group_index in range(world // group_size):
        decomposed_group_idx = decompose(group_index, unmasked_shape)
        rank = []
        for rank_in_group in range(group_size):
            decomposed_rank_idx = decompose(rank_in_group, masked_shape)
            rank.append(inner_product(decomposed_rank_idx, masked_stride)
                        + inner_product(decomposed_group_idx, unmasked_stride))
        ranks.append(rank)
    return ranks


def megatron_generator(tp, ep, dp, pp, cp, order, gtp_remat):
    name_to_size = {"tp": tp, "pp": pp, "dp": dp, "ep": ep, "cp": cp, "gtp_remat": gtp_remat}
    order = order.lower()
    for name in name_to_size:
        if name not in order.split("-"):
            order = order + "-" + name
    toks = order.split("-")
    sizes = [name_to_size[t] for t in toks]

    def get_ranks(token):
        mask = [t in token.split("-") for t in toks]
        return megatron_groups(tp * dp * pp * cp * ep * gtp_remat, sizes, mask)

    return get_ranks


@settings(deadline=None, max_examples=60)
@given(st.sampled_from([1, 2, 3]), st.sampled_from([1, 2]), st.sampled_from([1, 2]), st.sampled_from([1, 2, 3]),
       st.sampled_from([1, 2]), st.sampled_from([1, 2, 4]), st.sampled_from([1, 2]), st.sampled_from([1, 2]),
       st.permutations(["tp", "cp", "ep", "dp", "pp"]))
def test_groups_match_megatron_algorithm(tp, gtp, cp, dp, pp, ep, etp, egtp, perm):
    order = "-".join(perm)
    world = tp * gtp * cp * dp * pp
    if world % (etp * ep * egtp * pp):
        return
    edp = world // (etp * ep * egtp * pp)
    if not (order.endswith("pp") or pp == 1 or edp == dp):
        return
    dense = megatron_generator(tp, 1, dp, pp, cp, inject_gtp_axis(order, "tp"), gtp)
    expert = megatron_generator(etp, ep, edp, pp, 1, inject_gtp_axis(order, "ep"), egtp)
    if pp > 1 and dense("pp") != expert("pp"):
        return
    lay = ParallelLayout(tp=tp, gtp=gtp, dp=dp, cp=cp, pp=pp, ep=ep, etp=etp, egtp=egtp, order=order)
    for tokens in ["tp", "gtp_remat", "cp", "dp", "pp", "dp-cp", "gtp_remat-dp-cp", "tp-gtp_remat-pp"]:
        assert lay.dense.groups(tokens) == dense(tokens), tokens
    for tokens in ["tp", "ep", "gtp_remat", "dp", "tp-ep-gtp_remat-pp"]:
        assert lay.expert.groups(tokens) == expert(tokens), tokens
    for r in range(world):
        c = lay.coords(r)
        assert lay.rank(c.t, c.g, c.c, c.d, c.p) == r
        assert lay.expert_rank(c.et, c.e, c.eg, c.ed, c.p) == r
        assert lay.distopt_group(r)[lay.distopt_rank(r)] == r
        assert lay.model_parallel_group(r)[lay.dp_group_idx(r)] == r
