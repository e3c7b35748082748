"""Text formatting for inspection output: sizes, numbers, aligned tables, provenance summaries."""

from __future__ import annotations

import json
import re
from typing import Any, Sequence

from bridge.errors import BridgeError

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20,
          "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30, "T": 1 << 40, "TB": 1 << 40, "TIB": 1 << 40}


def parse_size(text: str) -> int:
    """Bytes from '256M', '1.5GiB', '4096' (binary units).

    >>> parse_size("64M"), parse_size("1.5GiB"), parse_size("4096")
    (67108864, 1610612736, 4096)
    """
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).upper() not in _UNITS:
        raise BridgeError(f"cannot read size {text!r}; write it like 256M, 2G or 1048576")
    n = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if n < 1:
        raise BridgeError(f"size {text!r} must be at least 1 byte")
    return n


def human_bytes(n: int) -> str:
    """Short binary size.

    >>> human_bytes(512), human_bytes(3 << 20), human_bytes(1536 << 20)
    ('512 B', '3.0 MiB', '1.5 GiB')
    """
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def fmt_num(x: Any) -> str:
    """Compact number for tables ('-' for None).

    >>> fmt_num(None), fmt_num(0.000123456), fmt_num(3), fmt_num(12345678.0)
    ('-', '1.235e-04', '3', '1.235e+07')
    """
    if x is None:
        return "-"
    if isinstance(x, int):
        return str(x)
    return f"{x:.4g}" if 1e-3 <= abs(x) < 1e5 or x == 0 else f"{x:.3e}"


def fmt_shape(shape: Sequence[int] | None) -> str:
    """'(4, 16)' style shape; '()' for scalars and '-' when unknown.

    >>> fmt_shape((4, 16)), fmt_shape(()), fmt_shape(None)
    ('(4,16)', '()', '-')
    """
    if shape is None:
        return "-"
    return "(" + ",".join(str(s) for s in shape) + ")"


def table(header: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[bool] | None = None) -> str:
    """Plain aligned text table.

    >>> print(table(["a", "bb"], [["x", "1"], ["yyy", "22"]], right=[False, True]))
    a    bb
    x     1
    yyy  22
    """
    right = right or [False] * len(header)
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = []
    for r in [header, *rows]:
        cells = [str(c).rjust(w) if rt else str(c).ljust(w) for c, w, rt in zip(r, widths, right)]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def summarize_value(v: Any, limit: int = 200) -> str:
    """One-line summary of a manifest value: dicts as k=v (containers as counts), long ones cut.

    >>> summarize_value({"tp": 2, "betas": [0.9, 0.95], "groups": [{"lr": 1}] * 3, "name": "adamw"})
    'tp=2 betas=[0.9, 0.95] groups=[3 items] name=adamw'
    >>> summarize_value({}), summarize_value(list(range(100)))
    ('{}', '[100 items]')
    """
    if isinstance(v, dict) and v:
        text = " ".join(f"{k}={_short(x)}" for k, x in v.items())
    else:
        text = _short(v, limit)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _short(v: Any, limit: int = 24) -> str:
    if isinstance(v, str):
        return v if v else "''"
    text = json.dumps(v, default=str)
    if len(text) <= limit:
        return text
    if isinstance(v, dict):
        return f"{{{len(v)} entries}}"
    if isinstance(v, list):
        return f"[{len(v)} items]"
    return text[: limit - 3] + "..."
