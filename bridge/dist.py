"""Coordinators: how the processes of one save talk to each other, and how a failure reaches them all.

Two kinds, one protocol (`Coordinator`):

- `LocalCoordinator(rank, world)`: processes that do not talk (one process, or writer processes
  started by a parent). Each call runs on this process only; the writers meet at the commit's file
  barrier (every writer publishes a report, writer 0 waits for them: `bridge.store.commit`).
- `TorchCoordinator(group)`: the ranks of an EXPLICIT torch.distributed process group (a subgroup
  works: ranks outside it are never waited for). Ranks exchange small JSON values over the group.
- `JaxCoordinator()`: the processes of a multi-process JAX run (the JAX save).

Every step that can fail on one rank runs through `all_gather(stage, fn)` or `broadcast(stage, fn)`
(the model is torch DCP's `_DistWrapper`): each rank runs `fn`, catching its error; the outcomes
are gathered, and if any rank failed every rank raises the same `CollectiveError`, naming the
failing ranks and the stage. A rank that dies or times out inside a collective turns into one
`BridgeError` line on its peers (`guard`).

torch is imported by `TorchCoordinator` only (a caller that passes a torch group has imported it),
jax by `JaxCoordinator` only.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import json
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Protocol, Sequence, TypeVar

from bridge.errors import BridgeError

T = TypeVar("T")


class CollectiveError(BridgeError):
    """A step failed on one or more ranks; raised on every rank with the same one-line message.

    `failures` maps each failing rank to its error line; `stage` names the step.

    >>> e = CollectiveError("the commit", {2: "rank 2: disk full"}, job="export to /c")
    >>> str(e)
    'export to /c: rank 2 failed during the commit: disk full'
    >>> str(CollectiveError("planning", {1: "bad shape", 3: "bad dtype"}))
    'rank 1 failed during planning: bad shape (also ranks [3])'
    """

    def __init__(self, stage: str, failures: dict[int, str], job: str = "") -> None:
        self.stage = stage
        self.failures = dict(sorted(failures.items()))
        first, msg = next(iter(self.failures.items()))
        prefix = f"rank {first}: "
        msg = msg[len(prefix):] if msg.startswith(prefix) else msg  # the rank is named once
        more = list(self.failures)[1:]
        also = f" (also ranks {more})" if more else ""
        super().__init__(f"{job + ': ' if job else ''}rank {first} failed during {stage}: {msg}{also}")


def error_line(e: BaseException) -> str:
    """One line for an error travelling to other ranks: a BridgeError's message, else its type too.

    >>> error_line(BridgeError("bad")), error_line(OSError("disk\\nfull"))
    ('bad', 'OSError: disk full')
    """
    text = " ".join(str(e).split())
    return text if isinstance(e, BridgeError) else f"{type(e).__name__}: {text}"


def _attempt(fn: Callable[[], T]) -> tuple[dict, Exception | None]:
    """Run `fn`: ({"ok": result}, None) or ({"error": line}, the error).

    A caller that keeps the error must drop it (`del`) once raised from: its traceback reaches the
    caller's frame (through this frame's f_back), so a local holding it is a reference cycle that
    lives until the garbage collector runs, keeping the caller's coordinator, hence its process
    group, alive past `destroy_process_group` (gloo then aborts the process at exit).
    """
    try:
        return {"ok": fn()}, None
    except Exception as e:  # BaseException (Ctrl-C, SIGTERM) leaves at once: no collective after it
        return {"error": error_line(e)}, e


def wait_for_writers(missing_of: Callable[[list], list], writers: Sequence, timeout: float, what: str,
                     first: float, longest: float) -> None:
    """The writers' barrier without a collective: poll `missing_of(still missing)` (sleeping `first`
    seconds, doubling up to `longest`) until nothing is missing; BridgeError naming the missing
    `what` after `timeout` seconds.

    >>> wait_for_writers(lambda left: [w for w in left if w != 0], [0, 1], 1.0, "writers", 0.001, 0.05)
    Traceback (most recent call last):
    ...
    bridge.errors.BridgeError: writers [1] did not finish within 1 s (crashed or still writing); nothing was committed, rerun the save
    >>> wait_for_writers(lambda left: [], [0, 1], 1.0, "writers", 0.001, 0.05)
    """
    deadline = time.monotonic() + timeout
    missing = list(writers)
    wait = first
    while missing:
        missing = missing_of(missing)
        if not missing:
            return
        if time.monotonic() > deadline:
            raise BridgeError(f"{what} {missing} did not finish within {timeout:.0f} s (crashed or still writing); "
                              f"nothing was committed, rerun the save")
        time.sleep(wait)
        wait = min(longest, wait * 2)


class Coordinator(Protocol):
    """The processes of one save: this one is `rank` of `world`."""

    rank: int
    world: int

    def all_gather(self, stage: str, fn: Callable[[], T]) -> list[T | None]:
        """Run `fn` here; every rank's result (JSON values), or CollectiveError on every rank."""

    def broadcast(self, stage: str, fn: Callable[[], T], src: int = 0) -> T | None:
        """Run `fn` on rank `src` only; its result on every rank, or CollectiveError on every rank."""

    def guard(self, stage: str) -> Any:
        """Context manager: a peer dying (or timing out) in a collective becomes one BridgeError line."""


