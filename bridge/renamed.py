"""Former names of public keywords: still accepted, with a one-line `DeprecationWarning` (issue 32).

One concept has one name across the layers (`commit_depth` for writer commits in flight, `budget`
for a memory budget in bytes); a public keyword that had another name keeps working for a while:

    >>> import warnings
    >>> with warnings.catch_warnings(record=True) as w:
    ...     warnings.simplefilter("always")
    ...     renamed("reload_state", "inflight_bytes", "budget", 7, None)
    7
    >>> str(w[0].message)
    'reload_state: inflight_bytes= is deprecated, pass budget= (same meaning)'
"""

from __future__ import annotations

import warnings
from typing import Any

from bridge.errors import BridgeError


def renamed(where: str, old: str, new: str, old_value: Any, new_value: Any, *, stacklevel: int = 3) -> Any:
    """The value to use for keyword `new` when the caller may have passed its former name `old`
    (`old_value` not None): warns once per call site and refuses both given at once."""
    if old_value is None:
        return new_value
    if new_value is not None:
        raise BridgeError(f"{where}: pass {new}= only ({old}= is its former name), not both")
    warnings.warn(f"{where}: {old}= is deprecated, pass {new}= (same meaning)", DeprecationWarning,
                  stacklevel=stacklevel)
    return old_value
