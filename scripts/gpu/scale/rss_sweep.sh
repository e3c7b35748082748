# The small-budget convert settings at scale, concurrently, for peak RSS vs the 0.5 GiB + budget bound (issue 16):
# a streamed synthetic checkpoint of G GiB (default 12), convert at 32M:1 and 64M:2 under measure.py, verify both,
# diff them against each other. Usage (device): OUT=$OUT bash scripts/gpu/scale/rss_sweep.sh  [G=, D=, PY=]
set -u
G=${G:-12}; D=${D:-/tmp/sw}; PY=${PY:-python3}
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
$PY -m compileall -q bridge converters benchmarks scripts >/dev/null
rm -rf $D; mkdir -p $D
t0=$(date +%s)
$PY -c "import scale_synth as ss; s=ss.Sizes.for_gib($G); ss.write('$D/src', s, 'dp_reshardable', ss.default_bucket_size(s)); print('state_bytes', s.state_bytes())"
echo "gen $(( $(date +%s)-t0 ))s"; nproc; free -g | head -2
$PY scripts/gpu/scale/measure.py --name convert_32M_w1 --json $OUT/sweep.jsonl --log $OUT/c32M1.log --timeout 200 -- $PY -m bridge.cli convert $D/src $D/o1 --budget 32M --workers 1 &
$PY scripts/gpu/scale/measure.py --name convert_64M_w2 --json $OUT/sweep.jsonl --log $OUT/c64M2.log --timeout 200 -- $PY -m bridge.cli convert $D/src $D/o2 --budget 64M --workers 2 &
wait; echo "convert done $(( $(date +%s)-t0 ))s"
$PY -m bridge.cli verify $D/o1 > $OUT/verify_o1.txt 2>&1; echo "verify o1 rc=$?"
$PY -m bridge.cli verify $D/o2 > $OUT/verify_o2.txt 2>&1; echo "verify o2 rc=$?"
$PY -m bridge.cli diff $D/o1 $D/o2 > $OUT/diff_o1_o2.txt 2>&1; echo "diff rc=$?"
du -sb $D/src $D/o1 $D/o2
$PY - <<'P'
import json, os
for l in open(os.environ["OUT"] + "/sweep.jsonl"):
    r = json.loads(l); print(r["name"], r["rc"], round(r["seconds"], 1), "s", "peak_process_rss GiB", round(r["peak_process_rss"] / 2**30, 3))
P
echo "total $(( $(date +%s)-t0 ))s"
