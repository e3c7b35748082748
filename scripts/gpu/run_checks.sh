#!/usr/bin/env bash
# Device call for the live Megatron-Core round trip of #7 on 2 H200s (kind nvidia-h200-x2), repo
# root, `.whl` carried, no TransformerEngine (scripts/gpu/run_gtp.sh adds the GTP run and the
# to-megatron load checks, which need it). Logs and small results go to $OUT.
set -u
out=${OUT:-/tmp/gpu-out}; mkdir -p "$out"
source scripts/gpu/common.sh
install_megatron
run roundtrip 400 bash scripts/gpu/megatron_roundtrip.sh /tmp/mrt
cp /tmp/mrt/summary.txt "$out/roundtrip_summary.txt" 2>/dev/null
# One tar (at most 8 files come back): results, logs and the small logical checkpoints the
# JAX-step test uses (tests/fixtures/megatron_live/); Megatron's own saves stay behind.
(cd /tmp/mrt && tar cf "$out/megatron_live.tar" *.log */result.json \
   $(ls -d */live */live_after */live_grads */own_live_after */own_live_grads 2>/dev/null))
