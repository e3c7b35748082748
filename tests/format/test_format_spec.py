"""docs/format.md is enough to check a checkpoint without gtp-bridge: its checksum and digest
definitions, implemented here from the text alone (plain json / hashlib / numpy), agree with what
the store writes."""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np

from bridge.store import save_checkpoint

MASK64 = (1 << 64) - 1


def spec_digest(a: np.ndarray) -> str:
    """`gtpb-sum64-v2` as docs/format.md defines it, element by element."""
    a = np.ascontiguousarray(a)
    lane = 32 if a.dtype.itemsize <= 4 else 64
    k, m, s = (0x9E3779B9, 0x85EBCA6B, 15) if lane == 32 else (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 31)
    mask = (1 << lane) - 1
    bits = a.reshape(-1).view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])
    total = 0
    for i, b in enumerate(bits.tolist()):
        y = ((((i + 1) * k) & mask) ^ b) * m & mask
        total += y ^ (y >> s)
    return f"{total & MASK64:016x}"


def spec_checksum(metadata: dict) -> str:
    body = json.loads(json.dumps(metadata))
    body["custom_metadata"].pop("gtp_bridge_checksum")
    return "sha256-all:" + hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def test_checksum_and_digests_follow_the_written_spec(tmp_path):
    rng = np.random.default_rng(7)
    arrays = {("params", "w"): rng.standard_normal((6, 5)).astype(np.float32),
              ("params", "b"): rng.standard_normal(7),                      # float64: 64-bit lanes
              ("model", "w"): rng.integers(0, 255, (4, 3), dtype=np.uint8),
              ("opt_state", "0", "mu", "w"): rng.standard_normal((2, 3)).astype(np.float16)}
    arrays[("params", "w")][1, 2] = -0.0
    dst = str(tmp_path / "ck")
    save_checkpoint(dst, arrays, num_writers=2)

    meta = json.load(open(os.path.join(dst, "_METADATA")))
    custom = meta["custom_metadata"]
    assert custom["gtp_bridge_checksum"] == spec_checksum(meta)
    ckpt_meta = json.load(open(os.path.join(dst, "_CHECKPOINT_METADATA")))
    assert ckpt_meta["custom_metadata"]["gtp_bridge_checksum"] == custom["gtp_bridge_checksum"]

    manifest = custom["gtp_bridge"]
    assert manifest["format_version"] == 1 and manifest["digest_algorithm"] == "gtpb-sum64-v2"
    for path, a in arrays.items():
        rec = manifest["arrays"][".".join(path)]
        assert rec["shape"] == list(a.shape) and rec["dtype"] == a.dtype.name
        assert rec["digest"] == spec_digest(a), path
