#!/usr/bin/env bash
# Issue 31: to-maxtext / from-maxtext streamed, at the defaults and at --budget 64M, against convert's time
# for the same state. A synthetic Megatron-shaped checkpoint of G GiB (default 12; benchmarks/scale_synth.py,
# llama-style: RMSNorm, SwiGLU, GQA, RoPE) is converted, moved to MaxText and back under measure.py (time,
# peak RSS of the largest process), and the way back is compared with the conversion (maxtext_compare.py).
# Usage (device, repository root): OUT=$OUT SP_DEADLINE=225 bash scripts/gpu/scale/maxtext_stream.sh
source scripts/gpu/scale/lib.sh
G=${G:-12}; D=${SP_DIR:-/tmp/mts}; rm -rf "$D"; mkdir -p "$D"
export PYTHONPATH=$PYTHONPATH:$PWD/benchmarks
env_info; compile_tree
step gen 60 20 $PY -c "import scale_synth as ss; s=ss.Sizes.for_gib($G); ss.write('$D/src', s, 'dp_reshardable', ss.default_bucket_size(s)); print('[gen] state_bytes', s.state_bytes())"
step convert 60 20 $M --name convert_defaults --drop-caches -- $PY -m bridge.cli convert "$D/src" "$D/conv"
rm -rf "$D/src"
step to_maxtext 60 20 $M --name to_maxtext_defaults --drop-caches -- $PY -m bridge.cli to-maxtext "$D/conv" "$D/mt"
step from_maxtext 60 20 $M --name from_maxtext_defaults --drop-caches -- $PY -m bridge.cli from-maxtext "$D/mt" "$D/back"
step compare 60 15 $PY scripts/gpu/scale/maxtext_compare.py "$D/conv" "$D/back"
rm -rf "$D/back"
step to_maxtext_64M 60 20 $M --name to_maxtext_64M --drop-caches -- $PY -m bridge.cli to-maxtext "$D/conv" "$D/mt64" --budget 64M
rm -rf "$D/mt"
step from_maxtext_64M 60 20 $M --name from_maxtext_64M --drop-caches -- $PY -m bridge.cli from-maxtext "$D/mt64" "$D/back64" --budget 64M
step compare_64M 60 15 $PY scripts/gpu/scale/maxtext_compare.py "$D/conv" "$D/back64"
$PY - <<'P' | tee -a "$out/steps.txt"
import json, os
for l in open(os.environ.get("OUT", "/tmp/scale_out") + "/measure.jsonl"):
    r = json.loads(l)
    print("[measure]", r["name"], "rc", r["rc"], round(r["seconds"], 1), "s", "peak_process_rss GiB",
          round(r["peak_process_rss"] / 2**30, 3))
P
tail -5 "$logs/compare.log" >> "$out/steps.txt" 2>/dev/null
finish
