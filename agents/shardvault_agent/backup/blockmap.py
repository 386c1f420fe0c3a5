"""Block maps: what each block of a shard's files held at a backup, to find what changed since.

Terms:
- *block*: ``block_size`` bytes of one file (its last block may be shorter). 8 KiB, the
  PostgreSQL page: the unit PostgreSQL writes, so a changed row costs one block and not its
  neighbours; SQLite's pages (4 KiB by default) pair up in it, and a map of 8 KiB blocks
  costs 8 bytes per 8 KiB read (1 GiB per TiB on disk, 1 MiB of memory per 1 GiB file while
  it is compared; the whole map is never in memory).
- *block hash*: the first 8 bytes of the xxh3-128 digest of the block's bytes (about 20 GB/s
  on one core, measured in ``bench/compression_levels.py``; 400 ns per 8 KiB block with
  Python's call overhead). 64 bits are enough to say whether the block at one place of one
  file changed between two backups: a changed block goes unseen only if its new hash equals
  its old one, a chance of 2^-64 per changed block (for a TiB cluster rewriting a tenth of
  its blocks every night, once in billions of years). 16 bytes made the map, which does not
  compress, 4 % of a compressed full of pgbench data. Version-1 maps held all 16 bytes; they
  are still read (their hashes cut to 8 bytes), so a chain begun before keeps going.
- *block map*: per file of a listing, in listing order: its path, its size and its blocks'
  hashes. Written by the agent for every backup; an incremental compares the files it reads
  with its parent's map and sends only the blocks whose hash differs (or that the parent's
  file did not have).
- *changes*: the byte ranges of a file (block-aligned, merged when adjacent) that differ from
  the parent's; *extents* are the same ranges as offsets of the shard's stream.
- *file identity*: a file's device, inode, mtime and ctime (nanoseconds), taken before any of
  its bytes were read, or :data:`NO_IDENTITY` when it is not to be trusted (see
  :func:`identity_of`). The kernel sets a file's ctime to the current time on every write,
  truncate, rename or metadata change, and nothing can set it back (``utime`` sets mtime, and
  ctime with it to now), so a file whose identity and size are what the parent recorded holds
  the bytes the parent hashed: its blocks are not read again. A file changed within
  :data:`RACY_SECONDS` before its backup's checkpoint gets none, for two reasons. The clock
  behind ctime ticks in milliseconds, so a write later in the same tick would leave ctime as
  recorded (git's "racily clean" entries, pgBackRest's wait for the next second). And a
  write sets ctime when it starts, before it copies its bytes: the checkpoint is where the
  engine has finished the writes begun before it (PostgreSQL's waits for every buffer write
  in progress), so a file whose newest change is older than the checkpoint is not being
  written; a write begun since moves ctime past the checkpoint. Timestamps with no fraction
  of a second (file systems that keep whole seconds) give none either. Such a file's identity
  keeps its device and inode (its times zero, :attr:`FileIdentity.trusted` false): it proves
  no bytes unchanged, but that the file is the one the parent read, which an engine's block
  screen needs (``engines.base.BlockScreen``).

Binary format (one file, read with ``mmap``): ``SVBM`` + version (u8) + block size (u32), then
per file: path length (u16), path (UTF-8), size (u64), block count (u32), its identity
(device u64, inode u64, mtime and ctime i64 nanoseconds; times zero: untrusted, all zero:
none), 8 bytes per block. Version 1 had no identity and 16 bytes per block. Agents before the
block screen wrote all zero where the times were untrusted; their maps are read the same way
(such a file is just not screened).
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, NamedTuple

import xxhash

BLOCK_SIZE = 8192
HASH_SIZE = 8
MAGIC = b"SVBM"
VERSION = 2
HASH_SIZES = {1: 16, 2: HASH_SIZE}  # of each version this agent reads
HEADER = struct.Struct(">4sBI")
ENTRY = struct.Struct(">H")
ENTRY_TAILS = {1: struct.Struct(">QI"), 2: struct.Struct(">QIQQqq")}  # size, count[, identity]
READ_BLOCKS = 128  # blocks read at once: 1 MiB
RACY_SECONDS = 2  # see *file identity*


class FileIdentity(NamedTuple):
    device: int
    inode: int
    mtime_ns: int  # 0 with ctime_ns: the times prove nothing (see *file identity*)
    ctime_ns: int

    @property
    def trusted(self) -> bool:
        """The times are recorded: equal identities mean equal bytes."""
        return self.ctime_ns != 0

    @property
    def located(self) -> bool:
        """The device and inode are recorded: equal ones mean the same file."""
        return self.inode != 0


NO_IDENTITY = FileIdentity(0, 0, 0, 0)


def identity_of(stat: os.stat_result, checkpoint_ns: int) -> FileIdentity:
    """``stat``'s identity, taken after its backup's checkpoint at ``checkpoint_ns`` (ns since
    the epoch); its times are left out when the file changed too close to the checkpoint, or
    after it, to prove anything (see *file identity*)."""
    newest = max(stat.st_mtime_ns, stat.st_ctime_ns)
    racy = newest >= checkpoint_ns - RACY_SECONDS * 1_000_000_000
    if racy or stat.st_ctime_ns % 1_000_000_000 == 0:  # whole seconds: a tick a second wide
        return FileIdentity(stat.st_dev, stat.st_ino, 0, 0)
    return FileIdentity(stat.st_dev, stat.st_ino, stat.st_mtime_ns, stat.st_ctime_ns)


class BlockMapDamaged(ValueError):
    """A block map that does not parse: it must never be trusted to say what did not change."""


def block_count(size: int, block_size: int) -> int:
    return -(-size // block_size)


def block_hash(block: bytes | memoryview) -> bytes:
    """The block hash of one block (see the module docstring)."""
    return xxhash.xxh3_128_digest(block)[:HASH_SIZE]


def hash_blocks(data: bytes | memoryview, block_size: int) -> bytes:
    """The concatenated block hashes of ``data``'s blocks."""
    view = memoryview(data)
    return b"".join(block_hash(view[i : i + block_size]) for i in range(0, len(view), block_size))


