"""Byte sources: where the files of a checkpoint are read from (a local directory or an object
store prefix), by byte ranges, so a large record is never read whole."""

from __future__ import annotations

from pathlib import Path

from bridge.errors import BridgeError
from bridge.location import is_remote
from bridge.store.ranged import open_range
from converters.megatron.read.dcp_metadata import check_relative_path



class FileSource:
    """The files of a local checkpoint directory."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def location(self, rel: str) -> str:
        return str(check_relative_path(self.root, rel, str(self.root)))

    def read_whole(self, rel: str) -> bytes | None:
        p = self.root / rel
        return p.read_bytes() if p.is_file() else None

    def check_length(self, rel: str, end: int) -> None:
        """BridgeError when file `rel` is missing or shorter than `end` bytes."""
        p = self.root / rel
        if not p.is_file():
            raise BridgeError(f"missing shard file {p} (named in .metadata); copy the complete checkpoint")
        size = p.stat().st_size
        if size < end:
            raise BridgeError(f"truncated shard file {p}: {size} bytes, .metadata needs {end}; "
                              f"copy the complete checkpoint")


class ObjectSource:
    """The objects under an s3:// / gs:// prefix holding a torch_dist checkpoint."""

    def __init__(self, root: str) -> None:
        self.root = root

    def location(self, rel: str) -> str:
        return check_relative_path(self.root, rel, self.root)

    def read_whole(self, rel: str) -> bytes | None:
        from bridge.store import kvstore

        return kvstore.read_bytes(self.root, rel)

    def check_length(self, rel: str, end: int) -> None:
        """BridgeError when object `rel` is missing or shorter than `end` bytes (reads its last needed byte)."""
        where = self.location(rel)
        with open_range(where) as r:
            if end > 0 and len(r.pread(1, end - 1)) != 1:
                raise BridgeError(f"truncated shard file {where}: shorter than the {end} bytes .metadata needs; "
                                  f"copy the complete checkpoint")
            if end == 0 and self.read_whole(rel) is None:
                raise BridgeError(f"missing shard file {where} (named in .metadata); copy the complete checkpoint")


def source_of(root: Path | str) -> FileSource | ObjectSource:
    return ObjectSource(root) if isinstance(root, str) and is_remote(root) else FileSource(Path(root))


