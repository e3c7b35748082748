#!/usr/bin/env bash
# GPU machine (one GPU): try a real Megatron-Bridge save of the tiny GPT (scripts/gpu/mbridge_save.py).
# Usage, from a directory holding scripts/gpu, tests/fixtures/megatron, mbwhl/ (megatron-bridge and its
# import-time deps, --no-deps wheels for Python 3.12; list in records/gpu/2026-12-01_session8/
# releases2_mbridge/wheels.txt) and ../../.whl (megatron-core):  bash scripts/gpu/run_mbridge_save.sh OUTDIR
# Status (2026-12-01): never got past the imports -- megatron-core 0.19.2 asserts nvidia-resiliency-ext
# >= 0.6.0 while PyPI's newest is 0.4.1 (results README, releases2_mbridge/).
set -u
out=$1
export PYTHONUNBUFFERED=1 CUDA_DEVICE_MAX_CONNECTIONS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-mb ../../.whl/megatron_core-0.19.2-*.whl mbwhl/*.whl 2>&1 | tail -3
python3 -m pip show typing_extensions pyarrow transformers huggingface_hub tokenizers 2>/dev/null | grep -E "^(Name|Version)"
export PYTHONPATH=/tmp/site-mb
for m in megatron.bridge megatron.bridge.training.config megatron.bridge.models.gpt_provider megatron.bridge.training.gpt_step megatron.bridge.training.pretrain; do
  python3 -c "import sys; sys.path.insert(0, 'scripts/gpu'); import mbridge_save; mbridge_save.nvrx_version_shim(); import $m" > $out/import_$m.log 2>&1; echo "import $m rc=$?"; grep -E "Error|error" $out/import_$m.log | tail -2
done
timeout 300 python3 -m torch.distributed.run --standalone --nproc-per-node 1 scripts/gpu/mbridge_save.py --out $out/mb > $out/mb.log 2>&1; echo "mb rc=$?"
grep -vE "Warning|warn" $out/mb.log | tail -40
ls -la $out/mb $out/mb/ckpt $out/mb/ckpt/* 2>&1 | head -40
