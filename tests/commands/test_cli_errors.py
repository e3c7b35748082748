"""The command line's contract: one-line errors with exit 2, --debug tracebacks, examples in --help."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from bridge import cli
from inspect_fixtures import run_cli, save_plain_orbax


def _one_error_line(r) -> str:
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    assert "Traceback" not in r.stderr
    return lines[0]


@pytest.fixture(scope="module")
def ck(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("cli") / "ck")
    save_plain_orbax(path, {"params": {"w": np.ones((4, 4), np.float32)}})
    return path


@pytest.mark.parametrize("argv, needle", [
    (["inspect", "/nonexistent/ckpt"], "not a directory"),
    (["inspect"], "required: DIR"),
    (["inspect", "--bogus", "x"], "unrecognized arguments"),
    (["frobnicate"], "invalid choice"),
    (["diff", "/nonexistent/a", "/nonexistent/b"], "not a directory"),
])
def test_bad_usage_is_one_line_exit_2(argv, needle):
    r = run_cli(*argv)
    assert r.returncode == 2
    line = _one_error_line(r)
    assert line.startswith("gtp-bridge") and "error:" in line and needle in line


def test_bad_input_one_line_exit_2_and_debug_traceback(tmp_path, ck):
    not_ck = tmp_path / "empty"
    not_ck.mkdir()
    r = run_cli("inspect", str(not_ck))
    assert r.returncode == 2 and "_METADATA" in _one_error_line(r)
    r = run_cli("inspect", ck, "--stats", "--budget", "lots")
    assert r.returncode == 2 and "256M" in _one_error_line(r)  # says how to write it
    r = run_cli("diff", ck, ck, "--ulp", "-1")
    assert r.returncode == 2 and "--ulp" in _one_error_line(r)
    # a Megatron torch_dist checkpoint: says to convert it first
    dcp = tmp_path / "iter_0000003"
    dcp.mkdir()
    (dcp / ".metadata").write_bytes(b"\x80\x04N.")
    r = run_cli("inspect", str(dcp))
    assert r.returncode == 2 and "gtp-bridge convert" in _one_error_line(r)
    # damaged metadata: still one line
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "_METADATA").write_text("{not json")
    r = run_cli("inspect", str(bad))
    assert r.returncode in (1, 2) and "_METADATA" in _one_error_line(r)
    # --debug, before or after the command, shows the traceback instead
    for argv in (["--debug", "inspect", str(not_ck)], ["inspect", str(not_ck), "--debug"]):
        r = run_cli(*argv)
        assert r.returncode != 0 and "Traceback" in r.stderr and "BridgeError" in r.stderr


def test_unexpected_exception_is_one_line_unless_debug(capsys):
    def boom(args):
        raise ValueError("synthetic failure\nsecond line")

    parser = cli.build_parser()
    parser._subparsers._group_actions[0].choices["inspect"].set_defaults(func=boom)
    assert cli.run(lambda: parser, ["inspect", "x"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unexpected ValueError: synthetic failure" in err and "--debug" in err
    with pytest.raises(ValueError):
        cli.run(lambda: parser, ["--debug", "inspect", "x"])


def test_help_shows_an_example_for_every_command():
    r = run_cli("--help")
    assert r.returncode == 0
    parser = cli.build_parser()
    commands = list(parser._subparsers._group_actions[0].choices)
    assert {"inspect", "diff"} <= set(commands)
    examples = r.stdout.split("examples:", 1)[1]
    for name in commands:
        assert f"gtp-bridge {name} " in examples, name
    for name in ("inspect", "diff"):
        sub = run_cli(name, "--help")
        assert sub.returncode == 0 and sub.stdout.count(f"gtp-bridge {name} ") >= 2


def test_piped_output_is_plain(ck):
    r = run_cli("inspect", ck, "--stats")
    assert r.returncode == 0 and r.stderr == ""  # no progress bar on a pipe
    assert r.stdout.splitlines()[0].startswith(ck) and "params/w" in r.stdout
    rep = json.loads(run_cli("inspect", ck, "--json").stdout)
    assert [a["name"] for a in rep["arrays"]] == ["params/w"]


def test_progress_bar_only_on_a_terminal(ck):
    import pty
    import subprocess
    import sys

    from inspect_fixtures import REPO

    import threading

    import fcntl
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a 100-column terminal
    env = dict(os.environ, PYTHONPATH=REPO)
    chunks: list[bytes] = []

    def drain():  # read the terminal while the child runs (a closed pty drops unread data)
        try:
            while chunk := os.read(master, 65536):
                chunks.append(chunk)
        except OSError:  # EIO once the child side is closed
            pass

    reader = threading.Thread(target=drain)
    reader.start()
    p = subprocess.run([sys.executable, "-m", "bridge.cli", "inspect", ck, "--stats"], stdout=subprocess.PIPE,
                       stderr=slave, cwd=REPO, env=env, timeout=120)
    os.close(slave)
    reader.join(timeout=10)
    os.close(master)
    err = b"".join(chunks)
    assert p.returncode == 0
    assert b"stats" in err  # tqdm bar drawn on the terminal
    assert b"stats" not in p.stdout.split(b"\n", 1)[0] and b"params/w" in p.stdout


def test_damaged_array_is_named_exit_1(tmp_path):
    path = tmp_path / "ck"
    save_plain_orbax(str(path), {"params": {"w": np.ones((8, 8), np.float32), "v": np.ones(4, np.float32)}},
                     use_ocdbt=False, chunk_byte_size=64)
    chunks = sorted(p for p in (path / "params.w").rglob("*") if p.is_file() and p.name != "zarr.json")
    assert chunks
    chunks[0].unlink()  # a lost chunk file
    r = run_cli("inspect", str(path), "--stats")
    assert r.returncode == 1
    line = _one_error_line(r)
    assert "params/w" in line and "failed" in line
    r = run_cli("diff", str(path), str(path))
    assert r.returncode == 1 and "params/w" in _one_error_line(r)