class LocalCoordinator:
    """Processes that never talk: each call runs here only, other ranks' entries are None.

    An error raises here unchanged (there is nobody to tell); writers other than the committer
    learn nothing from the commit (`broadcast` returns None to them).

    >>> c = LocalCoordinator()
    >>> c.all_gather("writing", lambda: 3), c.broadcast("the commit", lambda: "/ck")
    ([3], '/ck')
    >>> LocalCoordinator(1, 2).broadcast("the commit", lambda: "/ck") is None
    True
    """

    def __init__(self, rank: int = 0, world: int = 1) -> None:
        if not 0 <= rank < world:
            raise BridgeError(f"rank {rank} is not in 0..{world - 1}")
        self.rank, self.world = rank, world

    def all_gather(self, stage: str, fn: Callable[[], T]) -> list[T | None]:
        out: list[T | None] = [None] * self.world
        out[self.rank] = fn()
        return out

    def broadcast(self, stage: str, fn: Callable[[], T], src: int = 0) -> T | None:
        return fn() if self.rank == src else None

    @contextmanager
    def guard(self, stage: str) -> Iterator[None]:
        yield


class _Exchanging(ABC):
    """`all_gather` / `broadcast` of coordinators that exchange every rank's outcome (`_exchange`)."""

    rank: int
    job: str
    #: one process and nobody to tell: its error raises as it is, not as a CollectiveError
    solo_error_as_is = False

    @abstractmethod
    def _exchange(self, stage: str, mine: dict) -> list[dict]:
        """Every rank's outcome of `stage` (`mine` from this rank), in rank order."""

    def all_gather(self, stage: str, fn: Callable[[], T]) -> list[T | None]:
        mine, err = _attempt(fn)
        outcomes = self._exchange(stage, mine)
        failures = {r: o["error"] for r, o in enumerate(outcomes) if "error" in o}
        if failures:
            try:
                if self.solo_error_as_is and len(outcomes) == 1:
                    raise err
                raise CollectiveError(stage, failures, self.job) from err
            finally:
                del err  # see _attempt
        return [o["ok"] for o in outcomes]

    def broadcast(self, stage: str, fn: Callable[[], T], src: int = 0) -> T | None:
        return self.all_gather(stage, fn if self.rank == src else (lambda: None))[src]


class TorchCoordinator(_Exchanging):
    """The ranks of torch.distributed process group `group` (required: the store never assumes the world).

    `job` prefixes every error line (e.g. "export to /ckpt"). Values travel as JSON, never pickle:
    a peer's payload must not be able to run code here.
    """

    def __init__(self, group: Any, job: str = "", device: Any = None) -> None:
        import torch.distributed as dist

        if group is None:
            raise BridgeError("TorchCoordinator needs an explicit process group (torch.distributed.group.WORLD "
                              "for every rank)")
        self.group = group
        self.job = job
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        if self.rank < 0:
            raise BridgeError("this process is not a member of the process group it was given; pass a group "
                              "that contains it")
        self.device = device if device is not None else collective_device(group)

    def _exchange(self, stage: str, mine: dict) -> list[dict]:
        with self.guard(stage):
            return all_gather_json(mine, self.group, self.device)

    @contextmanager
    def guard(self, stage: str) -> Iterator[None]:
        try:
            yield
        except BridgeError:
            raise
        except RuntimeError as e:  # torch.distributed.DistBackendError and gloo/NCCL failures are RuntimeErrors
            first = " ".join(str(e).split())[:300]
            job = f" {self.job}" if self.job else ""
            raise BridgeError(f"rank {self.rank}:{job} aborted during {stage}: a peer failed or timed out "
                              f"({first}); nothing was committed, rerun") from e


