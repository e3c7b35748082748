#!/usr/bin/env bash
# One device call (nvidia-h200-x2, about 6 minutes): OCDBT target data file size TF MiB (default 16)
# against 64 MiB, alternating, in the live export (each layout) and the store benchmark. Logs to $OUT.
set -u
out=${OUT:-/tmp/gpu-out}; mkdir -p "$out"
tf=${TF:-16}
source scripts/gpu/common.sh
RUN_GREP="PASS|FAIL|Error"
for layout in gtp2 tp2; do
  for f in $tf 64; do
    run live_${layout}_tf$f 110 python3 scripts/gpu/live_bench.py --layout $layout --mib 1024 --reps 5 \
        --dir "$PWD/.lb" --target-file-mib $f
    rm -rf "$PWD/.lb"
  done
done
RUN_GREP="SUMMARY|Error"
run store 110 python3 benchmarks/bench_store_write.py --gib 2 --reps 3 --memory warm \
    --variants store_tf$tf,store_tf64,raw_ts --workdir "$PWD/.bsw" --json "$out/store.json"
