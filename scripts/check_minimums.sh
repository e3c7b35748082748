#!/usr/bin/env bash
# Check that the minimum versions declared in pyproject.toml really work: build a throw-away venv with
# every dependency of the core and of the [torch,jax] extras pinned to its declared minimum (">=X" -> "==X"),
# then run `gtp-bridge demo` and the fast tests that exercise each dependency.
#
#   scripts/check_minimums.sh                 # venv in /tmp/gtp-bridge-minimums (rebuilt)
#   VENV=/tmp/m PYTHON=python3.11 scripts/check_minimums.sh
#   KEEP_VENV=1 VENV=/tmp/m scripts/check_minimums.sh   # reuse an existing venv (pins are re-applied)
#
# Not part of `make test` (it downloads and installs a few GB: torch's minimum is a CUDA build).
# Found by bisecting with this script (older versions fail):
#   tensorstore 0.1.71 and 0.1.76 fail the demo (file_io_locking mode "non_atomic" is unknown there);
#   orbax-checkpoint before 0.11.26 lacks `use_compression` and StepMetadata.item_metadata (used by the JAX
#   side); 0.11.26-0.11.33 fail tests/store/test_store_orbax_compat.py or test_jax_saveback.py (None leaves, async
#   save), 0.11.34 imports flax; 0.11.35 passes. jax 0.7.0 fails the same tests (0.6.x too); 0.7.1 passes.
#   torch: to-megatron writes DCP `Metadata(version=...)`, a field torch gained in 2.9.0 (2.4.0 fails the
#   demo with "unexpected keyword argument 'version'"; 2.5-2.8 lack the field as well).
#   Verified set (Python 3.11): numpy 1.26.0, tensorstore 0.1.77, ml_dtypes 0.5.0, tqdm 4.60.0, torch 2.9.0,
#   jax 0.7.1, orbax-checkpoint 0.11.35, optax 0.2.3: the demo and these tests pass.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-/tmp/gtp-bridge-minimums}

pins=$("$PYTHON" - <<'PY'
import re, tomllib
p = tomllib.load(open("pyproject.toml", "rb"))["project"]
reqs = p["dependencies"] + p["optional-dependencies"]["torch"] + p["optional-dependencies"]["jax"]
pins = []
for r in reqs:
    m = re.fullmatch(r"\s*([A-Za-z0-9_.\-]+)\s*>=\s*([0-9.]+)\s*", r)
    if not m:
        raise SystemExit(f"pyproject requirement {r!r} is not NAME>=VERSION")
    pins.append(f"{m.group(1)}=={m.group(2)}")
    if m.group(1) == "jax":
        pins.append(f"jaxlib=={m.group(2)}")  # jax's matching jaxlib
print(" ".join(pins))
PY
)
echo "minimums: $pins"
if [ "${KEEP_VENV:-0}" != 1 ] || [ ! -x "$VENV/bin/python" ]; then
  rm -rf "$VENV"
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
fi
# shellcheck disable=SC2086
"$VENV/bin/pip" install -q --only-binary :all: $pins pytest pytest-timeout hypothesis packaging
export PYTHONPATH=$PWD  # this checkout's code, without installing it
"$VENV/bin/pip" list 2>/dev/null | grep -i -E "^(numpy|ml.dtypes|tensorstore|tqdm|torch|jax|jaxlib|orbax-checkpoint|optax) "

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
env -u XLA_FLAGS -u JAX_PLATFORMS "$VENV/bin/python" -m bridge.cli demo --workdir "$work/demo"  # = gtp-bridge demo
XLA_FLAGS=--xla_force_host_platform_device_count=8 "$VENV/bin/python" -m pytest -q -p no:cacheprovider \
  tests/store/test_store_orbax_compat.py tests/jaxside/test_jax_saveback.py tests/jaxside/test_jax_save_model.py \
  tests/jaxside/test_jax_optax.py tests/commands/test_cli_errors.py tests/commands/test_cli_flow.py tests/megatron/test_convert_dcp_reader.py
echo "minimum versions OK: $pins"