class JaxCoordinator(_Exchanging):
    """The processes of a (multi-process) JAX run: `jax.process_index()` of `jax.process_count()`.

    Values travel as JSON through `multihost_utils.process_allgather`; with one process nothing
    is exchanged. `guard` adds nothing: JAX's collectives report a lost peer themselves.
    """

    def __init__(self, job: str = "") -> None:
        import jax

        self.job = job
        self.rank, self.world = jax.process_index(), jax.process_count()

    solo_error_as_is = True

    def _exchange(self, stage: str, mine: dict) -> list[dict]:
        return [mine] if self.world == 1 else _jax_all_gather_json(mine)

    @contextmanager
    def guard(self, stage: str) -> Iterator[None]:
        yield


def _jax_all_gather_json(obj: Any) -> list[Any]:
    """Every JAX process's JSON-serialisable `obj`, in process order (two all-gathers: sizes, bytes)."""
    import numpy as np
    from jax.experimental import multihost_utils

    data = np.frombuffer(json.dumps(obj, separators=(",", ":")).encode(), dtype=np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.array([data.size], np.int32))).reshape(-1)
    buf = np.zeros(max(1, int(sizes.max())), dtype=np.uint8)
    buf[:data.size] = data
    rows = np.asarray(multihost_utils.process_allgather(buf)).reshape(sizes.size, -1)
    return [json.loads(rows[r, :sizes[r]].tobytes().decode()) for r in range(sizes.size)]


# -- JSON over a torch group ----------------------------------------------------------------------
def collective_device(group: Any = None) -> Any:
    """Where this group's collectives must run: the current CUDA device for NCCL, else cpu."""
    import torch
    import torch.distributed as dist

    backend = dist.get_backend(group)
    if "nccl" in str(backend).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather_flat(local: Any, group: Any = None) -> Any:
    """`all_gather_into_tensor` of equal-sized flat buffers: result[r*n:(r+1)*n] = rank r's buffer."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size(group)
    out = torch.empty(world * local.numel(), dtype=local.dtype, device=local.device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, local.reshape(-1).contiguous(), group=group)
    return out


def all_gather_json(obj: Any, group: Any = None, device: Any = None, inline_bytes: int = 1024) -> list[Any]:
    """Every rank's JSON-serialisable `obj`, in group-rank order.

    One all-gather of fixed `inline_bytes + 8`-byte slots (length header + payload) when every
    rank's JSON fits, else a second all-gather sized to the largest (every rank learns that from
    the headers, so all ranks take the same path). JSON, not pickle: the payload is plan metadata
    and must never execute code on a peer.
    """
    import torch

    device = device or collective_device(group)
    data = json.dumps(obj, separators=(",", ":")).encode()
    slot = torch.zeros(8 + inline_bytes, dtype=torch.uint8)
    slot[:8] = torch.tensor([len(data)], dtype=torch.int64).view(torch.uint8)
    if len(data) <= inline_bytes and data:
        slot[8:8 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    first = all_gather_flat(slot.to(device), group).cpu().reshape(-1, 8 + inline_bytes)
    sizes = first[:, :8].contiguous().view(torch.int64).reshape(-1).tolist()
    if max(sizes) <= inline_bytes:
        rows = first[:, 8:].numpy()
    else:
        buf = torch.zeros(max(sizes), dtype=torch.uint8)
        if data:
            buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        rows = all_gather_flat(buf.to(device), group).cpu().numpy().reshape(len(sizes), -1)
    return [json.loads(rows[r, : sizes[r]].tobytes().decode()) for r in range(len(sizes))]
