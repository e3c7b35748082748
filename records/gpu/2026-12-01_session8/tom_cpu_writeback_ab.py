# CPU A/B harness (session 8, tom): to-megatron of /tmp/tom/conv into /tmp/tom/tm, in-process; NOWB=1 disables the
# early writeback. argv[1]: workers (default: the CLI default). Needs root to drop the page cache.
import time, sys, os, shutil
import torch, torch.distributed.checkpoint, tensorstore
import converters.megatron.write as w
orig = w.DcpFile.close
T = {"close": 0.0}
def close(self):
    t0 = time.perf_counter(); orig(self); T["close"] += time.perf_counter() - t0
w.DcpFile.close = close
if os.environ.get("NOWB"): w._SYNC_FILE_RANGE = None
os.system("sync; echo 3 > /proc/sys/vm/drop_caches")
shutil.rmtree("/tmp/tom/tm", ignore_errors=True)
t0 = time.perf_counter()
r = w.to_megatron("/tmp/tom/conv", "/tmp/tom/tm", w.MegatronTarget(tp=2), show_progress=False, workers=int(sys.argv[1]) if len(sys.argv) > 1 else None)
print("total", time.perf_counter() - t0, T, r["workers"], r["budget"])
shutil.rmtree("/tmp/tom/tm", ignore_errors=True)
