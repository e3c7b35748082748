"""Ordered work cut into contiguous runs of about equal bytes, one run per process (pure)."""

from __future__ import annotations

from typing import Sequence


def contiguous_parts(sizes: Sequence[int], parts: int) -> list[int]:
    """The part (0..parts-1) of each item: `parts` contiguous runs of about equal total size, so each
    part reads a compact region. An item goes to the part its middle byte falls in.

    >>> contiguous_parts([4, 4, 4, 4, 8], 2)
    [0, 0, 0, 1, 1]
    >>> contiguous_parts([1, 1, 1], 5)
    [0, 2, 4]
    """
    total = sum(sizes)
    out, done = [], 0
    for n in sizes:
        out.append(min(parts - 1, int((done + n / 2) * parts // max(1, total))))
        done += n
    return out
