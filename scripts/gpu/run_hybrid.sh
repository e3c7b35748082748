#!/usr/bin/env bash
# GPU machine (one GPU), issue #21 hybrid models, one call: make the hybrid fixtures RUNS
# (make_hybrid_fixture.sh, in the background) while loading checkpoints into megatron-core 0.19.2 with
# hybrid_load_check.py (each spec "RUN FORMAT CKPT": a to-megatron output made on the CPU, or as a
# control the fixture's own save; checked against tests/fixtures/megatron/RUN's reference and
# next_losses). Usage, from a directory holding tests/fixtures/megatron and scripts/gpu:
#   bash scripts/gpu/run_hybrid.sh DEPS OUTDIR "RUN..." "RUN FORMAT CKPT" ...
set -u
deps=$1; out=$2; runs=$3; shift 3
F=tests/fixtures/megatron
mkdir -p "$out/fx" "$out/load"
bash $F/make_hybrid_fixture.sh "$deps" "$out/fx" > "$out/fx/make.log" 2>&1 &
make=$!
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 CUDA_DEVICE_MAX_CONNECTIONS=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
wait $make   # (with no RUN it only installs; the loads need its /tmp/site)
[ -n "$runs" ] && { bash $F/make_hybrid_fixture.sh "$deps" "$out/fx" $runs > "$out/fx/make.log" 2>&1 & make=$!; }
pids=""
for spec in "$@"; do
  read -r run fmt ck <<< "$spec"
  name=${run}_${fmt}_$(basename "$(dirname "$ck")")
  python3 -m torch.distributed.run --standalone --nproc-per-node 1 scripts/gpu/hybrid_load_check.py --fixture-run "$run" \
    --ckpt "$ck" --fmt "$fmt" --ref "$F/$run/reference_rank0.pt" --run-json "$F/$run/run.json" \
    --out "$out/load/$name.json" > "$out/load/$name.log" 2>&1 &
  pids="$pids $!"
done
for p in $pids; do wait "$p"; done
[ -n "$runs" ] && wait $make
cat "$out/fx/make.log"
for f in "$out"/load/*.json; do [ -f "$f" ] && python3 -c "
import json, sys
d = json.load(open(sys.argv[1]))
for m, r in d['modes'].items():
    print(sys.argv[1].split('/')[-1], m, 'ok' if r.get('ok') else 'FAIL', (r.get('differs') or [])[:4],
          r.get('error', '')[:300], r.get('next_losses'), r.get('want_next_losses'), r.get('compared'))" "$f"; done