class BlockMapWriter:
    """Writes a block map file entry by entry, in listing order."""

    def __init__(self, out: BinaryIO, block_size: int = BLOCK_SIZE) -> None:
        self.out, self.block_size = out, block_size
        out.write(HEADER.pack(MAGIC, VERSION, block_size))

    def add(
        self, path: str, size: int, hashes: bytes, identity: FileIdentity = NO_IDENTITY
    ) -> None:
        encoded = path.encode()
        count = len(hashes) // HASH_SIZE
        if count != block_count(size, self.block_size):
            raise ValueError(f"{path}: {count} hashes for {size} bytes")
        tail = ENTRY_TAILS[VERSION].pack(size, count, *identity)
        self.out.write(ENTRY.pack(len(encoded)) + encoded + tail + hashes)


Hashed = tuple[str, int, bytes, FileIdentity]  # a file's path, size, hashes and identity


def write_map(path: Path, block_size: int, hashed: Iterable[Hashed]) -> None:
    """Writes a block map of ``(path, size, hashes, identity)`` entries, in listing order, to
    ``path`` at once: through a ``.partial`` file, so a map that is there is whole."""
    partial = path.with_suffix(".partial")
    with open(partial, "wb") as out:
        writer = BlockMapWriter(out, block_size)
        for name, size, hashes, identity in hashed:
            writer.add(name, size, hashes, identity)
    partial.replace(path)


@dataclass(frozen=True)
class MapEntry:
    size: int
    offset: int  # of the first hash in the map file
    count: int
    identity: FileIdentity = NO_IDENTITY


