"""Scans: a capture's changed extents against a parent's block map, and reading them back."""

from __future__ import annotations

import itertools
import os
import random
from pathlib import Path

import pytest
from shardvault_agent.blockmap import BLOCK_SIZE, HASH_SIZE, BlockMap
from shardvault_agent.ratelimit import RateLimiter
from shardvault_agent.scan import (
    DeltaReader,
    PackHasher,
    assemble_map,
    scan_capture,
    write_fragment,
)
from shardvault_agent.transfer import stream_source

from shardvault.errors import CheckpointNotFound
from shardvault.models import FileEntry

B = BLOCK_SIZE


def capture(root: Path, files: dict[str, bytes]) -> list[FileEntry]:
    entries = []
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
        entries.append(FileEntry(path=name, size=len(data)))
    return entries


def test_a_full_scan_changes_everything_and_an_incremental_only_what_changed(tmp_path: Path):
    root, limiter = tmp_path / "data", RateLimiter(None)
    files = {"base/1/16384": os.urandom(20 * B), "base/1/16385": os.urandom(3 * B + 5)}
    listing = capture(root, files)
    full = scan_capture(root, listing, limiter, None, tmp_path / "full.map")
    assert full.extents == [(0, 23 * B + 5)]
    assert full.delta_bytes == full.stream_bytes == 23 * B + 5

    with open(root / "base/1/16384", "r+b") as f:  # one row in block 7
        f.seek(7 * B + 100)
        f.write(b"x")
    with open(root / "base/1/16385", "ab") as f:  # the second file grows
        f.write(os.urandom(B))
    listing = [FileEntry(path=p, size=(root / p).stat().st_size) for p in files]
    with BlockMap(tmp_path / "full.map") as parent:
        incr = scan_capture(root, listing, limiter, parent, tmp_path / "incr.map")
    assert incr.extents == [
        (7 * B, B),
        (20 * B + 3 * B, B + 5),
    ]  # block 3 (partial) and the new one
    stream = b"".join((root / p).read_bytes() for p in files)
    delta = DeltaReader(root, listing, incr.extents, 0, incr.delta_bytes, limiter)
    got = delta.read(5) + delta.read(incr.delta_bytes)
    assert got == stream[7 * B : 8 * B] + stream[23 * B : 24 * B + 5]


def test_an_unchanged_capture_has_no_extents(tmp_path: Path):
    root, limiter = tmp_path / "data", RateLimiter(None)
    listing = capture(root, {"a": os.urandom(5 * B), "b": b""})
    scan_capture(root, listing, limiter, None, tmp_path / "one.map")
    with BlockMap(tmp_path / "one.map") as parent:
        again = scan_capture(root, listing, limiter, parent, tmp_path / "two.map")
    assert again.extents == []
    assert again.stream_bytes == 5 * B


def test_a_parent_of_another_block_size_is_ignored(tmp_path: Path):
    root, limiter = tmp_path / "data", RateLimiter(None)
    listing = capture(root, {"a": os.urandom(4 * B)})
    scan_capture(root, listing, limiter, None, tmp_path / "p.map", block_size=2 * B)
    with BlockMap(tmp_path / "p.map") as parent:
        result = scan_capture(root, listing, limiter, parent, tmp_path / "c.map")
    assert result.extents == [(0, 4 * B)]


def test_a_delta_read_spans_files_and_reads_a_vanished_file_as_zeros(tmp_path: Path):
    """An extent may cross from one file into the next; a file dropped since the listing (a
    table dropped during the backup) reads as zeros, which its WAL replay repairs."""
    root, limiter = tmp_path / "data", RateLimiter(None)
    files = {"a": os.urandom(2 * B), "b": os.urandom(2 * B), "gone": os.urandom(B)}
    listing = capture(root, files)
    (root / "gone").unlink()
    extents = [(B + 10, 2 * B), (4 * B + 5, 100)]  # a's end into b; inside "gone"
    delta = DeltaReader(root, listing, extents, 0, 2 * B + 100, limiter)

    got = b"".join(iter(lambda: delta.read(3000), b""))

    stream = files["a"] + files["b"]
    assert got == stream[B + 10 : 3 * B + 10] + b"\0" * 100
    assert delta.handles == {}  # every file closed once the range was read


def pack_hashed(root: Path, entries: list[FileEntry], cuts: list[int], reads: int) -> Path:
    """Hashes the stream as packs of the objects between ``cuts`` would, reading ``reads``
    bytes at a time, and assembles the fragments into a block map."""
    hashes = root.parent / "hashes"
    for offset, end in itertools.pairwise(cuts):
        read = stream_source(root, entries, offset, end - offset, RateLimiter(None))
        hasher = PackHasher(entries, offset, end - offset, lambda o, n: at(root, entries, o, n))
        tapped, left = hasher.tap(read), end - offset
        while left:
            left -= len(tapped(min(reads, left)))
        write_fragment(hashes, offset, end - offset, hasher.fragment())
    assemble_map(hashes, entries, root.parent / "packed.map")
    return root.parent / "packed.map"


def at(root: Path, entries: list[FileEntry], offset: int, length: int) -> bytes:
    return stream_source(root, entries, offset, length, RateLimiter(None))(length)


def test_a_full_hashed_by_its_packs_has_the_block_map_a_scan_makes(tmp_path: Path):
    # Files that end inside a block, an empty one, a directory; objects cut inside blocks and
    # inside files, read in pieces smaller and larger than a block.
    rng = random.Random(7)
    files = {
        "a": rng.randbytes(3 * BLOCK_SIZE + 100),
        "b": b"",
        "c": rng.randbytes(BLOCK_SIZE),
        "d": rng.randbytes(5 * BLOCK_SIZE - 1),
        "e": rng.randbytes(17),
    }
    entries = capture(tmp_path / "root", files)
    entries.insert(2, FileEntry(path="dir/", size=0))
    total = sum(len(data) for data in files.values())
    scanned = tmp_path / "scanned.map"
    scan_capture(tmp_path / "root", entries, RateLimiter(None), None, scanned)
    for cuts, reads in [
        ([0, total], 1 << 20),
        ([0, 5000, BLOCK_SIZE * 3 + 50, BLOCK_SIZE * 4 + 200, total], 3000),
        ([0, *sorted(rng.sample(range(1, total), 6)), total], 777),
    ]:
        for old in (tmp_path / "hashes").glob("*"):
            old.unlink()
        packed = pack_hashed(tmp_path / "root", entries, cuts, reads)
        assert packed.read_bytes() == scanned.read_bytes(), cuts


def test_a_lost_hash_fragment_fails_the_map_by_name(tmp_path: Path):
    entries = capture(tmp_path / "root", {"a": os.urandom(3 * BLOCK_SIZE)})
    hashes = tmp_path / "hashes"
    write_fragment(hashes, 0, BLOCK_SIZE, b"\0" * HASH_SIZE)  # the second object's are missing
    with pytest.raises(CheckpointNotFound, match="were lost"):
        assemble_map(hashes, entries, tmp_path / "packed.map")
    assert not (tmp_path / "packed.map").exists()
