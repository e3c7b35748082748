"""Remote ranged reads return exactly the bytes asked for (issue 29, item 1).

- `RangeReader` over an object on S3 and GCS, reads of every size class (below, inside and above the
  read-ahead window, across and past the object's end) in an order that leaves every window state
  behind, against the bytes themselves.
- Real Megatron-Core saves uploaded to the local servers (megatron-core 0.14.0 fully_sharded_bucket_space,
  0.19.2 dp_zero_gather_scatter: records below, inside and above the window), converted at the default
  budget and at one whose share is smaller than the largest records (read by byte ranges): equal
  array for array, bit for bit, to the conversion of the local copy.
- The README's S3 round trip, its commands run as written, on a synthetic save with records of every
  size class.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "support"))  # tests/support: shared helpers
from servers import remote_servers  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "megatron"
KIB = 1 << 10
SMALL_BUDGET = 64 * KIB
READ_AHEAD = 64 * KIB   # the reader's read-ahead window (bridge.store.ranged.READ_AHEAD; checked below)


@pytest.fixture(scope="module")
def stores():
    with remote_servers() as servers:
        yield servers


def upload(srv, scheme: str, local: Path, key: str) -> None:
    """Every file of `local` under `key`, through the bridge's own whole-object writes (any scheme)."""
    from bridge.store import kvstore

    for f in sorted(local.iterdir()):
        kvstore.write_bytes(srv.url(key), f.name, f.read_bytes())


def same_arrays(a_loc: str, b_loc: str) -> int:
    """Every array of checkpoint `a_loc` equals `b_loc`'s bit for bit (NaN payloads included); how many."""
    from bridge.store.reader import open_checkpoint

    a, b = open_checkpoint(a_loc), open_checkpoint(b_loc)
    assert a.paths() == b.paths()
    for p in a.paths():
        x, y = np.asarray(a.read(p)), np.asarray(b.read(p))
        assert x.dtype == y.dtype and x.shape == y.shape, p
        assert x.tobytes() == y.tobytes(), p
    return len(a.paths())


# ---------------------------------------------------------------------------------------------
# The reader itself

