"""The user's round trip at its edges (issue 18 items 3-7): URLs, missing extras, versions, Orbax
CheckpointManager roots, `diff` output, the demo's temporary directory."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest

import bridge
from bridge.commands.demo import DEMO_SRC
from bridge.errors import BridgeError

REPO = Path(bridge.__file__).resolve().parent.parent  # the code under test (subprocesses import it too)


def cli(*argv, cwd=None, env=None, prelude=""):
    """Run `python -m bridge.cli ARGV` in a fresh process (after `prelude`, e.g. an import blocker)."""
    code = prelude + "\nimport sys\nfrom bridge.cli import main\nsys.exit(main(sys.argv[1:]))"
    e = dict(os.environ, PYTHONPATH=str(REPO), **(env or {}))
    return subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, cwd=cwd, env=e,
                          timeout=600)


def one_line_error(r, needle: str) -> None:
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gtp-bridge: error: "), r.stderr
    assert needle in lines[0], lines[0]


@pytest.fixture(scope="module")
def logical(tmp_path_factory):
    from converters.megatron.convert import ConvertOptions
    from converters.megatron.convert_entry import convert

    d = str(tmp_path_factory.mktemp("flow") / "logical")
    convert(str(DEMO_SRC), d, ConvertOptions(workers=1))
    return d


# --- item 3: an unknown URL scheme is refused in one line, never taken for a local path -----------------------
# (s3:// and gs:// are storage locations since issue 20: tests/*/test_remote_*.py)

@pytest.mark.parametrize("argv", [
    ["convert", str(DEMO_SRC), "hdfs://bucket/x"],
    ["convert", "az://bucket/megatron/iter_0000001", "out"],
    ["to-megatron", "--no-scheduler", "LOGICAL", "hdfs://bucket/megatron", "--tp", "1"],
    ["to-megatron", "--no-scheduler", "hdfs://bucket/logical", "out", "--tp", "1"],
    ["inspect", "az://bucket/ckpt"],
    ["verify", "az://bucket/ckpt"],
    ["diff", "LOGICAL", "hdfs://bucket/other"],
    ["demo", "--workdir", "hdfs://bucket/demo"],
])
def test_url_is_refused_in_one_line_and_nothing_is_written(argv, logical, tmp_path):
    argv = [logical if a == "LOGICAL" else a for a in argv]
    scheme = next(a for a in argv if "://" in a).split("://")[0]
    r = cli(*argv, cwd=tmp_path)
    one_line_error(r, f"unknown storage scheme {scheme}://; use a local path, s3:// or gs://")
    assert os.listdir(tmp_path) == []  # no ./hdfs:/bucket/x, no ./out


def test_python_entry_points_refuse_urls(logical, tmp_path, monkeypatch):
    from bridge.jaxside import restore, save
    from bridge.store.reader import open_checkpoint
    from bridge.store.verify import verify_checkpoint
    from converters.megatron.convert_entry import convert
    from converters.megatron.write.torch_dist import MegatronTarget
    from converters.megatron.write.to_megatron import to_megatron

    monkeypatch.chdir(tmp_path)
    calls = [lambda: convert(str(DEMO_SRC), "hdfs://b/x"), lambda: convert("az://b/x", "out"),
             lambda: to_megatron(logical, "hdfs://b/x", MegatronTarget(tp=1)),
             lambda: to_megatron("az://b/x", "out", MegatronTarget(tp=1)),
             lambda: open_checkpoint("az://b/x"), lambda: verify_checkpoint("hdfs://b/x"),
             lambda: restore("az://b/x"), lambda: save("hdfs://b/x", params={}, opt_state=None, step=0)]
    for call in calls:
        with pytest.raises(BridgeError, match=r"unknown storage scheme (hdfs|az)://"):
            call()
    assert os.listdir(tmp_path) == []


def test_live_entry_points_refuse_urls(tmp_path, monkeypatch):
    torch_dist = pytest.importorskip("torch.distributed")
    assert torch_dist is not None
    from bridge.live.export import export_state
    from bridge.live.reload import reload_state

    monkeypatch.chdir(tmp_path)
    for call in (lambda: export_state("hdfs://b/x", None, []), lambda: reload_state("az://b/x", None, [])):
        with pytest.raises(BridgeError, match="unknown storage scheme"):
            call()
    assert os.listdir(tmp_path) == []


def test_destination_that_is_not_utf8_is_one_line(tmp_path):
    """issue 17 item 10: a DST with invalid UTF-8 was 'unexpected RuntimeError'."""
    bad = os.fsencode(str(tmp_path)) + b"/out\xff\xfe"
    code = "import sys\nfrom bridge.cli import main\nsys.exit(main())"
    r = subprocess.run([sys.executable, "-c", code, "convert", str(DEMO_SRC), bad], capture_output=True,
                       env=dict(os.environ, PYTHONPATH=str(REPO)), timeout=600)
    r.stderr = r.stderr.decode("utf-8", "replace")
    one_line_error(r, "is not valid UTF-8")
    assert os.listdir(tmp_path) == []


# --- item 4: a missing optional dependency names the extra ---------------------------------------------------

def blocker(*modules: str) -> str:
    """Source that makes importing `modules` (and their submodules) fail as if they were not installed."""
    return f"""
