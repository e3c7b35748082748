"""The benchmarks' pure helpers (variant-name parsers, mode tables) keep their docstring examples."""

import doctest
import importlib.util
import os
import sys

import pytest

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks")


@pytest.mark.parametrize("name", ["bench_store_write", "bench_ocdbt_commits", "bench_jax_restore", "bench_many_arrays",
                                  "bench_verify", "scale_synth", "bench_remote", "bench_remote_reads"])
def test_doctests(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(BENCH, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    old = sys.modules.get(name)
    sys.modules[name] = mod  # dataclasses look their module up there
    try:
        spec.loader.exec_module(mod)
        res = doctest.testmod(mod, optionflags=doctest.ELLIPSIS)
    finally:  # another test's import of the module stays the one registered
        if old is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = old
    assert res.attempted > 0 and res.failed == 0
