#!/usr/bin/env bash
# Second device call: real Megatron-Core loads `to-megatron` output (#4) and a live export loaded
# back at the same layout continues identically (#7). Repo root, `.whl` carried, 2 GPUs.
set -u
out=${OUT:-/tmp/gpu-out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 CUDA_DEVICE_MAX_CONNECTIONS=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/megatron_core-0.19.2-*.whl
export PYTHONPATH=$PWD:/tmp/site
R="python3 -m torch.distributed.run --standalone --nproc-per-node 2"
run() { local name=$1 t=$2; shift 2; local t0=$(date +%s)
  timeout "$t" "$@" > "$out/$name.log" 2>&1; echo "=== $name rc=$? $(( $(date +%s) - t0 ))s"
  grep -E "PASS|FAIL|Error|loss" "$out/$name.log" | tail -8; }
run load_check_fully 90 $R scripts/gpu/megatron_load_check.py --fixture dp2 --tp 2 --format fully_reshardable --work /tmp/lc1
run load_check_dp 90 $R scripts/gpu/megatron_load_check.py --fixture dp2 --tp 2 --format dp_reshardable --work /tmp/lc2
M=scripts/gpu/megatron_roundtrip.py
run train_tp2 70 $R $M --mode train --layout tp2 --out /tmp/mrt
run load_tp2_same 70 $R $M --mode load --layout tp2 --src /tmp/mrt/tp2 --out /tmp/mrt
python3 - <<'PY' | tee "$out/same_layout.txt"
import json; a = json.load(open("/tmp/mrt/tp2/result.json")); b = json.load(open("/tmp/mrt/load_tp2/result.json"))
print("source next", a["next_losses"], "loaded next", b["next_losses"], "after_vs_source_after", b.get("after_vs_source_after", {}).get("ok"), b.get("after_vs_source_after", {}).get("max_abs"))
PY
