"""to-megatron on a full disk: one line that says "disk full" and names the file (issue 29 item 6).

Was "unexpected RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"
(torch's zip writer after a short write) or "[Errno 28] No space left on device (check the path and
permissions)". A real full file system: a tmpfs of a few hundred KiB (needs root to mount; skipped
otherwise), sizes chosen so that the writes fail in the `.distcp` files and in `.metadata`.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from bridge import cli
from converters.megatron.convert import ConvertOptions
from converters.megatron.convert_entry import convert

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "megatron" / "dp2" / "fully_reshardable"


@pytest.fixture(scope="module")
def logical(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("full") / "logical"
    convert(str(FIXTURE), str(d), ConvertOptions(workers=1))
    return d


@pytest.fixture
def tiny_fs(tmp_path):
    """Mount a tmpfs of the size asked for at tmp_path/fs; unmounted after the test."""
    mounted: list[Path] = []

    def mount(size_k: int) -> Path:
        p = tmp_path / f"fs{size_k}"
        p.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_k}k", "tmpfs", str(p)], capture_output=True)
        if r.returncode:
            pytest.skip(f"cannot mount a tmpfs here ({r.stderr.decode().strip()[:80]}): needs root")
        mounted.append(p)
        return p

    yield mount
    for p in mounted:
        subprocess.run(["umount", "-l", str(p)], check=False)   # lazy: a busy mount must not outlive the test


@pytest.mark.parametrize("size_k", [64, 128, 200, 384])
def test_full_disk_is_named_in_one_line_and_nothing_is_left(logical, tiny_fs, size_k, capsys):
    fs = tiny_fs(size_k)
    rc = cli.main(["to-megatron", "--no-scheduler", str(logical), str(fs / "run"), "--tp", "1", "--workers", "1"])
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert "disk full" in lines[0] and str(fs / "run") in lines[0], lines[0]
    assert list(fs.iterdir()) == []   # the partial output is removed
