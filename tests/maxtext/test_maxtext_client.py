"""The real-client round trip of the maxtext preset (issue #22): Megatron-Core -> MaxText -> Megatron-Core.

Needs a Python 3.12 environment with `maxtext` 0.2.5 (CPU jax), named by MAXTEXT_PYTHON; skipped
cleanly otherwise. The command (README, "MaxText"):

    python3.12 -m venv /opt/venv-maxtext && /opt/venv-maxtext/bin/pip install maxtext==0.2.5 \\
        "jax>=0.11.1" flax optax orbax-checkpoint ...   (docs/maxtext.md lists the set)
    MAXTEXT_PYTHON=/opt/venv-maxtext/bin/python python -m pytest -q tests/maxtext/test_maxtext_client.py

Data: tests/fixtures/maxtext/llama (a llama-style megatron-core 0.19.2 run on an H200: the state at
step 3, Megatron's step-3 grads, the state after step 3, its losses and tokens).
1. `convert` + `write_maxtext` turn Megatron's step-3 save into a MaxText checkpoint root; MaxText's own trainer setup
   (`train_utils.setup_train_loop`) restores it; MaxText's `loss_fn` on batch 3 == Megatron's loss
   (bf16 activations: LOSS_RTOL).
2. MaxText's own optimizer (`get_optimizer` from the preset's config overrides, `apply_gradients`)
   takes Megatron's step-3 grads: MaxText's loss on batch 4 == Megatron's (and the control: before
   the step it is far off), MaxText's own `save_checkpoint` writes step 3; `read_maxtext` brings it back
   and it equals Megatron's state after step 3 within ADAM_ULP_TOL / MOMENT_ULP_TOL (same metric as
   tests/jaxside/test_megatron_jax_step.py); count and step 4.
3. `to-megatron` writes it as a Megatron torch_dist checkpoint (iteration 4) and the converter reads
   that back bit-exactly.
4. A fresh MaxText run (its own init and 2 training steps, a checkpoint we did not write) reads back
   and converts to Megatron with shapes and values checked against the raw stored arrays.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from ulp import max_ulp as _max_ulp

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/
ROOT = os.path.dirname(HERE)
LLAMA = os.path.join(HERE, "fixtures", "maxtext", "llama")
CLIENT = os.path.join(HERE, "support", "maxtext_client.py")
PY = os.environ.get("MAXTEXT_PYTHON", "")
# Observed (CPU, MaxText 0.2.5 / jax 0.12): |rel| 1.6e-5 (batch 3), 2.1e-5 (batch 4 after the step).
LOSS_RTOL = 1e-4
# Observed: masters 5 ulp (at max(|value|, |before|, lr)), mu <= 2 ulp of its operands, nu 1 ulp.
ADAM_ULP_TOL = 8
MOMENT_ULP_TOL = 6


def _maxtext_ok() -> bool:
    if not PY or not os.path.exists(PY):
        return False
    r = subprocess.run([PY, "-c", "import maxtext, maxtext.trainers.pre_train.train"], capture_output=True,
                       timeout=300)
    return r.returncode == 0


pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not _maxtext_ok(), reason="needs MAXTEXT_PYTHON: a Python 3.12 env with maxtext 0.2.5")]


def read_all(path: str) -> dict:
    from bridge.store.reader import open_checkpoint

    ck = open_checkpoint(path)
    return {p: ck.read(p) for p in ck.paths()}


def run_client(cmd: str, base: str, run: str, overrides: dict, **files: str) -> dict:
    ov = os.path.join(base, f"{run}_overrides.json")
    json.dump(overrides, open(ov, "w"))
    out = os.path.join(base, f"{run}_report.json")
    args = [PY, CLIENT, cmd, "--base-dir", base, "--run", run, "--overrides", ov, "--out", out]
    for k, v in files.items():
        args += [f"--{k}", v]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XLA_FLAGS")}
    env["JAX_PLATFORMS"] = "cpu"
    r = subprocess.run(args, capture_output=True, text=True, timeout=900, env=env, cwd=base)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return json.load(open(out))


@pytest.fixture(scope="module")
def trip(tmp_path_factory):
    """Steps 1-2 once: write, MaxText restores + loss + its optimizer step + its save, read back."""
    from bridge.jaxside.presets import maxtext as mx
    from bridge.jaxside.presets.maxtext_ckpt import read_logical
    from bridge.jaxside.presets.maxtext_stream import read_maxtext, write_maxtext

    from converters.megatron.convert_entry import convert

    base = str(tmp_path_factory.mktemp("maxtext"))
    root = os.path.join(base, "run", "checkpoints")
    # The user's path: Megatron's own save -> convert -> to MaxText (the converted state equals the
    # live export `live` bit for bit; tests/fixtures/maxtext/README.md).
    convert(os.path.join(LLAMA, "dp_reshardable"), os.path.join(base, "logical"))
    w = write_maxtext(os.path.join(base, "logical"), root)
    _, grads, _, _ = read_logical(os.path.join(LLAMA, "live_grads"))
    g = mx.to_maxtext(grads["params"], "params", w.dims, w.options)
    np.savez(os.path.join(base, "grads.npz"), **{"/".join(k): v for k, v in g.items()})
    meg = json.load(open(os.path.join(LLAMA, "run.json")))
    json.dump(meg["tokens"], open(os.path.join(base, "batches.json"), "w"))
    report = run_client("step", base, "run", w.overrides, batch=os.path.join(base, "batches.json"),
                        grads=os.path.join(base, "grads.npz"))
    back = os.path.join(base, "back")
    res = read_maxtext(root, back)
    return dict(base=base, root=root, written=w, report=report, megatron=meg, back=back, back_res=res)


def test_maxtext_restores_and_computes_megatrons_loss(trip):
    r, meg = trip["report"], trip["megatron"]
    assert r["restored_step"] == 3                       # MaxText resumed our step (dir 2, step 3)
    want = meg["next_losses"][0]                          # Megatron's loss of batch 3 on this state
    print(f"MaxText loss {r['loss_batch3']:.7f}, Megatron {want:.7f}, rel {abs(r['loss_batch3'] - want) / want:.2e}")
    assert abs(r["loss_batch3"] - want) <= LOSS_RTOL * want


def test_maxtext_step_equals_megatrons_next_update(trip):
    r, meg = trip["report"], trip["megatron"]
    assert r["step_after"] == 4 and r["saved_step_dir"] == 3 and trip["back_res"]["trained_steps"] == 4
    want = meg["next_losses"][1]                          # Megatron's loss of batch 4 after its step 3
    err, control = abs(r["loss_batch4_after"] - want), abs(r["loss_batch4_before"] - want)
    print(f"batch 4: MaxText after its step {r['loss_batch4_after']:.7f}, before {r['loss_batch4_before']:.7f}, "
          f"Megatron {want:.7f}")
    assert err <= LOSS_RTOL * want and control > 5 * err

    before, after, grads = (read_all(os.path.join(LLAMA, n)) for n in ("live", "live_after", "live_grads"))
    back = read_all(trip["back"])
    lr, b1 = 1e-2, 0.9

    def part(tree, kind):
        pre = ("params",) if kind == "params" else ("opt_state", "0", kind)
        return {p[len(pre):]: a for p, a in tree.items() if p[:len(pre)] == pre}

    g = part(grads, "params")
    m_terms = {p: np.maximum(np.abs(part(before, "mu")[p]), np.abs(g[p]) * (1 - b1)) for p in g}
    dev = {"params": _max_ulp(part(back, "params"), part(after, "params"), lr, part(before, "params")),
           "mu": _max_ulp(part(back, "mu"), part(after, "mu"), 1e-30, m_terms),
           "nu": _max_ulp(part(back, "nu"), part(after, "nu"), 1e-30)}
    miss = _max_ulp(part(before, "params"), part(after, "params"), lr)  # control: no step at all
    print(f"MaxText step vs Megatron step, max ulp {dev}; before vs after {miss:.0f}")
    assert dev["params"] <= ADAM_ULP_TOL and max(dev["mu"], dev["nu"]) <= MOMENT_ULP_TOL, dev
    assert miss > 1000 * ADAM_ULP_TOL
    assert int(back[("opt_state", "0", "count")]) == int(after[("opt_state", "0", "count")]) == 4
    assert int(back[("step",)]) == 4


def test_back_through_to_megatron(trip, tmp_path):
    pytest.importorskip("torch")
    from converters.megatron.convert_entry import convert
    from converters.megatron.write.torch_dist import MegatronTarget
    from converters.megatron.write.to_megatron import to_megatron

    run_dir = str(tmp_path / "meg")
    to_megatron(trip["back"], run_dir, MegatronTarget(tp=1, fmt="dp_reshardable"))
    assert open(os.path.join(run_dir, "latest_checkpointed_iteration.txt")).read().strip() == "4"
    convert(os.path.join(run_dir, "iter_0000004"), str(tmp_path / "again"))
    back, again = read_all(trip["back"]), read_all(str(tmp_path / "again"))
    n = 0
    for p, a in back.items():
        assert p in again, p
        assert np.array_equal(again[p], a), p
        n += 1
    assert n >= 3 * 12 + 2
    keep = os.environ.get("MAXTEXT_KEEP_MEGATRON")   # for the device check: Megatron loads this run dir
    if keep:
        import shutil

        shutil.copytree(run_dir, keep, dirs_exist_ok=True)


def test_fresh_maxtext_run_converts_to_megatron(trip, tmp_path):
    """A checkpoint MaxText wrote on its own (init + 2 steps) -> logical -> to-megatron -> convert."""
    pytest.importorskip("torch")
    from bridge.jaxside.presets import maxtext as mx
    from bridge.jaxside.presets.maxtext_ckpt import find_items
    from bridge.jaxside.presets.maxtext_stream import read_maxtext
    from converters.megatron.convert_entry import convert
    from converters.megatron.write.torch_dist import MegatronTarget
    from converters.megatron.write.to_megatron import to_megatron
    from test_maxtext_preset import _plain_read

    base = str(tmp_path)
    run_client("fresh", base, "fresh", trip["written"].overrides)
    root = os.path.join(base, "fresh", "checkpoints")
    items = find_items(root)
    hyper = mx.Hyper(lr=0.01, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, clip_grad=1.0)
    res = read_maxtext(root, str(tmp_path / "logical"), hyper=hyper)
    assert res["adam_count"] == 2 and not res["sidecar"]
    raw, back = _plain_read(items), read_all(str(tmp_path / "logical"))
    d = trip["written"].dims
    for kind, src, pre in (("params", "params/params/", ("params",)), ("mu", "opt_state/0/mu/params/", ("opt_state", "0", "mu"))):
        emb = raw[src + "token_embedder/embedding"]
        assert emb.shape == (d.vocab, d.hidden) and np.array_equal(back[pre + ("embedding", "word_embeddings", "weight")], emb)
        k = raw[src + "decoder/layers/self_attention/key/kernel"]          # (E, L, K, D)
        want = np.stack([k[:, l].reshape(d.hidden, d.kv_heads * d.head_dim).T for l in range(d.layers)])
        assert np.array_equal(back[pre + ("decoder", "layers", "self_attention", "linear_qkv", "weight", "key")], want)
        ln = raw[src + "decoder/layers/post_self_attention_layer_norm/scale"]   # (E, L)
        assert np.array_equal(back[pre + ("decoder", "layers", "mlp", "linear_fc1", "layer_norm_weight")], ln.T)
    run_dir = str(tmp_path / "meg")
    to_megatron(str(tmp_path / "logical"), run_dir, MegatronTarget(tp=2, fmt="fully_reshardable"))
    convert(os.path.join(run_dir, "iter_0000002"), str(tmp_path / "again"))
    again = read_all(str(tmp_path / "again"))
    for p, a in back.items():
        assert np.array_equal(again[p], a), p


def test_llama2_block_forward_exact_adam_not(tmp_path):
    """MaxText's own llama2 block (query scale folded into the kernel, moments as the gradient scales):
    the loss is Megatron's, the moments continue exactly, and the query kernel's Adam step comes out
    sqrt(D) times Megatron's -- the documented reason the qwen2 block is the default."""
    from bridge.jaxside.presets import maxtext as mx
    from bridge.jaxside.presets.maxtext_ckpt import read_logical
    from bridge.jaxside.presets.maxtext_stream import read_maxtext, write_maxtext

    base = str(tmp_path)
    root = os.path.join(base, "l2", "checkpoints")
    w = write_maxtext(os.path.join(LLAMA, "live"), root, decoder_block="llama2")
    assert w.overrides["decoder_block"] == "llama2"
    _, grads, _, _ = read_logical(os.path.join(LLAMA, "live_grads"))
    g = mx.to_maxtext(grads["params"], "grad", w.dims, w.options)
    np.savez(os.path.join(base, "grads.npz"), **{"/".join(k): v for k, v in g.items()})
    meg = json.load(open(os.path.join(LLAMA, "run.json")))
    json.dump(meg["tokens"], open(os.path.join(base, "batches.json"), "w"))
    r = run_client("step", base, "l2", w.overrides, batch=os.path.join(base, "batches.json"),
                   grads=os.path.join(base, "grads.npz"))
    assert abs(r["loss_batch3"] - meg["next_losses"][0]) <= LOSS_RTOL * meg["next_losses"][0]
    read_maxtext(root, os.path.join(base, "back"))
    before, after, back = (read_all(p) for p in (os.path.join(LLAMA, "live"), os.path.join(LLAMA, "live_after"),
                                                  os.path.join(base, "back")))
    q = ("decoder", "layers", "self_attention", "linear_qkv", "weight", "query")
    for kind in ("mu", "nu"):
        k = ("opt_state", "0", kind) + q
        np.testing.assert_allclose(back[k], after[k], rtol=1e-5, atol=1e-30 if kind == "nu" else 1e-12)
    decayed = before[("params",) + q] * np.float32(1 - 1e-2 * 0.1)
    step_meg, step_mt = after[("params",) + q] - decayed, back[("params",) + q] - decayed
    ratio = float(np.linalg.norm(step_mt) / np.linalg.norm(step_meg))
    print(f"llama2 block: loss {r['loss_batch3']:.7f} (Megatron {meg['next_losses'][0]:.7f}); batch 4 after the step "
          f"{r['loss_batch4_after']:.7f} (Megatron {meg['next_losses'][1]:.7f}); query step / Megatron's {ratio:.4f} "
          f"(sqrt(D) = {np.sqrt(w.dims.head_dim):.4f})")
    assert abs(ratio - np.sqrt(w.dims.head_dim)) < 1e-3 * np.sqrt(w.dims.head_dim)
    for p in after:
        if p[0] == "params" and p[1:] != q:
            assert _max_ulp({p: back[p]}, {p: after[p]}, 1e-2, {p: before[p]}) <= ADAM_ULP_TOL, p


