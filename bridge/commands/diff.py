"""`gtp-bridge diff A B [--atol X] [--ulp N] [--all] [--json]`: compare two checkpoints array by array, streamed.

The table lists the arrays that differ (with `--all`, every array), then a summary line; `--json`
always has every array.

Exit 0 when every array is present in both with the same shape and dtype and every element is within
tolerance; exit 1 otherwise (an array present in one checkpoint only counts as a difference).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from bridge.commands.inspect import select
from bridge.errors import BridgeError
from bridge.inspect.format import fmt_num, fmt_shape, table
from bridge.units import parse_size
from bridge.inspect.open import open_for_inspection
from bridge.inspect.stream import DEFAULT_BUDGET, stream_diff
from bridge.progress import progress

EPILOG = """examples:
  gtp-bridge diff before/ after/                 # exact comparison (NaN == NaN; -0.0 vs 0.0 noted)
  gtp-bridge diff torch_rt/ jax_rt/ --ulp 4      # allow 4 ulp per element
  gtp-bridge diff a/ b/ --atol 1e-6 --json --only 'params/*'
  gtp-bridge diff a/ b/ --all                    # every array's row, equal ones too
exit status: 0 within tolerance, 1 beyond it (or arrays missing / shape or dtype differ), 2 bad input
"""


def add_parser(sub: Any) -> None:
    """Register the `diff` subcommand."""
    p = sub.add_parser("diff", help="compare two checkpoints array by array (exit 1 when they differ)",
                       description="Per-array max abs and max ulp difference and the first differing index, "
                                   "streamed chunk by chunk.",
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("a", metavar="A", help="first checkpoint directory")
    p.add_argument("b", metavar="B", help="second checkpoint directory")
    p.add_argument("--atol", type=float, default=0.0, metavar="X",
                   help="an element within X absolute difference is equal (default 0)")
    p.add_argument("--ulp", type=int, default=0, metavar="N",
                   help="an element within N units in the last place is equal (default 0)")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of a table")
    p.add_argument("--all", action="store_true", help="list equal arrays too (default: only the differing ones)")
    p.add_argument("--budget", default=None, metavar="SIZE",
                   help=f"host memory for reads in flight, both sides together (default {DEFAULT_BUDGET >> 20}M)")
    p.add_argument("--only", action="append", metavar="GLOB", help="only arrays matching GLOB (repeatable)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Print the comparison; exit 0 when equal within tolerance, 1 otherwise."""
    if args.atol < 0 or args.ulp < 0:
        raise BridgeError("--atol and --ulp must be >= 0")
    budget = parse_size(args.budget) if args.budget is not None else DEFAULT_BUDGET
    report = diff_report(args.a, args.b, atol=args.atol, ulp=args.ulp, budget=budget, only=args.only)
    if args.json:
        json.dump(report, sys.stdout, indent=1, allow_nan=False)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(render_text(report, show_equal=args.all))
    return 0 if report["equal"] else 1


def diff_report(dir_a: str, dir_b: str, atol: float = 0.0, ulp: int = 0, budget: int = DEFAULT_BUDGET,
                only: list[str] | None = None) -> dict[str, Any]:
    """JSON-ready comparison of two checkpoints; `equal` is False when anything is beyond tolerance."""
    a_info, b_info = open_for_inspection(dir_a), open_for_inspection(dir_b)
    a_arrays = {x.name: x for x in select(a_info, only)}
    b_arrays = {x.name: x for x in select(b_info, only)}
    common = [n for n in a_arrays if n in b_arrays]
    records = []
    comparable = [n for n in common if a_arrays[n].shape == b_arrays[n].shape]
    total = sum(a_arrays[n].nbytes + b_arrays[n].nbytes for n in comparable)
    with progress(total, "diff") as bar:
        for n in common:
            x, y = a_arrays[n], b_arrays[n]
            rec: dict[str, Any] = {"name": n, "shape": list(x.shape), "dtype": x.dtype}
            if x.shape != y.shape:
                rec.update(status="shape", shape_b=list(y.shape))
            else:
                a_info.checkpoint.check_chunk_bytes(x.path)
                b_info.checkpoint.check_chunk_bytes(y.path)
                d = stream_diff(x.view, y.view, atol, ulp, budget, x.read_chunk, bar,
                                names=[f"{n} of {dir_a}", f"{n} of {dir_b}"])
                rec.update(d.to_json())
                if x.dtype != y.dtype:
                    rec.update(status="dtype", dtype_b=y.dtype)
                else:
                    rec["status"] = "beyond" if d.beyond_tolerance else "within" if d.differing else "equal"
            records.append(rec)
    only_a = sorted(set(a_arrays) - set(b_arrays))
    only_b = sorted(set(b_arrays) - set(a_arrays))
    equal = not only_a and not only_b and all(r["status"] in ("equal", "within") for r in records)
    return {"a": dir_a, "b": dir_b, "atol": atol, "ulp": ulp, "equal": equal,
            "only_in_a": only_a, "only_in_b": only_b, "arrays": records}


def render_text(report: dict[str, Any], show_equal: bool = False) -> str:
    """Human-readable comparison: a row per differing array (all with `show_equal`), presence, summary, verdict.

    An equal array with a note (signed zeros) counts as differing for display: it is worth seeing.
    """
    rows = []
    for r in report["arrays"]:
        note = {"shape": f"shape {fmt_shape(r['shape'])} vs {fmt_shape(r.get('shape_b'))}",
                "dtype": f"dtype {r['dtype']} vs {r.get('dtype_b')}"}.get(r["status"], "")
        if r.get("signed_zero"):
            note = (note + "; " if note else "") + f"{r['signed_zero']} signed zeros (-0.0 vs 0.0)"
        if r.get("nan_mismatch"):
            note = (note + "; " if note else "") + f"{r['nan_mismatch']} NaN vs number"
        if r["status"] == "equal" and not note and not show_equal:
            continue
        first = r.get("first_index")
        rows.append([r["name"], r["status"], str(r.get("differing", "-")), fmt_num(_num(r.get("max_abs"))),
                     str(r.get("max_ulp", "-")), fmt_shape(first) if first is not None else "-", note])
    out = []
    if rows:
        out.append(table(["array", "status", "differing", "max abs", "max ulp", "first index", "note"], rows,
                         [False, False, True, True, True, False, False]))
    for side, key in (("A", "only_in_a"), ("B", "only_in_b")):
        for n in report[key]:
            out.append(f"only in {side}: {n}")
    out.append(summary_line(report))
    verdict = "equal within tolerance" if report["equal"] else "DIFFERENT"
    out.append(f"{verdict} (atol={report['atol']}, ulp={report['ulp']})")
    return "\n".join(out) + "\n"


def summary_line(report: dict[str, Any]) -> str:
    """'12 arrays compared: 10 equal, 1 within tolerance, 1 beyond; 1 only in A' (zero counts left out)."""
    counts: dict[str, int] = {}
    for r in report["arrays"]:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    labels = [("equal", "equal"), ("within", "within tolerance"), ("beyond", "beyond tolerance"),
              ("shape", "shape differs"), ("dtype", "dtype differs")]
    parts = [f"{counts[k]} {label}" for k, label in labels if counts.get(k)]
    text = f"{len(report['arrays'])} arrays compared: " + (", ".join(parts) or "none")
    extra = [f"{len(report[k])} only in {side}" for side, k in (("A", "only_in_a"), ("B", "only_in_b")) if report[k]]
    return text + ("; " + ", ".join(extra) if extra else "")


def _num(v: Any) -> Any:
    return float("inf") if v == "inf" else v
