"""Compare the way back from MaxText with the logical checkpoint it came from, array by array, bit for bit:
masters, both moments, count and step (the bf16 weights are not in MaxText's state; the way back names an
aliased array by the mapping table's first name).

    python3 scripts/gpu/scale/maxtext_compare.py LOGICAL BACK
"""

from __future__ import annotations

import sys

import numpy as np

from bridge.format import schema
from bridge.jaxside.presets.maxtext import TABLE
from bridge.store import open_checkpoint


def canonical(p: tuple[str, ...]) -> tuple[str, ...]:
    sp = schema.split_role(p)
    for leaf in TABLE if sp else ():
        if "/".join(sp[1]) in leaf.logical:
            return schema.role_path(sp[0], tuple(leaf.logical[0].split("/")))
    return p


def main() -> int:
    a, b = open_checkpoint(sys.argv[1]), open_checkpoint(sys.argv[2])
    moved = [p for p in a.paths() if p[0] in ("params", "opt_state") or p == schema.STEP_PATH]
    if sorted(canonical(p) for p in moved) != sorted(b.paths()):
        print("[compare] different array sets"); return 1
    bad = 0
    for p in moved:
        x, y = a.read(p), b.read(canonical(p))
        if not (x.dtype == y.dtype and x.shape == y.shape
                and np.array_equal(x.reshape(-1).view(np.uint8), y.reshape(-1).view(np.uint8))):
            print("[compare] differs:", "/".join(p)); bad += 1
    print(f"[compare] {len(moved) - bad}/{len(moved)} arrays bit-identical (masters, mu, nu, count, step)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
