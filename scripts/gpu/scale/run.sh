#!/usr/bin/env bash
# One device call (one H200, 16 cores, 128 GiB, 64 GiB disk; repository root): the scale benchmark
# (benchmarks/bench_scale.py) at SP_GIB GiB of state (default 12), finishing before SP_DEADLINE
# seconds (default 560). Needs nothing beyond the machine's torch / tensorstore (no wheel).
#   bash scripts/gpu/scale/run.sh   # results: $OUT/{bench_scale.jsonl,bench_scale.txt,offline.jsonl,sweep.jsonl,steps.txt,env.txt,logs.txt}
# SP_BENCH_ARGS: extra bench_scale options (e.g. "--skip anchor_convert --no-fully"); SP_SKIP: driver steps
# not to run (tomeg_ab sweep verify_inproc); SP_SWEEP: convert settings of the sweep (default 32M:1,64M:2);
# SP_TOMEG_S / SP_SWEEP_S / SP_AB_S: seconds kept for those steps after the benchmark.
source scripts/gpu/scale/lib.sh
env_info
compile_tree
D=${SP_DIR:-/tmp/bench_scale}; rm -rf "$D"
# the benchmark keeps 10 s for collecting logs and the time of the later steps; it skips (and names)
# every step that would not fit
keep=10
for s in "tomeg_ab:${SP_TOMEG_S:-150}" "sweep:${SP_SWEEP_S:-150}" "verify_inproc:${SP_AB_S:-30}"; do
  [[ " ${SP_SKIP:-} " == *" ${s%%:*} "* ]] || keep=$(( keep + ${s#*:} ))
done
budget=$(( $(left) - keep ))
step bench_scale "$budget" 60 $PY benchmarks/bench_scale.py --gib "${SP_GIB:-12}" --dir "$D" \
  --deadline "$(( budget - 5 ))" --json "$out/bench_scale.jsonl" ${SP_BENCH_ARGS:-}
grep -v '^{"bench' "$logs/bench_scale.log" > "$out/bench_scale.txt"
# to-megatron vs its anchor A B B A (API in-process after its imports, as the anchor), then the CLI once
[ -d "$D/conv_dp" ] && step tomeg_ab "${SP_TOMEG_S:-150}" 40 $PY scripts/gpu/scale/offline.py tomeg_ab "$D/conv_dp" \
  "$D/tm2" --json "$out/offline.jsonl" --step-timeout 60
# convert at small budgets on the same source: peak RSS of the largest process vs 0.5 GiB + its share,
# verify, exact against regenerated values
[ -d "$D/src_dp" ] && step sweep "${SP_SWEEP_S:-150}" 40 $PY benchmarks/scale_sweep.py --gib "${SP_GIB:-12}" --dir "$D" \
  --grid "${SP_SWEEP:-32M:1,64M:2}" --json "$out/sweep.jsonl" --deadline "$(( ${SP_SWEEP_S:-150} - 10 ))"
# verify in-process, cold then warm: is it bound by the disk? (offline.py verify)
[ -d "$D/conv_dp" ] && step verify_inproc "${SP_AB_S:-30}" 10 $PY scripts/gpu/scale/offline.py verify "$D/conv_dp" \
  --json "$out/offline.jsonl"
df -h "$D" | tee -a "$out/steps.txt"
rm -rf "$D"
finish
