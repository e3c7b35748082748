"""MaxText's own learning-rate schedule, for tests/maxtext/test_maxtext_schedule.py (runs in MAXTEXT_PYTHON).

    python tests/support/maxtext_schedule_client.py CASES.json OUT.json

CASES.json: a list of {"settings": {MaxText key: value}, "steps": N, "counts": [c, ...]}. For each,
MaxText's `pyconfig.initialize` parses the settings as its command line would (base.yml, then
`key=value`, its validation included) and `maxtext_utils.create_learning_rate_schedule(config)` is
evaluated at the counts (the optimizer count optax hands the schedule). Imports nothing from gtp-bridge.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile


def main() -> None:
    from maxtext.configs import pyconfig
    from maxtext.utils import maxtext_utils

    cases = json.load(open(sys.argv[1]))
    base_yml = os.path.join(os.path.dirname(pyconfig.__file__), "base.yml")
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for case in cases:
            kv = dict(case["settings"], steps=case["steps"], hardware="cpu", skip_jax_distributed_system=True,
                      run_name="schedule", base_output_directory=tmp, enable_checkpointing=False)
            argv = [sys.argv[0], base_yml] + [f"{k}={json.dumps(v) if isinstance(v, bool) else v}"
                                              for k, v in kv.items()]
            config = pyconfig.initialize(argv)
            schedule = maxtext_utils.create_learning_rate_schedule(config)
            out.append([float(schedule(c)) for c in case["counts"]])
    json.dump(out, open(sys.argv[2], "w"))


if __name__ == "__main__":
    main()
