#!/usr/bin/env bash
# One device call (one H200; repository root; `.whl/` carrying megatron_core-0.19.2): the real
# 0.85 B Megatron-Core run (scripts/gpu/scale/bigpt.py: 16 layers, hidden 2048, SwiGLU 5632,
# GQA 16/4, vocab 32000, 18 DDP buckets; 11.9 GB of state), finishing before SP_DEADLINE seconds
# (default 560); steps that would not fit are skipped and named in steps.txt.
#   1. train 2 steps, live export (export_megatron), Megatron's own dp_reshardable save (torch_side.py)
#   2. `gtp-bridge convert` of the save at DEFAULT settings (measured: time, peak RSS, bytes), or with
#      step convert_ab instead (SP_SKIP=convert): convert vs its anchor in the order A B B A
#      (offline.py convert_ab: CLI convert, anchor, anchor, convert with phase timings; the page cache
#      dropped and the libraries re-read before each)
#   3. its per-array digests equal the live export's (offline.py digests), `gtp-bridge verify` of the conversion (measured: time, bytes read), then its anchor: a raw
#      read of the conversion's files (offline.py rawread), then verify in-process cold and warm
#      (offline.py verify)
#   4. convert's anchor: dcp.load of the save + a raw write of the same bytes (offline.py anchor)
#   5. JAX restore of the conversion vs plain Orbax (offline.py jax)
#   6. the convert sweep (benchmarks/scale_sweep.py, SP_GRID, default 32M:1,64M:2,256M:4): each
#      output verified, its digests equal to the live export's, bytes on disk, peak RSS vs share
#   7. bit-exact comparison of the default conversion with the live export (offline.py compare)
#   8. load_megatron of the conversion vs of the live export: time, bytes read, states bit-exact (load_probe.py)
#   9. one layer of the largest stacked array of the conversion: bytes read vs needed, exact vs the
#      live export (offline.py layer_read); `gtp-bridge to-megatron --tp 2` of the conversion vs its
#      anchor (bench_scale.py _anchor_tomeg: raw TensorStore read + dcp.save), both measured
#  10. SP_PYSPY=BINARY: py-spy of one more convert (offline.py convert; all processes, raw stacks)
# Steps 6-10 run only if time remains (SP_DEADLINE); each skipped step is named in steps.txt, as is
# each step named in SP_SKIP (e.g. SP_SKIP="jax compare load_probe"). SP_VERIFY_BASELINE=FILE (an
# older bridge/store/verify.py) adds warm A B B A runs against it and a reads-only run to step 3;
# SP_PYSPY=BINARY (py-spy) records which threads hold the GIL during a verify (after step 8).
# CPU dry run (tiny sizes, CUDA patched out by cpu/cpu_patch.py, megatron-core on PYTHONPATH):
#   SP_CPU=1 SP_LAYERS=2 SP_HIDDEN=64 SP_FFN=176 SP_HEADS=4 SP_GROUPS=2 SP_VOCAB=512 SP_SEQ=32 \
#   SP_PYTHON=.venv/bin/python SP_SITE=/path/to/megatron-site bash scripts/gpu/scale/run_real.sh
source scripts/gpu/scale/lib.sh
env_info
compile_tree
O="$PY scripts/gpu/scale/offline.py"
J=$out/offline.jsonl
TR="$PY -m torch.distributed.run --standalone --nproc-per-node 1"
TS=scripts/gpu/scale/torch_side.py LP=scripts/gpu/scale/load_probe.py
if [ -n "${SP_CPU:-}" ]; then TS=scripts/gpu/scale/cpu/run_torch_side_cpu.py LP=scripts/gpu/scale/cpu/run_load_probe_cpu.py; fi
D=${SP_DIR:-/tmp/sp_ckpt}; rm -rf "$D"; mkdir -p "$D"
usage() { echo "disk: $(df -h "$D" | awk 'NR==2{print $3" used, "$4" free"}'); $(cd "$D" && du -sh -- * 2>/dev/null | tr '\n' ' ')" | tee -a "$out/steps.txt"; }

