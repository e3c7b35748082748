"""Error types shared by the library and the command line.

`BridgeError` is a user-facing error: its message is one line that says what is wrong and how to
fix it. The CLI prints it and exits 2 (bad usage / bad input) without a traceback.
`IntegrityError` means stored data is damaged; `verify` maps it to exit code 1.
`MissingExtra` means an optional dependency is not installed; it names the extra to install.
"""

from __future__ import annotations

import errno
import importlib
import os


class BridgeError(Exception):
    """Bad input or bad usage; message = one line: what is wrong and how to fix it."""

    exit_code = 2


class IntegrityError(BridgeError):
    """A checkpoint's stored data or metadata is damaged (names the array)."""

    exit_code = 1


class MissingExtra(BridgeError, ModuleNotFoundError):
    """An optional dependency is missing. Also a ModuleNotFoundError, so `except ImportError` still works."""


#: errno values that mean "the file system has no room": full, or the user's quota spent
NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def write_failure(path: str, e: BaseException) -> BridgeError:
    """One line for a failed write of file `path`: "disk full" when that is the cause.

    The cause is an OSError with ENOSPC / EDQUOT, or the file system has less than 1 MiB free right
    after the failure: torch's zip writer reports a short write as a RuntimeError without the errno
    ("[enforce fail at inline_container.cc:672] . unexpected pos ...").
    """
    full = isinstance(e, OSError) and e.errno in NO_SPACE
    if not full:
        try:
            st = os.statvfs(os.path.dirname(path) or ".")
            full = st.f_bavail * st.f_frsize < (1 << 20)
        except OSError:
            pass
    if full:
        return BridgeError(f"{path}: disk full (no space left on its file system) while writing; free some space "
                           f"or write elsewhere (the partial output is removed)")
    first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), "")
    return BridgeError(f"{path}: writing failed ({type(e).__name__}: {first[:200]})")


# Which extra of pyproject.toml installs each optional top-level module.
EXTRA_OF = {"torch": "torch", "jax": "jax", "jaxlib": "jax", "orbax": "jax", "optax": "jax"}


def require(what: str, *modules: str) -> None:
    """Import `modules` (e.g. "torch", "orbax.checkpoint"); MissingExtra naming the extra(s) if one is missing.

    `what` is the feature that needs them, e.g. "convert": "convert needs torch: pip install 'gtp-bridge[torch]'".
    """
    missing: list[str] = []
    broken = ""
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as e:
            top = name.split(".")[0]
            missing.append(top)
            if e.name and e.name.split(".")[0] not in EXTRA_OF:  # the module exists but its own import failed
                broken = f" (import {name} failed: {e})"
    if missing:
        extras = sorted({EXTRA_OF.get(m, m) for m in missing})
        err = MissingExtra(f"{what} needs {' and '.join(dict.fromkeys(missing))}: "
                           f"pip install 'gtp-bridge[{','.join(extras)}]'{broken}")
        err.name = missing[0]
        raise err
