"""A byte-bounded least-recently-used map of numpy arrays (the converters' read caches)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable

import numpy as np


class ArrayLRU:
    """Arrays by key; the least recently used are dropped once the total exceeds `max_bytes`
    (the newest array is always kept, however large).

    >>> c = ArrayLRU(32); c.put("a", np.zeros(2)); c.put("b", np.zeros(2)); c.get("a") is not None
    True
    >>> c.put("c", np.zeros(1)); c.get("b") is None, c.get("a") is not None
    (True, True)
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._d: OrderedDict[Hashable, np.ndarray] = OrderedDict()
        self._bytes = 0

    def get(self, key: Hashable) -> np.ndarray | None:
        """The array under `key` (None when absent), marked most recently used."""
        a = self._d.get(key)
        if a is not None:
            self._d.move_to_end(key)
        return a

    def put(self, key: Hashable, a: np.ndarray) -> None:
        """Keep `a` under `key` (a key not yet held), then drop the oldest arrays over the budget."""
        self._d[key] = a
        self._bytes += a.nbytes
        while self._bytes > self.max_bytes and len(self._d) > 1:
            _, old = self._d.popitem(last=False)
            self._bytes -= old.nbytes


class ChunkCache:
    """Decoded stored chunks (numpy) of one DCP checkpoint, least-recently-used out over `max_bytes`."""

    def __init__(self, ck, max_bytes: int) -> None:
        self.ck = ck
        self._lru = ArrayLRU(max(1, max_bytes))
        self.bytes_read = 0

    def get(self, key: str, index: int) -> np.ndarray:
        """Stored chunk `index` of tensor `key`, shaped as stored."""
        a = self._lru.get((key, index))
        if a is None:
            from bridge.torch_numpy import to_numpy

            info = self.ck.tensors[key]
            a = to_numpy(self.ck.read_chunk(key, info.chunks[index]))
            self.bytes_read += info.chunks[index].storage.length
            self._lru.put((key, index), a)
        return a

    def region(self, c) -> np.ndarray:
        """The source data of copy `c` (a `megatron_plan.Copy`), shaped like its logical box."""
        a = self.get(c.key, c.chunk)
        if c.flat:
            view = c.view or c.dst.shape
            n = 1
            for s in view:
                n *= s
            a = a.reshape(-1)[c.flat_start:c.flat_start + n].reshape(view)
            if not c.src:
                return a
        return a[tuple(slice(x, y) for x, y in c.src)].reshape(c.dst.shape)