import sys
class _Blocked:
    names = {modules!r}
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in self.names:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None
sys.meta_path.insert(0, _Blocked())
"""


@pytest.mark.parametrize("argv,blocked,needle", [
    (["to-megatron", "--no-scheduler", "LOGICAL", "OUT", "--tp", "1"], ("torch",),
     "to-megatron needs torch: pip install 'gtp-bridge[torch]'"),
    (["demo"], ("torch",), "demo needs torch: pip install 'gtp-bridge[torch]'"),
    (["demo"], ("jax", "jaxlib", "orbax", "optax"), "demo needs jax and orbax and optax: pip install 'gtp-bridge[jax]'"),
])
def test_missing_extra_is_named_in_one_line(argv, blocked, needle, logical, tmp_path):
    argv = [logical if a == "LOGICAL" else str(tmp_path / "out") if a == "OUT" else a for a in argv]
    r = cli(*argv, prelude=blocker(*blocked), env={"TMPDIR": str(tmp_path)})
    one_line_error(r, needle)
    assert os.listdir(tmp_path) == []


def test_missing_extra_in_python_entry_points(logical, tmp_path):
    code = blocker("jax", "jaxlib", "orbax", "optax", "torch") + f"""
from bridge.errors import BridgeError
try:
    from bridge.jaxside import restore
except ImportError as e:  # also a BridgeError
    assert isinstance(e, BridgeError), type(e)
    print("JAX:", e)
from converters.megatron.write.torch_dist import MegatronTarget
from converters.megatron.write.to_megatron import to_megatron
try:
    to_megatron({logical!r}, {str(tmp_path / 'out')!r}, MegatronTarget(tp=1))
except BridgeError as e:
    print("TO-MEGATRON:", e)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=str(REPO)), timeout=600)
    assert r.returncode == 0, r.stderr
    assert "JAX: bridge.jaxside (restore / save) needs jax and orbax and optax: pip install 'gtp-bridge[jax]'" in r.stdout
    assert "TO-MEGATRON: to-megatron needs torch: pip install 'gtp-bridge[torch]'" in r.stdout
    assert not (tmp_path / "out").exists()


def test_convert_runs_without_torch(logical, tmp_path):
    """convert reads torch_dist records without torch (converters.megatron.read.torch_archive): with torch not
    installed it still converts, and its output is the one a run with torch gives, array for array."""
    from bridge.store.reader import open_checkpoint

    out = tmp_path / "out"
    r = cli("convert", str(DEMO_SRC), str(out), "--workers", "1", prelude=blocker("torch"))
    assert r.returncode == 0, r.stderr
    got, want = open_checkpoint(str(out)).manifest.arrays, open_checkpoint(logical).manifest.arrays
    assert set(got) == set(want) and all(got[k].digest == want[k].digest for k in want)


# --- item 5: versions, --version, LICENSE, no unused dependency ---------------------------------------------