class BlockMap:
    """A block map file, indexed by path; hashes are read from the mapped file on demand."""

    def __init__(self, path: Path) -> None:
        self._file = open(path, "rb")  # noqa: SIM115 (closed by close())
        try:
            self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError as error:  # an empty file cannot be mapped
            self._file.close()
            raise BlockMapDamaged(f"{path} is empty") from error
        self.hash_size = HASH_SIZE  # of the file's hashes, set by its version
        self.entries, self.block_size = self._index(path)

    def _index(self, path: Path) -> tuple[dict[str, MapEntry], int]:
        data = self._map
        if len(data) < HEADER.size:
            raise BlockMapDamaged(f"{path} is too short for a block map")
        magic, version, block_size = HEADER.unpack_from(data, 0)
        if magic != MAGIC or version not in HASH_SIZES or block_size <= 0:
            known = " or ".join(str(v) for v in HASH_SIZES)
            raise BlockMapDamaged(f"{path} is not a version-{known} block map")
        self.hash_size = hash_size = HASH_SIZES[version]
        entry_tail = ENTRY_TAILS[version]
        entries, at = {}, HEADER.size
        try:
            while at < len(data):
                (length,) = ENTRY.unpack_from(data, at)
                at += ENTRY.size
                name = bytes(data[at : at + length]).decode()
                at += length
                size, count, *identity = entry_tail.unpack_from(data, at)
                at += entry_tail.size
                if count != block_count(size, block_size) or at + count * hash_size > len(data):
                    raise BlockMapDamaged(f"{path}: entry {name!r} is cut short")
                entries[name] = MapEntry(
                    size, at, count, FileIdentity(*identity) if identity else NO_IDENTITY
                )
                at += count * hash_size
        except (struct.error, UnicodeDecodeError) as error:
            raise BlockMapDamaged(f"{path} is damaged at byte {at}: {error}") from error
        return entries, block_size

    def hashes(self, path: str) -> memoryview | bytes | None:
        """``path``'s block hashes, ``HASH_SIZE`` bytes each (a version-1 map's cut to it)."""
        entry = self.entries.get(path)
        if entry is None:
            return None
        view = memoryview(self._map)[entry.offset : entry.offset + entry.count * self.hash_size]
        if self.hash_size == HASH_SIZE:
            return view
        step = self.hash_size
        return b"".join(view[at : at + HASH_SIZE] for at in range(0, len(view), step))

    def unchanged(self, path: str, size: int, identity: FileIdentity) -> bool:
        """Whether ``path``, now of ``size`` bytes and ``identity``, holds the bytes this map
        hashed: both identities trusted and equal (see *file identity*)."""
        entry = self.entries.get(path)
        return (
            entry is not None
            and identity.trusted
            and entry.identity == identity
            and entry.size == size
        )

    def same_file(self, path: str, identity: FileIdentity) -> bool:
        """Whether ``path`` is, by its device and inode, the file this map read there (its
        bytes may have changed since)."""
        entry = self.entries.get(path)
        return (
            entry is not None
            and identity.located
            and (entry.identity.device, entry.identity.inode) == identity[:2]
        )

    def close(self) -> None:
        self._map.close()
        self._file.close()

    def __enter__(self) -> BlockMap:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def changed_blocks(hashes: bytes, parent: memoryview | bytes | None) -> Iterator[int]:
    """Indexes of the blocks whose hash differs from the parent's (every block without one)."""
    parent_count = len(parent) // HASH_SIZE if parent is not None else 0
    for i in range(len(hashes) // HASH_SIZE):
        at = i * HASH_SIZE
        if i >= parent_count or hashes[at : at + HASH_SIZE] != parent[at : at + HASH_SIZE]:
            yield i


def changes(
    hashes: bytes, parent: memoryview | bytes | None, size: int, block_size: int
) -> list[tuple[int, int]]:
    """The byte ranges ``(offset, length)`` of a file that differ from its parent's, merged."""
    ranges: list[tuple[int, int]] = []
    for i in changed_blocks(hashes, parent):
        start = i * block_size
        length = min(block_size, size - start)
        if ranges and ranges[-1][0] + ranges[-1][1] == start:
            ranges[-1] = (ranges[-1][0], ranges[-1][1] + length)
        else:
            ranges.append((start, length))
    return ranges


def scan_file(read: Callable[[int], bytes], size: int, block_size: int = BLOCK_SIZE) -> bytes:
    """The block hashes of a file of ``size`` bytes, read through ``read(n)`` (which returns
    exactly ``n`` bytes) a MiB at a time."""
    parts, left = [], size
    while left > 0:
        data = read(min(left, READ_BLOCKS * block_size))
        parts.append(hash_blocks(data, block_size))
        left -= len(data)
    return b"".join(parts)


def merge_extents(extents: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Adjacent ``(offset, length)`` ranges joined (files follow each other in a stream)."""
    merged: list[tuple[int, int]] = []
    for offset, length in extents:
        if merged and merged[-1][0] + merged[-1][1] == offset:
            merged[-1] = (merged[-1][0], merged[-1][1] + length)
        elif length:
            merged.append((offset, length))
    return merged
