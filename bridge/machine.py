"""What the machine offers, for the defaults of the offline commands: cores, memory available now,
and a glibc setting that keeps resident memory near what is live."""

from __future__ import annotations

import os
import sys


def default_workers(cores: int | None = None) -> int:
    """Writer processes: one per core up to 8 (more adds contention, not speed).

    >>> default_workers(2), default_workers(64)
    (2, 8)
    """
    return max(1, min(8, cores if cores is not None else (os.cpu_count() or 1)))


# A writer process costs seconds to start (imports): each gets at least this much work, so small
# checkpoints are converted in-process.
MIN_BYTES_PER_WORKER = 1 << 30
PROCESS_OVERHEAD = 512 << 20   # interpreter + torch + TensorStore, per process, outside the budget


def default_budget(workers: int, available: int | None) -> int:
    """Half of what is free after each process's fixed overhead, between 256 MiB and 16 GiB.

    >>> default_budget(4, 16 << 30) >> 20, default_budget(4, None) >> 20, default_budget(8, 1 << 30) >> 20
    (6912, 1024, 256)
    """
    if available is None:
        return 1 << 30
    spare = available - (workers + 1) * PROCESS_OVERHEAD
    return int(min(16 << 30, max(256 << 20, spare // 2)))


def mem_available() -> int | None:
    """Bytes the kernel says can be allocated without swapping (MemAvailable), None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def return_freed_memory() -> None:
    """Make glibc give large freed buffers back to the system at once (Linux; no-op elsewhere).

    Blocks and source chunks are allocated and freed all the time; glibc's default raises its mmap
    threshold after each freed large buffer, so later ones come from heaps that never shrink and
    resident memory grows past what is live. A fixed 1 MiB threshold keeps them mmapped."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    M_MMAP_THRESHOLD = -3
    try:
        ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, 1 << 20)
    except (OSError, AttributeError):
        pass