def _pyproject() -> dict:
    with open(REPO / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


def _minimums(reqs: list[str]) -> dict[str, str]:
    out = {}
    for r in reqs:
        m = re.fullmatch(r"([A-Za-z0-9_.\-]+)\s*>=\s*([0-9.]+)", r.strip())
        assert m, f"requirement {r!r} is not NAME>=VERSION"
        out[m.group(1).lower().replace("_", "-")] = m.group(2)
    return out


def test_version_flag_matches_the_package_metadata():
    r = cli("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"gtp-bridge {_pyproject()['project']['version']}"


def test_license_file_is_the_apache_license():
    text = (REPO / "LICENSE").read_text()
    assert _pyproject()["project"]["license"] == "Apache-2.0"
    assert text.lstrip().startswith("Apache License") and "Version 2.0, January 2004" in text
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text and "END OF TERMS AND CONDITIONS" in text


def test_declared_minimums_are_the_verified_ones():
    """scripts/check_minimums.sh installs exactly these minimums and runs the demo and tests on them;
    older tensorstore fails the demo (file_io_locking "non_atomic"), older orbax-checkpoint / jax fail
    the JAX tests (see the script)."""
    p = _pyproject()["project"]
    core = _minimums(p["dependencies"])
    extras = {k: _minimums(v) for k, v in p["optional-dependencies"].items() if k in ("torch", "jax")}
    script = (REPO / "scripts" / "check_minimums.sh").read_text()
    assert "pyproject.toml" in script and "bridge.cli demo" in script
    from packaging.version import Version

    assert Version(core["tensorstore"]) >= Version("0.1.77")
    assert Version(extras["jax"]["jax"]) >= Version("0.6.2")
    # rich only where it is used: the notebooks' jax.debug.visualize_array_sharding needs it
    assert "rich" not in json.dumps([p["dependencies"], p["optional-dependencies"]["torch"],
                                     p["optional-dependencies"]["jax"]])
    if "rich" in json.dumps(p["optional-dependencies"]["notebooks"]):
        assert any("visualize_array_sharding" in nb.read_text() for nb in REPO.glob("notebooks/*.ipynb"))
    for path in list(REPO.glob("bridge/**/*.py")) + list(REPO.glob("converters/*.py")):
        assert not re.search(r"^\s*(import|from) rich\b", path.read_text(), re.M), path


# --- item 6: Orbax CheckpointManager roots --------------------------------------------------------------

@pytest.mark.slow
def test_convert_into_an_orbax_manager_root_and_read_it_back(logical, tmp_path):
    import jax
    import orbax.checkpoint as ocp

    from bridge.jaxside import restore
    from bridge.jaxside.keypaths import leaves_by_path, nested_from_paths
    from bridge.store.reader import open_checkpoint

    root = tmp_path / "mgr"
    r = cli("convert", str(DEMO_SRC), str(root), "--orbax-step-dir", "--workers", "1")
    assert r.returncode == 0, r.stderr
    plain = open_checkpoint(logical)
    step = int(plain.read(("step",)))
    assert os.listdir(root) == [str(step)]
    assert sorted(os.listdir(root / str(step))) == ["_CHECKPOINT_METADATA", "default"]
    arrays = plain.arrays()
    mgr = ocp.CheckpointManager(str(root))
    assert mgr.latest_step() == step
    # what a JAX loop does: restore onto its own (here: one-device) shardings, through the manager
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = nested_from_paths({p: jax.ShapeDtypeStruct(tuple(a.shape), np.dtype(a.dtype), sharding=one)
                                  for p, a in arrays.items()})
    opt = abstract.pop("opt_state")
    abstract["opt_state"] = [opt["0"], None, None]  # optax.adamw state: (ScaleByAdamState, EmptyState, EmptyState)
    got = leaves_by_path(mgr.restore(step, args=ocp.args.PyTreeRestore(
        abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract))))
    got = {(p[0], str(p[1])) + p[2:] if p[0] == "opt_state" else p: v for p, v in got.items()}
    mgr.close()
    assert {p for p in got if got[p] is not None} == set(arrays)
    for p in arrays:
        want = plain.read(p)
        have = np.asarray(jax.device_get(got[p]))
        assert have.dtype == want.dtype, p
        assert np.array_equal(have.reshape(-1).view(np.uint8), want.reshape(-1).view(np.uint8)), p
    # every reader takes the root (and says which step) or the step directory
    r = cli("inspect", str(root), "--json")
    assert r.returncode == 0 and f"using its latest step {step}" in r.stderr, r.stderr
    assert cli("verify", str(root / str(step))).returncode == 0
    r = cli("verify", str(root))
    assert r.returncode == 0 and "OK" in r.stdout and f"latest step {step}" in r.stderr
    assert cli("to-megatron", "--no-scheduler", str(root), str(tmp_path / "mg"), "--tp", "2").returncode == 0
    rs = restore(str(root), items=("params",), mesh=jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("fsdp", "tp")))
    first = next(p for p in arrays if p[0] == "params")
    node = rs.params
    for k in first[1:]:
        node = node[k]
    assert np.array_equal(np.asarray(node), plain.read(first))
    # a second conversion of the same step is refused; the root keeps one step
    r = cli("convert", str(DEMO_SRC), str(root), "--orbax-step-dir", "--workers", "1")
    one_line_error(r, f"already has step {step}")
    assert os.listdir(root) == [str(step)]


