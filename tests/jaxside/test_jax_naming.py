"""bridge.jaxside.naming: plans, exact inverses, lazy TensorStore views, refusals."""

from __future__ import annotations

import numpy as np
import pytest
import tensorstore as ts
from hypothesis import given, settings, strategies as st

from bridge.errors import BridgeError
from bridge.jaxside.naming import (NUMPY, TENSORSTORE, JoinSections, NamingMap, Rename, Transpose, Unstack,
                                   jax_backend)

FC1 = ("decoder", "layers", "mlp", "linear_fc1", "weight")
QKV = ("decoder", "layers", "self_attention", "linear_qkv", "weight")


def _tree(L=3, H=4, F=5, seed=0):
    rng = np.random.default_rng(seed)
    return {
        FC1 + ("gate",): rng.standard_normal((L, F, H)).astype(np.float32),
        FC1 + ("up",): rng.standard_normal((L, F, H)).astype(np.float32),
        QKV + ("query",): rng.standard_normal((L, H, H)).astype(np.float32),
        QKV + ("key",): rng.standard_normal((L, 2, H)).astype(np.float32),
        QKV + ("value",): rng.standard_normal((L, 2, H)).astype(np.float32),
        ("decoder", "layers", "mlp", "linear_fc2", "weight"): rng.standard_normal((L, H, F)).astype(np.float32),
        ("decoder", "layers", "3", "mixer", "in_proj", "weight"): rng.standard_normal((7, H)).astype(np.float32),
        ("decoder", "final_layernorm", "weight"): rng.standard_normal((H,)).astype(np.float32),
    }


FULL = NamingMap([JoinSections("*/linear_fc1/weight", ("gate", "up")), JoinSections("*/linear_qkv/weight"),
                  Unstack("decoder/layers/*"), Transpose("*/weight"),
                  Rename(r"^decoder/layers/(\d+)/", r"h_\1/")])
SECTIONS = {QKV: ["query", "key", "value"]}


def test_forward_matches_hand_written_numpy():
    tree = _tree()
    out = FULL.plan({p: a.shape for p, a in tree.items()}, SECTIONS).apply(tree)
    fc1 = out[("h_2", "mlp", "linear_fc1", "weight")]
    np.testing.assert_array_equal(fc1, np.concatenate([tree[FC1 + ("gate",)][2], tree[FC1 + ("up",)][2]]).T)
    qkv = out[("h_0", "self_attention", "linear_qkv", "weight")]
    assert qkv.shape == (4, 8)
    np.testing.assert_array_equal(qkv[:, 4:6], tree[QKV + ("key",)][0].T)
    # hybrid layer (explicit index, no stacked axis) is not unstacked; 1-D is not transposed
    np.testing.assert_array_equal(out[("h_3", "mixer", "in_proj", "weight")],
                                  tree[("decoder", "layers", "3", "mixer", "in_proj", "weight")].T)
    np.testing.assert_array_equal(out[("decoder", "final_layernorm", "weight")],
                                  tree[("decoder", "final_layernorm", "weight")])
    assert len(out) == 3 * 3 + 2


def test_inverse_is_exact_and_lazy_views_agree():
    tree = _tree()
    plan = FULL.plan({p: a.shape for p, a in tree.items()}, SECTIONS)
    out = plan.apply(tree)
    back = plan.invert(out)
    assert set(back) == set(tree)
    for p in tree:
        assert np.array_equal(back[p], tree[p]), p
    lazy = plan.apply({p: ts.array(a) for p, a in tree.items()}, TENSORSTORE)
    for p, view in lazy.items():
        assert isinstance(view, ts.TensorStore)  # nothing read yet
        assert np.array_equal(view.read().result(), out[p]), p
    jbe = jax_backend()
    jout = plan.apply(tree, jbe)
    for p in out:
        assert np.array_equal(np.asarray(jout[p]), out[p]), p


@settings(max_examples=40, deadline=None)
@given(L=st.integers(1, 3), rows=st.lists(st.integers(1, 4), min_size=1, max_size=3), cols=st.integers(1, 4),
       unstack=st.booleans(), transpose=st.booleans())
