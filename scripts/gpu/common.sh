# Sourced by the scripts/gpu drivers (repo root on the device machine, `.whl` carried).
# The caller sets `out` (and `logs`, default $out) before calling `run`.
export PYTHONUNBUFFERED=1 CUDA_DEVICE_MAX_CONNECTIONS=1
# NCCL's multicast stays off on the lent machines (the device tool's KINDS.md says why).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD:/tmp/site
R="python3 -m torch.distributed.run --standalone --nproc-per-node 2"

install_megatron() {  # megatron-core 0.19.2 from the carried wheel, once per warm machine
  [ -d /tmp/site/megatron ] ||
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/megatron_core-0.19.2-*.whl
}

# run NAME TIMEOUT CMD...: CMD's output to $logs/NAME.log; prints its exit code, seconds and the
# lines matching $RUN_GREP.
run() {
  local name=$1 t=$2; shift 2; local t0=$(date +%s) log="${logs:-$out}/$name.log"
  timeout "$t" "$@" > "$log" 2>&1; echo "=== $name rc=$? $(( $(date +%s) - t0 ))s"
  grep -E "${RUN_GREP:-PASS|FAIL|Error|^\[rank 0\]}" "$log" | tail -14
}
