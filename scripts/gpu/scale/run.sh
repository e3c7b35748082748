#!/usr/bin/env bash
# One device call (one H200, 16 cores, 128 GiB, 64 GiB disk; repository root): the scale benchmark
# (benchmarks/bench_scale.py) at SP_GIB GiB of state (default 12), finishing before SP_DEADLINE
# seconds (default 560). Needs nothing beyond the machine's torch / tensorstore (no wheel).
#   bash scripts/gpu/scale/run.sh            # results: $OUT/{bench_scale.jsonl,bench_scale.txt,offline.jsonl,steps.txt,env.txt,logs.txt}
source scripts/gpu/scale/lib.sh
env_info
compile_tree
D=${SP_DIR:-/tmp/bench_scale}; rm -rf "$D"
# the benchmark keeps 10 s for collecting logs and SP_AB_S (default 30) for the verify cold/warm run on its
# conversion; it skips (and names) every step that would not fit
budget=$(( $(left) - 10 - ${SP_AB_S:-30} ))
step bench_scale "$budget" 60 $PY benchmarks/bench_scale.py --gib "${SP_GIB:-12}" --dir "$D" \
  --deadline "$(( budget - 5 ))" --json "$out/bench_scale.jsonl" ${SP_BENCH_ARGS:-}
grep -v '^{"bench' "$logs/bench_scale.log" > "$out/bench_scale.txt"
# verify in-process, cold then warm: is it bound by the disk? (offline.py verify)
[ -d "$D/conv_dp" ] && step verify_inproc "${SP_AB_S:-30}" 10 $PY scripts/gpu/scale/offline.py verify "$D/conv_dp" \
  --json "$out/offline.jsonl"
df -h "$D" | tee -a "$out/steps.txt"
rm -rf "$D"
finish
