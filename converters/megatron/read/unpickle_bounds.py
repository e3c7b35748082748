"""Time bounds for reading untrusted pickles: hash flooding, costly hashes, shared and deep graphs.

`read.dcp.SafeUnpickler` bounds memory by charging what it builds to a budget proportional to the
input. Three things cost time without costing memory, and are bounded here:

- Hash flooding. Inserting n distinct keys that share one hash value into a dict or set costs n**2 / 2
  equality tests. Python's hashes of ints, floats and tuples are not randomized: `k * (2**61 - 1)` all
  hash to 0, and tuples combine their items' hashes so that colliding tuples are easy to make.
  `KeyGuard` sees every key before a dict or set hashes it and keeps, per hash value, the distinct
  keys seen so far in the whole file; the (MAX_SAME_HASH + 1)-th is refused. So no insertion compares
  more than MAX_SAME_HASH keys, whatever the input: the refusal comes before the dict is built.
  Keys whose hash an attacker cannot choose (str / bytes under hash randomization, objects hashed by
  identity) are not tracked.
- Costly hashes. A tuple's hash is not cached and the memo lets a tuple hold the same tuple twice
  at every level: `(t, t)` nested 40 deep has 2**40 leaves, and hashing it once never ends.
  `Immutables` records each tuple's unfolded size as it is built (from its items', so the cost is
  linear), and every hash the guard lets happen is charged that size.
- Shared graphs. `check_graph` refuses cycles, nesting deeper than MAX_NESTING and a graph whose
  unfolded size (what a recursive walk of it visits) exceeds the budget: later code walks these
  objects recursively, and a list holding the same list twice at every level is tiny as a pickle.
"""

from __future__ import annotations

import argparse
import sys
import types
from typing import Any, Callable, Iterable

from bridge.errors import BridgeError

#: distinct keys one hash value may have in a file (real checkpoints: 1; -1 and -2 share one)
MAX_SAME_HASH = 8
MAX_NESTING = 64          # containers inside containers (a real checkpoint needs < 10)
_IMMUTABLE = (tuple, frozenset)
_LEAVES = {str, int, float, bool, bytes, type(None)}


def _int_cost(x: int) -> int:
    """Hashing / comparing an int costs its 30-bit digits."""
    return 1 + x.bit_length() // 30


class Immutables:
    """Nesting depth and unfolded size of the tuples / frozensets an unpickler builds.

    >>> im = Immutables(); t = (1, 2); u = (t, t)
    >>> im.note(t, t), im.note(u, u), im.size(u)
    (1, 2, 7)
    """

    def __init__(self) -> None:
        self._rec: dict[int, tuple[Any, int, int]] = {}   # id -> (object, depth, unfolded size), kept alive

    def size(self, x: Any) -> int:
        """What hashing or comparing `x` may visit (1 for a leaf)."""
        t = type(x)
        if t is int:
            return _int_cost(x)
        if t in _IMMUTABLE:
            rec = self._rec.get(id(x))
            return rec[2] if rec is not None and rec[0] is x else 1 + len(x)
        return 1

    def depth(self, x: Any) -> int:
        rec = self._rec.get(id(x))
        return rec[1] if rec is not None and rec[0] is x else 1

    def note(self, obj: Any, items: Iterable[Any]) -> int:
        """Record a new tuple / frozenset built from `items`; returns its nesting depth."""
        d, n, nested = 1, 1, False
        for i in items:
            n += self.size(i)
            if type(i) in _IMMUTABLE:
                nested = True
                d = max(d, 1 + self.depth(i))
        if nested or n > 1 + len(obj):
            self._rec[id(obj)] = (obj, d, n)
        return d


