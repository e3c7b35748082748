#!/usr/bin/env bash
# Last call of the TransformerEngine staging chain (docs/gpu-recipes.md): the parts
# tepart0..5 were copied to /tmp/te by earlier calls; .gpu/s6 carries the last part, the small
# wheels, the checksum, the torch-extension source and the build script. Builds TE, then runs the
# Megatron-Core checks that need it: fully_reshardable loads (torch Adam cannot), GTP targets, and the
# live round trip with a real GTP=2 run. Logs and small results go to $OUT.
set -u
out=${OUT:-/tmp/gpu-out}; mkdir -p "$out"
mkdir -p /tmp/te && cp .gpu/s6/* /tmp/te/
ls /tmp/te | tr '\n' ' '; echo
t0=$(date +%s); bash /tmp/te/te-build-on-device.sh > "$out/te_build.log" 2>&1; echo "=== te build $(( $(date +%s) - t0 ))s"
tail -1 "$out/te_build.log"
source scripts/gpu/common.sh
# Logs straight into $OUT in LOAD_CHECKS_ONLY mode (at most 8 files come back; a timeout keeps them).
logs=/tmp/gtplogs; [ "${LOAD_CHECKS_ONLY:-0}" = 1 ] && logs=$out
rm -rf /tmp/gtplogs /tmp/mrt /tmp/lc; mkdir -p /tmp/gtplogs /tmp/lc
# 1. Live round trip with a real GTP=2 run (TP2 source, GTP2 load, DP2 load of the GTP2 export);
#    LOAD_CHECKS_ONLY=1: only train the TP2 source the load checks below start from.
if [ "${LOAD_CHECKS_ONLY:-0}" = 1 ]; then
  run train_tp2 90 $R scripts/gpu/megatron_roundtrip.py --mode train --layout tp2 --out /tmp/mrt
else
  ONLY_GTP=1 WITH_GTP=1 run roundtrip 260 bash scripts/gpu/megatron_roundtrip.sh /tmp/mrt
  cat /tmp/mrt/summary.txt > "$out/roundtrip_summary.txt" 2>/dev/null
fi
# 2. to-megatron output of the TP2 run's save (made in this environment) loaded by Megatron-Core at
#    DP2 and GTP2; the DP2 loads are compared with Megatron's own load of the run's fully_reshardable save.
G="python3 -m bridge.cli"
$G convert /tmp/mrt/tp2/dp_reshardable /tmp/lc/logical > $logs/lc_convert.log 2>&1 || echo "convert FAILED"
L=scripts/gpu/megatron_load_check.py
for f in fully_reshardable dp_reshardable; do
  $G to-megatron /tmp/lc/logical /tmp/lc/dp2_$f --tp 1 --dp 2 --format $f --no-scheduler >> $logs/lc_convert.log 2>&1 || echo "to-megatron dp2 $f FAILED"
  run load_check_dp2_$f 50 $R $L --source /tmp/mrt/tp2 --tp 1 --format $f --megatron-ckpt /tmp/lc/dp2_$f --hang-report 40
  $G to-megatron /tmp/lc/logical /tmp/lc/gtp2_$f --tp 1 --gtp 2 --dp 1 --format $f --no-scheduler >> $logs/lc_convert.log 2>&1 || echo "to-megatron gtp2 $f FAILED"
  run load_check_gtp2_$f 50 $R $L --source /tmp/mrt/tp2 --tp 1 --gtp 2 --format $f --megatron-ckpt /tmp/lc/gtp2_$f --hang-report 40
done
[ "$logs" = "$out" ] || (cd /tmp/mrt && tar cf "$out/gtp_results.tar" *.log */result.json from_gtp2/*/result.json) 2>/dev/null
[ "$logs" = "$out" ] || (cd /tmp/gtplogs && tar cf "$out/gtp_logs.tar" *.log)
