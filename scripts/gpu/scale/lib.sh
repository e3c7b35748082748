# Sourced by run.sh and run_real.sh (repository root on the device machine).
# Sets up the environment, the deadline and `step NAME MAX NEED CMD...`: runs CMD (output to
# $logs/NAME.log) under min(MAX, time left - 5) seconds, or skips it, saying so, when less than
# NEED seconds are left before the deadline (SP_DEADLINE seconds from the start, default 560) or
# when NAME is in SP_SKIP (space-separated step names).
set -u
T0=$(date +%s)
DEADLINE=$(( T0 + ${SP_DEADLINE:-560} ))
out=${OUT:-/tmp/scale_out}; mkdir -p "$out"
logs=${SP_LOGS:-/tmp/scale_logs}; rm -rf "$logs"; mkdir -p "$logs"
export PYTHONUNBUFFERED=1 CUDA_DEVICE_MAX_CONNECTIONS=1
# NCCL's multicast stays off on the lent machines (the device tool's KINDS.md says why).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD:${SP_SITE:-/tmp/site}
export XLA_PYTHON_CLIENT_PREALLOCATE=false
PY=${SP_PYTHON:-python3}
M="$PY scripts/gpu/scale/measure.py --json $out/measure.jsonl"

left() { echo $(( DEADLINE - $(date +%s) )); }
step() {
  local name=$1 max=$2 need=$3; shift 3
  local l; l=$(left)
  if [[ " ${SP_SKIP:-} " == *" $name "* ]]; then
    echo "=== $name SKIPPED (SP_SKIP)" | tee -a "$out/steps.txt"; return 99
  fi
  if [ "$l" -lt "$need" ]; then
    echo "=== $name SKIPPED (only ${l}s left before the deadline, needs ${need}s)" | tee -a "$out/steps.txt"; return 99
  fi
  local t=$(( max < l - 5 ? max : l - 5 )) t1; t1=$(date +%s)
  timeout "$t" "$@" > "$logs/$name.log" 2>&1; local rc=$?
  echo "=== $name rc=$rc $(( $(date +%s) - t1 ))s (limit ${t}s, t+$(( $(date +%s) - T0 ))s)" | tee -a "$out/steps.txt"
  grep -E '^\[(op|measure|offline|step|gen|sweep)\]|^\| |converted vs|SKIPPED|Error|error:|Traceback|^[a-z_]+: ' "$logs/$name.log" \
    | grep -v '^{"bench' | cut -c1-400 | tail -25
  return $rc
}
env_info() {
  { echo "date $(date -u)"; echo "commit $(cat COMMIT 2>/dev/null || git rev-parse HEAD 2>/dev/null)"; nproc; free -g
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null; df -h /tmp
    $PY -c "import importlib.metadata as m; print({p: m.version(p) for p in ('torch', 'tensorstore', 'numpy', 'ml_dtypes')})"
    echo "PYTHONDONTWRITEBYTECODE=${PYTHONDONTWRITEBYTECODE:-}"
  } > "$out/env.txt" 2>&1
}
install_megatron() {  # megatron-core 0.19.2 from the carried wheel (.whl/), once per warm machine
  [ -d /tmp/site/megatron ] || $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
    .whl/megatron_core-0.19.2-*.whl
}
finish() {
  echo "total $(( $(date +%s) - T0 ))s" | tee -a "$out/steps.txt"
  for f in "$logs"/*.log; do echo "##### $f"; tail -c 200000 "$f"; done > "$out/logs.txt"
  ls -la "$out"
}
compile_tree() {  # bytecode for this tree, as an installed package has it: the device runs Python with
  # PYTHONDONTWRITEBYTECODE and a fresh tree, so every process of a measured command (convert: the
  # parent and its workers) would compile the bridge's sources again (seen in session 8's py-spy of
  # convert: the spawned workers run `python3 -B`), while an anchor's libraries come compiled
  $PY -m compileall -q -j 0 bridge converters benchmarks scripts/gpu/scale > /dev/null 2>&1 || true
}
