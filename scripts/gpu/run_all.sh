#!/usr/bin/env bash
# One device call for the exporter's GPU checks and benchmark on 2 H200s (kind nvidia-h200-x2), from
# the repo root with `.whl` (megatron-core 0.19.2 wheel) carried. Logs go to $OUT (or /tmp/gpu-out).
# The Megatron-Core checks are scripts/gpu/run_checks.sh and (TransformerEngine staged) run_gtp.sh.
set -u
out=${OUT:-/tmp/gpu-out}; mkdir -p "$out"
source scripts/gpu/common.sh
install_megatron
nvidia-smi -L
RUN_GREP="PASS|FAIL|ratio|busbw|GB/s|loss|Error"
run live_nccl 110 python3 scripts/gpu/live_nccl.py
run live_bench 100 python3 scripts/gpu/live_bench.py --mib 1024 --reps 3
run reference_nccl 80 python3 scripts/gpu/reference_nccl.py
