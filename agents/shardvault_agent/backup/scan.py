"""Scan: which bytes of a shard's stream changed since its parent backup.

Terms:
- *scan*: reading every file of a capture once (``SCAN_THREADS`` files at a time), hashing
  its blocks (``blockmap``), writing this backup's block map and comparing each file with the
  parent's map. Reading is allowed;
  uploading unchanged bytes is not.
- *extents*: the changed byte ranges as ``(stream_offset, length)``, in stream order, merged.
  A full backup's extents are the whole stream (no parent: every block is new).
- *delta stream*: the concatenation of the extents' bytes. An incremental's objects are cut
  from its delta stream exactly as a full's are cut from its stream, so planning, packing and
  the part size do not change; ``DeltaReader`` reads a range of it from the files.
- *hash fragment*: a full reads every byte once, in its pack: ``PackHasher`` hashes the blocks
  an object's pack reads (each block belongs to the object holding its first byte) and keeps
  them as ``<offset>-<length>.hashes``; ``assemble_map`` joins the fragments of a shard into
  its block map when the data is all packed. The map then describes exactly the bytes that
  were uploaded, and a full no longer reads its data twice (a scan, then the pack).

- *unchanged file*: one whose size and file identity (``blockmap``: device, inode, mtime and
  ctime, taken before its first byte is read; none for a file changed since shortly before the
  backup's checkpoint) equal what its parent's map recorded. Its blocks are not read: the
  parent's hashes are copied into the new map, and nothing of it is sent. Size and mtime alone
  would not do (PostgreSQL rewrites pages in place within the same second, and anyone may set an
  mtime); ctime cannot be set back. Only engines whose capture says so
  (``Capture.trust_identity``: PostgreSQL's live data directory) skip files; SQLite's snapshots
  are new files every time. A cold table costs its ``stat``; every block of a changed file is
  read and hashed (0.05 s per GiB of CPU; the read itself is the cost, and ``scan_seconds``
  reports it).
- *screened file*: a changed file whose engine vouches for its blocks' headers (a
  ``BlockScreen``: PostgreSQL's page LSNs) and that the parent read at the same path, by
  device and inode. It is taken in ranges, each a task of the scan's threads; only the
  blocks the screen lets through are hashed, the others keep the parent's hashes, and their
  bytes count as ``screened_bytes``. A range is judged through a mapping by the agent's
  helper (``mappedscreen``: 256 MiB ranges, ``MAPPED_RANGE_READS``), which costs page-table
  entries rather than a copy of every byte (0.03 s for 1.5 GiB of relation files on one
  thread in a dev probe), and then only the blocks it let through are read. A paced backup
  (its limiter has a rate, or the adaptive throttle steers it), or one whose helper cannot
  answer, reads the range instead, a MiB at a time into the thread's buffer, judging each
  block by its header there; a paced scan cuts 16 MiB ranges (a relation's 1 GiB segment as
  one task kept one thread copying while the other had finished the smaller files). Whole
  reads rather than one ``pread`` per header: those cost as much CPU per GiB (0.15 to 0.2 s
  in a dev probe) but held the interpreter's lock between tiny calls. The copy is most of a
  read range's cost: 0.11 s per GiB on one thread of this project's test machine.
"""

from __future__ import annotations

import bisect
import itertools
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from shardvault.contracts.models import FileEntry
from shardvault.data.streams import StreamIndex
from shardvault.errors import CheckpointNotFound
from shardvault_agent.backup.blockmap import (
    BLOCK_SIZE,
    HASH_SIZE,
    NO_IDENTITY,
    READ_BLOCKS,
    BlockMap,
    FileIdentity,
    Hashed,
    block_count,
    block_hash,
    changes,
    hash_blocks,
    identity_of,
    merge_extents,
    scan_file,
    write_map,
)
from shardvault_agent.backup.mappedscreen import MappedScreener
from shardvault_agent.engines.base import BlockScreen
from shardvault_agent.ratelimit import RateLimiter
from shardvault_agent.transfer import StreamReader, read_exactly

# Files read and hashed at once: a read's copy from the page cache runs without the GIL while
# another file's blocks are hashed (a scan of 1.6 GiB took 0.4 s on one thread).
SCAN_THREADS = 2
# A screened file is judged in ranges of this many reads (16 MiB), each a task of the scan's
# threads: a relation's 1 GiB segments, one task each, kept one thread copying for most of
# the scan while the other had finished the smaller files.
SCREEN_RANGE_READS = 16
# Through the mapped screen, a range of a file costs its mapping and a request to the helper,
# not a copy: ranges of 256 MiB (four to a relation's segment) hold the helper's requests to
# a few per file while the threads still share a large file's blocks to hash.
MAPPED_RANGE_READS = 256


