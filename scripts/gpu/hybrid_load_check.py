"""GPU, one rank: `release_load_check.py` for the tiny hybrid model of a `make_fixtures.py` hybrid run.

    PYTHONPATH=/tmp/site python3 -m torch.distributed.run --standalone --nproc-per-node 1 \\
        scripts/gpu/hybrid_load_check.py --fixture-run hybrid --ckpt DIR --fmt dp_reshardable \\
        --ref REF.pt --run-json RUN.json --out OUT.json

The same checks as release_load_check.py (load DIR into a fresh model + optimizer as Megatron-LM does,
and with FusedAdam's step handling; compare every bf16 weight and every owned fp32 master / Adam
moment range with REF, the live dump of the run; two more steps against its `next_losses`), with
`tinyhybrid.build` (the hybrid run `--fixture-run` of make_fixtures.RUNS) as the model
(`--run` would be taken by torch.distributed.run as its own `--run-path`).
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests", "fixtures", "megatron"))


def main() -> None:
    """Swap the model builder, then run release_load_check's main on the remaining arguments."""
    i = sys.argv.index("--fixture-run")
    name = sys.argv[i + 1]
    del sys.argv[i : i + 2]
    import make_fixtures
    import release_load_check
    import tinygpt
    import tinyhybrid

    tinygpt.build = lambda run: tinyhybrid.build(dict(make_fixtures.RUNS[name]))
    release_load_check.main()


if __name__ == "__main__":
    main()
