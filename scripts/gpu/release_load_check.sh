#!/usr/bin/env bash
# GPU machine (one GPU): load to-megatron outputs (and, as controls, the releases' own saves) into
# several megatron-core releases and check them against the live dumps of the runs they came from
# (release_load_check.py: Megatron's load as is, and with FusedAdam's step handling). Usage (a directory
# holding this repository's tests/fixtures/megatron and scripts/gpu, wheels in WHL):
#   bash scripts/gpu/release_load_check.sh WHL OUTDIR "VERSION CKPT FORMAT RUN" ...
# CKPT is an iteration directory (or a fixture's format directory); RUN names tests/fixtures/megatron/RUN (reference_rank0.pt, run.json).
set -u
whl=$1; out=$2; shift 2
export PYTHONUNBUFFERED=1 CUDA_DEVICE_MAX_CONNECTIONS=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p "$out"
specs=("$@")
for spec in "${specs[@]}"; do   # install each release once, before the concurrent checks
  read -r v _ <<< "$spec"
  [ -d "/tmp/site-$v/megatron" ] || python3 -m pip install -q --no-index --no-deps --no-compile \
    --target "/tmp/site-$v" "$whl"/megatron_core-"$v"-*.whl || exit 1
done
pids=""
for spec in "${specs[@]}"; do
  read -r v ck fmt run <<< "$spec"
  name=$(basename "$(dirname "$ck")")-$(basename "$ck")
  PYTHONPATH=/tmp/site-$v python3 -m torch.distributed.run --standalone --nproc-per-node 1 \
    scripts/gpu/release_load_check.py --ckpt "$ck" --fmt "$fmt" --ref "tests/fixtures/megatron/$run/reference_rank0.pt" \
    --run-json "tests/fixtures/megatron/$run/run.json" --out "$out/$name-$v.json" > "$out/$name-$v.log" 2>&1 &
  pids="$pids $!"
done
for p in $pids; do wait "$p"; done
for f in "$out"/*.json; do python3 -c "
import json, sys
d = json.load(open(sys.argv[1]))
for m, r in d['modes'].items():
    print(sys.argv[1].split('/')[-1], m, 'ok' if r.get('ok') else 'FAIL', r.get('differs', '')[:3] if r.get('differs') else '',
          r.get('error', '')[:200], r.get('next_losses'), r.get('want_next_losses'), r.get('steps_after_next'))" "$f"; done
