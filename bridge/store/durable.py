"""Durability helpers: atomic JSON files and fsync of files and directory trees."""

from __future__ import annotations

import json
import os


def write_json_atomic(path: str, obj) -> None:
    """Write JSON via tmp file + fsync + rename (a reader never sees half a file)."""
    tmp = path + ".part"
    with open(tmp, "w") as f:
        f.write(json.dumps(obj))  # json.dump streams through the pure-Python encoder: 3x slower
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
