"""`to_megatron`: the entry of `gtp-bridge to-megatron` and `bridge.to_megatron`.

It plans once (`write.torch_dist.plan_megatron`), then writes in this process
(`write.torch_dist.write_files`), or, under a torchrun launch of two or more processes, hands the
plan to `write.ranks` where every rank writes a share. The dispatch sits here, above both, so
neither imports the other's caller.
"""

from __future__ import annotations

import importlib
import threading

from bridge.progress import progress
from bridge.store import open_storage
from bridge.torchrun import launched_world
from converters.megatron.read.rundir import write_tracker
from converters.megatron.write.ranks import to_megatron_ranks
from converters.megatron.write.torch_dist import (MegatronTarget, OpenFile, plan_megatron, publish_iteration, take_back,
                                                  write_files)


def to_megatron(src: str, dst: str, target: MegatronTarget, *, budget: int | None = None, workers: int | None = None,
                weights_from_masters: bool = False, show_progress: bool | None = None,
                open_file: OpenFile | None = None) -> dict:
    """Write step N of logical checkpoint `src` for `target` as Megatron-LM's run directory layout.

    DST is the run directory or its `iter_<step, 7 digits>` (see `converters.megatron.read.rundir.plan_run_dir`); the
    iteration directory is written under a temporary name, renamed when complete, and only then
    is `latest_checkpointed_iteration.txt` set to N (atomically), so `--load RUN` finds it.
    Without `model` arrays (or with `weights_from_masters`) the weights are bf16(fp32 masters),
    rounded to nearest even as Megatron's optimizer does; otherwise each weight is checked to be that.
    `open_file` opens each worker's `.distcp` file (default `default_open_file`), e.g. one whose writes
    fail midway. Under torchrun every rank writes a share (`converters.megatron.write.ranks`).
    """
    mp = plan_megatron(src, dst, target, budget, workers, weights_from_masters)
    if launched_world() > 1:
        return to_megatron_ranks(mp, open_file, show_progress)
    where = mp.where
    created_run = open_storage(where.run_dir).make_dirs()   # taken back if empty after a failure
    published = False
    importer = _import_dcp_meanwhile()
    try:
        with mp.claim() as claim:
            index = mp.index()
            with progress(mp.total_bytes, f"to-megatron {where.iter_dir}", enabled=show_progress) as bar:
                written, stats, nbytes = write_files(mp, claim.tmp, open_file, 0, mp.jobs(), True, bar)
            index.written += written
            publish_iteration(claim, index)
            published = True
        write_tracker(where.run_dir, mp.step)  # only now: the iteration directory is complete
    except BaseException:
        take_back(mp, published, created_run)
        raise
    finally:
        if importer is not None:
            importer.join()
    return mp.result(nbytes, stats)



def _import_dcp_meanwhile() -> threading.Thread | None:
    """Import torch.distributed.checkpoint (needed only for the `.metadata` at the end; most of a
    second of CPU) on a thread while the arrays are read and written: `DcpIndex.encode`'s own import
    then finds it done, or waits on the import lock for the rest. An error is left for that import
    to raise. The caller joins the thread before returning (no import running at interpreter exit)."""
    import sys

    name = "torch.distributed.checkpoint.filesystem"
    if name in sys.modules:
        return None

    def load() -> None:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 (raised again, with its message, by encode's import)
            pass

    t = threading.Thread(target=load, name="to-megatron-import", daemon=True)
    t.start()
    return t
