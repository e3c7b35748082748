#!/usr/bin/env bash
# GPU machine (2 GPUs, repo root, `.whl` carried): live export / load round trip with real
# Megatron-Core 0.19.2 at TP2 and DP2 (issue #7). Usage: bash scripts/gpu/megatron_roundtrip.sh OUTDIR
# Writes OUTDIR/{tp2,dp2,load_tp2,load_dp2}/result.json, logs, and OUTDIR/summary.txt.
set -u
out=${1:-/tmp/mrt}; mkdir -p "$out"
if [ ! -d /tmp/site/megatron ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/megatron_core-0.19.2-*.whl || exit 1
fi
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 CUDA_DEVICE_MAX_CONNECTIONS=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
S=scripts/gpu/megatron_roundtrip.py
R="python3 -m torch.distributed.run --standalone --nproc-per-node 2 $S"
step() { echo "=== $1"; shift; "$@" > "$out/$LOG.log" 2>&1; rc=$?; echo "rc=$rc"; grep -E '^\{|Error|error' "$out/$LOG.log" | grep -v Warn | tail -4; }
LOG=train_tp2 step "train tp2" $R --mode train --layout tp2 --out "$out"
if [ "${ONLY_GTP:-0}" != 1 ]; then
  LOG=train_dp2 step "train dp2" $R --mode train --layout dp2 --out "$out"
  LOG=load_dp2 step "load dp2 from tp2" $R --mode load --layout dp2 --src "$out/tp2" --out "$out"
  [ "${SKIP_REVERSE:-0}" = 1 ] || LOG=load_tp2 step "load tp2 from dp2" $R --mode load --layout tp2 --src "$out/dp2" --out "$out"
fi
if [ "${WITH_GTP:-0}" = 1 ]; then  # TransformerEngine must be staged in /tmp/site (te-build-on-device.sh)
  LOG=train_gtp2 step "train gtp2" $R --mode train --layout gtp2 --out "$out"
  LOG=load_gtp2 step "load gtp2 from tp2" $R --mode load --layout gtp2 --src "$out/tp2" --out "$out"
  LOG=load_dp2g step "load dp2 from gtp2" $R --mode load --layout dp2 --src "$out/gtp2" --out "$out/from_gtp2"
fi
for L in $([ "${ONLY_GTP:-0}" = 1 ] && echo tp2 || echo tp2 dp2); do
  LOG=convert_$L step "convert $L dp_reshardable" python3 -m bridge.cli convert "$out/$L/dp_reshardable" "$out/$L/converted"
  LOG=compare_$L step "compare live export vs converted dp_reshardable ($L)" python3 $S --mode compare "$out/$L/live" "$out/$L/converted" --exact
done
python3 - "$out" > "$out/summary.txt" <<'PY'
import json, sys, os
o = sys.argv[1]
for d in ("tp2", "dp2", "load_dp2", "load_tp2", "gtp2", "load_gtp2", "from_gtp2/load_dp2"):
    p = os.path.join(o, d, "result.json")
    if not os.path.exists(p):
        print(d, "missing"); continue
    r = json.load(open(p))
    keep = ("losses", "next_losses", "source_next_losses", "loss_diff", "warm_median_seconds", "ratio_live_over_dcp",
            "readback_mismatches", "loaded_step", "step", "step3", "own_next_losses", "own_loss_diff", "own_error")
    print(d, json.dumps({k: r[k] for k in keep if k in r}))
    for k in ("reexport_vs_source", "after_vs_source_after", "own_load_vs_ours", "own_after_vs_ours"):
        if k in r:
            c = r[k]; print("  ", k, "ok" if c["ok"] else "MISMATCH", c["arrays"], "arrays, max_abs", c["max_abs"], c["mismatch"][:3])
PY
cat "$out/summary.txt"