@dataclass(frozen=True)
class ScanResult:
    extents: list[tuple[int, int]]
    stream_bytes: int
    scan_seconds: float
    unchanged_bytes: int = 0  # of unchanged files: not read
    screened_bytes: int = 0  # of blocks a screen proved unchanged: only their headers read
    mapped_bytes: int = 0  # of screened files' ranges judged through a mapping (mappedscreen)

    @property
    def delta_bytes(self) -> int:
        return sum(length for _, length in self.extents)


@dataclass(frozen=True)
class ScannedFile:
    hashes: bytes
    changes: list[tuple[int, int]]  # the byte ranges that differ from the parent's, merged
    screened_bytes: int = 0
    mapped_bytes: int = 0


Scanning = Callable[[], ScannedFile]  # a changed file's scan, under way in the scan's threads


def scan_capture(
    root: Path,
    files: list[FileEntry],
    limiter: RateLimiter,
    parent: BlockMap | None,
    map_path: Path,
    block_size: int = BLOCK_SIZE,
    trusted_before: float | None = None,
    screen: BlockScreen | None = None,
    mapped: MappedScreener | None = None,
) -> ScanResult:
    """Hashes every block of the capture into a new block map at ``map_path`` and returns the
    extents that differ from ``parent`` (all of them without a parent, or with a parent of
    another block size). With ``trusted_before`` (the checkpoint's time, for an engine whose
    capture trusts identities), an unchanged file (see the module docstring) is not read:
    its parent's hashes are its own; with ``screen``, a screened file's blocks are read only
    where their headers say they may have changed, judged through ``mapped`` (the agent's
    helper; see ``mappedscreen``) where it answers, else from reads of the whole range."""
    if parent is not None and parent.block_size != block_size:
        parent = None
    started, extents, offset, unchanged, screened = time.monotonic(), [], 0, 0, 0
    mapped_total = 0
    # A paced backup (a rate limit, the adaptive throttle) reads its ranges a MiB at a time,
    # taking from its limiter between reads: a mapping is judged a range at once.
    mapped = None if limiter.paced() else mapped

    def scan(entry: FileEntry) -> ScannedFile:
        reader = StreamReader(root, [entry], 0, entry.size, limiter)
        hashes = scan_file(lambda n: read_exactly(reader, n), entry.size, block_size)
        before = parent.hashes(entry.path) if parent is not None else None
        return ScannedFile(hashes, changes(hashes, before, entry.size, block_size))

    def screen_of(entry: FileEntry, identity: FileIdentity) -> BlockScreen | None:
        """The screen for ``entry``, when its engine vouches for its blocks and the parent
        read it at the same path (device and inode)."""
        if screen is None or parent is None or block_size != BLOCK_SIZE:
            return None
        if not (screen.screens(entry.path) and parent.same_file(entry.path, identity)):
            return None
        return screen

    def screening(
        pool: ThreadPoolExecutor,
        entry: FileEntry,
        before: memoryview | bytes,
        vouching: BlockScreen,
    ) -> Scanning:
        """A screened file's ranges, each a task of the pool, joined when asked for."""
        path = root / entry.path
        parts = [
            pool.submit(
                screen_range, path, entry.size, before, vouching, limiter, blocks, mapped=mapped
            )
            for blocks in screen_ranges(entry.size, block_size, mapped is not None)
        ]
        return lambda: joined_screen(entry.size, [p.result() for p in parts], block_size)

    def hashed(pool: ThreadPoolExecutor) -> Iterator[Hashed]:
        nonlocal offset, unchanged, screened, mapped_total
        # Each identity is taken before its file is read; the changed files are read and
        # hashed SCAN_THREADS at a time (a screened file in ranges), and their hashes taken
        # in listing order.
        listed: list[tuple[FileEntry, FileIdentity, Scanning | None]] = []
        for entry in mapped_files(files):
            identity = file_identity(root, entry, trusted_before)
            if parent is not None and parent.unchanged(entry.path, entry.size, identity):
                listed.append((entry, identity, None))
            elif parent is not None and (vouching := screen_of(entry, identity)) is not None:
                before = parent.hashes(entry.path) or b""
                listed.append((entry, identity, screening(pool, entry, before, vouching)))
            else:
                listed.append((entry, identity, pool.submit(scan, entry).result))
        for entry, identity, scanning in listed:
            if scanning is None:
                hashes = bytes(parent.hashes(entry.path) or b"") if parent is not None else b""
                unchanged += entry.size
            else:
                scanned = scanning()
                hashes = scanned.hashes
                extents.extend((offset + o, n) for o, n in scanned.changes)
                screened += scanned.screened_bytes
                mapped_total += scanned.mapped_bytes
            offset += entry.size
            yield entry.path, entry.size, hashes, identity

    with ThreadPoolExecutor(SCAN_THREADS) as pool:
        try:
            write_map(map_path, block_size, hashed(pool))
        except BaseException:
            pool.shutdown(cancel_futures=True)
            raise
    seconds = round(time.monotonic() - started, 3)
    return ScanResult(merge_extents(extents), offset, seconds, unchanged, screened, mapped_total)


