"""A `restore_watch` seam (`bridge._testing`) that counts a restore's bytes in flight: between a block's
read starting ("read") and its placement on the devices ("placed")."""

from __future__ import annotations


def counting_watch():
    """(seen, watch): `seen` holds the bytes in flight now, their peak, the bytes started and the blocks."""
    seen = {"now": 0, "peak": 0, "started": 0, "blocks": 0}

    def watch(event: str, n: int) -> None:
        if event == "read":
            seen["now"] += n
            seen["started"] += n
            seen["blocks"] += 1
            seen["peak"] = max(seen["peak"], seen["now"])
        else:
            seen["now"] -= n

    return seen, watch
