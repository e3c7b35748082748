"""How `inspect` and `convert` put `ReplicaRecord` (the manifest's record of a source's replicated
copies, `bridge.format.manifest`) into words."""

from __future__ import annotations

from typing import Any, Mapping

from bridge.errors import IntegrityError
from bridge.format.manifest import REPLICAS_KEY, ReplicaDiff, ReplicaRecord
from bridge.format.schema import MODEL, MU, NU, PARAMS

MAIN_REPLICA = ReplicaRecord.kept         # "tp0.gtp0": the copy convert writes
ROLE_NAMES = {PARAMS: "master", MU: "exp_avg", NU: "exp_avg_sq", MODEL: "weight"}


def describe(d: ReplicaDiff) -> str:
    """One array's difference in one role, in words.

    >>> describe(ReplicaDiff("decoder.final_layernorm.weight", "params", ["tp1"], 24, 24, 0.0319))
    'decoder.final_layernorm.weight master: 24 of 24 elements differ, max |diff| 0.0319 (tp1 vs the main replica)'
    """
    return f"{d.param} {_role_text(d)} ({', '.join(d.replicas)} vs the main replica)"


def _role_text(d: ReplicaDiff) -> str:
    nf = f", {d.nonfinite} non-finite" if d.nonfinite else ""
    return (f"{ROLE_NAMES.get(d.role, d.role)}: {d.differ} of {d.elements} elements differ, "
            f"max |diff| {d.max_abs_diff:.3g}{nf}")


def param_lines(rec: ReplicaRecord) -> list[str]:
    """One line per parameter whose copies differ, its roles together.

    >>> rec = ReplicaRecord(differ=[ReplicaDiff("w", "params", ["tp1"], 4, 4, 0.5), ReplicaDiff("w", "mu", ["tp1"], 4, 1, 0.25)])
    >>> param_lines(rec)
    ['w (tp1 vs the main replica): master: 4 of 4 elements differ, max |diff| 0.5; exp_avg: 1 of 4 elements differ, max |diff| 0.25']
    """
    order = {r: i for i, r in enumerate(ROLE_NAMES)}
    by: dict[str, list[ReplicaDiff]] = {}
    for d in rec.differ:
        by.setdefault(d.param, []).append(d)
    lines = []
    for param, ds in sorted(by.items()):
        ds = sorted(ds, key=lambda d: order.get(d.role, len(order)))
        reps = sorted({r for d in ds for r in d.replicas})
        lines.append(f"{param} ({', '.join(reps)} vs the main replica): " + "; ".join(_role_text(d) for d in ds))
    return lines


def record_lines(rec: ReplicaRecord | None) -> list[str]:
    """What `inspect` shows of the record.

    >>> record_lines(ReplicaRecord(copies=2, compared=3, elements_compared=72))
    ['replicas: 2 copies of each replicated parameter; 3 parameter states compared (72 elements): all equal; kept tp0.gtp0']
    >>> record_lines(ReplicaRecord())
    ['replicas: the source holds one copy of each replicated parameter (nothing to compare)']
    """
    if rec is None:
        return []
    if not rec.compared:
        return ["replicas: the source holds one copy of each replicated parameter (nothing to compare)"]
    state = f"{len(rec.differ)} differ" if rec.differ else "all equal"
    lines = [f"replicas: {rec.copies} copies of each replicated parameter; {rec.compared} parameter states compared "
             f"({rec.elements_compared} elements): {state}; kept {rec.kept}"]
    return lines + ["  " + line for line in param_lines(rec)]


def replica_lines(manifest: Mapping[str, Any]) -> list[str]:
    """`inspect`'s lines for the replica record of a manifest (its JSON); none when not recorded.

    >>> replica_lines({"extra": {"replicas": {"version": 1, "copies": 1}}})
    ['replicas: the source holds one copy of each replicated parameter (nothing to compare)']
    >>> replica_lines({"extra": {}})
    []
    """
    extra = manifest.get("extra")
    raw = extra.get(REPLICAS_KEY) if isinstance(extra, Mapping) else None
    if not isinstance(raw, Mapping):
        return []
    try:
        return record_lines(ReplicaRecord.from_json(raw))
    except IntegrityError as e:
        return [f"replicas: {e}"]
