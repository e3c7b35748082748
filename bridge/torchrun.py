"""Offline commands under `torchrun`: the ranks of one command, from the environment torchrun sets.

    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint host0:29500 \\
        $(which gtp-bridge) convert /shared/iter_0001000 s3://bucket/logical

`command_ranks(job)` is what a command calls: with WORLD_SIZE > 1 it joins the launch's process
group (gloo: the ranks exchange small JSON values only, never array data, so CPU hosts and GPU
hosts alike) and yields a `bridge.dist.TorchCoordinator` plus a `RankCounter` for progress; with no
launch, or a launch of one process, it yields None and the command runs exactly as it does alone.

Ranks meet through the launch's rendezvous store (`torch.distributed.rendezvous("env://")`, what
`init_process_group` itself uses): the process group under one prefix of it, the progress counters
under another, so rank 0 can show every rank's bytes while they write without any collective.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Iterator, Mapping, Sequence

from bridge.dist import TorchCoordinator
from bridge.errors import BridgeError
from bridge.store import open_storage

#: how long a collective waits for a slow rank: a rank converting its share of a large checkpoint
#: reaches the barrier after its whole share is written (a rank that dies is noticed at once: its
#: sockets close, or torchrun stops the others)
COLLECTIVE_TIMEOUT_S = 6 * 3600
_NEEDED = ("RANK", "MASTER_ADDR", "MASTER_PORT")
#: a private test seam: "<rank>:<action>" makes that rank fail once its share is written, before the
#: ranks meet ("error": a BridgeError; "kill": SIGKILL of the rank itself)
_TESTING_FAULT_ENV = "_GTPB_TESTING_RANK_FAULT"


def launched_world(environ: Mapping[str, str] = os.environ) -> int:
    """Processes of the torchrun launch this one belongs to (1 when not launched by torchrun).

    >>> launched_world({}), launched_world({"WORLD_SIZE": "4", "RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "1"})
    (1, 4)
    >>> launched_world({"WORLD_SIZE": "2"})
    Traceback (most recent call last):
    ...
    bridge.errors.BridgeError: WORLD_SIZE=2 is set but RANK, MASTER_ADDR, MASTER_PORT are not: start the command with torchrun (or unset WORLD_SIZE to run one process)
    """
    raw = environ.get("WORLD_SIZE")
    if raw is None or raw.strip() in ("", "1"):
        return 1
    try:
        world = int(raw)
    except ValueError:
        raise BridgeError(f"WORLD_SIZE={raw!r} is not a number of processes; start the command with torchrun") from None
    if world < 1:
        raise BridgeError(f"WORLD_SIZE={world} is not a number of processes; start the command with torchrun")
    missing = [k for k in _NEEDED if not environ.get(k)]
    if missing:
        raise BridgeError(f"WORLD_SIZE={world} is set but {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} "
                          f"not: start the command with torchrun (or unset WORLD_SIZE to run one process)")
    return world


def leave_launch(rc: int, environ: Mapping[str, str] = os.environ) -> None:
    """As a rank of a torchrun launch of 2+ whose command has finished (committed, or failed on every
    rank alike): flush the output and end the process now with `rc`. The interpreter's teardown of
    torch, gloo and TensorStore (~1.3 s measured on the CPU machine) is time every rank, hence the
    launch, waits for at the end while there is nothing left to write or release; one process
    (no launch) returns and exits as usual."""
    try:
        if launched_world(environ) == 1:
            return
    except BridgeError:
        return
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except (OSError, ValueError):
            pass
    os._exit(rc)


def host_ranks(environ: Mapping[str, str] = os.environ) -> int:
    """Ranks of the launch on this host (torchrun's LOCAL_WORLD_SIZE; 1 without a launch): the
    defaults that size themselves from the host (memory budget, worker count) take 1/host_ranks each.

    >>> host_ranks({}), host_ranks({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "RANK": "5", "MASTER_ADDR": "h",
    ...                                "MASTER_PORT": "1"})
    (1, 4)
    """
    if launched_world(environ) == 1:
        return 1
    try:
        return max(1, int(environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


@dataclass
class Ranks:
    """This process's place in a torchrun launch: the coordinator and the progress counter."""

    coord: TorchCoordinator
    counter: "RankCounter"
    #: seconds this process spent importing torch.distributed and joining the launch (the rendezvous
    #: and the process group): phases of its report that one process does not have
    phases: dict = field(default_factory=dict)

    @property
    def rank(self) -> int:
        return self.coord.rank

    @property
    def world(self) -> int:
        return self.coord.world


@contextmanager
def command_ranks(job: str, environ: Mapping[str, str] = os.environ) -> Iterator[Ranks | None]:
    """The ranks running command `job` (e.g. "convert to /ckpt"), or None without a launch of 2+.

    Joins the launch's gloo process group (and leaves it on exit) unless this process already
    belongs to one (a caller inside torch.distributed: its WORLD group is used as it is).
    """
    if launched_world(environ) == 1:
        yield None
        return
    t0 = time.perf_counter()
    import torch.distributed as dist

    phases = {"torch_import": round(time.perf_counter() - t0, 3)}
    made = not dist.is_initialized()
    store = None
    t0 = time.perf_counter()
    if made:
        store, rank, world = next(dist.rendezvous("env://", timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S)))
        dist.init_process_group("gloo", store=dist.PrefixStore("pg", store), rank=rank, world_size=world,
                                timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    try:
        coord = TorchCoordinator(dist.group.WORLD, job=job, device=_cpu())
        counter = RankCounter(dist.PrefixStore(f"gtpb-progress/{job}", store) if store is not None else None,
                              coord.rank)
        phases["rendezvous"] = round(time.perf_counter() - t0, 3)
        yield Ranks(coord, counter, phases)
    finally:
        if made:
            dist.destroy_process_group()


def check_same_plan(fingerprints: Sequence[str]) -> None:
    """Every rank must have planned the same conversion; else name the ranks that differ from rank 0.

    >>> check_same_plan(["a", "a"])
    >>> check_same_plan(["a", "b", "a"])
    Traceback (most recent call last):
    ...
    bridge.errors.BridgeError: ranks [1] planned another conversion than rank 0 (their source, flags or gtp-bridge version differ); start every rank with the same SRC, DST and flags
    """
    other = [r for r, f in enumerate(fingerprints) if f != fingerprints[0]]
    if other:
        raise BridgeError(f"ranks {other} planned another conversion than rank 0 (their source, flags or gtp-bridge "
                          f"version differ); start every rank with the same SRC, DST and flags")


def launch_claim(coord: TorchCoordinator, stack: ExitStack, dst: str, make_claim: Callable[[], Any],
                 marker: str = "_METADATA") -> Any:
    """The launch's one claim on `dst` (stage "the claim"): rank 0 claims (`make_claim()`, a
    `bridge.store.claim.Destination`, held in `stack`) and sends the claim's record; every other rank
    joins it (`Storage.joined`: the record must be a claim of the same `dst` and the claim recorded
    there; held in use in `stack` while this rank writes). Returns rank 0's claim on rank 0 and a
    handle on it on the others (its release removes nothing), whose `tmp` the writers write into and
    which rank 0 commits; a failure on any rank raises the same one-line error on every rank.
    `marker`: the claim's marker (`Storage.claim`), `.metadata` for a torch_dist iteration."""
    mine: list[Any] = []

    def claim() -> dict:
        mine.append(stack.enter_context(make_claim()))
        return mine[0].info.record()

    record = coord.broadcast("the claim", claim)

    def join() -> bool:
        if coord.rank != 0:
            mine.append(stack.enter_context(open_storage(dst, "destination").joined(record, marker)))
        return True

    coord.all_gather("the claim", join)
    return mine[0]


def _cpu() -> Any:
    import torch

    return torch.device("cpu")


class RankCounter:
    """Bytes done by every rank, summed in the launch's store: ranks `add`, rank 0 `watch`es.

    Adds are batched (one store request per `every_s` at most) so a rank's progress costs nothing
    beside its writes; without a store (a process group made by the caller) nothing is shared and
    rank 0 shows its own bytes only.
    """

    KEY = "done"

    def __init__(self, store: Any, rank: int, every_s: float = 0.5) -> None:
        self.store, self.rank, self.every_s = store, rank, every_s
        self._pending = 0
        self._last = 0.0
        self._lock = threading.Lock()

    def add(self, n: int) -> None:
        """Count `n` more bytes done here (sent to the store at most every `every_s`)."""
        with self._lock:
            self._pending += int(n)
            now = time.monotonic()
            if self.store is None or now - self._last < self.every_s:
                return
            n, self._pending, self._last = self._pending, 0, now
        self.store.add(self.KEY, n)

    def flush(self) -> None:
        """Send what is still pending (a rank's last bytes)."""
        with self._lock:
            n, self._pending = self._pending, 0
        if n and self.store is not None:
            self.store.add(self.KEY, n)

    def total(self) -> int:
        """Bytes every rank reported so far."""
        return int(self.store.add(self.KEY, 0)) if self.store is not None else 0

    @contextmanager
    def watch(self, bar: Any) -> Iterator[Any]:
        """On rank 0: a thread moving `bar` by every rank's progress while the block runs; yields the
        `update(n)` this rank's own progress goes to (other ranks: to the store only)."""
        if self.store is None:
            yield bar
            return
        own = _Adder(self)
        if self.rank != 0:
            try:
                yield own
            finally:
                self.flush()
            return
        stop = threading.Event()
        shown = [0]

        def follow() -> None:
            while True:
                done = stop.wait(self.every_s)
                try:
                    total = self.total()
                except Exception:  # noqa: BLE001 - the store went away: the collectives report why
                    return
                if total > shown[0]:
                    bar.update(total - shown[0])
                    shown[0] = total
                if done:
                    return

        t = threading.Thread(target=follow, name="gtpb-progress", daemon=True)
        t.start()
        try:
            yield own
        finally:
            self.flush()
            stop.set()
            t.join()


class _Adder:
    """`update(n)` of a progress bar that counts into a RankCounter."""

    def __init__(self, counter: RankCounter) -> None:
        self.counter = counter

    def update(self, n: int = 1) -> None:
        self.counter.add(n)


def _testing_fault(rank: int, environ: Mapping[str, str] = os.environ) -> None:
    """The private seam (`_TESTING_FAULT_ENV`): fail this rank at a known point, for the tests."""
    spec = environ.get(_TESTING_FAULT_ENV, "")
    at, _, action = spec.partition(":")
    if not spec or at != str(rank):
        return
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise BridgeError(f"testing fault on rank {rank}")
