#!/usr/bin/env bash
# Device call for the Megatron-Core checks of #4 and #7 on 2 H200s (kind nvidia-h200-x2), repo root,
# `.whl` carried. Expects to-megatron outputs made on a CPU machine under gpu_stage/ (see
# scripts/gpu/README in the header of megatron_load_check.py). Logs and small results go to $OUT.
set -u
out=${OUT:-/tmp/gpu-out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 CUDA_DEVICE_MAX_CONNECTIONS=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
[ -d /tmp/site/megatron ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/megatron_core-0.19.2-*.whl
export PYTHONPATH=$PWD:/tmp/site
R="python3 -m torch.distributed.run --standalone --nproc-per-node 2"
run() { local name=$1 t=$2; shift 2; local t0=$(date +%s)
  timeout "$t" "$@" > "$out/$name.log" 2>&1; echo "=== $name rc=$? $(( $(date +%s) - t0 ))s"
  grep -E "PASS|FAIL|Error|^\[rank 0\]" "$out/$name.log" | tail -12; }
if [ "${SKIP_LOAD_CHECK:-0}" != 1 ]; then
  for f in fully_reshardable dp_reshardable; do
    run load_check_$f 100 $R scripts/gpu/megatron_load_check.py --fixture dp2 --tp 2 --format $f \
      --megatron-ckpt gpu_stage/dp2_to_tp2_$f --hang-report 80
  done
fi
if [ "${SKIP_ROUNDTRIP:-0}" != 1 ]; then
  run roundtrip 400 bash scripts/gpu/megatron_roundtrip.sh /tmp/mrt
  cp /tmp/mrt/summary.txt "$out/roundtrip_summary.txt" 2>/dev/null
  # One tar (at most 8 files come back): results, logs and the small logical checkpoints the
  # JAX-step test uses; Megatron's own saves and repeated exports stay behind.
  (cd /tmp/mrt && tar cf "$out/megatron_live.tar" *.log */result.json \
     $(ls -d */live */live_after */live_grads */own_live_after */own_live_grads 2>/dev/null))
fi
