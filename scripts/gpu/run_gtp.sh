#!/usr/bin/env bash
# Last call of the TransformerEngine staging chain (docs: ../shared/docs/gpu-recipes.md): the parts
# tepart0..5 were copied to /tmp/te by earlier calls; .gpu/s6 carries the last part, the small
# wheels, the checksum, the torch-extension source and the build script. Builds TE, then runs the
# Megatron-Core checks that need it: fully_reshardable loads (torch Adam cannot), GTP targets, and the
# live round trip with a real GTP=2 run. Logs and small results go to $OUT.
set -u
out=${OUT:-/tmp/gpu-out}; mkdir -p "$out"
mkdir -p /tmp/te && cp .gpu/s6/* /tmp/te/
ls /tmp/te | tr '\n' ' '; echo
t0=$(date +%s); bash /tmp/te/te-build-on-device.sh > "$out/te_build.log" 2>&1; echo "=== te build $(( $(date +%s) - t0 ))s"
tail -1 "$out/te_build.log"
export PYTHONUNBUFFERED=1 CUDA_DEVICE_MAX_CONNECTIONS=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD:/tmp/site
R="python3 -m torch.distributed.run --standalone --nproc-per-node 2"
run() { local name=$1 t=$2; shift 2; local t0=$(date +%s)
  timeout "$t" "$@" > "/tmp/gtplogs/$name.log" 2>&1; echo "=== $name rc=$? $(( $(date +%s) - t0 ))s"
  grep -E "PASS|FAIL|Error|^\[rank 0\]" "/tmp/gtplogs/$name.log" | tail -14; }
rm -rf /tmp/gtplogs /tmp/mrt /tmp/gtp_load_check; mkdir -p /tmp/gtplogs
L=scripts/gpu/megatron_load_check.py
run load_check_tp2_fully 100 $R $L --fixture dp2 --tp 2 --format fully_reshardable --megatron-ckpt gpu_stage/dp2_to_tp2_fully_reshardable
run load_check_tp2_dp 100 $R $L --fixture dp2 --tp 2 --format dp_reshardable --megatron-ckpt gpu_stage/dp2_to_tp2_dp_reshardable
run load_check_gtp2_fully 100 $R $L --fixture dp2 --tp 1 --gtp 2 --format fully_reshardable --megatron-ckpt gpu_stage/dp2_to_gtp2_fully
WITH_GTP=1 run roundtrip 330 bash scripts/gpu/megatron_roundtrip.sh /tmp/mrt
cat /tmp/mrt/summary.txt > "$out/roundtrip_summary.txt" 2>/dev/null
(cd /tmp/mrt && tar cf "$out/gtp_results.tar" *.log */result.json from_gtp2/*/result.json \
   $(ls -d */live */live_after */live_grads */own_live_after */own_live_grads 2>/dev/null)) 2>/dev/null
(cd /tmp/gtplogs && tar cf "$out/gtp_logs.tar" *.log)
