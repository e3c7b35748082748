#!/usr/bin/env bash
# One device call (kind nvidia-h200-x2, about 4 minutes, nothing to carry) for the two throughput
# benchmarks with every anchor in the same run: the live export (TP2 and GTP2 over NCCL, with the
# exchange's bus bandwidth and an exact read-back) and the store (4 GiB by 2 writers vs raw
# TensorStore, Orbax and DCP). Logs and the store's JSON go to $OUT (or /tmp/gpu-out).
set -u
out=${OUT:-/tmp/gpu-out}; mkdir -p "$out"
source scripts/gpu/common.sh
RUN_GREP="PASS|FAIL|SUMMARY|Error|^\|"
run live_bench 240 python3 scripts/gpu/live_bench.py --mib 1024 --reps 5 --dir "$PWD/.live_bench"
rm -rf "$PWD/.live_bench"
run store_bench 240 python3 benchmarks/bench_store_write.py --gib 4 --reps 3 --memory warm \
    --workdir "$PWD/.bench_store_write" --json "$out/bench_store_write.json"
rm -rf "$PWD/.bench_store_write"
