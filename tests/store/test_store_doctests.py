"""The index-math examples in the store's docstrings are executed, so they stay true."""

import doctest
import importlib

import pytest

MODULES = ["bridge.layout.chunks", "bridge.format.tree", "bridge.store.specs", "bridge.store.plan", "bridge.store.claim",
           "bridge.format.manifest", "bridge.format.seal", "bridge.format.schema",
           "bridge.store.digest", "bridge.store.verify", "bridge.store.commit",
           "bridge.store.staging", "bridge.store.writer", "bridge.store.ranged", "bridge.store.sources", "bridge.dist"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0, f"{name} has no examples"
    assert result.failed == 0
