"""The benchmarks' pure helpers (variant-name parsers, mode tables) keep their docstring examples."""

import doctest
import importlib.util
import os
import sys

import pytest

BENCH = os.path.join(os.path.dirname(__file__), "..", "benchmarks")


@pytest.mark.parametrize("name", ["bench_store_write", "bench_ocdbt_commits", "bench_jax_restore", "bench_many_arrays",
                                  "scale_synth"])
def test_doctests(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(BENCH, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    res = doctest.testmod(mod, optionflags=doctest.ELLIPSIS)
    assert res.attempted > 0 and res.failed == 0
