"""PostgreSQL's block screen: an incremental reads only the pages whose LSN says they may have
changed since the parent's start, and only in files it can vouch for."""

from __future__ import annotations

import os
import struct
import sys
import time
from pathlib import Path

from shardvault_agent.backup.blockmap import BLOCK_SIZE, HASH_SIZE, BlockMap, hash_blocks
from shardvault_agent.backup.scan import scan_capture
from shardvault_agent.engines.postgres.pages import (
    PageLsnScreen,
    page_lsns,
    screen_since,
    system_identifier,
)
from shardvault_agent.ratelimit import RateLimiter

from shardvault.contracts.models import FileEntry

B = BLOCK_SIZE
PARENT_START = 0x2_0000_0000  # 2/0
CLUSTER = {"block_size": "8192", "system_identifier": "7312345678901234567"}
MARKER = {"start_lsn": "2/0", "start_wal": "000000010000000200000000"} | CLUSTER
LATER = {"start_lsn": "3/10", "start_wal": "000000010000000300000000"} | CLUSTER


def page(lsn: int, fill: bytes) -> bytes:
    """An 8 KiB page whose header holds ``lsn`` as PostgreSQL writes it (native halves)."""
    return struct.pack("=II", lsn >> 32, lsn & 0xFFFFFFFF) + fill * (B - 8)


def screen() -> PageLsnScreen:
    found = screen_since(LATER, MARKER)
    assert isinstance(found, PageLsnScreen)
    return found


def test_page_lsns_read_both_halves_and_mark_blocks_too_short_for_one():
    blocks = page(0x1_0000_0020, b"a") + page(0, b"b")
    assert page_lsns(blocks, B) == [0x1_0000_0020, 0]
    assert page_lsns(blocks + page(0x3_0000_0001, b"c")[:100], B)[2] == 0x3_0000_0001
    assert page_lsns(blocks + b"\x01\x02", B) == [0x1_0000_0020, 0, None]
    assert page_lsns(b"", B) == []


def test_only_relation_main_forks_are_screened():
    s = screen()
    assert s.screens("base/5/16384")
    assert s.screens("base/5/16384.3")
    assert s.screens("global/1262")
    for path in ("base/5/16384_fsm", "base/5/16384_vm", "base/5/16384_init", "global/pg_control",
                 "pg_xact/0000", "base/5/PG_VERSION", "global/pg_filenode.map"):  # fmt: skip
        assert not s.screens(path), path


def test_a_page_may_differ_when_its_lsn_is_zero_or_at_or_after_the_parents_start():
    s = screen()
    lsns = [PARENT_START - 1, PARENT_START, PARENT_START + 1, 0, 5]
    blocks = b"".join(page(n, b"x") for n in lsns) + b"\x01"
    assert s.may_differ(memoryview(blocks), B) == [1, 2, 3, 5]


def test_no_screen_across_clusters_timelines_backwards_or_with_other_page_sizes():
    other_timeline = LATER | {"start_wal": "000000020000000300000000"}
    assert screen_since(other_timeline, MARKER) is None
    other_cluster = LATER | {"system_identifier": "7399999999999999999"}
    assert screen_since(other_cluster, MARKER) is None
    unknown = {"system_identifier": ""}
    assert screen_since(LATER | unknown, MARKER | unknown) is None
    assert screen_since(MARKER, LATER) is None  # a parent after its child
    assert screen_since(LATER | {"block_size": "16384"}, MARKER) is None
    no_page_size = {k: v for k, v in LATER.items() if k != "block_size"}
    assert screen_since(no_page_size, MARKER) is None
    assert screen_since(LATER, {}) is None  # a parent from before markers
    assert screen_since(LATER | {"start_lsn": "junk"}, MARKER) is None


def write(root: Path, files: dict[str, bytes]) -> list[FileEntry]:
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return [FileEntry(path=name, size=len(data)) for name, data in files.items()]


def scan(
    root: Path, listing: list[FileEntry], parent: Path | None, out: Path, screen=None, mapped=None
):
    at = time.time()  # just written: the identities are located, not trusted
    if parent is None:
        return scan_capture(root, listing, RateLimiter(None), None, out, trusted_before=at)
    with BlockMap(parent) as parent_map:
        return scan_capture(
            root, listing, RateLimiter(None), parent_map, out, trusted_before=at, screen=screen,
            mapped=mapped,
        )  # fmt: skip


def rewrite_in_place(path: Path, index: int, data: bytes) -> None:
    """Writes one page where it is (the file keeps its inode, as PostgreSQL's writes do)."""
    with open(path, "r+b") as f:
        f.seek(index * B)
        f.write(data)


