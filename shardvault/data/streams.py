"""Mapping between a shard's stream and its files.

A *segment* is the part of one file that falls inside a byte range of the stream. The agent
reads an object as the segments of its range; a restore writes them back the same way.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterator
from dataclasses import dataclass

from shardvault.contracts.models import FileEntry


@dataclass(frozen=True)
class Segment:
    path: str
    file_offset: int
    length: int
    stream_offset: int


class StreamIndex:
    """Cumulative offsets of a file list, for finding the files under a byte range."""

    def __init__(self, files: list[FileEntry]) -> None:
        self.files = files
        self.starts = [0, *itertools.accumulate(f.size for f in files)]

    @property
    def length(self) -> int:
        return self.starts[-1]

    def segments(self, offset: int, length: int) -> Iterator[Segment]:
        end = offset + length
        i = max(0, bisect.bisect_right(self.starts, offset) - 1)
        while i < len(self.files) and self.starts[i] < end:
            start = self.starts[i]
            lo, hi = max(offset, start), min(end, start + self.files[i].size)
            if hi > lo:
                yield Segment(self.files[i].path, lo - start, hi - lo, lo)
            i += 1
