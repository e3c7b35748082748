"""Issue 30, items 1-2: what `to-megatron` writes is what Megatron-LM's own loader builds.

1. One key convention for every entry. The references are real megatron-core 0.19.2 saves: the
   training-loop fixture `dp2` (unwrapped model, keys `decoder...`: what Megatron-LM's
   `load_checkpoint` builds) and the library-style fixture `tp1` (DDP-wrapped, `module.decoder...`).
   Both are TP1 saves of the same tiny GPT, so a TP1 output must hold exactly their key sets.
2. Scheduler state for every hand-off. The reference is Megatron-LM's own code: the real
   `OptimizerParamScheduler` (vendored file) built by Megatron-LM's verbatim `get_optimizer_param_scheduler`
   (tests/fixtures/megatron_core_src/megatron/training/scheduler_from_args.py) from the same arguments,
   stepped as the training loop steps it (global batch size per iteration); and the real class's
   `load_state_dict` with Megatron-LM's defaults, which asserts every recorded value equals its own.
"""

from __future__ import annotations

import io
import os

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

import convert_reference as cref
from megatron_scheduler import megatron_args, real_scheduler, vendored_megatron
from bridge.cli import main
from bridge.errors import BridgeError

RUNS = cref.available_runs()
pytestmark = pytest.mark.skipif(not {"tp1", "dp2"} <= set(RUNS), reason="needs the real fixtures")
HEADS = ["--num-attention-heads", "4", "--num-query-groups", "2", "--kv-channels", "6"]  # tp1 saved no args
STEP, GBS = 3, 4


def keys_of(ckpt_dir: str) -> set[str]:
    """Every key of a torch_dist checkpoint's `.metadata` (torch DCP's own reader)."""
    return set(FileSystemReader(ckpt_dir).read_metadata().state_dict_metadata)


def common_state(ckpt_dir: str) -> dict:
    """common_state as megatron-core's load_common_state_dict reads it (dcp.load of the byte item)."""
    import torch.distributed.checkpoint as dcp

    key = "common_state/shard_0_1"
    sd = {key: io.BytesIO()}
    dcp.load(sd, storage_reader=dcp.FileSystemReader(ckpt_dir), no_dist=True)
    loaded = sd[key]
    if isinstance(loaded, io.BytesIO):
        loaded.seek(0)
        loaded = torch.load(loaded, weights_only=False)
    return loaded[0]


@pytest.fixture(scope="module")
def logicals(tmp_path_factory):
    """convert of the library-style tp1 save and of the training-loop dp2 save (both dp_reshardable)."""
    root = tmp_path_factory.mktemp("handoff")
    out = {}
    for run, extra in (("tp1", HEADS), ("dp2", [])):
        out[run] = str(root / f"{run}_logical")
        assert main(["convert", os.path.join(cref.FIXTURES, run, "dp_reshardable"), out[run], *extra]) == 0
    return out


SCHED = ["--lr", "0.01", "--min-lr", "0.01", "--lr-decay-style", "constant", "--train-iters", "100",
         "--global-batch-size", str(GBS), "--weight-decay", "0.1"]


def iter_dir(run_dir) -> str:
    return os.path.join(str(run_dir), f"iter_{STEP:07d}")


# --- 1. key convention ------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["fully_reshardable", "dp_reshardable"])
@pytest.mark.parametrize("source", ["tp1", "dp2"])
def test_every_key_in_one_convention_as_megatron_saves_it(logicals, tmp_path, fmt, source):
    """Default: exactly the keys of Megatron-LM's training-loop save (dp2); --key-convention wrapped:
    exactly the keys of the DDP-wrapped library save (tp1). Whatever convention the source had."""
    for conv, ref in (("unwrapped", "dp2"), ("wrapped", "tp1")):
        run = tmp_path / conv
        flags = [] if conv == "unwrapped" else ["--key-convention", "wrapped"]
        assert main(["to-megatron", logicals[source], str(run), "--tp", "1", "--format", fmt, *SCHED, *flags]) == 0
        got, want = keys_of(iter_dir(run)), keys_of(os.path.join(cref.FIXTURES, ref, fmt))
        assert got == want, (conv, sorted(got ^ want)[:6])
        model_keys = [k for k in got if not k.startswith(("optimizer.distributed.", "common_state/"))]
        names = [k.split("optimizer.state.", 1)[-1].split(".", 1)[-1] if k.startswith("optimizer.state.") else k
                 for k in model_keys]
        assert names and all(n.startswith("module.decoder.") or n.startswith("module.embedding.")
                             or n.startswith("module.output_layer.") for n in names) == (conv == "wrapped")
        assert not any(n.startswith("module.") for n in names) or conv == "wrapped"


