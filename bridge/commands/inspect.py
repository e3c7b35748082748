"""`gtp-bridge inspect DIR [--json] [--stats]`: arrays, shapes, dtypes, chunking, provenance, statistics."""

from __future__ import annotations

import argparse
import fnmatch
import json
import sys
from typing import Any

from bridge.format.schema import split_role
from bridge.inspect.format import fmt_num, fmt_shape, summarize_value, table
from bridge.units import human_bytes, parse_size
from bridge.inspect.open import CheckpointInfo, open_for_inspection
from bridge.inspect.replicas import replica_lines
from bridge.inspect.stream import DEFAULT_BUDGET, stream_stats
from bridge.progress import progress

EPILOG = """examples:
  gtp-bridge inspect ckpt/                         # arrays, shapes, dtypes, chunking, provenance
  gtp-bridge inspect ckpt/ --stats --budget 512M   # + min/max/mean/RMS/zeros/NaN/Inf per array, streamed
  gtp-bridge inspect ckpt/ --json --only 'opt_state/0/nu/*' --stats | jq .arrays
"""


def add_parser(sub: Any) -> None:
    """Register the `inspect` subcommand."""
    p = sub.add_parser("inspect", help="list arrays, shapes, dtypes, chunking, provenance (and --stats)",
                       description="Show what a logical (or any Orbax PyTree) checkpoint holds, without loading it.",
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir", metavar="DIR", help="checkpoint directory (the one holding _METADATA)")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of a table")
    p.add_argument("--stats", action="store_true",
                   help="also read every array, chunk by chunk, for min/max/mean/RMS, zero fraction, NaN/Inf counts")
    p.add_argument("--budget", default=None, metavar="SIZE",
                   help=f"host memory for reads in flight with --stats (default {DEFAULT_BUDGET >> 20}M)")
    p.add_argument("--only", action="append", metavar="GLOB",
                   help="only arrays whose '/'-joined path matches GLOB (repeatable), e.g. 'opt_state/0/nu/*'")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Print the inspection report; exit 0."""
    budget = parse_size(args.budget) if args.budget is not None else DEFAULT_BUDGET
    report = inspect_report(args.dir, stats=args.stats, budget=budget, only=args.only)
    if args.json:
        json.dump(report, sys.stdout, indent=1, allow_nan=False)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(render_text(report))
    return 0


def select(info: CheckpointInfo, only: list[str] | None) -> list:
    """Arrays of `info` whose names match any of the `only` globs (all when None)."""
    if not only:
        return list(info.arrays)
    return [a for a in info.arrays if any(fnmatch.fnmatchcase(a.name, g) for g in only)]


def inspect_report(directory: str, stats: bool = False, budget: int = DEFAULT_BUDGET,
                   only: list[str] | None = None) -> dict[str, Any]:
    """The JSON-ready report: format flags, manifest, and one record per array (with stats if asked)."""
    info = open_for_inspection(directory)
    arrays = select(info, only)
    records = [_record(a, info) for a in arrays]
    if stats:
        total = sum(a.nbytes for a in arrays)
        with progress(total, "stats") as bar:
            for rec, a in zip(records, arrays):
                info.checkpoint.check_chunk_bytes(a.path)  # before TensorStore decodes a chunk it claims
                rec["stats"] = stream_stats(a.view, budget, a.read_chunk, bar, name=a.name).to_json()
    return {
        "directory": info.directory,
        "format": {"use_ocdbt": info.use_ocdbt, "use_zarr3": info.use_zarr3},
        "manifest": info.manifest,
        "empty_nodes": info.empty_nodes,
        "total_bytes": sum(r["bytes"] for r in records),
        "arrays": records,
    }


def _record(a: Any, info: CheckpointInfo) -> dict[str, Any]:
    rec = {"name": a.name, "shape": list(a.shape), "dtype": a.dtype, "bytes": a.nbytes,
           "chunk": list(a.chunk) if a.chunk is not None else None,
           "read_chunk": list(a.read_chunk) if a.read_chunk is not None else None,
           "compression": a.compression}
    prov = info.record(a.name)
    if prov is not None:
        rec["manifest"] = prov
    fused = _fused_section(a.path, info.checkpoint.manifest.fused if info.checkpoint.manifest is not None else {})
    if fused is not None:
        rec["fused"] = fused
    return rec


def _fused_section(path: tuple[str, ...], fused: dict) -> dict | None:
    """{"param", "section", "kind"} when `path` is one section of a fused projection in the manifest.

    >>> _fused_section(("params", "l", "qkv", "weight", "key"), {"l/qkv/weight": {"kind": "grouped"}})
    {'param': 'l/qkv/weight', 'section': 'key', 'kind': 'grouped'}
    """
    found = split_role(path)  # (role, parameter path) of a per-parameter array
    if found is not None and len(found[1]) > 1:
        param = "/".join(found[1][:-1])
        spec = fused.get(param)
        if isinstance(spec, dict):
            return {"param": param, "section": path[-1], "kind": spec.get("kind")}
    return None


def render_text(report: dict[str, Any]) -> str:
    """Human-readable report: provenance lines, then the array table."""
    fmt = report["format"]
    out = [f"{report['directory']}: {len(report['arrays'])} arrays, {human_bytes(report['total_bytes'])}, "
           f"{'OCDBT' if fmt['use_ocdbt'] else 'plain files'}, {'zarr3' if fmt['use_zarr3'] else 'zarr2'}"]
    manifest = report.get("manifest")
    if isinstance(manifest, dict):
        out.append("provenance (gtp_bridge manifest):")
        for k, v in manifest.items():
            text = f"{len(v)} records (digests in the table)" if k == "arrays" and isinstance(v, dict) else summarize_value(v)
            out.append(f"  {k}: {text}")
        out += replica_lines(manifest)
    else:
        out.append("provenance: none (not written by gtp-bridge)")
    if report["empty_nodes"]:
        out.append("empty nodes: " + ", ".join(report["empty_nodes"]))
    has_stats = any("stats" in r for r in report["arrays"])
    has_digest = any((r.get("manifest") or {}).get("digest") for r in report["arrays"])
    header = ["array", "shape", "dtype", "bytes", "chunk", "read chunk"] + (["digest"] if has_digest else [])
    right = [False, False, False, True, False, False] + ([False] if has_digest else [])
    if has_stats:
        header += ["min", "max", "mean", "rms", "zeros", "nan", "inf"]
        right += [True] * 7
    rows = []
    for r in report["arrays"]:
        row = [r["name"], fmt_shape(r["shape"]), r["dtype"], human_bytes(r["bytes"]),
               fmt_shape(r["chunk"]), fmt_shape(r["read_chunk"])]
        if has_digest:
            row.append(str((r.get("manifest") or {}).get("digest") or "-")[-12:])
        if has_stats:
            s = r["stats"]
            zf = s["zero_fraction"]
            row += [fmt_num(s["min"]), fmt_num(s["max"]), fmt_num(s["mean"]), fmt_num(s["rms"]),
                    "-" if zf is None else f"{100 * zf:.1f}%", str(s["nan"]), str(s["posinf"] + s["neginf"])]
        rows.append(row)
    out.append(table(header, rows, right))
    return "\n".join(out) + "\n"
