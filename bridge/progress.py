"""Progress reporting: a bar on a terminal, silent when stderr is not a tty."""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Iterator


class _Quiet:
    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, s: str) -> None:
        pass


@contextmanager
def progress(total: int | None, desc: str, unit: str = "B", enabled: bool | None = None) -> Iterator:
    """Yield an object with `.update(n)`; a tqdm bar only when stderr is a terminal.

    >>> with progress(10, "demo", enabled=False) as bar:
    ...     bar.update(10)
    """
    if enabled is None:
        enabled = sys.stderr.isatty()
    if not enabled:
        yield _Quiet()
        return
    from tqdm import tqdm

    scale = unit == "B"
    with tqdm(total=total, desc=desc, unit=unit, unit_scale=scale, unit_divisor=1024 if scale else 1000,
              leave=False, file=sys.stderr) as bar:
        yield bar
