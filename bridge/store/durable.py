"""Durability helpers: atomic JSON files and fsync of files and directory trees."""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor


def write_json_atomic(path: str, obj) -> None:
    """Write JSON via tmp file + fsync + rename (a reader never sees half a file)."""
    tmp = path + ".part"
    with open(tmp, "w") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def fsync_tree(root: str, threads: int = 1) -> None:
    """fsync every file and directory under root, on `threads` threads (files before their dirs)."""
    files, dirs = [], []
    for dirpath, _dirs, names in os.walk(root):
        files += [os.path.join(dirpath, fn) for fn in names]
        dirs.append(dirpath)
    if threads > 1 and len(files) > 1:
        with ThreadPoolExecutor(min(threads, len(files))) as pool:
            list(pool.map(fsync_path, files))
    else:
        for f in files:
            fsync_path(f)
    for d in dirs:
        fsync_path(d)


def fsync_path(path: str) -> None:
    """fsync one file or directory (a directory: so renames and new names in it are durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
