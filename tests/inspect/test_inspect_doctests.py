"""The worked examples in the inspection modules' docstrings (index math, formats) stay true."""

import doctest
import importlib

import pytest

MODULES = ["bridge.inspect.blocks", "bridge.inspect.stats", "bridge.inspect.diff", "bridge.inspect.format",
           "bridge.commands.inspect"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
