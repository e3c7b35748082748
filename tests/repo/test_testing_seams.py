"""Test seams stay out of the public API (issue 32): what tests and benchmarks vary goes through the one
private hook `bridge._testing`, set for a block, never through a public option or parameter."""

from __future__ import annotations

import dataclasses
import doctest
import inspect
import threading

import pytest

from bridge import _testing

SEAMS = {f.name for f in dataclasses.fields(_testing.Seams)}
# the seams' former public names too (`restore_remote(watch=)`)
FORMER = SEAMS | {"watch"}


def _parameters(obj) -> set[str]:
    target = obj.__init__ if inspect.isclass(obj) else obj
    try:
        return set(inspect.signature(target).parameters)
    except (TypeError, ValueError):
        return set()


def test_no_public_entry_point_takes_a_seam():
    """Every entry point of the facade, and the options dataclasses they take, have no parameter or
    field named like a seam."""
    pytest.importorskip("torch")
    pytest.importorskip("jax")
    import bridge
    from bridge.jaxside.restore_io import read_arrays
    from bridge.jaxside.save_io import write_tree
    from bridge.live.export import Exporter, ExportOptions

    offenders = {}
    entries = {n: getattr(bridge, n) for n in bridge.__all__ if callable(getattr(bridge, n, None))}
    entries.update({"read_arrays": read_arrays, "write_tree": write_tree,
                    "Exporter.export": Exporter.export, "Exporter.export_async": Exporter.export_async})
    for name, obj in entries.items():
        bad = _parameters(obj) & FORMER
        if dataclasses.is_dataclass(obj):
            bad |= {f.name for f in dataclasses.fields(obj)} & FORMER
        if bad:
            offenders[name] = sorted(bad)
    assert offenders == {}
    assert not {f.name for f in dataclasses.fields(ExportOptions)} & FORMER


def test_a_block_sets_seams_for_its_thread_only():
    seen = {}

    def other() -> None:
        seen["other"] = _testing.current().stage_all

    with _testing.seams(stage_all=True, target_data_file_size=1 << 20) as s:
        assert s == _testing.current() == _testing.Seams(stage_all=True, target_data_file_size=1 << 20)
        with _testing.seams(stage_all=False):
            assert _testing.current() == _testing.Seams(target_data_file_size=1 << 20)
        assert _testing.current().stage_all is True
        t = threading.Thread(target=other)
        t.start()
        t.join()
    assert seen == {"other": False}
    assert _testing.current() == _testing.Seams()
    with pytest.raises(TypeError):
        with _testing.seams(no_such_seam=1):
            pass


def test_docstring_examples():
    res = doctest.testmod(_testing)
    assert res.attempted > 0 and res.failed == 0