def test_a_screened_scan_reads_only_pages_logged_since_the_parent(tmp_path: Path):
    root = tmp_path / "data"
    old = PARENT_START - 0x1000
    heap = [page(old, bytes([i])) for i in range(10)]
    listing = write(root, {"base/5/16384": b"".join(heap), "base/5/16384_fsm": page(0, b"f")})
    scan(root, listing, None, tmp_path / "full.map")

    rel = root / "base/5/16384"
    rewrite_in_place(rel, 2, page(PARENT_START + 8, b"N"))  # logged since: sent
    rewrite_in_place(rel, 4, page(PARENT_START + 9, bytes([4])))  # LSN moved, bytes alike...
    heap[4] = page(PARENT_START + 9, bytes([4]))
    rewrite_in_place(rel, 5, page(old, b"H"))  # hint bits only: the LSN vouches, not read
    rewrite_in_place(rel, 7, page(0, b"Z"))  # never logged: read
    with open(rel, "ab") as f:
        f.write(page(old, b"E"))  # past the parent's end: read, whatever its LSN
    rewrite_in_place(root / "base/5/16384_fsm", 0, page(0, b"g"))  # not screened: read
    listing = [FileEntry(path=p, size=(root / p).stat().st_size) for p in
               ("base/5/16384", "base/5/16384_fsm")]  # fmt: skip

    incremental = scan(root, listing, tmp_path / "full.map", tmp_path / "incr.map", screen())

    changed_pages = [2, 4, 7, 10]  # page 4's header changed, so its hash did
    # The new page and the free space map's (the next file's first) are adjacent in the stream.
    assert incremental.extents == [(2 * B, B), (4 * B, B), (7 * B, B), (10 * B, 2 * B)]
    assert incremental.screened_bytes == (11 - 4) * B  # pages 0, 1, 3, 5, 6, 8, 9
    with BlockMap(tmp_path / "incr.map") as new, BlockMap(tmp_path / "full.map") as full:
        hashes = bytes(new.hashes("base/5/16384") or b"")
        parents = bytes(full.hashes("base/5/16384") or b"")
        now = hash_blocks(rel.read_bytes(), B)
        for i in range(11):
            at = slice(i * HASH_SIZE, (i + 1) * HASH_SIZE)
            # Screened pages keep the parent's hash: the map says what a restore lays down.
            expected = now[at] if i in changed_pages else parents[at]
            assert hashes[at] == expected, i
        assert hashes[5 * HASH_SIZE : 6 * HASH_SIZE] != now[5 * HASH_SIZE : 6 * HASH_SIZE]


def test_a_page_whose_lsn_moved_but_whose_bytes_did_not_is_not_sent(tmp_path: Path):
    root = tmp_path / "data"
    data = page(PARENT_START + 5, b"s")  # logged after the parent's start, before its read
    listing = write(root, {"base/5/1": data})
    scan(root, listing, None, tmp_path / "full.map")
    incremental = scan(root, listing, tmp_path / "full.map", tmp_path / "incr.map", screen())
    assert incremental.extents == []
    assert incremental.screened_bytes == 0


def test_a_file_replaced_at_the_same_path_is_read_whole(tmp_path: Path):
    """A new inode (a database's files copied in, with their old LSNs) proves nothing."""
    root = tmp_path / "data"
    old = PARENT_START - 1
    listing = write(root, {"base/5/1": page(old, b"a") * 3})
    scan(root, listing, None, tmp_path / "full.map")
    replacement = tmp_path / "elsewhere"
    replacement.write_bytes(page(old, b"b") * 3)
    replacement.replace(root / "base/5/1")

    incremental = scan(root, listing, tmp_path / "full.map", tmp_path / "incr.map", screen())

    assert incremental.extents == [(0, 3 * B)]
    assert incremental.screened_bytes == 0


def test_a_file_that_shrank_under_the_scan_reads_as_zeros(tmp_path: Path, monkeypatch):
    """Pages cut off after the listing (a vacuum's truncation) are read as zeros, as a
    whole-file read reads them; nothing crashes."""
    root = tmp_path / "data"
    listing = write(root, {"base/5/1": page(PARENT_START - 1, b"a") * 4})
    scan(root, listing, None, tmp_path / "full.map")
    real_preadv = os.preadv

    def truncating_preadv(fd: int, buffers: list, offset: int) -> int:
        os.truncate(root / "base/5/1", 2 * B)  # as the read starts: the last two pages go
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr("shardvault_agent.backup.scan.os.preadv", truncating_preadv)
    monkeypatch.setattr("shardvault_agent.backup.scan.READ_BLOCKS", 2)  # the buffer's second fill
    incremental = scan(root, listing, tmp_path / "full.map", tmp_path / "incr.map", screen())

    assert incremental.extents == [(2 * B, 2 * B)]  # zeros now, where the pages were
    assert incremental.screened_bytes == 2 * B
    with BlockMap(tmp_path / "incr.map") as new:
        zeros = hash_blocks(bytes(2 * B), B)
        assert bytes(new.hashes("base/5/1") or b"")[2 * HASH_SIZE :] == zeros