if [ -z "${SP_CPU:-}" ]; then  # a shell function: not run under `timeout`
  install_megatron > "$logs/install.log" 2>&1 || { echo "install failed" | tee -a "$out/steps.txt"; cat "$logs/install.log"; finish; exit 1; }
fi
step torch_side 240 120 $TR $TS --dir "$D" --json "$out/torch_side.json" --warm 0 --skip-fully --no-loads
usage
[ -f "$D/dp/.metadata" ] || { echo "no dp_reshardable save; stopping" | tee -a "$out/steps.txt"; finish; exit 1; }

C=$D/conv
step convert 200 50 $M --name convert_defaults --drop-caches --log "$logs/convert.cli.log" \
  -- $PY -m bridge.cli convert "$D/dp" "$C"
step convert_ab 300 120 $O convert_ab "$D/dp" "$C" --json "$J"
usage
if [ -d "$C" ]; then
  step digests 30 10 $O digests "$D/live" "$C" --json "$J"
  step layer_read 40 15 $O layer_read "$C" "$D/live" --json "$J"
  step to_megatron 150 60 $M --name to_megatron --drop-caches --warm-imports --log "$logs/tomeg.cli.log" \
    -- $PY -m bridge.cli to-megatron --tp 2 --no-scheduler "$C" "$D/tm2"
  rm -rf "$D/tm2"
  step anchor_tomeg 150 60 $M --name anchor_tomeg --drop-caches --warm-imports --log "$logs/anchor_tomeg.out" \
    -- $PY benchmarks/bench_scale.py _anchor_tomeg "$C" "$D/tm2a"
  rm -rf "$D/tm2a"
  step load_probe_ab 200 100 $TR $LP --conv "$C" --live "$D/live" --json "$out/load_probe.json"
fi
if [ -d "$C" ]; then
  step verify 150 30 $M --name verify_converted --drop-caches --log "$logs/verify.cli.log" \
    -- $PY -m bridge.cli verify "$C"
  step rawread 60 20 $O rawread "$C" --json "$J"
  step verify_inproc 90 30 $O verify "$C" --json "$J" ${SP_VERIFY_BASELINE:+--baseline "$SP_VERIFY_BASELINE" --reads-only}
fi
step anchor 120 60 $O anchor "$D/dp" "$D/raw" --json "$J"
rm -rf "$D/raw"
[ -d "$C" ] && step jax 110 60 $O jax "$C" --json "$J" --budget-s 75
if [ -d "$C" ]; then  # the sweep's outputs go next to the default one: the disk holds dp, live, conv + one
  step sweep 240 60 $PY benchmarks/scale_sweep.py --src "$D/dp" --ref "$D/live" --dir "$D/sweep" \
    --grid "${SP_GRID:-32M:1,64M:2,256M:4}" --json "$out/sweep.jsonl" --deadline "$(( $(left) - 10 < 230 ? $(left) - 10 : 230 ))"
  rm -rf "$D/sweep"
  step compare 100 40 $O compare "$D/live" "$C" --json "$J"
  step load_probe 150 60 $TR $LP --conv "$C" --live "$D/live" --json "$out/load_probe.json"
  if [ -n "${SP_PYSPY:-}" ]; then  # where verify's threads spend their time, warm (who holds the GIL)
    step verify_profile 40 25 "$SP_PYSPY" record -r 200 --gil --native -f raw -o "$out/verify_gil.txt" \
      -- $O verify "$C" --json "$logs/verify_profile.jsonl"
  fi
fi
if [ -n "${SP_PYSPY:-}" ]; then  # where convert's processes spend their time (page cache dropped first)
  $PY -c "import sys; sys.path.insert(0, 'benchmarks'); import scale_measure as s; s.drop_caches()"
  step convert_profile 60 40 "$SP_PYSPY" record -r 100 --subprocesses -f raw -o "$out/convert_pyspy.txt" \
    -- $O convert "$D/dp" "$D/conv_p" --json "$J"
  rm -rf "$D/conv_p"
fi
usage
rm -rf "$D"
finish
