"""Process measurement for bench_scale.py: wall time, peak RSS of a command's process tree, and the
bytes its tree read and wrote (from /proc, Linux only; no third-party package)."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

PAGE = os.sysconf("SC_PAGE_SIZE")


def io_counters(pid: str = "self") -> dict[str, int]:
    """/proc/<pid>/io: rchar/wchar count every read()/write() byte (page cache included);
    read_bytes/write_bytes only what reached the disk. A waited-for child's counters are added to
    its parent's, so a delta around `wait()` covers the child's whole (reaped) tree."""
    out = {}
    try:
        with open(f"/proc/{pid}/io") as f:
            for line in f:
                k, v = line.split(":")
                out[k.strip()] = int(v)
    except OSError:
        pass
    return out


def _children(pid: int) -> list[int]:
    out = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(x) for x in f.read().split()]
    except OSError:
        pass
    return out


def tree(pid: int) -> list[int]:
    """`pid` and all its descendants alive now."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += _children(p)
    return out


def rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * PAGE
    except (OSError, IndexError, ValueError):
        return 0


# What a step imports, run once in a throwaway process after the page cache is dropped: the
# checkpoint's bytes stay cold, the libraries' files do not (a user's machine has torch and
# TensorStore cached, and an anchor timed in-process never pays for loading them).
WARM_IMPORTS = ("import torch, torch.distributed.checkpoint, tensorstore, numpy, ml_dtypes, bridge.cli, "
                "bridge.store.reader, converters.megatron.convert_entry, converters.megatron.write.to_megatron")


def drop_caches() -> bool:
    """Drop the page cache (root only) so that the next reads come from the disk."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def du(path: str) -> int:
    """Bytes of the files under `path` (allocated size is not what the issue compares: file sizes)."""
    total = 0
    for root, _, files in os.walk(path):
        for n in files:
            try:
                total += os.path.getsize(os.path.join(root, n))
            except OSError:
                pass
    return total


@dataclass
class Run:
    """Result of `measure()`."""

    argv: list[str]
    rc: int = 0
    seconds: float = 0.0
    peak_tree_rss: int = 0       # largest sum of RSS over the tree at one sample
    peak_process_rss: int = 0    # largest RSS of any one process of the tree
    io: dict[str, int] = field(default_factory=dict)  # deltas of io_counters over the run
    timed_out: bool = False
    output: str = ""
    cpu_seconds: float = 0.0     # user + system CPU of the whole (reaped) tree


class TreeSampler:
    """Samples the peak RSS of a process tree every `dt` seconds in a thread."""

    def __init__(self, pid: int, dt: float = 0.05) -> None:
        self.pid, self.dt = pid, dt
        self.peak_tree = self.peak_process = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            r = [rss(p) for p in tree(self.pid)]
            self.peak_tree = max(self.peak_tree, sum(r))
            self.peak_process = max([self.peak_process] + r)
            time.sleep(self.dt)

    def __enter__(self) -> "TreeSampler":
        self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join()


def exit_on_sigterm() -> None:
    """Turn SIGTERM (e.g. from `timeout`) into SystemExit, so `measure` kills the command's tree."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def measure(argv: list[str], timeout: float | None = None, log: str | None = None, env: dict | None = None) -> Run:
    """Run `argv` (own process group, killed whole on timeout) and measure it."""
    r = Run(list(argv))
    io0 = io_counters()
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = open(log, "w") if log else subprocess.PIPE
    t0 = time.perf_counter()
    p = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env, text=True)
    with TreeSampler(p.pid) as s:
        try:
            text, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            text, _ = p.communicate()
            r.timed_out = True
        except BaseException:  # SIGTERM turned into SystemExit, Ctrl-C: the command's tree goes too
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            raise
    r.seconds = time.perf_counter() - t0
    r.rc = p.returncode
    r.peak_tree_rss, r.peak_process_rss = s.peak_tree, s.peak_process
    io1 = io_counters()
    r.io = {k: io1[k] - io0.get(k, 0) for k in io1}
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    r.cpu_seconds = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    if log:
        out.close()
        with open(log, errors="replace") as f:
            r.output = f.read()[-4000:]
    else:
        r.output = (text or "")[-4000:]
    return r
