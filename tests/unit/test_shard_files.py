"""Where a restore's bytes land: a chain member's scattered pieces (many small writes, some
across file boundaries, in any order) end up exactly where a contiguous write of the same
stream puts them, and the ranges flushed behind them cover every piece with few calls."""

from __future__ import annotations

import itertools
import os
import random

from shardvault_agent.restore import FLUSH_GAP, ShardFiles, written_ranges

from shardvault.models import FileEntry
from shardvault.streams import StreamIndex

# Sizes a PostgreSQL shard has: pages, a file not a whole number of pages, an empty one.
FILES = [("base/1", 5 * 8192), ("global/pg_control", 8192 + 100), ("empty", 0), ("base/2", 9000)]


def staged(root) -> ShardFiles:
    for path, size in FILES:
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        with open(root / path, "wb") as out:
            out.truncate(size)
    return ShardFiles(root, StreamIndex([FileEntry(path=p, size=s) for p, s in FILES]))


def contents(root) -> bytes:
    return b"".join((root / path).read_bytes() for path, _ in FILES)


def test_scattered_pieces_land_where_a_contiguous_write_puts_them(tmp_path):
    stream = os.urandom(sum(size for _, size in FILES))
    whole, pieces = tmp_path / "whole", tmp_path / "pieces"
    whole.mkdir(), pieces.mkdir()
    files = staged(whole)
    files.write(0, stream)
    files.close()
    cuts = sorted({0, len(stream), *random.Random(7).sample(range(1, len(stream)), 40)})
    spans = list(itertools.pairwise(cuts))
    random.Random(8).shuffle(spans)  # in any order
    view = memoryview(stream)
    files = staged(pieces)
    for a, b in spans:
        files.write(a, view[a:b])
    files.close()

    assert contents(pieces) == contents(whole) == stream


class Read:
    def __init__(self, placements) -> None:
        self.placements = placements


def test_pieces_close_together_are_flushed_as_one_range():
    far = 10 * FLUSH_GAP
    # frame -> (offset in frame, length, stream offset)
    read = Read({0: [(0, 8192, 0), (8192, 8192, 3 * 8192)], 1: [(0, 8192, far)]})

    assert written_ranges(None, read) == [(0, 4 * 8192), (far, 8192)]


def test_scattered_pieces_are_left_to_the_fsync_at_finish():
    # An incremental's blocks, one 8 KiB piece every 256 KiB: starting writeback over the
    # span would walk 32 times the bytes written; a dense run among them is still flushed.
    step = 32 * 8192
    scattered = [(0, 8192, i * step) for i in range(40)]
    dense = [(0, 8192, 100 * FLUSH_GAP + i * 8192) for i in range(64)]
    read = Read({0: scattered, 1: dense})

    assert written_ranges(None, read) == [(100 * FLUSH_GAP, 64 * 8192)]