class KeyGuard:
    """Admits the keys of every dict and set built from untrusted input (see the module docstring).

    `charge(n)` is told the cost of each hash and comparison it lets happen (and refuses when over
    budget); `refuse(why)` raises.

    >>> g = KeyGuard(lambda why: (_ for _ in ()).throw(BridgeError(why)), lambda n: None, Immutables())
    >>> g.admit_all(range(1000)); g.admit_all(range(1000))          # distinct hashes, and repeats
    >>> g.admit_all(k * (2**61 - 1) for k in range(1, 100))
    Traceback (most recent call last):
    ...
    bridge.errors.BridgeError: 9 distinct dict/set keys with one hash value (hash flooding: building them costs time quadratic in their number)
    """

    def __init__(self, refuse: Callable[[str], None], charge: Callable[[int], None], sizes: Immutables) -> None:
        self.refuse, self.charge, self.sizes = refuse, charge, sizes
        self._seen: dict[int, list[Any]] = {}
        self._skip_str = bool(sys.flags.hash_randomization)

    def admit(self, k: Any) -> None:
        """Refuse `k` when it is the MAX_SAME_HASH + 1-th distinct key of its hash value."""
        t = type(k)
        if (t is str or t is bytes) and self._skip_str:
            return
        if t.__hash__ is object.__hash__:    # hashed by identity: nothing to flood
            return
        cost = self.sizes.size(k)
        self.charge(cost)
        h = hash(k)
        reps = self._seen.get(h)
        if reps is None:
            self._seen[h] = [k]
            return
        for r in reps:
            self.charge(cost)
            if r is k or (type(r) is t and _equal(r, k)):
                return
        reps.append(k)
        if len(reps) > MAX_SAME_HASH:
            self.refuse(f"{len(reps)} distinct dict/set keys with one hash value (hash flooding: building them "
                        f"costs time quadratic in their number)")

    def admit_all(self, keys: Iterable[Any]) -> None:
        for k in keys:
            self.admit(k)

    def pairs(self, pairs: Iterable[tuple[Any, Any]]) -> list[tuple[Any, Any]]:
        """`pairs` as a list, each key admitted."""
        out = list(pairs)
        for k, _v in out:
            self.admit(k)
        return out


def _equal(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:   # an odd __eq__: count the keys as distinct (the bound still holds)
        return False


def copy_keys(cls: type, arg: Any) -> Iterable[Any]:
    """The keys `cls(arg)` hashes (REDUCE's copy of an already-built container).

    >>> list(copy_keys(dict, [("a", 1), ("b", 2)])), list(copy_keys(set, (3, 4))), list(copy_keys(list, [5]))
    (['a', 'b'], [3, 4], [])
    """
    import collections

    if isinstance(arg, dict):
        return arg.keys() if issubclass(cls, (dict, set, frozenset)) else ()
    if cls in (set, frozenset, collections.Counter):
        return arg
    if issubclass(cls, dict):
        return (p[0] for p in arg if type(p) in (tuple, list) and len(p) == 2)
    return ()


# ---------------------------------------------------------------------------------------------
# the graph an unpickler returned


def _children(x: Any) -> Any:
    """The objects a container of an unpickled graph refers to (none for leaves)."""
    from converters.megatron.read.inert import InertStub

    t = type(x)
    if t is list or t is tuple or t is set or t is frozenset:
        return x
    if isinstance(x, dict):
        return [*x.keys(), *x.values()]
    if isinstance(x, InertStub):
        return [x.stub_args, x.stub_kwargs, x.stub_state, x.stub_items, x.stub_list]
    if t is argparse.Namespace or t is types.SimpleNamespace:
        return list(vars(x).values())
    return ()


def check_graph(obj: Any, what: str, max_size: int | None = None) -> None:
    """Refuse cycles, nesting deeper than MAX_NESTING and, with `max_size`, more than that many nodes
    in the graph unfolded into a tree (iterative walk, each object visited once).

    Later code walks these objects recursively; a cycle, a 10^6-deep list or a list holding the same
    list twice at every level (2**60 nodes unfolded) must stop here.

    >>> a = [1]; b = [a, a]; c = [b, b]
    >>> check_graph(c, "x", max_size=11)
    >>> check_graph(c, "x", max_size=10)
    Traceback (most recent call last):
    ...
    bridge.errors.BridgeError: x: a graph that unfolds into more than 10 objects (the same containers shared at every level); the file is damaged or hostile
    """
    depth: dict[int, int] = {}
    size: dict[int, int] = {}
    on_path: set[int] = set()
    todo: list[tuple[Any, bool]] = [(obj, False)]
    keep: list[Any] = []  # ids stay unique while the walk holds the objects
    while todo:
        x, done = todo.pop()
        i = id(x)
        if done:
            on_path.discard(i)
            d, n = 0, 1
            for c in _children(x):
                if type(c) in _LEAVES:
                    n += 1
                else:
                    d = max(d, depth.get(id(c), 0))
                    n += size.get(id(c), 1)
            if d >= MAX_NESTING:
                raise BridgeError(f"{what}: objects nested more than {MAX_NESTING} deep; the file is damaged or hostile")
            if max_size is not None and n > max_size:
                raise BridgeError(f"{what}: a graph that unfolds into more than {max_size} objects (the same "
                                  f"containers shared at every level); the file is damaged or hostile")
            depth[i], size[i] = d + 1, n
            continue
        if i in depth:
            continue
        if i in on_path:
            raise BridgeError(f"{what}: an object that contains itself; the file is damaged or hostile")
        kids = [c for c in _children(x) if type(c) not in _LEAVES and id(c) not in depth]
        keep.append(x)
        on_path.add(i)
        todo.append((x, True))
        todo.extend((c, False) for c in kids)
