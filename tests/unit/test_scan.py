"""Scans: a capture's changed extents against a parent's block map, and reading them back."""

from __future__ import annotations

import itertools
import os
import random
import time
from pathlib import Path

import pytest
from shardvault_agent.backup.blockmap import (
    BLOCK_SIZE,
    HASH_SIZE,
    NO_IDENTITY,
    BlockMap,
    hash_blocks,
)
from shardvault_agent.backup.scan import (
    DeltaReader,
    PackHasher,
    assemble_map,
    save_identities,
    scan_capture,
    write_fragment,
)
from shardvault_agent.ratelimit import RateLimiter
from shardvault_agent.transfer import stream_source

from shardvault.contracts.models import FileEntry
from shardvault.errors import CheckpointNotFound

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


# --- unchanged files: not read (see scan's module docstring) -----------------------------------
def scanned(
    root: Path,
    files: dict[str, bytes],
    parent: Path | None,
    out: Path,
    trust: bool = True,
    checkpoint_at: float | None = None,
):
    """A scan as an agent makes it after a checkpoint at ``checkpoint_at`` (default: now)."""
    listing = [FileEntry(path=p, size=(root / p).stat().st_size) for p in files]
    at = (checkpoint_at or time.time()) if trust else None
    if parent is None:
        return scan_capture(root, listing, RateLimiter(None), None, out, trusted_before=at)
    with BlockMap(parent) as map_:
        return scan_capture(root, listing, RateLimiter(None), map_, out, trusted_before=at)


@pytest.fixture
def no_racy_margin(monkeypatch):
    """Files written by the test a moment ago count as old enough to prove themselves; the
    test then waits for the next tick of the clock behind ctime (``next_tick``) before it
    changes one, which the margin does in a real scan."""
    monkeypatch.setattr("shardvault_agent.backup.blockmap.RACY_SECONDS", 0)


def next_tick() -> None:
    time.sleep(0.05)  # the coarse clock ticks every 1 to 10 ms


def test_a_file_unchanged_since_the_parent_is_not_read_and_keeps_its_hashes(
    tmp_path: Path, no_racy_margin
):
    root = tmp_path / "data"
    files = {"base/1/cold": os.urandom(40 * B + 3), "base/1/hot": os.urandom(8 * B)}
    capture(root, files)
    scanned(root, files, None, tmp_path / "full.map")
    next_tick()
    with open(root / "base/1/hot", "r+b") as f:  # the hot table changes; the cold one does not
        f.seek(2 * B)
        f.write(b"changed")

    incremental = scanned(root, files, tmp_path / "full.map", tmp_path / "incr.map")

    assert incremental.unchanged_bytes == 40 * B + 3  # the cold file: one stat, no read
    cold_offset = 0  # listing order: cold first
    assert incremental.extents == [(cold_offset + 40 * B + 3 + 2 * B, B)]
    with BlockMap(tmp_path / "incr.map") as new, BlockMap(tmp_path / "full.map") as old:
        assert bytes(new.hashes("base/1/cold")) == bytes(old.hashes("base/1/cold"))
        assert new.entries["base/1/cold"].identity == old.entries["base/1/cold"].identity
    again = scanned(root, files, tmp_path / "incr.map", tmp_path / "again.map")
    assert again.unchanged_bytes == 40 * B + 3 + 8 * B  # a skipped file's identity carries on
    assert again.extents == []


def test_a_same_size_rewrite_with_its_mtime_put_back_is_read_and_found(
    tmp_path: Path, no_racy_margin
):
    """Size and mtime are what a careless shortcut trusts, and both can be forged: ctime
    moves with the write and cannot be set back, so the change is found."""
    root = tmp_path / "data"
    files = {"rel": os.urandom(16 * B)}
    capture(root, files)
    scanned(root, files, None, tmp_path / "full.map")
    before = os.stat(root / "rel")
    next_tick()
    with open(root / "rel", "r+b") as f:
        f.seek(9 * B)
        f.write(os.urandom(B))  # same size
    os.utime(root / "rel", ns=(before.st_atime_ns, before.st_mtime_ns))
    assert os.stat(root / "rel").st_mtime_ns == before.st_mtime_ns

    incremental = scanned(root, files, tmp_path / "full.map", tmp_path / "incr.map")

    assert incremental.unchanged_bytes == 0
    assert incremental.extents == [(9 * B, B)]


def test_a_file_changed_just_before_the_parents_scan_proves_nothing(tmp_path: Path):
    """With the real margin, a file written a moment ago gets no identity (a write later in
    the same clock tick would leave its ctime as recorded): the next scan reads it again."""
    root = tmp_path / "data"
    files = {"rel": os.urandom(4 * B)}
    capture(root, files)
    scanned(root, files, None, tmp_path / "full.map")
    with BlockMap(tmp_path / "full.map") as full:
        identity = full.entries["rel"].identity
        assert not identity.trusted  # its times prove nothing; where it is, still
        assert identity.inode == os.stat(root / "rel").st_ino

    incremental = scanned(root, files, tmp_path / "full.map", tmp_path / "incr.map")

    assert incremental.unchanged_bytes == 0


def test_a_file_written_after_the_checkpoint_proves_nothing(tmp_path: Path, no_racy_margin):
    """A write sets ctime as it starts and may still be copying bytes when the scan reads: a
    file whose newest change is not older than the checkpoint gets no identity."""
    root = tmp_path / "data"
    files = {"rel": os.urandom(4 * B)}
    capture(root, files)
    next_tick()
    checkpoint_at = time.time()
    next_tick()
    os.utime(root / "rel")  # a change after the checkpoint, before the scan's stat
    scanned(root, files, None, tmp_path / "full.map", checkpoint_at=checkpoint_at)
    with BlockMap(tmp_path / "full.map") as full:
        identity = full.entries["rel"].identity
        assert not identity.trusted  # its times prove nothing; where it is, still
        assert identity.inode == os.stat(root / "rel").st_ino

    incremental = scanned(root, files, tmp_path / "full.map", tmp_path / "incr.map")

    assert incremental.unchanged_bytes == 0


def test_an_engine_that_does_not_trust_identities_reads_every_file(tmp_path: Path, no_racy_margin):
    root = tmp_path / "data"
    files = {"rel": os.urandom(4 * B)}
    capture(root, files)
    scanned(root, files, None, tmp_path / "full.map", trust=False)
    incremental = scanned(root, files, tmp_path / "full.map", tmp_path / "incr.map", trust=False)
    assert incremental.unchanged_bytes == 0
    with BlockMap(tmp_path / "incr.map") as new:
        assert new.entries["rel"].identity == NO_IDENTITY


def test_a_full_records_the_identities_taken_before_its_packs_read(tmp_path: Path, no_racy_margin):
    """A full's map is joined from its packs' hashes; the identities beside them were taken
    at its scan, before any pack read: a file changed after that point proves nothing."""
    root = tmp_path / "data"
    files = {"a": os.urandom(3 * B), "b": os.urandom(2 * B)}
    entries = capture(root, files)
    hashes = tmp_path / "hashes"
    save_identities(hashes, root, entries, trusted_before=time.time())
    next_tick()
    os.utime(root / "b")  # changed after the identities were taken (ctime moves)
    data = b"".join(files.values())
    write_fragment(hashes, 0, len(data), hash_blocks(data, B))

    assemble_map(hashes, entries, tmp_path / "full.map")

    incremental = scanned(root, files, tmp_path / "full.map", tmp_path / "incr.map")
    assert incremental.unchanged_bytes == 3 * B  # "a" only
    assert incremental.extents == []  # "b" was read, and its bytes had not changed
