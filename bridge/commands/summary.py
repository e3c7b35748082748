"""`--json` summaries (`convert`, `to-megatron`, `verify`) and `convert --dry-run`'s report.

With `--json` a command prints ONE JSON object on stdout and its human lines on stderr, so
`gtp-bridge convert ... --json | jq .arrays` reads the result alone. The fields are listed in the
README's command reference ("JSON summaries"); each is also what an independent read of the output
gives (tests/commands/test_cli_summaries.py reads them back with plain TensorStore, torch DCP and du).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from typing import Any, Callable, TextIO

SCHEMA = 1   # bumped when a field changes meaning or goes away (new fields keep it)


def emit(obj: dict[str, Any]) -> None:
    """The one JSON object of a `--json` run, on stdout."""
    print(json.dumps(obj, indent=1), flush=True)


def human_stream(args: Any) -> TextIO:
    """Where a command's human lines go: stderr with `--json` (stdout is the JSON object's)."""
    return sys.stderr if getattr(args, "json", False) else sys.stdout


def run_reporting(args: Any, body: Callable[[], Any], summarize: Callable[[Any], dict[str, Any]],
                  exit_code: Callable[[Any], int] = lambda _res: 0) -> int:
    """Run `body` (which prints its human lines to stdout and returns its result), then with `--json`
    print `summarize(result)`; under `--json` the human lines are moved to stderr."""
    if not getattr(args, "json", False):
        return exit_code(body())
    with contextlib.redirect_stdout(sys.stderr):
        res = body()
    if os.environ.get("RANK", "0") == "0":   # under torchrun rank 0 reports for every rank
        emit(summarize(res))
    return exit_code(res)


# -- convert --------------------------------------------------------------------------------------


def convert_json(res: Any, src: str, given: list[str], inferred: list[str]) -> dict[str, Any]:
    """`convert --json`: a `converters.megatron.convert.ConvertResult` as documented fields."""
    return {"schema": SCHEMA, "command": "convert", "source": src, "destination": res.dst,
            "source_format": res.source_format, "layout": res.layout, "step": res.step, "params": res.params,  # foreign: report keys
            "arrays": res.arrays, "array_bytes": res.bytes, "workers": res.workers, "budget": res.budget,
            "given": given, "inferred": inferred, "warnings": list(res.warnings),
            "phases": dict(res.phases), "ranks": list(res.ranks)}


def dry_run_json(cp: Any, src: str, dst: str, facts: list[Any]) -> dict[str, Any]:
    """`convert --dry-run`: the plan (`converters.megatron.convert.ConvertPlan`), the facts with their
    sources, and the bytes the conversion would write."""
    arrays = []
    for name, ap in cp.plan.arrays.items():
        arrays.append({"name": name, "shape": list(ap.spec.shape), "dtype": ap.spec.dtype,
                       "chunk_shape": list(ap.ownership.chunk_shape), "chunks": ap.ownership.num_chunks,
                       "bytes": ap.spec.nbytes})
    return {"schema": SCHEMA, "command": "convert", "dry_run": True, "source": src, "destination": dst,
            "source_format": cp.src.format_label, "layout": cp.src.layout.to_json(), "step": cp.step,  # foreign: report keys
            "params": len(cp.units), "arrays": len(arrays), "array_bytes": cp.plan.total_bytes,  # foreign: report keys
            "stored_bytes": cp.plan.stored_bytes(), "workers": cp.workers, "budget": cp.budget,
            "facts": [f.to_json() for f in facts], "plan": arrays}


def print_dry_run(rep: dict[str, Any], out: TextIO) -> None:
    """The human form of `dry_run_json`'s report."""
    from bridge.units import human_bytes

    lay = rep["layout"]
    print(f"dry run: convert {rep['source']} ({rep['source_format']}, TP={lay['tp']} GTP={lay['gtp']} "
          f"DP={lay['dp']} EP={lay['ep']} PP={lay['pp']}, step {rep['step']}) -> {rep['destination']}", file=out)  # foreign: report keys
    print("facts (source: flag = you passed it, save = recorded in or read from the checkpoint, default = "
          "neither):", file=out)
    width = max((len(f["name"]) for f in rep["facts"]), default=0)
    vwidth = max((len(str(f["value"])) for f in rep["facts"]), default=0)
    for f in rep["facts"]:
        print(f"  {f['name'].ljust(width)}  {str(f['value']).ljust(vwidth)}  {f['source']:<7}  {f['detail']}",
              file=out)
    stored = rep["stored_bytes"]
    print(f"would write {rep['arrays']} arrays of {rep['params']} params: {rep['array_bytes']:,} bytes of array "  # foreign: report keys
          f"data ({human_bytes(rep['array_bytes'])}), stored as {stored:,} bytes of chunks (data, checksums and "
          f"shard indexes), plus a few KiB of metadata; {rep['workers']} worker"
          f"{'s' if rep['workers'] != 1 else ''}, budget {human_bytes(rep['budget'])}", file=out)
    print("nothing written (--dry-run)", file=out)


# -- to-megatron, verify -------------------------------------------------------------------------------


def to_megatron_json(res: dict[str, Any]) -> dict[str, Any]:
    """`to-megatron --json`: what `converters.megatron.write.to_megatron.to_megatron` reports, as documented fields."""
    return {"schema": SCHEMA, "command": "to-megatron", "destination": res["dst"], "run_dir": res["run_dir"],
            "tracker": res["tracker"], "tracker_previous": res["tracker_previous"], "format": res["format"],
            "layout": res["layout"], "step": res["step"], "params": res["params"], "bytes": res["bytes"],  # foreign: report keys
            "weights_from_masters": res["weights_derived"], "scheduler_written": res["scheduler"],
            "workers": res["workers"], "budget": res["budget"], "elements_read": res["elements_read"],
            "elements_needed": res["elements_needed"]}


def verify_json(path: str, res: Any) -> dict[str, Any]:
    """`verify --json`: a `bridge.store.verify.VerifyResult` as documented fields."""
    return {"schema": SCHEMA, "command": "verify", "checkpoint": path, "ok": res.ok, "arrays_checked": res.checked,
            "damaged": dict(sorted(res.damaged.items())), "metadata_problems": list(res.metadata_problems),
            "digests": res.has_manifest, "bytes_read": res.bytes_read}
