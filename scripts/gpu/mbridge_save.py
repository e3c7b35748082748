"""GPU, one rank: a real Megatron-Bridge training run of the tiny GPT, saved by Megatron-Bridge itself.

    PYTHONPATH=/tmp/site-mb python3 -m torch.distributed.run --standalone --nproc-per-node 1 \\
        scripts/gpu/mbridge_save.py --out DIR

Megatron-Bridge's own `pretrain()` (mock data, NullTokenizer) trains `tests/fixtures/megatron/tinygpt.py`'s
sizes for 3 steps and saves through its own checkpointing (`DIR/ckpt/iter_0000003`, its
`run_config.yaml` beside the torch_dist files). At the save (Megatron-Bridge's `on_checkpoint_save`
callback) each rank's live model and distributed-optimizer state is dumped with `tinygpt.reference`
(`DIR/reference_rank0.pt`) and `DIR/run.json` written, as `make_fixtures.py` does: the independent
reference a conversion of the save is compared with. No TransformerEngine on the machine: the model
uses Megatron-Core's local layer spec. `nvrx_version_shim` bridges a version attribute the PyPI
packages disagree on.

Status (2026-12-01, records/gpu/2026-12-01_session8/, releases2_mbridge/): this has NOT run to
completion. With megatron-bridge 0.6.2 (PyPI's newest for Python 3.12), megatron-core 0.19.2 and
nvidia-resiliency-ext 0.4.1 (PyPI's newest) `import megatron.core.dist_checkpointing` itself fails:
0.19.2 asserts nvidia-resiliency-ext >= 0.6.0 whenever it is importable, and Megatron-Bridge's
`pretrain` imports it unconditionally. Megatron-Bridge 0.3.1 (megatron-core 0.15-0.16, nvrx 0.4.1)
would avoid that but its training loop imports TransformerEngine unconditionally
(train -> utils.flop_utils -> peft.lora), which has to be built on the machine first
(te-build-on-device.sh).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests", "fixtures", "megatron"))


def nvrx_version_shim() -> None:
    """megatron-core 0.19.2 reads `nvidia_resiliency_ext.__version__` at import; the newest release on
    PyPI (0.4.1, what Megatron-Bridge's requirement resolves to) has none: set it from the installed
    distribution's metadata (nothing else is changed)."""
    import importlib.metadata

    import nvidia_resiliency_ext as nvrx

    if not hasattr(nvrx, "__version__"):
        nvrx.__version__ = importlib.metadata.version("nvidia-resiliency-ext")


def local_spec(config):
    """Megatron-Core's local (no TransformerEngine) GPT layer spec."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return get_gpt_layer_local_spec()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--iters", type=int, default=3)
    a = ap.parse_args()
    import torch
    import torch.nn.functional as F

    nvrx_version_shim()
    import megatron.bridge
    import megatron.core
    import tinygpt
    from megatron.bridge.models.gpt_provider import GPTModelProvider
    from megatron.bridge.training.callbacks import Callback
    from megatron.bridge.training.config import (CheckpointConfig, ConfigContainer, DistributedInitConfig,
                                                 LoggerConfig, MockGPTDatasetConfig, OptimizerConfig, RNGConfig,
                                                 SchedulerConfig, TokenizerConfig, TrainingConfig, ValidationConfig)
    from megatron.bridge.training.gpt_step import forward_step
    from megatron.bridge.training.pretrain import pretrain
    from megatron.core.distributed import DistributedDataParallelConfig

    S = tinygpt.SIZES
    model = GPTModelProvider(
        num_layers=S["num_layers"], hidden_size=S["hidden_size"], ffn_hidden_size=S["ffn_hidden_size"],
        num_attention_heads=S["num_attention_heads"], num_query_groups=S["num_query_groups"],
        kv_channels=S["kv_channels"], gated_linear_unit=True, activation_func=F.silu,
        vocab_size=S["vocab_size"], seq_length=S["seq_length"], share_embeddings_and_output_weights=False,
        position_embedding_type="learned_absolute", hidden_dropout=0.0, attention_dropout=0.0,
        bias_activation_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
        normalization="LayerNorm", bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16,
        init_method_std=0.02, make_vocab_size_divisible_by=8, transformer_layer_spec=local_spec,
    )
    ckpt = os.path.join(a.out, "ckpt")
    cfg = ConfigContainer(
        model=model,
        train=TrainingConfig(train_iters=a.iters, global_batch_size=S["global_batch"],
                             micro_batch_size=S["global_batch"], eval_iters=0, eval_interval=1000),
        validation=ValidationConfig(eval_interval=1000, eval_iters=0),
        optimizer=OptimizerConfig(optimizer="adam", lr=tinygpt.LR, min_lr=tinygpt.LR, weight_decay=tinygpt.WEIGHT_DECAY,
                                  adam_beta1=tinygpt.BETAS[0], adam_beta2=tinygpt.BETAS[1], adam_eps=tinygpt.EPS,
                                  bf16=True, params_dtype=torch.bfloat16, use_distributed_optimizer=True, clip_grad=1.0),
        scheduler=SchedulerConfig(lr_decay_style="constant", lr_warmup_iters=0, start_weight_decay=tinygpt.WEIGHT_DECAY,
                                  end_weight_decay=tinygpt.WEIGHT_DECAY, weight_decay_incr_style="constant"),
        ddp=DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                          use_distributed_optimizer=True, average_in_collective=False),
        dataset=MockGPTDatasetConfig(seq_length=S["seq_length"], random_seed=1234, reset_attention_mask=False,
                                     reset_position_ids=False, eod_mask_loss=False, num_dataset_builder_threads=1,
                                     split="9999,8,2", data_sharding=True, dataloader_type="single",
                                     skip_getting_attention_mask_from_dataset=True),
        logger=LoggerConfig(log_interval=1),
        tokenizer=TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=S["vocab_size"] - 1),
        checkpoint=CheckpointConfig(save_interval=a.iters, save=ckpt, ckpt_format="torch_dist",
                                    fully_parallel_save=False, async_save=False),
        rng=RNGConfig(seed=1234),
        dist=DistributedInitConfig(),
        mixed_precision="bf16_mixed",
    )

    class Dump(Callback):
        def on_checkpoint_save(self, context):
            ref = tinygpt.reference(context.model[0], context.optimizer)
            ref["step"] = int(context.state.train_state.step)
            rank = torch.distributed.get_rank()
            os.makedirs(a.out, exist_ok=True)
            torch.save(ref, os.path.join(a.out, f"reference_rank{rank}.pt"))
            bad = tinygpt.check_reference(ref)
            if rank == 0:
                tinygpt.write_json(os.path.join(a.out, "run.json"), {
                    "run": "mbridge", "layout": {"nproc": 1}, "sizes": S, "steps": ref["step"],
                    "saver": f"megatron-bridge {getattr(megatron.bridge, '__version__', '?')} pretrain()",
                    "megatron_core": megatron.core.__version__, "torch": torch.__version__,
                    "reference_mismatches": bad,
                    "optimizer_classes": [o["class"] + "/" + o["inner_class"] for o in ref["optimizers"]]})
            print(f"[dump] step {ref['step']} params {len(ref['params'])} mismatches {len(bad)}", flush=True)

    pretrain(cfg, forward_step, callbacks=[Dump()])
    print("[done]", json.dumps(sorted(os.listdir(ckpt))), flush=True)


if __name__ == "__main__":
    main()