@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["s3", "gs"])
def test_every_read_returns_exactly_the_bytes_asked_for(stores, scheme):
    from bridge.store.ranged import open_range

    srv = stores[scheme]
    size = 5 * READ_AHEAD + 12_345
    data = np.random.default_rng(7).integers(0, 256, size, dtype=np.uint8).tobytes()
    from bridge.store import kvstore

    kvstore.write_bytes(srv.url("ranged/unit"), "obj", data)
    w = READ_AHEAD
    sizes = [1, 7, w // 2 - 1, w // 2, w // 2 + 1, 34_345, w - 1, w, w + 1, 3 * w + 5]
    reads = []
    for n in sizes:
        for off in (0, 138_527 % size, size // 2, size - n - 1, size - n, size - n // 2, size - 1, size, size + 9):
            reads.append((n, max(0, off)))
    with open_range(srv.url("ranged/unit/obj")) as r:  # one reader: each read meets the window the last left
        for n, off in reads:
            assert r.pread(n, off) == data[off:off + n], (n, off)
        for n, off in reversed(reads):
            buf = bytearray(n)
            got = r.readinto(buf, off)
            assert got == len(data[off:off + n]) and buf[:got] == data[off:off + n], (n, off)
    for n, off in reads[::5]:  # and each on a fresh reader (no window yet)
        with open_range(srv.url("ranged/unit/obj")) as r:
            assert r.pread(n, off) == data[off:off + n], (n, off)


# ---------------------------------------------------------------------------------------------
# Real saves on object storage

REAL = [("release_0_14_0_bucket_space", "fully_sharded_bucket_space"), ("release_0_19_2", "dp_zero_gather_scatter")]


@pytest.fixture(scope="module")
def local_conversions(tmp_path_factory):
    from converters.megatron.convert import ConvertOptions
    from converters.megatron.convert_entry import convert

    out = {}
    for run, fmt in REAL:
        d = tmp_path_factory.mktemp("local") / run
        convert(str(FIXTURES / run / fmt), str(d), ConvertOptions(workers=1, show_progress=False))
        out[run] = str(d)
    return out


def test_real_saves_have_records_of_every_size_class():
    """What the conversions below exercise: records below, inside and above the read-ahead window,
    and larger than the small budget's cache share (read by byte ranges)."""
    from bridge.store import ranged
    from bridge.budget import split_share
    from converters.megatron.read.dcp import DcpCheckpoint

    assert ranged.READ_AHEAD == READ_AHEAD
    lengths = [r.length for run, fmt in REAL for r in DcpCheckpoint(FIXTURES / run / fmt).all_refs()]
    assert any(n < READ_AHEAD // 2 for n in lengths)
    assert any(READ_AHEAD // 2 < n < READ_AHEAD for n in lengths)      # the reads that came back short
    assert any(n > READ_AHEAD for n in lengths)
    assert any(n > split_share(SMALL_BUDGET).cache for n in lengths)


@pytest.mark.parametrize("scheme,budget", [("s3", None), ("gs", None), ("gs", SMALL_BUDGET),
                                           pytest.param("s3", SMALL_BUDGET, marks=pytest.mark.slow)],
                         ids=["s3-default-budget", "gs-default-budget", "gs-64k-budget", "s3-64k-budget"])
@pytest.mark.slow
@pytest.mark.parametrize("run,fmt", REAL, ids=[r for r, _ in REAL])
def test_real_save_on_object_storage_converts_as_the_local_copy(stores, local_conversions, scheme, budget, run, fmt):
    from converters.megatron.convert import ConvertOptions
    from converters.megatron.convert_entry import convert

    srv = stores[scheme]
    key = f"ranged/{run}/{budget}"
    upload(srv, scheme, FIXTURES / run / fmt, f"{key}/src")
    opts = ConvertOptions(workers=1, show_progress=False, **({"budget": budget} if budget else {}))
    got = convert(srv.url(f"{key}/src"), srv.url(f"{key}/out"), opts)
    assert got.source_format == fmt
    assert same_arrays(local_conversions[run], srv.url(f"{key}/out")) > 20


# ---------------------------------------------------------------------------------------------
# The README's round trip

def readme_object_storage_commands() -> list[list[str]]:
    """The `gtp-bridge` lines of the README's first bash block under "Object storage", split."""
    text = (REPO / "README.md").read_text()
    section = text[text.index("## Object storage"):]
    block = section[section.index("```bash") + len("```bash"):]
    block = block[:block.index("```")]
    return [ln.split()[1:] for ln in block.splitlines() if ln.startswith("gtp-bridge ")]


TRAINING_LOOP_ARGS = {"lr": 3e-4, "min_lr": 3e-5, "lr_decay_style": "cosine", "train_iters": 100, "global_batch_size": 4,
                      "lr_warmup_iters": 0, "weight_decay": 0.1}
TRAINING_LOOP_SCHEDULER = {"max_lr": 3e-4, "min_lr": 3e-5, "lr_warmup_steps": 0, "num_steps": 12, "lr_decay_style": "cosine",
                           "lr_decay_steps": 400, "start_wd": 0.1, "end_wd": 0.1, "wd_incr_style": "constant",
                           "wd_incr_steps": 400}


@pytest.mark.slow
def test_readme_s3_round_trip_runs_as_written(stores, tmp_path, capfd):
    """A Megatron run on S3 (tracker + iteration; a synthetic save with records below, inside and
    above the read-ahead window, 4 query groups so --tp 4 is a valid layout): the README's commands,
    as written, in a bucket `ckpts`; the logical checkpoint equals the local conversion, and the one
    converted back from the --tp 4 run equals it too."""
    import convert_synth as synth

    from bridge.cli import main
    from converters.megatron.convert import ConvertOptions
    from converters.megatron.convert_entry import convert
    from converters.megatron.read.dcp import DcpCheckpoint

    cmds = readme_object_storage_commands()
    assert [c[0] for c in cmds] == ["convert", "verify", "to-megatron", "convert"], cmds
    src = tmp_path / "src"
    with synth.dims(L=2, H=64, NQ=8, NG=4, HD=8, F=160, V=256):
        # a training-loop save records its LR scheduler, which to-megatron carries (iteration 3 x 4 samples)
        synth.make_checkpoint(str(src), "dp_reshardable", extra_args=TRAINING_LOOP_ARGS, scheduler=TRAINING_LOOP_SCHEDULER)
    lengths = [r.length for r in DcpCheckpoint(src).all_refs()]
    assert min(lengths) < READ_AHEAD // 2 < max(n for n in lengths if n < READ_AHEAD) and max(lengths) > READ_AHEAD
    convert(str(src), str(tmp_path / "local"), ConvertOptions(workers=1, show_progress=False))

    s3 = stores["s3"]
    c = s3.client()
    c.create_bucket(Bucket="ckpts")
    run = re.match(r"s3://ckpts/(.+)", cmds[0][1]).group(1)     # the README's Megatron run prefix
    for f in src.iterdir():
        c.upload_file(str(f), "ckpts", f"{run}/iter_0000003/{f.name}")
    c.put_object(Bucket="ckpts", Key=f"{run}/latest_checkpointed_iteration.txt", Body=b"3")
    for argv in cmds:
        capfd.readouterr()
        assert main(argv) == 0, (argv, capfd.readouterr())
    logical, back = cmds[0][2], cmds[3][2]
    assert same_arrays(str(tmp_path / "local"), logical) > 50
    assert same_arrays(logical, back) > 50
