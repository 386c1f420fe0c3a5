"""Scan: which bytes of a shard's stream changed since its parent backup.

Terms:
- *scan*: reading every file of a capture once, hashing its blocks (``blockmap``), writing
  this backup's block map and comparing each file with the parent's map. Reading is allowed;
  uploading unchanged bytes is not.
- *extents*: the changed byte ranges as ``(stream_offset, length)``, in stream order, merged.
  A full backup's extents are the whole stream (no parent: every block is new).
- *delta stream*: the concatenation of the extents' bytes. An incremental's objects are cut
  from its delta stream exactly as a full's are cut from its stream, so planning, packing and
  the part size do not change; ``DeltaReader`` reads a range of it from the files.

No file is skipped for an unchanged size and modification time: PostgreSQL rewrites pages in
place within the same second and sets no mtime it promises, and SQLite snapshots are new files
every time, so neither engine makes that shortcut safe. Every block is hashed (0.05 s per GiB
of CPU; the read itself is the cost, and ``scan_seconds`` reports it).
"""

from __future__ import annotations

import bisect
import itertools
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from shardvault.models import FileEntry
from shardvault.streams import StreamIndex
from shardvault_agent.blockmap import (
    BLOCK_SIZE,
    BlockMap,
    BlockMapWriter,
    changes,
    merge_extents,
    scan_file,
)
from shardvault_agent.ratelimit import RateLimiter
from shardvault_agent.transfer import StreamReader, read_exactly


@dataclass(frozen=True)
class ScanResult:
    extents: list[tuple[int, int]]
    stream_bytes: int
    scan_seconds: float

    @property
    def delta_bytes(self) -> int:
        return sum(length for _, length in self.extents)


def scan_capture(
    root: Path,
    files: list[FileEntry],
    limiter: RateLimiter,
    parent: BlockMap | None,
    map_path: Path,
    block_size: int = BLOCK_SIZE,
) -> ScanResult:
    """Hashes every block of the capture into a new block map at ``map_path`` and returns the
    extents that differ from ``parent`` (all of them without a parent, or with a parent of
    another block size)."""
    if parent is not None and parent.block_size != block_size:
        parent = None
    started, extents, offset = time.monotonic(), [], 0
    partial = map_path.with_suffix(".partial")
    with open(partial, "wb") as out:
        writer = BlockMapWriter(out, block_size)
        for entry in files:
            if entry.path.endswith("/"):
                continue
            reader = StreamReader(root, [entry], 0, entry.size, limiter)
            hashes = scan_file(lambda n, r=reader: read_exactly(r, n), entry.size, block_size)
            writer.add(entry.path, entry.size, hashes)
            before = parent.hashes(entry.path) if parent is not None else None
            extents += [(offset + o, n) for o, n in changes(hashes, before, entry.size, block_size)]
            offset += entry.size
    partial.replace(map_path)
    return ScanResult(merge_extents(extents), offset, round(time.monotonic() - started, 3))


class DeltaReader:
    """Reads ``length`` bytes of a delta stream from ``offset``: the extents' bytes, in order,
    read from the capture's files. Files stay open from one extent to the next (an incremental
    after scattered writes has tens of thousands of 8 KiB extents) and are closed at the end;
    a file that shrank or vanished since the listing reads as zeros, as in ``StreamReader``."""

    def __init__(
        self,
        root: Path,
        files: list[FileEntry],
        extents: list[tuple[int, int]],
        offset: int,
        length: int,
        limiter: RateLimiter,
    ) -> None:
        self.root, self.index, self.limiter = root, StreamIndex(files), limiter
        self.extents = extents
        self.starts = [0, *itertools.accumulate(n for _, n in extents)]
        self.offset, self.remaining = offset, length
        self.handles: dict[str, BinaryIO | None] = {}

    def read(self, size: int) -> bytes:
        """Exactly ``size`` bytes (fewer only at the end of the range)."""
        want, pieces = min(size, self.remaining), []
        while want > 0:
            i = bisect.bisect_right(self.starts, self.offset) - 1
            stream_offset, length = self.extents[i]
            inside = self.offset - self.starts[i]
            take = min(want, length - inside)
            pieces.append(self._stream_bytes(stream_offset + inside, take))
            self.offset, self.remaining, want = (
                self.offset + take,
                self.remaining - take,
                want - take,
            )
        if not self.remaining:
            self.close()
        return b"".join(pieces)

    def _stream_bytes(self, offset: int, length: int) -> bytes:
        parts = []
        for seg in self.index.segments(offset, length):
            handle = self._handle(seg.path)
            data = os.pread(handle.fileno(), seg.length, seg.file_offset) if handle else b""
            parts.append(data + b"\0" * (seg.length - len(data)))
        self.limiter.take(length)
        return b"".join(parts)

    def _handle(self, path: str) -> BinaryIO | None:
        if path not in self.handles:
            try:
                self.handles[path] = open(self.root / path, "rb")  # noqa: SIM115 - closed by close()
            except (FileNotFoundError, IsADirectoryError):
                self.handles[path] = None
        return self.handles[path]

    def close(self) -> None:
        for handle in self.handles.values():
            if handle:
                handle.close()
        self.handles.clear()
