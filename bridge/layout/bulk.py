"""Bulk planning helper: pause CPython's cyclic garbage collector.

Planning 1024 ranks x 10,000 parameters allocates hundreds of thousands of small tuples (boxes,
pieces) that stay alive; the cyclic collector then rescans them again and again, a large share of
planning's CPU time (benchmarks/bench_planning.py). Layout planning creates no reference
cycles, so pausing the collector loses nothing; it is restored (and not forced) on exit.

>>> import gc
>>> with paused_gc():
...     gc.isenabled()
False
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def paused_gc() -> Iterator[None]:
    """Disable the cyclic GC inside the block (re-entrant; restores the previous state)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
