"""Half-open N-d boxes: the unit every plan, writer and reader speaks in."""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Iterable, Sequence


@dataclass(frozen=True, order=True)
class Box:
    """Half-open box ``[start, stop)`` per dimension.

    >>> b = Box.of((2, 0), (3, 8))          # offset (2, 0), shape (3, 8)
    >>> b.stop, b.shape, b.size
    ((5, 8), (3, 8), 24)
    >>> b.intersect(Box((4, 4), (9, 9)))
    Box(start=(4, 4), stop=(5, 8))
    """

    start: tuple[int, ...]
    stop: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.start) != len(self.stop):
            raise ValueError(f"box start {self.start} and stop {self.stop} differ in rank")
        if any(b < a for a, b in zip(self.start, self.stop)):
            raise ValueError(f"box stop {self.stop} is before start {self.start}")

    @classmethod
    def of(cls, offset: Sequence[int], shape: Sequence[int]) -> "Box":
        """Box from an offset and a shape."""
        return cls(tuple(int(o) for o in offset), tuple(int(o) + int(s) for o, s in zip(offset, shape)))

    @classmethod
    def full(cls, shape: Sequence[int]) -> "Box":
        """The whole index space of `shape`."""
        return cls.of((0,) * len(shape), shape)

    @property
    def ndim(self) -> int:
        return len(self.start)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in zip(self.start, self.stop))

    @property
    def size(self) -> int:
        return prod(self.shape)

    @property
    def empty(self) -> bool:
        return self.size == 0

    @property
    def slices(self) -> tuple[slice, ...]:
        return tuple(slice(a, b) for a, b in zip(self.start, self.stop))

    def intersect(self, other: "Box") -> "Box | None":
        """Overlap of two boxes, or None when they do not overlap."""
        lo = tuple(max(a, b) for a, b in zip(self.start, other.start))
        hi = tuple(min(a, b) for a, b in zip(self.stop, other.stop))
        if any(h <= l for l, h in zip(lo, hi)):
            return None
        return Box(lo, hi)

    def contains(self, other: "Box") -> bool:
        return all(a <= c and d <= b for a, b, c, d in zip(self.start, self.stop, other.start, other.stop))

    def shift(self, offset: Sequence[int]) -> "Box":
        """Translate by +offset (use negative offsets to make a box relative)."""
        return Box(tuple(a + o for a, o in zip(self.start, offset)), tuple(b + o for b, o in zip(self.stop, offset)))

    def relative_to(self, outer: "Box") -> "Box":
        """This box in the coordinates of `outer` (whose start becomes the origin)."""
        return self.shift(tuple(-o for o in outer.start))

    def __str__(self) -> str:
        return "[" + ", ".join(f"{a}:{b}" for a, b in zip(self.start, self.stop)) + "]"


def total_size(boxes: Iterable[Box]) -> int:
    """Sum of box sizes."""
    return sum(b.size for b in boxes)