# --- item 7: diff shows the differences and a summary; the demo cleans up -----------------------------------

def test_diff_lists_only_differing_arrays_and_a_summary(logical, tmp_path):
    from bridge.store.commit import save_checkpoint
    from bridge.store.reader import open_checkpoint

    ck = open_checkpoint(logical)
    arrays = {"/".join(p): ck.read(p) for p in ck.arrays()}
    changed = dict(arrays)
    name = next(n for n in arrays if n.startswith("params/") and arrays[n].size > 4)
    changed[name] = arrays[name].copy()
    changed[name].reshape(-1)[3] += 1.0
    save_checkpoint(str(tmp_path / "a"), arrays)
    save_checkpoint(str(tmp_path / "b"), changed)
    r = cli("diff", str(tmp_path / "a"), str(tmp_path / "b"))
    assert r.returncode == 1
    rows = [ln for ln in r.stdout.splitlines() if ln.startswith(("params/", "model/", "opt_state/", "step"))]
    assert [ln.split()[0] for ln in rows] == [name]
    assert f"{len(arrays)} arrays compared: {len(arrays) - 1} equal, 1 beyond tolerance" in r.stdout
    r_all = cli("diff", str(tmp_path / "a"), str(tmp_path / "b"), "--all")
    rows_all = [ln for ln in r_all.stdout.splitlines() if ln.startswith(("params/", "model/", "opt_state/", "step"))]
    assert r_all.returncode == 1 and len(rows_all) == len(arrays)
    same = cli("diff", str(tmp_path / "a"), str(tmp_path / "a"))
    assert same.returncode == 0 and "params/" not in same.stdout
    assert f"{len(arrays)} arrays compared: {len(arrays)} equal" in same.stdout


@pytest.mark.slow
def test_demo_without_workdir_leaves_nothing_behind(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env.update(TMPDIR=str(tmp_path), PYTHONPATH=str(REPO))
    r = subprocess.run([sys.executable, "-m", "bridge.cli", "demo"], capture_output=True, text=True, env=env,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "all checks passed" in r.stdout
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("module", ["bridge.location", "bridge.store.manager", "bridge.machine", "bridge.cast_check",
                                    "bridge.dtypes", "bridge.units"])
def test_docstring_examples(module):
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(module))
    assert result.attempted > 0 and result.failed == 0


@pytest.mark.parametrize("location,message", [
    ("s3://bucket/x", "remote storage (s3://)"), ("GS://bucket/x", "remote storage (gs://)"),
    ("hdfs://nn/x", "unknown storage scheme hdfs://"), ("file://host/x", "file:///path"),
    (b"/tmp/a\xff", "not valid UTF-8"), ("/tmp/a\udcff", "not valid UTF-8"), ("/tmp/a\x00b", "NUL byte"),
    ("", "empty"), (3, "must be a path"),
])
def test_local_path_refusals(location, message):
    from bridge.location import local_path

    with pytest.raises(BridgeError) as e:
        local_path(location)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_local_path_accepts_paths():
    from bridge.location import local_path

    assert local_path(Path("/tmp/x:y")) == "/tmp/x:y"     # a colon alone is a legal file name
    assert local_path(b"/tmp/caf\xc3\xa9") == "/tmp/café"
    assert local_path("file:///tmp/x") == "/tmp/x"
    assert local_path("c:/data") == "c:/data"              # no "//": not a URL
