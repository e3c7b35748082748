# Two entry points do all set-up on a fresh machine:
#   make demo   -> creates .venv, installs gtp-bridge with its extras, runs `gtp-bridge demo`
#   make test   -> same set-up, then the whole test suite (what CI runs)
#   make test-fast -> same set-up, then the fast tier: every test not marked `slow` (tests/README.md)
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

$(BIN)/gtp-bridge: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# Pin torch so pip takes the CPU build, not a multi-GB CUDA one.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[torch,jax,dev]'
	touch $@

install: $(BIN)/gtp-bridge

demo: install
	$(BIN)/gtp-bridge demo

test: install
	XLA_FLAGS=--xla_force_host_platform_device_count=8 $(BIN)/python -m pytest -q

test-fast: install
	XLA_FLAGS=--xla_force_host_platform_device_count=8 $(BIN)/python -m pytest -q -m "not slow"

.PHONY: install demo test test-fast