@dataclass(frozen=True)
class ScreenedRange:
    """A range of a screened file's blocks: their hashes, the file's indexes of those that
    changed, and the bytes of the blocks the screen let through (read and hashed)."""

    hashes: bytes
    changed: list[int]
    hashed: int
    mapped: int = 0  # the range's bytes, when judged through a mapping


def screen_ranges(size: int, block_size: int = BLOCK_SIZE, mapped: bool = False) -> list[range]:
    """A file's blocks in ranges of ``SCREEN_RANGE_READS`` reads (``MAPPED_RANGE_READS``
    through the mapped screen), each screened on its own."""
    step = (MAPPED_RANGE_READS if mapped else SCREEN_RANGE_READS) * READ_BLOCKS
    count = block_count(size, block_size)
    return [range(first, min(first + step, count)) for first in range(0, count, step)]


def screen_range(
    path: Path,
    size: int,
    before: memoryview | bytes,
    screen: BlockScreen,
    limiter: RateLimiter,
    blocks_range: range,
    block_size: int = BLOCK_SIZE,
    mapped: MappedScreener | None = None,
) -> ScreenedRange:
    """Screens ``blocks_range`` of a file: the blocks' hashes (the parent's ``before`` where
    the screen proves a block unchanged), which changed, and the bytes hashed. The screen
    judges the range through ``mapped`` when it answers (then only the blocks it lets
    through are read), else from reads of ``READ_BLOCKS`` at a time into the thread's
    buffer; a file that shrank since its listing reads as zeros past its end, as
    ``StreamReader`` reads it."""
    start, stop = blocks_range.start, blocks_range.stop
    known = min(len(before) // HASH_SIZE, stop)  # blocks the parent hashed
    hashes = bytearray((stop - start) * HASH_SIZE)
    if known > start:
        hashes[: (known - start) * HASH_SIZE] = before[start * HASH_SIZE : known * HASH_SIZE]
    changed: list[int] = []
    hashed = 0

    def judge(i: int, block: memoryview) -> None:
        """Hashes block ``i``, a block the screen let through (or one past the parent's)."""
        nonlocal hashed
        at = (i - start) * HASH_SIZE
        hashed += len(block)
        digest = block_hash(block)
        if i >= known or digest != hashes[at : at + HASH_SIZE]:
            hashes[at : at + HASH_SIZE] = digest
            changed.append(i)

    offset, length = start * block_size, min(stop * block_size, size) - start * block_size
    chunk = _read_buffer(READ_BLOCKS * block_size)
    try:
        fd: int | None = os.open(path, os.O_RDONLY)
    except FileNotFoundError:  # removed since its listing: zeros, as StreamReader reads it
        fd = None
    try:
        differ = None
        if mapped is not None and fd is not None:  # never paced (scan_capture): takes no time
            limiter.take(length)  # the range, before its mapping is read (the guard too)
            differ = mapped.may_differ(path, offset, length, screen, block_size)
        if differ is not None:
            wanted = set(differ).union(range(max(known - start, 0), stop - start))
            for first, blocks in read_runs(fd, [start + n for n in sorted(wanted)], size, chunk):
                for n in range(block_count(len(blocks), block_size)):
                    judge(first + n, blocks[n * block_size : (n + 1) * block_size])
            return ScreenedRange(bytes(hashes), changed, hashed, mapped=length)
        for first in range(start, stop, READ_BLOCKS):
            blocks = chunk[: min(READ_BLOCKS * block_size, size - first * block_size)]
            read_into(fd, blocks, first * block_size)
            limiter.take(len(blocks))
            past_parent = range(max(known - first, 0), block_count(len(blocks), block_size))
            for n in sorted(set(screen.may_differ(blocks, block_size)).union(past_parent)):
                judge(first + n, blocks[n * block_size : (n + 1) * block_size])
    finally:
        if fd is not None:
            os.close(fd)
    return ScreenedRange(bytes(hashes), changed, hashed)


def read_runs(
    fd: int, indexes: list[int], size: int, buffer: memoryview, block_size: int = BLOCK_SIZE
) -> Iterator[tuple[int, memoryview]]:
    """Reads the blocks ``indexes`` (ascending) of a file of ``size`` bytes in runs of
    consecutive blocks, at most ``buffer``'s size each (a whole number of blocks); yields each
    run's first block and its bytes (the last block cut short at ``size``, zeros past the
    file's end)."""
    for offset, length in merge_extents([(i * block_size, block_size) for i in indexes]):
        for at in range(offset, offset + length, len(buffer)):
            run = buffer[: min(len(buffer), offset + length - at, size - at)]
            read_into(fd, run, at)
            yield at // block_size, run


def joined_screen(size: int, parts: list[ScreenedRange], block_size: int) -> ScannedFile:
    """A screened file from its ranges, in order."""
    changed = [i for part in parts for i in part.changed]
    ranges = merge_extents(
        [(i * block_size, min(block_size, size - i * block_size)) for i in changed]
    )
    hashed = sum(part.hashed for part in parts)
    mapped = sum(part.mapped for part in parts)
    return ScannedFile(b"".join(part.hashes for part in parts), ranges, size - hashed, mapped)


_buffers = threading.local()


def _read_buffer(size: int) -> memoryview:
    """This thread's read buffer of ``size`` bytes, reused from one range to the next (a new
    MiB each time is a MiB of fresh pages to fault in)."""
    buffer = getattr(_buffers, "buffer", None)
    if buffer is None or len(buffer) != size:
        buffer = _buffers.buffer = memoryview(bytearray(size))
    return buffer


def read_into(fd: int | None, buffer: memoryview, offset: int) -> None:
    """Fills ``buffer`` from ``offset`` of ``fd``; zeros past the file's end (it shrank, or
    it is gone: ``fd`` None)."""
    done = 0
    while fd is not None and done < len(buffer):
        n = os.preadv(fd, [buffer[done:]], offset + done)
        if n <= 0:
            break
        done += n
    if done < len(buffer):
        buffer[done:] = bytes(len(buffer) - done)


def file_identity(root: Path, entry: FileEntry, trusted_before: float | None) -> FileIdentity:
    """``entry``'s identity now, before its bytes are read, judged against its checkpoint's
    time ``trusted_before``; none without one, or when the file is gone or no longer of its
    listed size (it is changing)."""
    if trusted_before is None:
        return NO_IDENTITY
    try:
        stat = os.stat(root / entry.path)
    except FileNotFoundError:
        return NO_IDENTITY
    if stat.st_size != entry.size:
        return NO_IDENTITY
    return identity_of(stat, int(trusted_before * 1_000_000_000))


IDENTITIES = "identities.json"  # beside a full's hash fragments


def save_identities(
    directory: Path, root: Path, files: list[FileEntry], trusted_before: float | None
) -> None:
    """Takes the identities of a full's mapped files, in listing order, before its packs read
    anything, and keeps them beside its hash fragments for ``assemble_map``."""
    identities = [list(file_identity(root, entry, trusted_before)) for entry in mapped_files(files)]
    directory.mkdir(parents=True, exist_ok=True)
    partial = directory / f"{IDENTITIES}.partial"
    partial.write_text(json.dumps(identities))
    partial.replace(directory / IDENTITIES)


def _saved_identities(directory: Path, files: list[FileEntry]) -> list[FileIdentity]:
    path = directory / IDENTITIES
    if not path.exists():  # none taken (an older agent's checkpoint): nothing is skipped later
        return [NO_IDENTITY for _ in mapped_files(files)]
    return [FileIdentity(*identity) for identity in json.loads(path.read_text())]


def mapped_files(files: list[FileEntry]) -> Iterator[FileEntry]:
    """The entries a block map lists: files, not directories (``path/``)."""
    return (entry for entry in files if not entry.path.endswith("/"))


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


class PackHasher:
    """Hashes, as a full's pack reads them, the blocks whose first byte lies in the object's
    range of the stream. A block that runs past the range's end is completed by ``read_at``
    (at most one block more is read); one that began before the range belongs to the object
    before."""

    def __init__(
        self,
        files: list[FileEntry],
        offset: int,
        length: int,
        read_at: Callable[[int, int], bytes],
        block_size: int = BLOCK_SIZE,
    ) -> None:
        self.index, self.read_at, self.block_size = StreamIndex(files), read_at, block_size
        self.sizes = {f.path: f.size for f in files}
        self.position, self.end = offset, offset + length
        self.pending = bytearray()  # the bytes read so far of a block of ours not yet complete
        self.pending_end = 0  # where that block ends, as a stream offset
        self.digests: list[bytes] = []

    def tap(self, read: Callable[[int], bytes]) -> Callable[[int], bytes]:
        """``read`` that hashes what passes through it."""

        def tapped(size: int) -> bytes:
            data = read(size)
            self.feed(data)
            return data

        return tapped

    def feed(self, data: bytes) -> None:
        view, start = memoryview(data), self.position
        for seg in self.index.segments(start, len(data)):
            at = seg.stream_offset - start
            chunk = view[at : at + seg.length]
            self._feed_segment(seg.stream_offset, seg.file_offset, self.sizes[seg.path], chunk)
        self.position += len(data)

    def _feed_segment(
        self, stream_offset: int, file_offset: int, file_size: int, chunk: memoryview
    ) -> None:
        size, at, stop = self.block_size, file_offset, file_offset + len(chunk)
        if at % size:  # inside a block: ours if it began in our range (``pending``)
            block_end = min(at - at % size + size, file_size)
            take = min(block_end, stop) - at
            if self.pending:
                self.pending += chunk[:take]
                if at + take == block_end:
                    self.digests.append(block_hash(bytes(self.pending)))
                    self.pending.clear()
            at += take
        if at == stop:
            return
        # Whole blocks, the file's short last block among them when the chunk reaches it.
        whole_end = stop if stop == file_size else at + (stop - at) // size * size
        self.digests.append(hash_blocks(chunk[at - file_offset : whole_end - file_offset], size))
        if whole_end < stop:  # a block of ours that continues in the next read
            self.pending = bytearray(chunk[whole_end - file_offset :])
            block_end = min(whole_end + size, file_size)
            self.pending_end = stream_offset + (block_end - file_offset)

    def fragment(self) -> bytes:
        """The hashes of the range's blocks, once the pack has read all of it."""
        if self.position != self.end:
            raise ValueError(f"hashed to {self.position}, not to the range's end {self.end}")
        if self.pending:  # a block that crosses into the next object: read its rest
            self.pending += self.read_at(self.end, self.pending_end - self.end)
            self.digests.append(block_hash(bytes(self.pending)))
            self.pending.clear()
        return b"".join(self.digests)


def fragment_name(offset: int, length: int) -> str:
    return f"{offset:020d}-{length:020d}.hashes"


def write_fragment(directory: Path, offset: int, length: int, digests: bytes) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / fragment_name(offset, length)
    path.with_suffix(".partial").write_bytes(digests)
    path.with_suffix(".partial").replace(path)


def assemble_map(
    directory: Path, files: list[FileEntry], map_path: Path, block_size: int = BLOCK_SIZE
) -> None:
    """Joins a full's hash fragments into its block map. The fragments must tile the stream:
    a missing one means a pack's hashes were lost, and a map of bytes read again now might
    not describe the bytes that were uploaded, so the backup fails instead."""
    fragments = sorted(directory.glob("*.hashes")) if directory.exists() else []
    expected, digests = 0, []
    for path in fragments:
        offset, length = (int(part) for part in path.stem.split("-"))
        if offset != expected:
            break
        digests.append(path.read_bytes())
        expected = offset + length
    stream_length = StreamIndex(files).length
    if expected != stream_length:
        raise CheckpointNotFound(
            f"this agent kept the block hashes of bytes 0 to {expected} of {stream_length} of "
            "the stream; the rest were lost (was its state directory cleared?).",
            fix="retry the backup.",
        )
    hashes = b"".join(digests)
    identities = _saved_identities(directory, files)

    def split() -> Iterator[Hashed]:
        at = 0
        for entry, identity in zip(mapped_files(files), identities, strict=True):
            count = block_count(entry.size, block_size) * HASH_SIZE
            yield entry.path, entry.size, hashes[at : at + count], identity
            at += count
        if at != len(hashes):  # raised before the map is put in place
            raise ValueError(f"{len(hashes) - at} bytes of block hashes left over")

    write_map(map_path, block_size, split())
