"""Replica consistency: the copies of a replicated parameter a save holds, compared while converting.

Each TP (and GTP) rank's DistributedOptimizer keeps its own fp32 master and Adam moments of the
parameters every rank of the group replicates (norms, biases of row-parallel layers, position
embeddings). They should be equal but need not be: Megatron all-reduces only what its config says
(e.g. a real TP2 run's masters of those parameters drift apart by up to ~0.1). `dp_reshardable`,
`dp_zero_gather_scatter` and bucket-space saves hold every rank's copy; model-space saves
(`fully_reshardable`) keep one. `convert` writes the main replica's (TP rank 0, GTP rank 0:
`replica_id` 0, the copy Megatron's own `fully_reshardable` save keeps) and compares the others
with it block by block while the block is in memory (each other copy is read once; the main
copy is not read again). What differs is reported, recorded in the manifest
(`bridge.format.manifest.ReplicaRecord`, `extra["replicas"]`) and, with `--strict-replicas`,
refused before anything is committed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Sequence

import numpy as np

from bridge.cast_check import bits_equal
from bridge.format.manifest import ReplicaDiff, ReplicaRecord
from bridge.inspect.replicas import MAIN_REPLICA, describe, param_lines
from converters.megatron.plan.convert_plan import Block, Copy, CopyIndex, Unit

MAIN_REPLICA_TEXT = ("TP rank 0, GTP rank 0 (replica_id 0: Megatron's main replica, the copy its fully_reshardable "
                     "save keeps)")


def copies_target(u: Unit, label: str) -> dict[str, list[Copy]]:
    """Where the copies of one replica go (compared, never written)."""
    return u.replicas.setdefault(label, {})


@dataclass
class BlockDiff:
    """One block of one array in one role against one other copy."""

    param: str                      # the Megatron parameter (its fused sections together)
    role: str
    replica: str
    elements: int
    differ: int
    max_abs_diff: float
    nonfinite: int


def compare(main: np.ndarray, other: np.ndarray, step: int = 1 << 18) -> tuple[int, float, int]:
    """(elements whose bits differ, largest finite |main - other| among them, non-finite differences),
    `step` elements at a time (float64 temporaries of a slice, not of the block).

    >>> compare(np.array([1.0, 2.0, np.nan], np.float32), np.array([1.0, 2.5, np.nan], np.float32), step=2)
    (1, 0.5, 0)
    >>> compare(np.array([1.0, np.inf], np.float32), np.array([0.0, 1.0], np.float32))
    (2, 1.0, 1)
    """
    a, b = main.reshape(-1), other.reshape(-1)
    n, mx, nonfinite = 0, 0.0, 0
    for i in range(0, a.size, step):
        x, y = a[i:i + step], b[i:i + step]
        diff = ~bits_equal(x, y)
        k = int(diff.sum())
        if not k:
            continue
        d = np.abs(x[diff].astype(np.float64) - y[diff].astype(np.float64))
        finite = np.isfinite(d)
        n += k
        nonfinite += int((~finite).sum())
        if finite.any():
            mx = max(mx, float(d[finite].max()))
    return n, mx, nonfinite


class ReplicaCheck:
    """Compares the other copies of a unit's block with the block about to be written (one CopyIndex
    per unit and replica, built once). Memory: `fill` assembles one role of one other copy at a time
    (convert reuses one buffer for it), and the comparison's temporaries are per slice."""

    def __init__(self) -> None:
        self._index: dict[tuple[str, str], CopyIndex] = {}
        self.diffs: list[BlockDiff] = []

    def block(self, unit: Unit, b: Block, bufs: Mapping[str, np.ndarray],
              fill: Callable[[CopyIndex, str], np.ndarray]) -> None:
        """Compare every other copy of block `b` (every role it has) with `bufs`, the main copy's.
        `fill(index, role)` assembles the block from a replica's copies."""
        for label, copies in unit.replicas.items():
            key = (unit.name, label)
            index = self._index.get(key)
            if index is None:
                index = self._index[key] = CopyIndex(Unit(unit.name, unit.arrays, unit.dtypes, copies))
            for role, main in bufs.items():
                if role not in copies:
                    continue
                n, mx, nonfinite = compare(main, fill(index, role))
                self.diffs.append(BlockDiff(unit.name, role, label, int(main.size), n, mx, nonfinite))


def summarize(diffs: Iterable[BlockDiff], units: Sequence[Unit]) -> ReplicaRecord:
    """The manifest record of every worker's block comparisons: one entry per (parameter, role) that
    differs, its counts summed over blocks and replicas, the largest difference kept."""
    labels = {label for u in units for label in u.replicas}
    by: dict[tuple[str, str], dict] = {}
    compared = 0
    for d in diffs:
        compared += d.elements
        e = by.setdefault((d.param, d.role), {"replicas": set(), "elements": 0, "differ": 0, "max": 0.0, "nf": 0})
        e["elements"] += d.elements
        e["differ"] += d.differ
        e["max"] = max(e["max"], d.max_abs_diff)
        e["nf"] += d.nonfinite
        if d.differ:
            e["replicas"].add(d.replica)
    differ = [ReplicaDiff(a, r, sorted(e["replicas"]), e["elements"], e["differ"], e["max"], e["nf"])
              for (a, r), e in sorted(by.items()) if e["differ"]]
    return ReplicaRecord(kept=MAIN_REPLICA, copies=1 + len(labels), compared=len(by),
                         elements_compared=compared, differ=differ)


def report_lines(rec: ReplicaRecord) -> list[str]:
    """What convert prints (as warnings) when replicated copies differ; nothing when they agree."""
    if not rec.differ:
        return []
    lines = param_lines(rec)
    head = (f"the copies of {len(lines)} replicated parameter(s) differ between ranks ({len(rec.differ)} of "
            f"{rec.compared} parameter states compared); kept {MAIN_REPLICA_TEXT}; recorded in the manifest "
            f"(gtp-bridge inspect); --strict-replicas refuses such a source")
    return [head] + ["  " + line for line in lines]


def strict_error(rec: ReplicaRecord) -> str | None:
    """The one-line refusal of `--strict-replicas`, or None when every copy agrees."""
    if not rec.differ:
        return None
    worst = max(rec.differ, key=lambda d: d.max_abs_diff)
    more = len(rec.differ) - 1
    return (f"--strict-replicas: the replicated copies of {describe(worst)}"
            + (f"; {more} more parameter state(s) differ" if more else "")
            + "; nothing was written. Without --strict-replicas convert keeps TP rank 0's copy (Megatron's main "
              "replica) and records the differences")
