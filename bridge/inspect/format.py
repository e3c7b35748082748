"""Text formatting for inspection output: numbers, shapes, aligned tables, provenance summaries
(byte sizes: `bridge.units`)."""

from __future__ import annotations

import json
from typing import Any, Sequence


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
