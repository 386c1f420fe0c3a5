"""Block maps: a file's blocks hashed, written and read back, and compared with a parent's."""

from __future__ import annotations

import io
import os
import struct
from pathlib import Path

import pytest
from shardvault_agent.backup.blockmap import (
    BLOCK_SIZE,
    NO_IDENTITY,
    BlockMap,
    BlockMapDamaged,
    BlockMapWriter,
    changes,
    hash_blocks,
    merge_extents,
    scan_file,
)
from xxhash import xxh3_128_digest


def write_map(path: Path, files: dict[str, bytes]) -> None:
    with open(path, "wb") as out:
        writer = BlockMapWriter(out)
        for name, data in files.items():
            writer.add(name, len(data), hash_blocks(data, BLOCK_SIZE))


def test_a_map_reads_back_every_files_hashes(tmp_path: Path) -> None:
    files = {"base/1/16384": os.urandom(5 * BLOCK_SIZE + 100), "empty": b"", "PG_VERSION": b"15\n"}
    write_map(tmp_path / "map", files)
    with BlockMap(tmp_path / "map") as parent:
        assert parent.block_size == BLOCK_SIZE
        for name, data in files.items():
            assert bytes(parent.hashes(name)) == hash_blocks(data, BLOCK_SIZE)
        assert parent.hashes("not/there") is None


def test_only_changed_grown_and_cut_blocks_count_as_changes(tmp_path: Path) -> None:
    old = os.urandom(10 * BLOCK_SIZE)
    write_map(tmp_path / "map", {"rel": old})
    new = bytearray(old)
    new[3 * BLOCK_SIZE + 5] ^= 1  # one row in block 3
    new[4 * BLOCK_SIZE] ^= 1  # and the next block: one range
    new[8 * BLOCK_SIZE + 1] ^= 1
    new += os.urandom(BLOCK_SIZE // 2)  # the file grew by half a block
    with BlockMap(tmp_path / "map") as parent:
        got = changes(
            hash_blocks(bytes(new), BLOCK_SIZE), parent.hashes("rel"), len(new), BLOCK_SIZE
        )
        assert got == [
            (3 * BLOCK_SIZE, 2 * BLOCK_SIZE),
            (8 * BLOCK_SIZE, BLOCK_SIZE),
            (10 * BLOCK_SIZE, BLOCK_SIZE // 2),
        ]
        cut = old[: 4 * BLOCK_SIZE + 10]  # truncated mid-block: the last block differs
        got = changes(hash_blocks(cut, BLOCK_SIZE), parent.hashes("rel"), len(cut), BLOCK_SIZE)
        assert got == [(4 * BLOCK_SIZE, 10)]
        same = changes(hash_blocks(old, BLOCK_SIZE), parent.hashes("rel"), len(old), BLOCK_SIZE)
        assert same == []


def test_a_file_the_parent_lacks_is_changed_whole() -> None:
    data = os.urandom(3 * BLOCK_SIZE)
    assert changes(hash_blocks(data, BLOCK_SIZE), None, len(data), BLOCK_SIZE) == [(0, len(data))]


def test_scanning_reads_blocks_in_order_whatever_the_read_size() -> None:
    data = os.urandom(300 * BLOCK_SIZE + 17)
    source = io.BytesIO(data)
    assert scan_file(source.read, len(data)) == hash_blocks(data, BLOCK_SIZE)


def write_version_1_map(path: Path, name: str, data: bytes) -> None:
    """A map as agents wrote them before version 2: whole 16-byte xxh3-128 digests."""
    digests = b"".join(
        xxh3_128_digest(data[at : at + BLOCK_SIZE]) for at in range(0, len(data), BLOCK_SIZE)
    )
    encoded = name.encode()
    count = len(digests) // 16
    path.write_bytes(
        struct.pack(">4sBI", b"SVBM", 1, BLOCK_SIZE)
        + struct.pack(">H", len(encoded))
        + encoded
        + struct.pack(">QI", len(data), count)
        + digests
    )


def test_a_version_1_parent_still_finds_exactly_the_changed_blocks(tmp_path: Path) -> None:
    """A chain begun by an older agent goes on: its parent's 16-byte hashes are compared by
    their first 8 bytes, so an unchanged block is not sent again and a changed one is."""
    old = os.urandom(6 * BLOCK_SIZE + 300)
    write_version_1_map(tmp_path / "v1", "rel", old)
    new = bytearray(old)
    new[2 * BLOCK_SIZE] ^= 1
    with BlockMap(tmp_path / "v1") as parent:
        assert bytes(parent.hashes("rel")) == hash_blocks(old, BLOCK_SIZE)
        got = changes(hash_blocks(bytes(new), BLOCK_SIZE), parent.hashes("rel"), len(new),
                      BLOCK_SIZE)  # fmt: skip
        assert got == [(2 * BLOCK_SIZE, BLOCK_SIZE)]
    write_map(tmp_path / "v2", {"rel": old})
    with BlockMap(tmp_path / "v1") as v1, BlockMap(tmp_path / "v2") as v2:
        assert (v1.hash_size, v2.hash_size) == (16, 8)  # a version-2 map's hashes: half
        assert v1.entries["rel"].identity == NO_IDENTITY  # version 1 never skips a file


@pytest.mark.parametrize("damage", [b"", b"SVBM", b"XXXX\x01\x00\x00\x20\x00", "cut"])
def test_a_damaged_map_is_refused_never_trusted(tmp_path: Path, damage) -> None:
    path = tmp_path / "map"
    if damage == "cut":
        write_map(path, {"rel": os.urandom(4 * BLOCK_SIZE)})
        path.write_bytes(path.read_bytes()[:-5])
    else:
        path.write_bytes(damage)
    with pytest.raises(BlockMapDamaged):
        BlockMap(path)


def test_adjacent_extents_merge() -> None:
    assert merge_extents([(0, 10), (10, 5), (20, 0), (30, 4)]) == [(0, 15), (30, 4)]
