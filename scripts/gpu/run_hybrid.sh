#!/usr/bin/env bash
# GPU machine (one GPU), issue #21 hybrid models, one call: (1) the hybrid fixtures (make_hybrid_fixture.sh);
# (2) if TM holds to-megatron outputs made on the CPU (TM/<run>_<fmt>/iter_0000003), load each into
# megatron-core 0.19.2 with hybrid_load_check.py; else convert + to-megatron here with this checkout's
# gtp-bridge (python3 -m bridge.cli) first; the fixtures' own saves are loaded too, as controls.
# Usage, from a directory holding tests/fixtures/megatron, scripts/gpu, bridge and converters:
#   bash scripts/gpu/run_hybrid.sh DEPS OUTDIR "RUN..." [TM]
set -u
deps=$1; out=$2; runs=$3; tm=${4:-}
F=tests/fixtures/megatron
mkdir -p "$out/fx" "$out/load" "$out/tm"
bash $F/make_hybrid_fixture.sh "$deps" "$out/fx" $runs
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 CUDA_DEVICE_MAX_CONNECTIONS=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
load() {  # RUN CKPT FMT NAME REFDIR
  python3 -m torch.distributed.run --standalone --nproc-per-node 1 scripts/gpu/hybrid_load_check.py --run "$1" \
    --ckpt "$2" --fmt "$3" --ref "$5/reference_rank0.pt" --run-json "$5/run.json" --out "$out/load/$4.json" \
    > "$out/load/$4.log" 2>&1
  echo "=== load $4 rc=$?"; tail -3 "$out/load/$4.log" | cut -c1-600
}
for run in $runs; do
  ref=$out/fx/$run
  [ -f "$ref/run.json" ] || { echo "=== $run: no fixture"; continue; }
  for fmt in dp_reshardable fully_reshardable; do
    [ -f "$ref/$fmt/.metadata" ] || continue
    load "$run" "$ref/$fmt" "$fmt" "${run}_${fmt}_control" "$ref"
    ck=$tm/${run}_${fmt}/iter_0000003
    if [ -z "$tm" ]; then
      ck=$out/tm/${run}_${fmt}/iter_0000003
      PYTHONPATH=$PWD python3 -m bridge.cli convert "$ref/$fmt" "/tmp/lg_${run}_$fmt" > "$out/tm/${run}_${fmt}_convert.log" 2>&1
      echo "=== convert $run $fmt rc=$?"; tail -2 "$out/tm/${run}_${fmt}_convert.log" | cut -c1-600
      PYTHONPATH=$PWD python3 -m bridge.cli to-megatron --tp 1 --format "$fmt" "/tmp/lg_${run}_$fmt" "$ck" \
        > "$out/tm/${run}_${fmt}_tomegatron.log" 2>&1
      echo "=== to-megatron $run $fmt rc=$?"; tail -2 "$out/tm/${run}_${fmt}_tomegatron.log" | cut -c1-600
    fi
    [ -d "$ck" ] && load "$run" "$ck" "$fmt" "${run}_${fmt}_tomegatron" "$ref"
  done
done
for f in "$out"/load/*.json; do [ -f "$f" ] && python3 -c "
import json, sys
d = json.load(open(sys.argv[1]))
for m, r in d['modes'].items():
    print(sys.argv[1].split('/')[-1], m, 'ok' if r.get('ok') else 'FAIL', (r.get('differs') or [])[:4],
          r.get('error', '')[:300], r.get('next_losses'), r.get('want_next_losses'))" "$f"; done