def test_round_trip_property(L, rows, cols, unstack, transpose):
    names = [f"s{i}" for i in range(len(rows))]
    parent = ("decoder", "layers", "m", "weight")
    tree = {parent + (n,): np.arange(L * r * cols, dtype=np.float32).reshape(L, r, cols) + 100 * i
            for i, (n, r) in enumerate(zip(names, rows))}
    rules = [JoinSections("*/m/weight", tuple(names))]
    rules += [Unstack("decoder/layers/*")] if unstack else []
    rules += [Transpose("*")] if transpose else []
    plan = NamingMap(rules).plan({p: a.shape for p, a in tree.items()})
    out = plan.apply(tree, NUMPY)
    assert len(out) == (L if unstack else 1)
    back = plan.invert(out)
    for p, a in tree.items():
        assert np.array_equal(back[p], a)


def test_stacked_sections():
    tree = _tree()
    nm = NamingMap([JoinSections("*/linear_fc1/weight", ("gate", "up"), stack=True), Transpose("*/linear_fc1/weight")])
    plan = nm.plan({p: a.shape for p, a in tree.items()})
    out = plan.apply(tree)
    fc1 = out[FC1]
    assert fc1.shape == (3, 2, 4, 5)  # [layers, {gate, up}, in, out]
    np.testing.assert_array_equal(fc1[:, 1], np.swapaxes(tree[FC1 + ("up",)], -1, -2))
    back = plan.invert(out)
    assert all(np.array_equal(back[p], tree[p]) for p in tree)
    with pytest.raises(BridgeError, match="stacking needs equal shapes"):
        NamingMap([JoinSections("*/linear_qkv/weight", ("query", "key", "value"), stack=True)]).plan(
            {p: a.shape for p, a in tree.items()})


def test_refusals():
    tree = _tree()
    shapes = {p: a.shape for p, a in tree.items()}
    with pytest.raises(BridgeError, match="no section order for fused decoder/layers/self_attention/linear_qkv"):
        NamingMap([JoinSections("*/linear_qkv/weight")]).plan(shapes)
    with pytest.raises(BridgeError, match=r"has sections \['gate', 'up'\], rule expects \['gate'\]"):
        NamingMap([JoinSections("*/linear_fc1/weight", ("gate",))]).plan(shapes)
    with pytest.raises(BridgeError, match="sends two arrays to x"):
        NamingMap([Rename(".*", "x")]).plan(shapes)
    plan = FULL.plan(shapes, SECTIONS)
    out = plan.apply(tree)
    out.pop(("h_1", "mlp", "linear_fc2", "weight"))
    with pytest.raises(BridgeError, match="lacks h_1/mlp/linear_fc2/weight"):
        plan.invert(out)
    out[("h_1", "mlp", "linear_fc2", "weight")] = np.zeros((4, 5), np.float32)
    with pytest.raises(BridgeError, match=r"shape \(4, 5\), expected \(5, 4\)"):
        plan.invert(out)


def test_named_views_on_a_store_checkpoint(tmp_path):
    """Lazy presentation straight from disk equals the numpy presentation of the same arrays."""
    from bridge.format.manifest import Manifest
    from bridge.jaxside.naming import named_views
    from jax_checkpoints import write_store_checkpoint

    tree = _tree()
    m = Manifest(fused={"/".join(QKV): {"kind": "concat", "sections": [["query", 4], ["key", 2], ["value", 2]]}})
    d = str(tmp_path / "ck")
    write_store_checkpoint(d, {("params",) + p: a for p, a in tree.items()}, m, num_writers=2)
    views = named_views(d, FULL)
    want = FULL.plan({p: a.shape for p, a in tree.items()}, SECTIONS).apply(tree)
    assert set(views) == set(want)
    for p, v in views.items():
        assert isinstance(v, ts.TensorStore)
        assert np.array_equal(v.read().result(), want[p]), p
    col = views[("h_1", "mlp", "linear_fc1", "weight")][:, 2:4].read().result()  # a slice of a lazy join
    assert np.array_equal(col, want[("h_1", "mlp", "linear_fc1", "weight")][:, 2:4])
    with pytest.raises(BridgeError, match="no arrays under model"):
        named_views(d, FULL, prefix=("model",))