def test_the_system_identifier_is_read_from_pg_control(tmp_path: Path):
    (tmp_path / "global").mkdir()
    (tmp_path / "global" / "pg_control").write_bytes(
        (7312345678901234567).to_bytes(8, sys.byteorder) + bytes(8184)
    )
    assert system_identifier(tmp_path) == "7312345678901234567"
    assert system_identifier(tmp_path / "nowhere") == ""


def test_only_a_parent_this_node_made_is_screened_against():
    """A device and inode name a file on one host only: a parent another node made (a
    replica, before a switch of the source) proves nothing here."""
    from types import SimpleNamespace

    from shardvault_agent.backup.commands import parent_screen
    from shardvault_agent.engines.postgres import pages as pgpages

    engine = SimpleNamespace(block_screen=pgpages.screen_since)
    own = SimpleNamespace(marker=MARKER, node_id="n1")  # the ParentMap fields it reads
    assert isinstance(parent_screen(engine, "n1", LATER, own), PageLsnScreen)
    assert parent_screen(engine, "n2", LATER, own) is None


def test_a_grown_file_is_read_and_judged_a_chunk_at_a_time(tmp_path: Path, monkeypatch):
    """Pages are read and judged ``READ_BLOCKS`` at a time (a MiB), into one buffer: a file
    grown by far more than that still comes out whole and right."""
    monkeypatch.setattr("shardvault_agent.backup.scan.READ_BLOCKS", 4)
    reads: list[int] = []
    real_preadv = os.preadv

    def recording_preadv(fd: int, buffers: list, offset: int) -> int:
        reads.append(sum(len(b) for b in buffers))
        return real_preadv(fd, buffers, offset)

    root = tmp_path / "data"
    old = PARENT_START - 1
    listing = write(root, {"base/5/1": page(old, b"a") * 10})
    scan(root, listing, None, tmp_path / "full.map")
    rel = root / "base/5/1"
    rewrite_in_place(rel, 6, page(PARENT_START + 1, b"c"))
    with open(rel, "ab") as f:
        f.write(b"".join(page(old, bytes([i % 250])) for i in range(300)))
    listing = [FileEntry(path="base/5/1", size=rel.stat().st_size)]

    monkeypatch.setattr("shardvault_agent.backup.scan.os.preadv", recording_preadv)
    incremental = scan(root, listing, tmp_path / "full.map", tmp_path / "incr.map", screen())

    assert incremental.extents == [(6 * B, B), (10 * B, 300 * B)]
    assert max(reads) == 4 * B
    assert len(reads) == -(-310 // 4)  # every page read once, a chunk of 4 at a time
    with BlockMap(tmp_path / "incr.map") as new:
        hashes = bytes(new.hashes("base/5/1") or b"")
    now = hash_blocks(rel.read_bytes(), B)
    assert hashes[6 * HASH_SIZE :] == now[6 * HASH_SIZE :]


def test_a_file_screened_in_ranges_comes_out_as_if_screened_whole(tmp_path: Path, monkeypatch):
    """The scan's threads take a screened file a range at a time (``SCREEN_RANGE_READS``):
    cut into ranges of two pages, with changes on both sides of their edges, in the last
    range and past the parent's end, it has the same extents, screened bytes and map."""
    root = tmp_path / "data"
    old = PARENT_START - 1
    listing = write(root, {"base/5/1": b"".join(page(old, bytes([i])) for i in range(9))})
    scan(root, listing, None, tmp_path / "full.map")
    rel = root / "base/5/1"
    for index in (1, 2, 5, 8):  # 1 and 2 are either side of the first edge; 8 in the last
        rewrite_in_place(rel, index, page(PARENT_START + index, b"n"))
    rewrite_in_place(rel, 4, page(old, b"h"))  # hint bits: vouched for, in any range
    with open(rel, "ab") as f:
        f.write(page(old, b"E") + page(old, b"F")[:100])  # past the parent's end, cut short
    listing = [FileEntry(path="base/5/1", size=rel.stat().st_size)]

    whole = scan(root, listing, tmp_path / "full.map", tmp_path / "whole.map", screen())
    monkeypatch.setattr("shardvault_agent.backup.scan.READ_BLOCKS", 2)
    monkeypatch.setattr("shardvault_agent.backup.scan.SCREEN_RANGE_READS", 1)
    ranged = scan(root, listing, tmp_path / "full.map", tmp_path / "ranged.map", screen())

    assert whole.extents == [(B, 2 * B), (5 * B, B), (8 * B, 2 * B + 100)]
    assert ranged.extents == whole.extents
    assert ranged.screened_bytes == whole.screened_bytes == 5 * B  # pages 0, 3, 4, 6, 7
    assert (tmp_path / "ranged.map").read_bytes() == (tmp_path / "whole.map").read_bytes()
