"""Megatron-LM run directories: `<run>/iter_<step, 7 digits>/` plus `<run>/latest_checkpointed_iteration.txt`.

What Megatron-LM (megatron-core 0.19.2, `megatron/training/checkpointing.py`) does with `--load RUN`:

- `get_checkpoint_tracker_filename(RUN)` = `RUN/latest_checkpointed_iteration.txt`;
- `read_metadata(tracker)`: `text.strip()`, then `int(text)`; else the text must be `release`
  (iteration 0), else it exits; the iteration must be >= 0;
- no tracker: a warning, and training starts from random initialisation (no error);
- `get_checkpoint_name(RUN, it, release, return_base_dir=True)` = `RUN/iter_{it:07d}` or `RUN/release`;
- a torch_dist checkpoint is recognised by `metadata.json` in that directory
  (`find_checkpoint_rank_0` -> `dist_checkpointing.check_is_distributed_checkpoint`).

The pure part (names, tracker text, where a DST goes) is separate from the file operations.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from bridge.errors import BridgeError
from bridge.location import absolute
from bridge.store import TMP_SUFFIX, open_storage

TRACKER_NAME = "latest_checkpointed_iteration.txt"
RELEASE = "release"
_ITER_RE = re.compile(r"iter_(\d+)")


def iteration_dir_name(iteration: int) -> str:
    """Megatron's directory name for an iteration (`'iter_{:07d}'`).

    >>> iteration_dir_name(1000), iteration_dir_name(12345678)
    ('iter_0001000', 'iter_12345678')
    """
    if iteration < 0:
        raise BridgeError(f"iteration {iteration} is negative; Megatron iterations start at 0")
    return f"iter_{iteration:07d}"


def parse_iteration_dir_name(name: str) -> int | None:
    """The iteration an `iter_*` directory name stands for, else None.

    >>> parse_iteration_dir_name("iter_0001000"), parse_iteration_dir_name("iter_12"), parse_iteration_dir_name("x")
    (1000, 12, None)
    """
    m = _ITER_RE.fullmatch(name)
    return int(m.group(1)) if m else None


def parse_tracker(text: str, where: str = TRACKER_NAME) -> int | str:
    """The tracker's iteration (int) or `"release"`, as `read_metadata` reads it; BridgeError otherwise.

    >>> parse_tracker("1000\\n"), parse_tracker(" release ")
    (1000, 'release')
    """
    s = text.strip()
    try:
        it = int(s)  # int() as Megatron: surrounding whitespace and '_' separators are accepted
    except ValueError:
        if s == RELEASE:
            return RELEASE
        raise BridgeError(f"{where}: {s[:40]!r} is neither an iteration number nor 'release'; "
                          f"Megatron-LM cannot read this tracker either") from None
    if it < 0:
        raise BridgeError(f"{where}: iteration {it} is negative; Megatron-LM refuses it too")
    return it


def tracker_text(iteration: int) -> str:
    """What Megatron's `save_checkpoint` writes into the tracker (`str(iteration)`, no newline).

    >>> tracker_text(1000)
    '1000'
    """
    return str(int(iteration))


def read_tracker(run_dir: str) -> int | str | None:
    """The tracker's value in `run_dir` (a directory or an s3:// / gs:// run prefix), None when there
    is none. Only its first 4 KiB are read (Megatron's tracker holds a number)."""
    storage = open_storage(run_dir)
    if not (storage.path() / TRACKER_NAME).is_file():
        return None
    with storage.open_range(TRACKER_NAME) as f:
        raw = f.pread(4096, 0)
    return parse_tracker(raw.decode("utf-8", errors="replace"), os.path.join(run_dir, TRACKER_NAME))


# ---------------------------------------------------------------------------------------------
# Reading side: a run directory or an iteration directory -> the checkpoint directory


@dataclass(frozen=True)
class Resolved:
    """Which checkpoint directory a user's path stands for, and why."""

    path: str
    iteration: int | str | None = None  # from the tracker, when the path was a run directory

    @property
    def note(self) -> str | None:
        """One line saying the tracker was followed (None when the path was the checkpoint itself)."""
        if self.iteration is None:
            return None
        return (f"{os.path.dirname(self.path)} is a Megatron run directory: its {TRACKER_NAME} names "
                f"{'the release checkpoint' if self.iteration == RELEASE else f'iteration {self.iteration}'}; "
                f"reading {self.path}")


def is_checkpoint_dir(path: str) -> bool:
    """A torch_dist checkpoint directory or prefix (`.metadata` or Megatron's `metadata.json`)."""
    root = open_storage(path).path()
    return (root / ".metadata").is_file() or (root / "metadata.json").is_file()


def locate_megatron_dir(path: str) -> Resolved:
    """The torch_dist directory for `path`: `path` itself, or (a run directory) the one its tracker names.

    A run directory without a tracker is refused, listing its `iter_*` directories, rather than
    guessed: Megatron-LM itself would not load any of them.
    """
    storage = open_storage(path, "source")
    path, root = storage.root, storage.path()   # a Path, or a str with its methods over objects
    if not root.is_dir() or is_checkpoint_dir(path):
        return Resolved(path)  # missing, a file, or the checkpoint itself: the reader's messages apply
    it = read_tracker(path)
    iters = sorted(p.name for p in root.glob("iter_*") if parse_iteration_dir_name(p.name) is not None)
    if it is None:
        if iters:
            raise BridgeError(f"{path}: a Megatron run directory without {TRACKER_NAME} (Megatron-LM would start "
                              f"from scratch); give the iteration directory, e.g. {os.path.join(path, iters[-1])}")
        return Resolved(path)
    name = RELEASE if it == RELEASE else iteration_dir_name(it)
    sub = os.path.join(path, name)
    if not (root / name).is_dir():
        have = f"; it has {', '.join(iters[-3:])}" if iters else ""
        raise BridgeError(f"{os.path.join(path, TRACKER_NAME)} names iteration {it} but {sub} does not exist{have}; "
                          f"fix the tracker or give the iteration directory")
    return Resolved(sub, it)


def resolve_megatron_dir(path: str) -> str:
    """`locate_megatron_dir(path).path`: the checkpoint directory a run or iteration directory stands for."""
    return locate_megatron_dir(path).path


# ---------------------------------------------------------------------------------------------
# Writing side: where to-megatron puts step N for a DST


@dataclass(frozen=True)
class RunDirTarget:
    """Where one iteration goes: `iter_dir` inside `run_dir`, then the tracker is set to `iteration`."""

    run_dir: str
    iter_dir: str
    iteration: int
    previous: int | str | None  # the tracker's value before this write (None: no tracker)

    @property
    def tracker(self) -> str:
        return f"{self.run_dir}/{TRACKER_NAME}"


def plan_run_dir(dst: str, iteration: int) -> RunDirTarget:
    """Where `to-megatron` writes iteration `iteration` for DST; checks only, creates nothing.

    DST is either the run directory (new, empty, or a Megatron run directory: one with a tracker or
    `iter_*` directories) or an `iter_<step, 7 digits>` directory in one, whose number must be `iteration`.
    The same rules hold for an s3:// / gs:// run prefix (read through `bridge.store.Storage`).
    """
    dst = absolute(open_storage(dst, "destination").root).rstrip("/") or "/"
    name = os.path.basename(dst)
    named = parse_iteration_dir_name(name)
    if named is not None:
        if name != iteration_dir_name(iteration):
            raise BridgeError(f"DST {dst} names iteration {named} but the checkpoint is at step {iteration}: Megatron-LM "
                              f"would look for {iteration_dir_name(iteration)}; name DST "
                              f"{os.path.join(os.path.dirname(dst), iteration_dir_name(iteration))} or give the run "
                              f"directory {os.path.dirname(dst)}")
        run_dir = os.path.dirname(dst)
    else:
        run_dir = dst
    iter_dir = os.path.join(run_dir, iteration_dir_name(iteration))
    run = open_storage(run_dir)
    if run.occupied():
        root = run.path()   # a Path, or a str with its methods over objects
        if not root.is_dir():
            raise BridgeError(f"{run_dir} exists and is not a directory; give a new or a Megatron run directory")
        if is_checkpoint_dir(run_dir):
            raise BridgeError(f"{run_dir} is itself a checkpoint; give a new run directory, or its parent run directory")
        # a temp dir of an earlier killed run is not the user's: the claim decides about it
        entries = [p.name for p in root.glob("*") if not p.name.endswith(TMP_SUFFIX)]
        if entries and named is None and TRACKER_NAME not in entries and \
                not any(parse_iteration_dir_name(n) is not None for n in entries):
            raise BridgeError(f"{run_dir} exists and is not a Megatron run directory (no {TRACKER_NAME}, no iter_* "
                              f"directories); give a new directory or an empty one")
    it = open_storage(iter_dir)
    # a partial checkpoint of a killed earlier run there (on object storage; locally it is beside): the claim decides
    if it.occupied() and not it.holds_partial():
        raise BridgeError(f"{iter_dir} already exists; remove it or write to another run directory")
    return RunDirTarget(run_dir, iter_dir, iteration, read_tracker(run_dir))


def write_tracker(run_dir: str, iteration: int) -> None:
    """Set the tracker atomically (temp file + fsync + rename + directory fsync).

    Called only once the iteration directory is complete, so a reader never finds a tracker naming
    a directory that is not there or half written.
    """
    open_storage(run_dir).replace_bytes(TRACKER_NAME, tracker_text(iteration).encode())
