"""`verify`'s read-and-digest pipeline does not serialize on the GIL (issue 16: on a 16-core host it ran
at about one core's rate, warm cache as slow as cold).

- TensorStore releases the numpy buffer a read wrote into only on a Python thread: were a read the
  last holder of its TensorStore wrapper, a TensorStore worker would take the GIL to drop the numpy
  array, stalling behind every thread that digests.
- The digest in large steps gives the same value as in small ones (an independent per-element
  reference of the mix decides), so verify may use few, large steps (few GIL round trips).
"""

import threading
import weakref

import numpy as np
import pytest

from bridge.layout.boxes import Box
from bridge.store import digest as dg

from test_verify_reads import _save


def _reference_digest(global_shape, box, data) -> int:
    """digest = sum over elements of mix(flat index, bits), element by element in Python integers."""
    bits = data.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[data.itemsize]) if data.dtype.kind != "u" else data
    lane = 64 if data.itemsize == 8 else 32
    m = (1 << lane) - 1
    k_index, k_mul, shift = ((0x9E3779B9, 0x85EBCA6B, 15) if lane == 32 else
                             (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 31))
    strides = [int(np.prod(global_shape[k + 1:])) for k in range(len(global_shape))]
    total = 0
    for local in np.ndindex(*box.shape):
        idx = sum((box.start[k] + local[k]) * strides[k] for k in range(len(strides)))
        y = ((((idx + 1) * k_index) & m) ^ int(bits[local])) * k_mul & m
        total += y ^ (y >> shift)
    return total & ((1 << 64) - 1)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.uint16])
def test_digest_is_the_same_for_every_step(dtype):
    rng = np.random.default_rng(5)
    shape = (3, 10, 12)
    a = (rng.standard_normal(shape) * 1000).astype(dtype)
    box = Box((1, 2, 0), (3, 9, 12))
    part = a[box.slices]
    want = _reference_digest(shape, box, part)
    for step in (1, 5, 12, 13, 100, 1 << 16, 1 << 20):  # rows longer than a step and steps of many rows
        assert dg.digest_box(shape, box, part, step=step) == want, step


def test_tensorstore_never_takes_the_gil_to_release_a_read_buffer(tmp_path, monkeypatch):
    """Every array TensorStore wraps for a read is released on a Python thread (main or a verify
    worker), never on one of TensorStore's own threads (a `_DummyThread` to Python)."""
    import tensorstore as ts

    from bridge.store.verify import verify_checkpoint

    rng = np.random.default_rng(3)
    arrays = {("params", f"w{i}"): rng.standard_normal((8, 64, 64)).astype(np.float32) for i in range(3)}
    dst = _save(str(tmp_path / "ck"), arrays, {p: (1, 64, 64) for p in arrays}, {p: 0 for p in arrays})
    released_on: list = []
    real_array = ts.array

    def array(data, *args, **kw):
        view = data.view()  # held by TensorStore's wrapper alone: finalized where TensorStore drops it
        weakref.finalize(view, lambda: released_on.append(threading.current_thread()))
        return real_array(view, *args, **kw)

    monkeypatch.setattr(ts, "array", array)
    res = verify_checkpoint(dst, threads=4, block_bytes=32 << 10)   # 2 layers a block: 12 blocks
    assert res.ok, res
    assert len(released_on) == 12
    foreign = [t.name for t in released_on if isinstance(t, threading._DummyThread)]
    assert not foreign, f"{len(foreign)} of 12 read buffers released on TensorStore threads"


def test_reads_only_verify_reads_every_byte_and_skips_only_the_digest(tmp_path):
    """`digests=False` (the reads-only diagnostic) reads the same bytes and still reports a missing
    array; only the content comparison is skipped, which the default run makes (a flipped digest)."""
    import json

    from bridge.store.verify import verify_checkpoint

    rng = np.random.default_rng(5)
    arrays = {("params", f"w{i}"): rng.standard_normal((4, 64, 64)).astype(np.float32) for i in range(2)}
    dst = _save(str(tmp_path / "ck"), arrays, {p: (1, 64, 64) for p in arrays}, {p: 0 for p in arrays})
    full, reads = verify_checkpoint(dst), verify_checkpoint(dst, digests=False)
    assert full.ok and reads.ok
    assert reads.bytes_read == full.bytes_read == sum(a.nbytes for a in arrays.values())
    # a wrong recorded digest: the default run reports it, the reads-only run by design does not
    meta = tmp_path / "ck" / "_METADATA"
    doc = json.loads(meta.read_text())
    rec = doc["custom_metadata"]["gtp_bridge"]["arrays"]["params.w0"]
    rec["digest"] = "0" * len(rec["digest"])
    meta.write_text(json.dumps(doc))
    edited, edited_reads = verify_checkpoint(dst), verify_checkpoint(dst, digests=False)
    assert "content digest" in edited.damaged.get("params/w0", ""), edited.damaged
    assert edited_reads.metadata_problems and not edited_reads.damaged
