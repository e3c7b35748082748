"""The layout modules' docstring examples are part of the contract: run them."""

import doctest
import importlib

import pytest

MODULES = ["boxes", "parallel", "params", "fused", "distopt", "rectangles", "assemble", "ownership", "bulk"]


@pytest.mark.parametrize("name", MODULES)
def test_doctests(name):
    mod = importlib.import_module(f"bridge.layout.{name}")
    res = doctest.testmod(mod, optionflags=doctest.ELLIPSIS)
    assert res.attempted > 0 and res.failed == 0
