"""Reference GTP trainer, single process (world size 1 = the unsharded reference).

The distributed optimizer is checked against an independent numpy emulation of TE/Apex FusedAdam
(docs/orbax-tensorstore-optax.md §4.2), the FP8 path against its definition, and the live-export
form against the API's contract. Multi-process layouts: test_reference_trainer_dist.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bridge.errors import BridgeError
from bridge.layout import ParallelLayout
from bridge.live.api import AdamConfig, QuantizedWeight
from bridge.live.fp8 import dequantize
from bridge.testing.check import fill_from_logical, logical_state
from bridge.testing.model import ModelConfig, batch, forward, init_logical, param_table
from bridge.testing.trainer import ReferenceTrainer, TrainerConfig, step, train

ADAM = AdamConfig(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _fused_adam_np(p, g, m, v, step_no, a: AdamConfig, decay: bool):
    """TE/Apex FusedAdam adam_w_mode=1 in numpy float32, bias corrections in host double."""
    f = np.float32
    b1, b2, eps, lr = f(a.betas[0]), f(a.betas[1]), f(a.eps), f(a.lr)
    wd = f(a.weight_decay if decay else 0.0)
    bc1, bc2 = f(1.0 - a.betas[0] ** step_no), f(1.0 - a.betas[1] ** step_no)
    m = b1 * m + (f(1) - b1) * g
    v = b2 * v + (f(1) - b2) * g * g
    update = (m / bc1) / (np.sqrt(v / bc2) + eps) + wd * p
    return p - lr * update, m, v


def _plain_grads(c: ModelConfig, weights: dict[str, torch.Tensor], tokens: torch.Tensor) -> dict[str, np.ndarray]:
    """Gradients of the mean token loss with respect to the unsharded weights (plain autograd)."""
    leaves = {k: v.clone().requires_grad_() for k, v in weights.items()}
    w = {k: (list(v.unbind(0)) if p.experts else v) for (k, v), p in zip(leaves.items(), param_table(c))}
    (forward(c, w, tokens) / (tokens.shape[0] * (tokens.shape[1] - 1))).backward()
    return {k: v.grad.numpy() for k, v in leaves.items()}


def test_world1_distopt_step_matches_independent_fused_adam():
    c = ModelConfig()
    cfg = TrainerConfig(weights="fp32", adam=ADAM)
    tr = ReferenceTrainer(ParallelLayout(), cfg)
    assert [len(b.layout.buckets) for b in tr.buffers] == [1, 1]  # dense + expert buffer
    init = init_logical(c, 0)
    grads = _plain_grads(c, init, batch(c, 0, 0))
    tr.train_step()
    for s in tr.slots:
        p0 = init[s.pdef.key][s.index[0]] if s.index else init[s.pdef.key]
        g = grads[s.pdef.key][s.index[0]] if s.index else grads[s.pdef.key]
        assert (s.frag.f0, s.frag.f1) == (0, p0.numel())
        want, m, v = _fused_adam_np(p0.numpy().reshape(-1), g.reshape(-1), 0 * g.reshape(-1), 0 * g.reshape(-1), 1, ADAM,
                                    s.pdef.decay)
        np.testing.assert_allclose(s.frag.master.numpy(), want, rtol=2e-6, atol=1e-7, err_msg=s.name)
        np.testing.assert_allclose(s.frag.exp_avg.numpy(), m, rtol=1e-5, atol=1e-9, err_msg=s.name)
        np.testing.assert_allclose(s.frag.exp_avg_sq.numpy(), v, rtol=1e-5, atol=1e-12, err_msg=s.name)
        assert torch.equal(s.storage.reshape(-1), s.frag.master)  # fp32 params: the model weight is the master
    # the bias correction is sharp: the wrong step count moves the masters far beyond the tolerance
    s = tr.slots[2]
    g = grads[s.pdef.key].reshape(-1)
    wrong, _, _ = _fused_adam_np(init[s.pdef.key].numpy().reshape(-1), g, 0 * g, 0 * g, 2, ADAM, True)
    assert np.abs(wrong - s.frag.master.numpy()).max() > 1e-3


@pytest.mark.slow
def test_world1_trains_and_bf16_weights_are_rounded_masters():
    st = train(ParallelLayout(), 25, seed=3, config=TrainerConfig(adam=ADAM))
    assert np.mean(st.losses[-5:]) < np.mean(st.losses[:5]) - 0.5
    for lp in st.params:
        assert lp.weight.dtype == torch.bfloat16
        assert torch.equal(lp.weight.reshape(-1)[lp.optim.f0:lp.optim.f1], lp.optim.master.to(torch.bfloat16))
    assert st.run.step == 25 and st.run.rank == 0 and st.run.layout.world == 1
    no_decay = set(st.run.optimizer.no_decay)
    assert "decoder.final_layernorm.weight" in no_decay and "output_layer.weight" not in no_decay


def test_local_params_follow_the_live_export_contract():
    st = train(ParallelLayout(), 0, seed=0)
    keys = [lp.key for lp in st.params]
    experts = [lp for lp in st.params if lp.key.endswith("experts.linear_fc1.weight")]
    assert [lp.index for lp in experts] == [(0,), (1,)]
    assert experts[0].geometry.prepend == (2,) and experts[0].geometry.expert
    arrays = {a for lp in st.params for a in lp.geometry.logical_arrays()}
    assert {"decoder.layers.0.self_attention.linear_qkv.weight.query",
            "decoder.layers.2.mixer.in_proj.weight.dt", "decoder.layers.1.mlp.linear_fc1.weight.up",
            "decoder.layers.3.mlp.experts.linear_fc1.weight.gate", "embedding.word_embeddings.weight"} <= arrays
    assert len(set(keys)) == len(keys) - 2  # only the two expert params share a key


def test_fp8_weights_quantize_with_the_logical_amax_and_bind_by_backlink():
    st = train(ParallelLayout(), 2, seed=1, config=TrainerConfig(weights="fp8", adam=ADAM))
    fp8 = [lp for lp in st.params if isinstance(lp.weight, QuantizedWeight)]
    assert len(fp8) == 10  # qkv, proj, fc1, fc2, in_proj, out_proj, 2 experts x (fc1, fc2)
    assert all(not isinstance(lp.weight, QuantizedWeight) for lp in st.params if "embedding" in lp.key or "output" in lp.key)
    for lp in fp8:
        q = lp.weight
        assert q.data.dtype == torch.float8_e4m3fn and q.scale_inv.dtype == torch.float32 and q.scale_inv.numel() == 1
        master = lp.optim.master
        amax = master.abs().max()
        assert torch.equal(q.scale_inv, (amax / 448.0).reshape(1))
        want = (master / q.scale_inv).clamp(-448, 448).to(torch.float8_e4m3fn)
        assert torch.equal(q.data.reshape(-1).view(torch.uint8), want.view(torch.uint8))
        copy = dequantize(q)
        assert copy._gtp_dequant_src is q and copy.dtype == torch.bfloat16
        # the master is the precise value: close to, not equal to, the dequantized weight
        assert 0 < float((copy.float().reshape(-1) - master).abs().max()) <= float(amax) / 8


@pytest.mark.slow
def test_resume_from_logical_state_continues_bit_exactly():
    cfg = TrainerConfig(adam=ADAM, weights="fp8")
    full = train(ParallelLayout(), 3, seed=5, config=cfg)
    part = train(ParallelLayout(), 2, seed=5, config=cfg)
    arrays = logical_state(part.trainer)
    fresh = ReferenceTrainer(ParallelLayout(), TrainerConfig(adam=ADAM, weights="fp8", seed=5), init=False)
    fill_from_logical(fresh, arrays)
    fresh.resume(2)
    assert step(fresh, 1) == full.losses[2:]
    for a, b in zip(fresh.local_params(), full.params):
        assert torch.equal(a.optim.master, b.optim.master) and torch.equal(a.optim.exp_avg_sq, b.optim.exp_avg_sq)
        wa, wb = (a.weight.data, b.weight.data) if isinstance(a.weight, QuantizedWeight) else (a.weight, b.weight)
        assert torch.equal(wa.view(torch.uint8) if wa.dtype == torch.float8_e4m3fn else wa,
                           wb.view(torch.uint8) if wb.dtype == torch.float8_e4m3fn else wb)


@pytest.mark.parametrize("kwargs, msg", [(dict(ep=3, dp=3), "EP=3"), (dict(cp=2), "cp=1"), (dict(tp=3), "TP=3"),
                                         (dict(tp=2), "init_process_group")])
def test_unsupported_layouts_are_refused(kwargs, msg):
    with pytest.raises(BridgeError, match=msg):
        ReferenceTrainer(ParallelLayout(**kwargs), groups=None)
