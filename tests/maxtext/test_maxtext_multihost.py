"""A to-maxtext checkpoint restores in MaxText under `jax.distributed` as in one process (issue #31).

`to-maxtext` (streamed) writes the llama fixture (tests/fixtures/maxtext/llama/live). MaxText's own trainer
setup restores it (tests/support/maxtext_multihost_client.py: `train_utils.setup_train_loop`, whose restore is
`checkpointing.load_state_if_possible` through Orbax's training Checkpointer) twice: in two CPU processes
joined by `jax.distributed.initialize` on localhost, 2 devices each, MaxText's mesh spanning all 4 (the
arrays it shards are split across both processes), and in one process with 4 devices. Every array of the
restored train state, gathered, is bit-equal between the two; the step is ours (3); and the restored
masters equal what to-maxtext wrote, read with plain TensorStore. Needs MAXTEXT_PYTHON (skipped otherwise).
The train loop itself is not run multi-process here: its restore is what a multi-host run shares.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess

import numpy as np
import pytest

from test_maxtext_command import _maxtext_ok, to_maxtext

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/
CLIENT = os.path.join(HERE, "support", "maxtext_multihost_client.py")
PY = os.environ.get("MAXTEXT_PYTHON", "")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def restore(tmp_path, overrides: dict, processes: int, devices_each: int, tag: str) -> tuple[dict, dict]:
    """MaxText's restore of tmp/mt/myrun/checkpoints in `processes` processes: (arrays, report)."""
    ov = tmp_path / "overrides.json"
    ov.write_text(json.dumps(overrides))
    out = str(tmp_path / f"{tag}.npz")
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XLA_FLAGS")}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices_each}")
    procs = [subprocess.Popen([PY, CLIENT, "--process-id", str(i), "--num-processes", str(processes), "--port",
                               str(port), "--base-dir", str(tmp_path / "mt"), "--run", "myrun", "--overrides", str(ov),
                               "--out", out], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                              cwd=str(tmp_path)) for i in range(processes)]
    logs = [p.communicate(timeout=900)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n----\n".join(log[-3000:] for log in logs)
    reports = [json.load(open(f"{out}.{i}.json")) for i in range(processes)]
    arrays: dict[str, np.ndarray] = {}
    covered: dict[str, np.ndarray] = {}
    held: dict[str, list[set]] = {}     # per array, the boxes each process holds
    for i in range(processes):
        with np.load(f"{out}.{i}.npz") as z:
            for key in z.files:
                name, where = key.rsplit("@", 1)
                shape = reports[i]["shapes"][name]
                if name not in arrays:
                    arrays[name] = np.zeros(shape, z[key].dtype)
                    covered[name] = np.zeros(shape, bool)
                box = tuple(slice(*map(int, r.split(":"))) for r in where.split(",")) if where else ()
                arrays[name][box] = z[key]
                covered[name][box] = True
                held.setdefault(name, [set() for _ in range(processes)])[i].add(where)
    holes = [n for n, c in covered.items() if not c.all()]
    assert not holes, holes[:3]          # the processes' shards tile every array
    split = sorted(n for n, boxes in held.items() if not all(b == boxes[0] for b in boxes))
    return arrays, dict(reports[0], split=split)


@pytest.mark.slow
@pytest.mark.skipif(not _maxtext_ok(), reason="needs MAXTEXT_PYTHON: a Python 3.12 env with maxtext 0.2.5")
def test_two_process_restore_equals_one_process_restore(tmp_path):
    from test_maxtext_preset import _plain_read

    to_maxtext(tmp_path, "mt/myrun/checkpoints", "--overrides-json", "ov.json")
    overrides = json.load(open(tmp_path / "ov.json"))
    multi, mrep = restore(tmp_path, overrides, 2, 2, "multi")
    single, srep = restore(tmp_path, overrides, 1, 4, "single")
    assert (mrep["processes"], mrep["devices"], srep["processes"], srep["devices"]) == (2, 4, 1, 4)
    assert mrep["step"] == srep["step"] == 3
    spanning = [k for k, v in mrep["spans"].items() if v]
    assert len(spanning) == len(multi), mrep["spans"]    # every array lives on the mesh of both processes
    assert len(mrep["split"]) >= 10, mrep["split"]       # and most are split: each process holds other parts
    assert set(multi) == set(single)
    differ = [k for k in multi if multi[k].dtype != single[k].dtype or not np.array_equal(multi[k], single[k])]
    assert not differ, differ[:5]
    # and it is our state, not an initialisation: the stored masters come back
    written = _plain_read(str(tmp_path / "mt" / "myrun" / "checkpoints" / "2" / "items"))
    norm = written["params/params/decoder/decoder_norm/scale"]
    restored = [k for k in multi if "decoder_norm" in k and "model" in k and multi[k].shape == norm.shape]
    assert restored and all(np.array_equal(multi[k], norm) for k in restored), restored
    print(f"{len(multi)} arrays bit-equal; all on a mesh spanning both processes, {len(mrep['split'])} of them "
          f"split between the processes")