def test_a_key_that_cannot_be_mapped_is_refused():
    from converters.megatron.plan.naming import check_one_convention

    roots = {"decoder", "embedding", "output_layer"}
    check_one_convention(["decoder.layers.mlp.linear_fc1._extra_state/shard_0_2"], "unwrapped", roots)
    for bad, conv in (("module.decoder.layers.mlp.linear_fc1._extra_state/shard_0_2", "unwrapped"),
                      ("decoder.final_layernorm.weight", "wrapped"),
                      ("optimizer.state.exp_avg.module.decoder.final_layernorm.weight", "unwrapped"),
                      ("vision_tower.proj._extra_state/shard_0_1", "unwrapped")):
        with pytest.raises(BridgeError, match="two conventions"):
            check_one_convention(["decoder.final_layernorm.weight", bad] if conv == "unwrapped" else [bad], conv, roots)


# --- 2. scheduler state --------------------------------------------------------------------------------

CASES = {
    "cosine_warmup_iters": dict(lr=3e-4, min_lr=3e-5, lr_decay_style="cosine", lr_warmup_iters=10, train_iters=100,
                                lr_decay_iters=80, global_batch_size=8),
    "linear_fraction_wd_incr": dict(lr=1e-3, lr_decay_style="linear", lr_warmup_fraction=0.1, train_iters=50,
                                    global_batch_size=16, weight_decay_incr_style="linear", start_weight_decay=0.0,
                                    end_weight_decay=0.1),
    "samples_isqrt": dict(lr=2e-4, min_lr=1e-5, lr_decay_style="inverse-square-root", lr_warmup_samples=64,
                          train_samples=1000, global_batch_size=8),
    "wsd": dict(lr=1e-3, lr_decay_style="WSD", lr_wsd_decay_style="cosine", lr_wsd_decay_iters=20, train_iters=100,
                global_batch_size=4, weight_decay=0.05, lr_warmup_init=1e-5, lr_warmup_iters=5),
    "constant": dict(lr=0.01, min_lr=0.01, lr_decay_style="constant", train_iters=100, global_batch_size=4,
                     weight_decay=0.1),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CASES))
def test_scheduler_from_args_equals_megatrons_own(name, monkeypatch):
    """record_from_args at iteration N == state_dict() of Megatron-LM's scheduler built from the same
    args and stepped N times by the global batch size (num_steps in samples), and the real class loads it."""
    from bridge.format.scheduler_args import record_from_args
    from bridge.lr_schedule import scheduler_state_dict

    cls, tr = vendored_megatron(monkeypatch)
    kw = CASES[name]
    args = megatron_args(**kw)
    for it in (0, 7):
        real, _ = real_scheduler(tr, args)
        for _ in range(it):
            real.step(increment=kw["global_batch_size"])
        ours = scheduler_state_dict(record_from_args(kw, it), it)
        want = real.state_dict()
        assert ours == want and {k: type(v) for k, v in ours.items()} == {k: type(v) for k, v in want.items()}, \
            (ours, want)
        fresh, opt = real_scheduler(tr, args)  # Megatron-LM's defaults: every value asserted equal to its own
        fresh.load_state_dict(ours)
        assert fresh.num_steps == it * kw["global_batch_size"]
        assert opt.param_groups[0]["lr"] == real.get_lr(real.optimizer.param_groups[0])


@pytest.mark.parametrize("bad,match", [
    (dict(lr=float("nan")), "finite"), (dict(min_lr=-1.0), ">= 0"), (dict(global_batch_size=0), "positive"),
    (dict(train_samples=10), "exactly one"), (dict(min_lr=1.0), "exceeds"),
    (dict(lr_warmup_iters=200), "lr_warmup_steps < lr_decay_steps"),
    (dict(start_weight_decay=0.1), "constant"), (dict(lr_decay_samples=5), "-iters"),
])
def test_bad_scheduler_args_are_refused(bad, match):
    from bridge.format.scheduler_args import record_from_args

    kw = dict(CASES["cosine_warmup_iters"], **bad)
    with pytest.raises(BridgeError, match=match):
        record_from_args(kw, 3)


