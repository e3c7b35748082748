"""Error types shared by the library and the command line.

`BridgeError` is a user-facing error: its message is one line that says what is wrong and how to
fix it. The CLI prints it and exits 2 (bad usage / bad input) without a traceback.
`IntegrityError` means stored data is damaged; `verify` maps it to exit code 1.
"""


class BridgeError(Exception):
    """Bad input or bad usage; message = one line: what is wrong and how to fix it."""

    exit_code = 2


class IntegrityError(BridgeError):
    """A checkpoint's stored data or metadata is damaged (names the array)."""

    exit_code = 1
