"""The streamed MaxText moves hand their writers one options object (issue 32), as `convert` hands
its writers a `WriterJob` (tests/repo/test_one_name.py): no function of the chain `run_job` ->
`run_job_ranks` / `_run_parallel` -> a spawned writer -> `write_blocks` takes a chain of positional
arguments, the writers' part travels as one frozen `StreamWriterJob`, and the plan (pure) lives apart
from the I/O. What the writers write with it is checked elsewhere against independent references
(`test_maxtext_stream.py`: two writers vs the whole-array mapping; `test_maxtext_torchrun.py`)."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_the_writers_chain_takes_one_options_object():
    from bridge.jaxside.presets import maxtext_ranks, maxtext_stream
    from bridge.jaxside.presets.maxtext_job import StreamOutput, StreamWriterJob

    chain = [maxtext_stream.run_job, maxtext_stream._run_parallel, maxtext_stream._worker_main,
             maxtext_stream.write_blocks, maxtext_ranks.run_job_ranks]
    too_long = {f.__name__: len(inspect.signature(f).parameters) for f in chain
                if len(inspect.signature(f).parameters) > 5}
    assert too_long == {}
    for f in chain:
        hints = {p.annotation for p in inspect.signature(f).parameters.values()}
        assert "StreamWriterJob" in hints, f.__name__
    for cls in (StreamWriterJob, StreamOutput):
        assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen


@pytest.mark.parametrize("module", ["maxtext_job", "maxtext_plan"])
def test_the_plan_does_no_io(module):
    """The planning modules import no store I/O (reader, writer, claim, commit) and no processes."""
    tree = ast.parse((REPO / "bridge/jaxside/presets" / f"{module}.py").read_text())
    names = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    names |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    io = {"bridge.store.reader", "bridge.store.writer", "bridge.store.claim", "bridge.store.commit",
          "multiprocessing", "bridge.torchrun"}
    assert names & io == set()