def test_to_megatron_writes_megatrons_scheduler_from_flags_and_from_a_file(logicals, tmp_path, monkeypatch):
    """The written common_state["opt_param_scheduler"] loads into Megatron-LM's own scheduler for
    those args (its defaults assert every value), at num_steps = step x global batch size; the
    param groups carry --lr / --min-lr (0.19.2 matches groups by them)."""
    cls, tr = vendored_megatron(monkeypatch)
    kw = CASES["cosine_warmup_iters"]
    flags = [x for k, v in kw.items() for x in (f"--{k.replace('_', '-')}", str(v))]
    args_file = tmp_path / "megatron_args.txt"
    args_file.write_text("# the run's command line\n" + " ".join(flags) + " --micro-batch-size 2 --bf16\n")
    for how, extra in (("flags", flags), ("file", ["--megatron-args", str(args_file)])):
        run = tmp_path / how
        assert main(["to-megatron", logicals["tp1"], str(run), "--tp", "1", *extra]) == 0
        common = common_state(iter_dir(run))
        real, _ = real_scheduler(tr, megatron_args(**kw))
        for _ in range(STEP):
            real.step(increment=kw["global_batch_size"])
        assert common["opt_param_scheduler"] == real.state_dict()
        fresh, _ = real_scheduler(tr, megatron_args(**kw))
        fresh.load_state_dict(common["opt_param_scheduler"])
        groups = common["optimizer"]["optimizer"]["param_groups"]
        assert {(g["max_lr"], g["min_lr"]) for g in groups} == {(kw["lr"], kw["min_lr"])}


def test_no_scheduler_recorded_or_given_is_refused(logicals, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["to-megatron", logicals["tp1"], str(run), "--tp", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "opt_param_scheduler" in err[0] and "--lr" in err[0] and "--global-batch-size" in err[0]
    assert not run.exists()
    assert main(["to-megatron", logicals["tp1"], str(run), "--tp", "1", "--no-scheduler"]) == 0
    assert "opt_param_scheduler" not in common_state(iter_dir(run))
    assert main(["to-megatron", logicals["tp1"], str(tmp_path / "r2"), "--tp", "1", "--no-scheduler", *SCHED]) == 2


@pytest.mark.slow
def test_jax_save_records_the_megatron_schedule_it_trained_with(tmp_path, monkeypatch):
    """bridge.save(lr_schedule=megatron_schedule(args)) records it: the state written back at count N is
    Megatron-LM's scheduler for those args after N iterations. Any other optax schedule is refused."""
    import jax.numpy as jnp
    import optax

    from bridge import open_checkpoint, save
    from bridge.lr_schedule import megatron_schedule, scheduler_state_dict

    cls, tr = vendored_megatron(monkeypatch)
    kw = CASES["wsd"]
    sched = megatron_schedule(kw)
    params = {"decoder": {"final_layernorm": {"weight": jnp.ones((4,), jnp.float32)}}}
    tx = optax.adamw(sched)
    state = tx.init(params)
    for _ in range(5):
        upd, state = tx.update(jax_grads(params), state, params)
        params = optax.apply_updates(params, upd)
    save(str(tmp_path / "ck"), params=params, opt_state=state, step=5, lr_schedule=sched)
    rec = open_checkpoint(str(tmp_path / "ck")).manifest.megatron.scheduler
    real, _ = real_scheduler(tr, megatron_args(**kw))
    for _ in range(5):
        real.step(increment=kw["global_batch_size"])
    assert scheduler_state_dict(rec, 5) == real.state_dict()
    with pytest.raises(BridgeError, match="not a Megatron schedule"):
        save(str(tmp_path / "other"), params=params, opt_state=state, step=5,
             lr_schedule=optax.cosine_decay_schedule(1e-3, 100))
    assert not (tmp_path / "other").exists()


def jax_grads(params):
    import jax

    return jax.tree.map(lambda p: 0.01 * p + 0.001, params)
