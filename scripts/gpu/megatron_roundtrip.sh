#!/usr/bin/env bash
# GPU machine (2 GPUs, repo root, `.whl` carried): live export / load round trip with real
# Megatron-Core 0.19.2 at TP2 and DP2 (issue #7). Usage: bash scripts/gpu/megatron_roundtrip.sh OUTDIR
# Writes OUTDIR/{tp2,dp2,load_tp2,load_dp2}/result.json, logs, and OUTDIR/summary.txt.
set -u
out=${1:-/tmp/mrt}; mkdir -p "$out"
source scripts/gpu/common.sh
install_megatron || exit 1
logs=$out RUN_GREP='^\{|Error'
S=scripts/gpu/megatron_roundtrip.py
M="$R $S"
run train_tp2 300 $M --mode train --layout tp2 --out "$out"
if [ "${ONLY_GTP:-0}" != 1 ]; then
  run train_dp2 300 $M --mode train --layout dp2 --out "$out"
  run load_dp2 300 $M --mode load --layout dp2 --src "$out/tp2" --out "$out"
  [ "${SKIP_REVERSE:-0}" = 1 ] || run load_tp2 300 $M --mode load --layout tp2 --src "$out/dp2" --out "$out"
fi
if [ "${WITH_GTP:-0}" = 1 ]; then  # TransformerEngine must be staged in /tmp/site (te-build-on-device.sh)
  run train_gtp2 300 $M --mode train --layout gtp2 --out "$out"
  run load_gtp2 300 $M --mode load --layout gtp2 --src "$out/tp2" --out "$out"
  run load_dp2g 300 $M --mode load --layout dp2 --src "$out/gtp2" --out "$out/from_gtp2"
fi
for L in $([ "${ONLY_GTP:-0}" = 1 ] && echo tp2 || echo tp2 dp2); do
  run convert_$L 300 python3 -m bridge.cli convert "$out/$L/dp_reshardable" "$out/$L/converted"
  run compare_$L 300 python3 $S --mode compare "$out/$L/live" "$out/$L/converted" --exact
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
