"""A staged shard's files, as downloads write them: ``ShardFiles``; and how written bytes
reach the disk (writeback started as they land, one fsync per shard at finish).

*Pieces*: a chain object's placements (``objects.Placements``) resolved to open files once
per object, per frame: (offset in frame, length, file descriptor, offset in the file, offset
in the stream).
"""

from __future__ import annotations

import bisect
import ctypes
import ctypes.util
import os
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from shardvault.data.streams import StreamIndex
from shardvault_agent.restore.objects import Placements

Pieces = dict[int, list[tuple[int, int, int, int, int]]]
Write = tuple[int, int, int]  # fd, file offset, length


@dataclass
class ShardFiles:
    """A staged shard's stream of one phase: writes land at the right place of each file."""

    root: Path
    index: StreamIndex
    handles: dict[str, int] = field(default_factory=dict)
    guard: threading.Lock = field(default_factory=threading.Lock)

    def write(self, stream_offset: int, data: bytes) -> None:
        view = memoryview(data)
        for seg in self.index.segments(stream_offset, len(data)):
            start = seg.stream_offset - stream_offset
            os.pwrite(self._fd(seg.path), view[start : start + seg.length], seg.file_offset)

    def resolve(self, placements: Placements) -> Pieces:
        """Per frame, its pieces as ``(offset in frame, length, file descriptor, file
        offset, stream offset)``, from its placements: each piece is found in its files once,
        before the download, so that placing a chain member's tens of thousands of 8 KiB
        pieces costs one ``pwrite`` each. A piece inside one file (nearly all) takes one
        bisect."""
        starts, files = self.index.starts, self.index.files
        fds: dict[int, int] = {}
        resolved: Pieces = {}
        for frame, inside, length, target in placements:
            runs = resolved.setdefault(frame, [])
            k = bisect.bisect_right(starts, target) - 1
            if target + length <= starts[k + 1]:
                fd = fds.get(k)
                if fd is None:
                    fd = fds[k] = self._fd(files[k].path)
                runs.append((inside, length, fd, target - starts[k], target))
                continue
            for seg in self.index.segments(target, length):
                at = inside + seg.stream_offset - target
                runs.append(
                    (at, seg.length, self._fd(seg.path), seg.file_offset, seg.stream_offset)
                )
        return resolved

    def writes(self, stream_offset: int, length: int) -> list[Write]:
        """Where a contiguous range of the stream lands, file by file."""
        return [
            (self._fd(seg.path), seg.file_offset, seg.length)
            for seg in self.index.segments(stream_offset, length)
        ]

    def _fd(self, path: str) -> int:
        with self.guard:
            if path not in self.handles:
                self.handles[path] = os.open(self.root / path, os.O_WRONLY)
            return self.handles[path]

    def close(self) -> None:
        for fd in self.handles.values():
            os.close(fd)
        self.handles.clear()


def _sync_file_range() -> Callable[[int, int, int, int], int] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        call = libc.sync_file_range
    except (OSError, AttributeError):  # not Linux: the fsync at finish does it all
        return None
    call.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    call.restype = ctypes.c_int
    return call


SYNC_FILE_RANGE = _sync_file_range()
SYNC_FILE_RANGE_WRITE = 2  # <linux/fs.h>: start writeback of dirty pages, do not wait


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Asks the kernel to start writing ``[offset, offset + length)`` of ``fd`` to disk now.

    Without it the downloaded bytes sit dirty in the page cache (below the kernel's background
    threshold nothing is written for 30 s), and the flush at finish (PostgreSQL fsyncs its
    data directory when recovery starts) writes them all while the restore waits: 2.4 s for
    1.5 GiB in the benchmark. Started per part, writeback overlaps the download. PostgreSQL
    does the same for its own writes (``pg_flush_data``). Durability still comes from the
    fsync at finish; this only moves the work earlier."""
    if SYNC_FILE_RANGE is not None and length > 0:
        SYNC_FILE_RANGE(fd, offset, length, SYNC_FILE_RANGE_WRITE)  # advisory: errors ignored


# Written ranges closer than this are flushed as one: starting writeback of a range walks
# only its dirty pages, while one call per 8 KiB piece of a chain restore (tens of thousands)
# cost more than the download itself.
FLUSH_GAP = 1 << 20
# A merged range is flushed only when pieces fill at least this share of it: an incremental's
# scattered blocks spread a read's few writes over much of a file, and starting writeback
# there walks (and waits on) pages other reads are writing. Those are left to the fsync at
# finish; a full's frames, and the root of a chain's, stay dense and are flushed as they land.
FLUSH_DENSITY = 0.5


def dense_runs(writes: Iterable[Write]) -> list[Write]:
    merged: list[list[int]] = []  # [fd, start, end, bytes written]
    for fd, start, length in sorted(writes):
        end = start + length
        last = merged[-1] if merged else None
        if last and last[0] == fd and start <= last[2] + FLUSH_GAP:
            last[2] = max(last[2], end)
            last[3] += length
        else:
            merged.append([fd, start, end, length])
    return [
        (fd, start, end - start)
        for fd, start, end, written in merged
        if written >= FLUSH_DENSITY * (end - start)
    ]


def sync_tree(root: Path) -> None:
    """fsync every file, then every directory, under ``root``: one flush per shard rather
    than one per object (on ext4 an fsync can flush the whole journal, so per-object fsyncs
    of concurrent downloads wait on each other)."""
    for path in sorted(root.rglob("*")):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    for directory in [root, *(p for p in root.rglob("*") if p.is_dir())]:
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
