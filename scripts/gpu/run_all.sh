#!/usr/bin/env bash
# One device call for the GPU checks of issues #4, #6, #7 on 2 H200s (kind nvidia-h200-x2), from
# the repo root with `.whl` (megatron-core 0.19.2 wheel) carried. Logs go to $OUT (or /tmp/gpu-out).
set -u
out=${OUT:-/tmp/gpu-out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD CUDA_DEVICE_MAX_CONNECTIONS=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/megatron_core-0.19.2-*.whl
nvidia-smi -L
run() {  # name, timeout, command...
  local name=$1 t=$2; shift 2; local t0=$(date +%s)
  timeout "$t" "$@" > "$out/$name.log" 2>&1; local rc=$?
  echo "=== $name rc=$rc $(( $(date +%s) - t0 ))s"; grep -E "PASS|FAIL|ratio|busbw|GB/s|loss|Error" "$out/$name.log" | tail -12
}
run live_nccl 110 python3 scripts/gpu/live_nccl.py
run live_bench 100 python3 scripts/gpu/live_bench.py --mib 1024 --reps 3
SKIP_REVERSE=1 run megatron_roundtrip 150 bash scripts/gpu/megatron_roundtrip.sh "$out/mrt"
cp "$out/mrt/summary.txt" "$out/megatron_roundtrip_summary.txt" 2>/dev/null
PYTHONPATH=$PWD:/tmp/site run megatron_load_check 80 python3 -m torch.distributed.run --standalone --nproc-per-node 2 \
  scripts/gpu/megatron_load_check.py --run dp2 --tp 2 --format fully_reshardable --work /tmp/loadcheck
run reference_nccl 80 python3 scripts/gpu/reference_nccl.py
rm -rf "$out/mrt"
