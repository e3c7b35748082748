"""Where a command's wall time goes before its own work starts: seconds since this process began.

A command's own timings start when its function is called; the seconds before that (interpreter
start, imports, argument parsing) are the ones a launch of several processes pays once per
process (`torchrun`'s ranks import torch for gloo, one process does not), so the reports show them
as the phase "start" beside the command's own phases.
"""

from __future__ import annotations

import os


def process_age(pid: int | None = None) -> float | None:
    """Seconds since process `pid` (default: this one) started, from Linux's /proc (both ends counted
    from boot, in clock ticks: 10 ms resolution); None where /proc is not there.

    >>> a = process_age(); a is None or 0 <= a < 1e6
    True
    """
    try:
        with open(f"/proc/{pid or os.getpid()}/stat") as f:
            stat = f.read()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    # field 22 (starttime, ticks since boot) counted after the command name, which may hold spaces
    ticks = int(stat.rpartition(")")[2].split()[19])
    return max(0.0, uptime - ticks / os.sysconf("SC_CLK_TCK"))


def seconds_since_start() -> float | None:
    """Seconds from this process's start to now (None without /proc): the phase "start" of a report."""
    age = process_age()
    return None if age is None else round(age, 3)