def _one_step(tmp: str, run: str, **opts) -> tuple[dict, dict]:
    """write_maxtext(live, **opts) -> MaxText restore + loss + its step on Megatron's grads + its save -> read back."""
    from bridge.jaxside.presets import maxtext as mx
    from bridge.jaxside.presets.maxtext_ckpt import read_logical
    from bridge.jaxside.presets.maxtext_stream import read_maxtext, write_maxtext

    root = os.path.join(tmp, run, "checkpoints")
    w = write_maxtext(os.path.join(LLAMA, "live"), root, **opts)
    _, grads, _, _ = read_logical(os.path.join(LLAMA, "live_grads"))
    g = mx.to_maxtext(grads["params"], "grad", w.dims, w.options)
    np.savez(os.path.join(tmp, f"{run}_grads.npz"), **{"/".join(k): v for k, v in g.items()})
    meg = json.load(open(os.path.join(LLAMA, "run.json")))
    json.dump(meg["tokens"], open(os.path.join(tmp, "batches.json"), "w"))
    r = run_client("step", tmp, run, w.overrides, batch=os.path.join(tmp, "batches.json"),
                   grads=os.path.join(tmp, f"{run}_grads.npz"))
    read_maxtext(root, os.path.join(tmp, f"{run}_back"))
    return r, read_all(os.path.join(tmp, f"{run}_back"))


