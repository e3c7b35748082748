"""Byte sizes as people write and read them (binary units): `--budget 256M` in, `1.5 GiB` out."""

from __future__ import annotations

import re

from bridge.errors import BridgeError

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20,
          "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30, "T": 1 << 40, "TB": 1 << 40, "TIB": 1 << 40}


def parse_size(text: str) -> int:
    """Bytes from '256M', '1.5GiB', '4096' (binary units).

    >>> parse_size("64M"), parse_size("1.5GiB"), parse_size("4096")
    (67108864, 1610612736, 4096)
    """
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).upper() not in _UNITS:
        raise BridgeError(f"cannot read size {text!r}; write it like 256M, 2G or 1048576")
    n = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if n < 1:
        raise BridgeError(f"size {text!r} must be at least 1 byte")
    return n


def human_bytes(n: int) -> str:
    """Short binary size.

    >>> human_bytes(512), human_bytes(3 << 20), human_bytes(1536 << 20)
    ('512 B', '3.0 MiB', '1.5 GiB')
    """
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"
