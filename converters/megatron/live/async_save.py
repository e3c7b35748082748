"""A Megatron-LM training loop's asynchronous checkpoint, written by the live exporter.

Drop-in for `save_checkpoint(iteration, model, optimizer, ...)` with `--async-save` and its
`maybe_finalize_async_save(blocking=...)` (megatron/training/async_utils.py), called the same way:

    saver = AsyncSave(args.save)                       # once, after the model and optimizer exist
    for iteration in range(start, args.train_iters):
        saver.maybe_finalize()                         # at each step's start, as Megatron does
        train_step(...)
        if iteration % args.save_interval == 0:
            saver.save(iteration, model, optimizer)    # blocks ~ the device -> host copy, returns
    saver.maybe_finalize(blocking=True)                # before destroy_process_group

Each save writes the logical checkpoint `<save>/iter_<iteration, 7 digits>/` (loadable by
`load_megatron` at any layout, `gtp-bridge to-megatron`, Orbax); when it commits, rank 0 sets
`<save>/latest_checkpointed_iteration.txt` to it (written in the commit, so the tracker never names
a checkpoint that is not complete, even if training dies before the next finalize). A failure of
the background part is raised by the next `maybe_finalize` (once the export finished) or `save`,
on every rank, naming the rank that failed.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from bridge.dist import TorchCoordinator
from bridge.store import open_storage
from converters.megatron.read.rundir import plan_run_dir, write_tracker


class AsyncSave:
    """Asynchronous checkpoints of one run into Megatron-LM's run directory `save_dir` (see the module).

    `options` (`bridge.live.export.ExportOptions`, e.g. `staging_bytes` to bound the pinned
    staging memory), `group` and the adapter's keywords (`metadata`, `dims`, `pad_for_alignment`,
    `extra`) as `export_megatron`'s. One `Exporter` is kept: plans and pinned slots are reused.
    """

    def __init__(self, save_dir: str, *, options: Any = None, group: Any = None, **adapter: Any) -> None:
        from bridge.live.export import Exporter

        self.save_dir = save_dir
        self.options = options
        self.group = group
        self.adapter = adapter
        self.exporter = Exporter()
        self.pending: tuple[int, Any] | None = None   # (iteration, ExportHandle) in flight
        self.last_saved: int | None = None

    def save(self, iteration: int, model: Any, optimizer: Any) -> Any:
        """Start the checkpoint of `iteration` (collective); returns its `ExportHandle`.

        Finalizes the previous one first (waiting for it if it still runs; its failure is raised).
        """
        from converters.megatron.live.adapter import export_megatron_async

        return self._start(iteration, lambda dst, on_commit: export_megatron_async(
            dst, model, optimizer, self.options, exporter=self.exporter, on_commit=on_commit, group=self.group,
            **self.adapter))

    def save_state(self, iteration: int, run: Any, params: Sequence[Any]) -> Any:
        """`save` for a run already described as `LiveRun` + `LocalParam`s (another trainer, tests)."""
        return self._start(iteration, lambda dst, on_commit: self.exporter.export_async(
            dst, run, params, self.options, on_commit=on_commit))

    def maybe_finalize(self, blocking: bool = False) -> int | None:
        """Finish the checkpoint in flight if it is done (or wait for it with `blocking`); returns its
        iteration, or None when none finished now. Raises its failure, on every rank."""
        if self.pending is None:
            return None
        iteration, handle = self.pending
        if not blocking and not handle.done():
            return None
        self.pending = None
        self.exporter.settle()   # the handle's outcome: the same on every rank
        self.last_saved = iteration
        return iteration

    def _start(self, iteration: int, export: Callable[[str, Callable[[str], None]], Any]) -> Any:
        import torch.distributed as dist

        self.maybe_finalize(blocking=True)
        coord = TorchCoordinator(self.group if self.group is not None else dist.group.WORLD,
                                 job=f"checkpoint of iteration {iteration}")
        run_dir = self.save_dir

        def target() -> str:  # rank 0 checks the run directory (and creates it); every rank gets the path
            t = plan_run_dir(run_dir, iteration)
            open_storage(t.run_dir).make_dirs()
            return t.iter_dir

        iter_dir = coord.broadcast("the run directory", target)
        handle = export(iter_dir, lambda _path: write_tracker(run_dir, iteration))
        self.pending = (iteration, handle)
        return handle