def test_unscanned_layers(tmp_path):
    """scan_layers=false (decoder/layers_<i>/...): MaxText restores it, same loss, same step, same state back."""
    r, back = _one_step(str(tmp_path), "flat", scan_layers=False)
    meg = json.load(open(os.path.join(LLAMA, "run.json")))
    assert r["restored_step"] == 3
    assert abs(r["loss_batch3"] - meg["next_losses"][0]) <= LOSS_RTOL * meg["next_losses"][0]
    assert abs(r["loss_batch4_after"] - meg["next_losses"][1]) <= LOSS_RTOL * meg["next_losses"][1]
    before, after = read_all(os.path.join(LLAMA, "live")), read_all(os.path.join(LLAMA, "live_after"))
    params = [p for p in after if p[0] == "params"]
    assert _max_ulp({p: back[p] for p in params}, {p: after[p] for p in params}, 1e-2,
                    {p: before[p] for p in params}) <= ADAM_ULP_TOL
    print(f"unscanned: loss {r['loss_batch3']:.7f}, after step {r['loss_batch4_after']:.7f}")


def reference_loss(params: dict, tokens, labels, h: int, k: int, d: int, base: float = 10000.0, eps: float = 1e-5,
                   interleaved: bool = False) -> float:
    """Megatron's llama forward written out in float32 torch from the logical params (test code, not the
    preset): RMSNorm (x * rsqrt(mean x^2 + eps) * w), RoPE on q and k with Megatron's inv_freq =
    base^(-2i/D) (rotate-half, or interleaved pairs), GQA head h on query group h // (H/K), scores / sqrt(D),
    causal softmax, SwiGLU silu(gate) * up, untied output layer; mean cross-entropy."""
    import torch

    P = {"/".join(p[1:]): torch.tensor(a) for p, a in params.items() if p[0] == "params"}
    t = torch.tensor(tokens)
    B, S = t.shape
    x = P["embedding/word_embeddings/weight"][t]
    f = torch.outer(torch.arange(S, dtype=torch.float32), 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float32) / d)))

    def rope(z):
        if interleaved:
            c, s_ = f.cos()[:, None], f.sin()[:, None]
            z1, z2 = z[..., 0::2], z[..., 1::2]
            return torch.stack([z1 * c - z2 * s_, z2 * c + z1 * s_], -1).flatten(-2)
        c, s_ = torch.cat([f, f], -1).cos()[:, None], torch.cat([f, f], -1).sin()[:, None]
        return z * c + torch.cat([-z[..., d // 2:], z[..., :d // 2]], -1) * s_

    def rms(z, w):
        return z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + eps) * w

    group = torch.arange(h) // (h // k)
    causal = torch.triu(torch.ones(S, S, dtype=torch.bool), 1)
    for layer in range(P["decoder/layers/self_attention/linear_qkv/weight/query"].shape[0]):
        g = lambda n: P["decoder/layers/" + n][layer]  # noqa: E731
        y = rms(x, g("self_attention/linear_qkv/layer_norm_weight"))
        q = rope((y @ g("self_attention/linear_qkv/weight/query").T).view(B, S, h, d))
        kk = rope((y @ g("self_attention/linear_qkv/weight/key").T).view(B, S, k, d))[:, :, group]
        vv = (y @ g("self_attention/linear_qkv/weight/value").T).view(B, S, k, d)[:, :, group]
        sc = torch.einsum("bshd,bthd->bhst", q, kk) / d ** 0.5
        o = torch.einsum("bhst,bthd->bshd", sc.masked_fill(causal, float("-inf")).softmax(-1), vv)
        x = x + o.reshape(B, S, h * d) @ g("self_attention/linear_proj/weight").T
        y = rms(x, g("mlp/linear_fc1/layer_norm_weight"))
        x = x + (torch.nn.functional.silu(y @ g("mlp/linear_fc1/weight/gate").T) * (y @ g("mlp/linear_fc1/weight/up").T)) \
            @ g("mlp/linear_fc2/weight").T
    logits = rms(x, P["decoder/final_layernorm/weight"]) @ P["output_layer/weight"].T
    return float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), torch.tensor(labels).reshape(-1)))


