#!/usr/bin/env bash
# One device call (one H200, repository root, `.whl/` carrying megatron_core-0.19.2): Megatron-LM's own
# `load_checkpoint` (--load RUN) resumes from `gtp-bridge to-megatron` output at a new layout (issue 18).
# The committed TP=2 fixture's dp_reshardable save -> convert -> to-megatron --tp 1 (dp_reshardable:
# without TransformerEngine, 0.19.2 loads only that optimizer format into torch Adam) -> megatron_resume.py.
#   bash scripts/gpu/run_resume.sh                   # results: $OUT/resume.json, $OUT/resume_logs.txt
# RESUME_CPU=1 (with megatron-core and triton on PYTHONPATH) is the CPU dry run.
set -u
out=${OUT:-/tmp/resume_out}; mkdir -p "$out"
W=${RESUME_DIR:-/tmp/resume}; rm -rf "$W"; mkdir -p "$W"
PY=${RESUME_PYTHON:-python3}
if [ -n "${RESUME_CPU:-}" ]; then
  export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${RESUME_SITE:-}; CPU=--cpu
else
  source scripts/gpu/common.sh; install_megatron || exit 1; CPU=
fi
L=$out/resume_logs.txt; : > "$L"
run_step() { local name=$1; shift; local t0=$(date +%s)
  timeout 240 "$@" > "$W/$name.log" 2>&1; local rc=$?
  echo "=== $name rc=$rc $(( $(date +%s) - t0 ))s" | tee -a "$L"; grep -E 'PASS|FAIL|Error|error:' "$W/$name.log" | tail -12
  { echo "##### $name: $*"; grep -v -e Warning -e warnings.warn "$W/$name.log" | tail -c 100000; } >> "$L"; return $rc; }
run_step convert $PY -m bridge.cli convert tests/fixtures/megatron/tp2/dp_reshardable "$W/logical" &&
run_step to_megatron $PY -m bridge.cli to-megatron --tp 1 --format dp_reshardable "$W/logical" "$W/run" \
  --megatron-args scripts/gpu/handoff_megatron_args.txt &&
{ ls -la "$W/run" "$W/run"/iter_* >> "$L" 2>&1; cat "$W/run/latest_checkpointed_iteration.txt"; echo; } &&
run_step resume $PY -m torch.distributed.run --standalone --nproc-per-node 1 scripts/gpu/megatron_resume.py \
  --run-dir "$W/run" --logical "$W/logical" --json "$out/resume.json" $CPU
rc=$?
rm -rf "$W"
exit $rc
