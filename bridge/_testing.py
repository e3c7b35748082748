"""The one private testing hook: what tests and benchmarks vary that users never set (issue 32).

Public signatures carry no test seams. A test or benchmark sets them for a block:

    >>> from bridge import _testing
    >>> with _testing.seams(stage_all=True):
    ...     _testing.current().stage_all
    True
    >>> _testing.current().stage_all
    False

The seams live in a `ContextVar`: a block sets them for its own thread (and the tasks it starts
with a copy of its context) only, and they are gone when it ends; nothing is patched
(tests/repo/test_no_global_patches.py). Product code reads them once, on the caller's thread, when a
call starts (`current()`), and passes them down with the call, so a background thread that call
starts sees the same ones. Not to be confused with `bridge.testing`, the test harness (a reference
trainer and scenarios), which product code never imports.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, replace
from typing import Callable, Iterator


@dataclass(frozen=True)
class Seams:
    """The seams, at their defaults (what every user run gets)."""

    # Live export: send CPU pieces through the staging buffers in one pass after the exchange, as
    # CUDA pieces go on a GPU machine (exercises that path on gloo).
    stage_all: bool = False
    # Live export, diagnostics: False lets TensorStore copy inner chunks itself (`CheckpointWriter(staging=False)`).
    writer_staging: bool = True
    # Live export, diagnostics: the OCDBT data file size (None: `bridge.store.specs.TARGET_DATA_FILE_SIZE`).
    target_data_file_size: int | None = None
    # Live export and the JAX save: the store writer class (None: `CheckpointWriter`;
    # a subclass that records or times its calls).
    writer_class: type | None = None
    # JAX restore (`bridge.jaxside.restore_io.read_arrays`): hears each block's
    # ("read", bytes) when its read starts and ("placed", bytes) once on its devices.
    restore_watch: Callable[[str, int], None] | None = None


_SEAMS: ContextVar[Seams] = ContextVar("gtp_bridge_test_seams", default=Seams())


def current() -> Seams:
    """The seams in force on this thread (the defaults outside a `seams` block)."""
    return _SEAMS.get()


@contextmanager
def seams(**changes) -> Iterator[Seams]:
    """Set some seams (named like `Seams`' fields) for the block; the earlier ones come back after it."""
    token = _SEAMS.set(replace(_SEAMS.get(), **changes))
    try:
        yield _SEAMS.get()
    finally:
        _SEAMS.reset(token)
