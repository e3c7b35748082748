#!/usr/bin/env bash
# One device call (one H200; repository root; `.whl/` carrying megatron_core-0.19.2): the asynchronous
# live export at scale (issue 33), scripts/gpu/scale/async_ab.py on the 0.85 B run, finishing before
# SP_DEADLINE seconds. Results: $OUT/{async_ab.json,steps.txt,env.txt,logs.txt}.
# CPU dry run: SP_CPU=1 SP_LAYERS=2 SP_HIDDEN=64 SP_FFN=176 SP_HEADS=4 SP_GROUPS=2 SP_VOCAB=512 SP_SEQ=32 \
#   SP_PYTHON=.venv/bin/python SP_SITE=<dir with megatron-core> bash scripts/gpu/scale/run_async.sh
source scripts/gpu/scale/lib.sh
env_info
compile_tree
TR="$PY -m torch.distributed.run --standalone --nproc-per-node 1"
S=scripts/gpu/scale/async_ab.py
if [ -n "${SP_CPU:-}" ]; then S=scripts/gpu/scale/cpu/run_async_ab_cpu.py; fi
D=${SP_DIR:-/tmp/sp_async}; rm -rf "$D"; mkdir -p "$D"
if [ -z "${SP_CPU:-}" ]; then
  install_megatron > "$logs/install.log" 2>&1 || { echo "install failed" | tee -a "$out/steps.txt"; cat "$logs/install.log"; finish; exit 1; }
fi
export SP_DEADLINE_AT=$(( DEADLINE - 10 ))
step async_ab $(( ${SP_DEADLINE:-560} )) 120 $TR $S "$D" "$out/async_ab.json"
rm -rf "$D"
finish
