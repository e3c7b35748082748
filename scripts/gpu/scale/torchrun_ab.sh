#!/usr/bin/env bash
# One device call (repository root): `convert` of the synthetic SP_GIB GiB save (default 12) by
# 2 ranks x 8 workers under torchrun vs 1 process x 16 workers, A B B A, page cache dropped before each
# run, the same budget per worker (benchmarks/bench_convert_ranks.py); both outputs' digests compared.
#   SP_DEADLINE=225 bash scripts/gpu/scale/torchrun_ab.sh   # results: $OUT/{convert_ranks.jsonl,steps.txt,env.txt,logs.txt}
source scripts/gpu/scale/lib.sh
env_info
compile_tree
budget=$(( $(left) - 10 ))
step convert_ranks "$budget" 60 $PY benchmarks/bench_convert_ranks.py --gib "${SP_GIB:-12}" --workers 16 --ranks 2 \
  --reps 2 --dir /tmp/bcr --deadline "$(( budget - 40 ))" --json "$out/convert_ranks.jsonl"
finish
