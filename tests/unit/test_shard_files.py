"""Where a restore's bytes land: a chain member's scattered pieces (many small writes, some
across file boundaries, in any order) end up exactly where a contiguous write of the same
stream puts them, and the ranges flushed behind them cover every piece with few calls."""

from __future__ import annotations

import itertools
import os
import random

from shardvault_agent.restore.files import FLUSH_GAP, ShardFiles, dense_runs
from shardvault_agent.restore.objects import Placements

from shardvault.contracts.models import FileEntry
from shardvault.data.streams import StreamIndex

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


def test_pieces_resolved_to_files_land_where_a_contiguous_write_puts_them(tmp_path):
    # A chain member's placements (frame, offset in frame, length, stream offset), some
    # across file boundaries and around the empty file: resolved once, each piece one pwrite.
    stream = os.urandom(sum(size for _, size in FILES))
    cuts = sorted({0, len(stream), *random.Random(9).sample(range(1, len(stream)), 30)})
    frame_size = 4096
    numbers: list[int] = []
    delta = b""  # the member's bytes, in the order its object holds them
    for start, end in random.Random(10).sample(list(itertools.pairwise(cuts)), len(cuts) - 1):
        at = start
        while at < end:  # a piece never crosses a frame of the object
            frame, inside = divmod(len(delta), frame_size)
            take = min(end - at, frame_size - inside)
            numbers += [frame, inside, take, at]
            delta += stream[at : at + take]
            at += take
    files = staged(tmp_path)
    pieces = files.resolve(Placements.of(numbers))
    for frame, runs in pieces.items():
        plain = memoryview(delta)[frame * frame_size : (frame + 1) * frame_size]
        for inside, length, fd, at, _ in runs:
            os.pwrite(fd, plain[inside : inside + length], at)
    files.close()

    assert contents(tmp_path) == stream


def test_pieces_close_together_are_flushed_as_one_range():
    far = 10 * FLUSH_GAP
    # (fd, file offset, length): two pieces of one file close together, one far, and one of
    # another file at the same offsets
    writes = [(3, 0, 8192), (3, 3 * 8192, 8192), (3, far, 8192), (4, 8192, 8192)]

    assert dense_runs(writes) == [(3, 0, 4 * 8192), (3, far, 8192), (4, 8192, 8192)]


def test_scattered_pieces_are_left_to_the_fsync_at_finish():
    # An incremental's blocks, one 8 KiB piece every 256 KiB: starting writeback over the
    # span would walk 32 times the bytes written; a dense run among them is still flushed.
    step = 32 * 8192
    scattered = [(3, i * step, 8192) for i in range(40)]
    dense = [(3, 100 * FLUSH_GAP + i * 8192, 8192) for i in range(64)]

    assert dense_runs(scattered + dense) == [(3, 100 * FLUSH_GAP, 64 * 8192)]
