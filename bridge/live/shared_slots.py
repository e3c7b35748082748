"""Staging slots in shared memory, for the asynchronous export's writer process (bridge/live/writer_process.py).

Each slot is a `memfd` (anonymous shared memory, not bounded by /dev/shm's size) mapped in the
training process as a torch tensor and, for CUDA data, page-locked with `cudaHostRegister` so
device -> host copies into it run as DMA at full speed; the writer process maps the same memory
from the descriptor it is sent. Allocated once, reused by every export (`HostSlots`' rules).
"""

from __future__ import annotations

import itertools
import mmap
import os
import weakref

from bridge.errors import BridgeError
from bridge.live.snapshot import HostSlots


class SharedSlot:
    """One staging slot in shared memory: a `memfd` of `size` bytes, mapped here (`tensor`)."""

    _serial = itertools.count()

    def __init__(self, size: int, pinned: bool) -> None:
        import torch

        self.serial = next(SharedSlot._serial)   # never reused (an id() could be, after a slot is freed)
        self.size = size
        self.fd = os.memfd_create("gtp-bridge-slot", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, size)
        self._map = mmap.mmap(self.fd, size)
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)
        self.pinned = False
        if pinned:
            # Registered (page-locked) host memory: device -> host copies run as DMA at full speed,
            # as into torch's pinned allocator (which can not allocate shared memory).
            err = torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), size, 1)  # 1: portable
            code = int(err)
            if code != 0:
                raise BridgeError(f"could not pin a {size}-byte staging slot (cudaHostRegister error {code}); "
                                  "lower staging_bytes or raise the locked-memory limit (ulimit -l)")
            self.pinned = True
        # An exporter dropped without close (export_state_async without `exporter=` makes one per
        # call): the descriptor keeps the memory alive, so it is closed (and the pages unpinned,
        # while still mapped) when the slot is collected.
        self._release = weakref.finalize(self, _release, self.tensor.data_ptr() if self.pinned else None, self.fd)

    def close(self) -> None:
        """Unpin, unmap and free the slot now."""
        ptr = self.tensor.data_ptr() if self.pinned and self.tensor is not None else None
        self._release.detach()
        self.tensor = None
        _release(ptr, None)
        try:
            self._map.close()
        except BufferError:  # a view is still alive somewhere: the mapping goes with it
            pass
        os.close(self.fd)


def _release(ptr: int | None, fd: int | None) -> None:
    if ptr is not None:
        import torch

        torch.cuda.cudart().cudaHostUnregister(ptr)
    if fd is not None:
        os.close(fd)


class SharedSlots(HostSlots):
    """`HostSlots` in shared memory (`SharedSlot`s), for the writer process to read."""

    def __init__(self) -> None:
        super().__init__()
        self.shared: list[SharedSlot] = []

    def _new(self, size: int, pinned: bool):
        slot = SharedSlot(size, pinned)
        self.shared.append(slot)
        return slot.tensor

    def _drop(self) -> None:
        self.slots.clear()
        for s in self.shared:
            s.close()
        self.shared.clear()
