#!/usr/bin/env bash
# GPU machine (one GPU), issue #21 follow-up, one call: (1) megatron-core 0.14.0's fully_sharded_bucket_space
# saved for real (make_fixtures.py run `release_bucket_space`; the default tiny GPT's attempt too, for its
# traceback); (2) release_load_check.sh on to-megatron outputs made on the CPU (TM/<name>/iter_0000003)
# and, as controls, the releases' own saves (the committed fixtures). Usage, from a directory holding
# scripts/gpu and tests/fixtures/megatron:
#   bash scripts/gpu/run_release_checks.sh WHL TM OUTDIR
set -u
whl=$1; tm=$2; out=$3
F=tests/fixtures/megatron
export PYTHONUNBUFFERED=1 CUDA_DEVICE_MAX_CONNECTIONS=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p "$out/fixtures" "$out/load"
for v in 0.14.0 0.15.3 0.16.1 0.19.2; do
  [ -d "/tmp/site-$v/megatron" ] || python3 -m pip install -q --no-index --no-deps --no-compile \
    --target "/tmp/site-$v" "$whl"/megatron_core-"$v"-*.whl || exit 1
done
fix() {  # NAME LABEL
  PYTHONPATH=/tmp/site-0.14.0 python3 -m torch.distributed.run --standalone --nproc-per-node 1 \
    "$F/make_fixtures.py" --name "$1" --label "$2" --formats fully_sharded_bucket_space --out "$out/fixtures" \
    > "$out/fixtures/$2.log" 2>&1
  echo "=== fixture $2 rc=$?"
}
fix release_bucket_space release_0_14_0_bucket_space &
p1=$!
fix release release_0_14_0_bucket_space_default_sizes &
p2=$!
bash scripts/gpu/release_load_check.sh "$whl" "$out/load" \
  "0.15.3 $tm/r153_dp/iter_0000003 dp_reshardable release_0_15_3" \
  "0.15.3 $tm/r153_fr/iter_0000003 fully_reshardable release_0_15_3" \
  "0.16.1 $tm/r161_dp/iter_0000003 dp_reshardable release_0_16_1" \
  "0.16.1 $tm/r161_fr/iter_0000003 fully_reshardable release_0_16_1" \
  "0.19.2 $tm/r192_dp/iter_0000003 dp_reshardable release_0_19_2" \
  "0.19.2 $tm/r192_fr/iter_0000003 fully_reshardable release_0_19_2" \
  "0.16.1 $tm/r140_to161_dp/iter_0000003 dp_reshardable release_0_14_0" \
  "0.15.3 $F/release_0_15_3/dp_reshardable dp_reshardable release_0_15_3" \
  "0.15.3 $F/release_0_15_3/fully_reshardable fully_reshardable release_0_15_3" \
  "0.16.1 $F/release_0_16_1/dp_reshardable dp_reshardable release_0_16_1" \
  "0.16.1 $F/release_0_16_1/fully_reshardable fully_reshardable release_0_16_1"
wait $p1 $p2
grep -hE "^release|save failed|AssertionError|assert " "$out"/fixtures/*.log | grep -v Warning | tail -20