SHARPEN = 10.0  # q and k kernels x10: attention scores x100, so RoPE / GQA / scaling conventions move the loss


def test_attention_conventions_on_a_sharpened_state(tmp_path):
    """The trained tiny model's attention is nearly uniform, so its loss barely sees RoPE, GQA grouping
    or the score scale (a wrong RoPE layout moves it by 1.2e-4 only). Here: (1) the float32 reference
    above reproduces Megatron's recorded loss (validating the reference on what Megatron computed);
    (2) with the q/k kernels sharpened x10, MaxText's loss equals the reference's, while the reference
    with the other RoPE layout is far off (so the check discriminates); (3) MaxText fed the state with
    the wrong RoPE permutation misses the reference by as much."""
    pytest.importorskip("torch")
    from bridge.jaxside.presets import maxtext as mx
    from bridge.jaxside.presets import maxtext_ckpt as mc
    from bridge.store.commit import save_checkpoint
    from bridge.format.schema import adamw_empty_paths
    from orbax.checkpoint import v1 as ocp

    meg = json.load(open(os.path.join(LLAMA, "run.json")))
    tokens, labels = meg["tokens"]["3"]
    live = read_all(os.path.join(LLAMA, "live"))
    ref = reference_loss(live, tokens, labels, 4, 2, 6)
    assert abs(ref - meg["next_losses"][0]) <= 6e-5 * meg["next_losses"][0], (ref, meg["next_losses"][0])

    sharp = {p: (a * np.float32(SHARPEN) if p[0] == "params" and p[-1] in ("query", "key") else a)
             for p, a in live.items() if p[0] != "model"}
    man, _, _, _ = mc.read_logical(os.path.join(LLAMA, "live"))
    base = str(tmp_path)
    save_checkpoint(os.path.join(base, "sharp"), sharp, man, empty_paths=adamw_empty_paths())
    want, wrong = reference_loss(sharp, tokens, labels, 4, 2, 6), reference_loss(sharp, tokens, labels, 4, 2, 6,
                                                                                   interleaved=True)
    json.dump(meg["tokens"], open(os.path.join(base, "batches.json"), "w"))
    losses = {}
    for name, interleaved in (("right", False), ("wrong", True)):
        m, trees, count, _ = mc.read_logical(os.path.join(base, "sharp"))
        dims = mx.Dims.from_logical({p: a.shape for p, a in trees["params"].items()}, 6)
        opts = mx.Options(rotary_interleaved=interleaved)
        hyper = mc.hyper_of(m, {p: a.shape for p, a in trees["params"].items()})
        mt = {kd: mx.to_maxtext(t, kd, dims, opts) for kd, t in trees.items()}
        state = mc.train_state(mt["params"], mt["mu"], mt["nu"], count, count, hyper, dims, opts)
        ocp.training.Checkpointer(os.path.join(base, name, "checkpoints")).save_checkpointables(
            count - 1, {"items": state}, custom_metadata={"scan_layers": True})
        np.savez(os.path.join(base, f"{name}.npz"), **{"/".join(kp): np.zeros_like(v) for kp, v in mt["params"].items()})
        r = run_client("step", base, name, mx.maxtext_overrides(dims, opts, hyper, max_target_length=16),
                       batch=os.path.join(base, "batches.json"), grads=os.path.join(base, f"{name}.npz"))
        losses[name] = r["loss_batch3"]
    print(f"sharpened x{SHARPEN}: reference {want:.7f} (other RoPE layout {wrong:.7f}); MaxText {losses['right']:.7f}, "
          f"MaxText fed the wrong layout {losses['wrong']:.7f}")
    tol = LOSS_RTOL * want
    assert abs(losses["right"] - want) <= tol
    assert abs(wrong - want) > 5 * tol and abs(losses["wrong"] - want) > 5 * tol
