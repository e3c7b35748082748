"""Peak resident memory of a program and its descendants, and whether processes still live, read from
/proc (the memory and process-hygiene tests' one probe)."""

from __future__ import annotations

import subprocess
import time


def vm_hwm(status: str) -> int:
    for line in status.splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/task/{p}/children") as f:
                kids = [int(x) for x in f.read().split()]
        except OSError:
            continue
        out += kids
        todo += kids
    return out


def peak_rss_of(argv: list[str], env: dict | None = None) -> int:
    """Largest VmHWM of a program (which prints its own /proc/self/status last) and its descendants,
    sampled from /proc while they run (getrusage would count what a spawned child inherits before its exec)."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    peak = 0
    while proc.poll() is None:
        for p in descendants(proc.pid):
            try:
                with open(f"/proc/{p}/status") as f:
                    peak = max(peak, vm_hwm(f.read()))
            except OSError:
                pass
        time.sleep(0.02)
    out, err = proc.communicate()
    assert proc.returncode == 0, err[-2000:]
    return max(peak, vm_hwm(out))


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_dead(pids: list[int], seconds: float = 20) -> list[int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if alive(p)]
