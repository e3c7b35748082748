"""Durability helpers: atomic JSON files and fsync of files and directory trees."""

from __future__ import annotations

import json
import os


def write_json_atomic(path: str, obj) -> None:
    """Write JSON via tmp file + fsync + rename (a reader never sees half a file)."""
    write_bytes_atomic(path, json_bytes(obj))


def json_bytes(obj) -> bytes:
    """`obj` as the JSON bytes the store writes (one `json.dumps`: `json.dump` streams through the
    pure-Python encoder, token by token)."""
    return json.dumps(obj).encode()


def write_bytes_atomic(path: str, data: bytes, *, fsync: bool = True) -> None:
    """Write `data` via tmp file (+ fsync) + rename (a reader never sees half a file)."""
    tmp = path + ".part"
    with open(tmp, "wb") as f:
        f.write(data)
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)


def fsync_tree(root: str) -> None:
    """fsync every file and directory under root (TensorStore syncs its files; this covers ours)."""
    for dirpath, _dirs, names in os.walk(root):
        for fn in names:
            fsync_path(os.path.join(dirpath, fn))
        fsync_path(dirpath)


def fsync_path(path: str) -> None:
    """fsync one file or directory (a directory: so renames and new names in it are durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
