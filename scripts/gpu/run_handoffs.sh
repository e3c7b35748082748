#!/usr/bin/env bash
# One device call (one H200, repository root, `.whl/` carrying megatron_core-0.19.2, `.gpu/megatron30/jax`
# carrying a JAX save made by scripts/gpu/jax_optax_save.py): issue 30's hand-offs, each loaded by
# Megatron-LM's own training-loop `load_checkpoint` with its default flags (no --no-load-optim, no
# --finetune), optimizer and scheduler included (scripts/gpu/megatron_resume.py):
#   a  library-style save (DDP-wrapped keys `module.`, no args): tests/fixtures/megatron/tp1  (flags)
#   b  training-loop save: tests/fixtures/megatron/tp1_buckets                    (--megatron-args FILE)
#   aw a, written with --key-convention wrapped, loaded into the DDP-wrapped model (scripts/gpu/wrapped_load_check.py)
#   c  JAX `save` after 2 optax steps, the schedule recorded by the save           (nothing to pass)
#   bash scripts/gpu/run_handoffs.sh           # results: $OUT/handoff_<case>.json, $OUT/handoff_logs.txt
# HANDOFF_CPU=1 (megatron-core + triton on HANDOFF_SITE) is the CPU dry run; HANDOFF_JAX=DIR the JAX save.
set -u
out=${OUT:-/tmp/handoff_out}; mkdir -p "$out"
W=${HANDOFF_DIR:-/tmp/handoff}; rm -rf "$W"; mkdir -p "$W"
PY=${HANDOFF_PYTHON:-python3}
JAXSAVE=${HANDOFF_JAX:-.gpu/megatron30/jax}
if [ -n "${HANDOFF_CPU:-}" ]; then
  export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${HANDOFF_SITE:-}; CPU=--cpu
else
  source scripts/gpu/common.sh; install_megatron || exit 1; CPU=
fi
L=$out/handoff_logs.txt; : > "$L"
run_step() { local name=$1; shift; local t0=$(date +%s)
  timeout 240 "$@" > "$W/$name.log" 2>&1; local rc=$?
  echo "=== $name rc=$rc $(( $(date +%s) - t0 ))s" | tee -a "$L"; grep -E 'PASS|FAIL|Error|error:|keys:' "$W/$name.log" | tail -14
  { echo "##### $name: $*"; grep -v -e Warning -e warnings.warn "$W/$name.log" | tail -c 60000; } >> "$L"; return $rc; }
resume() { local case=$1 logical=$2; shift 2
  run_step "${case}_resume" $PY -m torch.distributed.run --standalone --nproc-per-node 1 scripts/gpu/megatron_resume.py \
    --run-dir "$W/$case/run" --logical "$logical" --json "$out/handoff_$case.json" $CPU "$@"; }
HEADS="--num-attention-heads 4 --num-query-groups 2 --kv-channels 6"   # a library save records no args
SCHED="--lr 0.01 --min-lr 0.01 --lr-decay-style constant --train-iters 100 --global-batch-size 4 --weight-decay 0.1"
rc=0
# (a) library-style wrapped save
run_step a_convert $PY -m bridge.cli convert tests/fixtures/megatron/tp1/dp_reshardable "$W/a/logical" $HEADS &&
run_step a_to_megatron $PY -m bridge.cli to-megatron --tp 1 --format dp_reshardable "$W/a/logical" "$W/a/run" $SCHED &&
resume a "$W/a/logical" --source-run tests/fixtures/megatron/tp1/run.json || rc=1
# (a, wrapped) the same as a DDP-wrapped model's keys, loaded by a library user's dist_checkpointing.load
run_step aw_to_megatron $PY -m bridge.cli to-megatron --tp 1 --format dp_reshardable "$W/a/logical" "$W/aw/run" $SCHED \
  --key-convention wrapped &&
run_step aw_load $PY -m torch.distributed.run --standalone --nproc-per-node 1 scripts/gpu/wrapped_load_check.py \
  --ckpt "$W/aw/run/iter_0000003" --logical "$W/a/logical" --json "$out/handoff_aw.json" $CPU || rc=1
# (b) training-loop save (9 DDP buckets at the source; one here)
run_step b_convert $PY -m bridge.cli convert tests/fixtures/megatron/tp1_buckets/dp_reshardable "$W/b/logical" &&
run_step b_to_megatron $PY -m bridge.cli to-megatron --tp 1 --format dp_reshardable "$W/b/logical" "$W/b/run" \
  --megatron-args scripts/gpu/handoff_megatron_args.txt &&
resume b "$W/b/logical" --source-run tests/fixtures/megatron/tp1_buckets/run.json || rc=1
# (c) JAX save after optax steps (its manifest records the schedule: no scheduler flags)
run_step c_to_megatron $PY -m bridge.cli to-megatron --tp 1 --format dp_reshardable "$JAXSAVE" "$W/c/run" &&
resume c "$JAXSAVE" || rc=1
rm -rf "$W"
exit $rc
