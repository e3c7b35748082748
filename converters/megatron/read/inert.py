"""The inert stand-in the restricted unpickler builds for a class of an untrusted module (its own
module so that the unpickler, `read.dcp`, its allow-list, `read.unpickle_rules`, and its bounds,
`read.unpickle_bounds`, can name it)."""

from __future__ import annotations

from typing import Any


class InertStub:
    """Stand-in for a class from an untrusted module: records what it was built from, runs nothing.

    >>> from converters.megatron.read.dcp import make_stub
    >>> s = make_stub("megatron.core.enums", "ModelType")(1)
    >>> s.stub_name, s.stub_args
    ('megatron.core.enums.ModelType', (1,))
    """

    stub_name = "?"

    def __new__(cls, *args: Any, **kwargs: Any) -> "InertStub":
        obj = object.__new__(cls)
        obj.__dict__["stub_args"] = args
        obj.__dict__["stub_kwargs"] = kwargs
        obj.__dict__["stub_state"] = None
        obj.__dict__["stub_items"] = {}
        obj.__dict__["stub_list"] = []
        return obj

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # accept anything, do nothing
        pass

    def __setstate__(self, state: Any) -> None:
        self.__dict__["stub_state"] = state

    def __setitem__(self, key: Any, value: Any) -> None:
        self.__dict__["stub_items"][key] = value

    def append(self, value: Any) -> None:
        self.__dict__["stub_list"].append(value)

    def extend(self, values: Any) -> None:
        self.__dict__["stub_list"].extend(values)

    def get(self, name: str, default: Any = None) -> Any:
        """Attribute `name` from the pickled state (dict state or (dict, slots) state)."""
        st = self.stub_state
        if isinstance(st, tuple) and len(st) == 2 and isinstance(st[1], dict):
            merged = dict(st[0]) if isinstance(st[0], dict) else {}
            merged.update(st[1])
            st = merged
        if isinstance(st, dict):
            return st.get(name, default)
        return default

    def __repr__(self) -> str:
        return f"<stub {self.stub_name}{repr(self.stub_args)[:200]}>"

