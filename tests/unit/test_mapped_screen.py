"""The mapped screen: an incremental's screened ranges judged through a mapping, in the
agent's helper process (``shardvault_agent.backup.mappedscreen``), with the same outcome as reading
them, and reads whenever the helper cannot answer."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from pathlib import Path

import pytest
from shardvault_agent.backup import mappedscreen
from shardvault_agent.backup import scan as scan_module
from shardvault_agent.backup.blockmap import BlockMap
from shardvault_agent.backup.mappedscreen import MappedScreener
from shardvault_agent.ratelimit import RateLimiter

from shardvault.contracts.models import FileEntry

from .test_pgpages import PARENT_START, B, page, rewrite_in_place, scan, screen, write

OLD = PARENT_START - 0x1000


@pytest.fixture
def mapped():
    screener = MappedScreener()
    screener.start(preload="shardvault_agent.engines.postgres.pages")
    yield screener
    screener.close()


def answered(screener: MappedScreener) -> list[int]:
    """Counts the ranges the helper judged (answers that were not None)."""
    judged: list[int] = []
    ask = screener.may_differ

    def counting(*args, **kwargs):
        answer = ask(*args, **kwargs)
        if answer is not None:
            judged.append(len(answer))
        return answer

    screener.may_differ = counting  # type: ignore[method-assign]
    return judged


def changed_since_the_full(root: Path, tmp_path: Path, monkeypatch) -> list[FileEntry]:
    """A relation of 40 pages and one of 6, scanned by a full, then changed as PostgreSQL
    changes them (logged pages, a hint bit, a page never logged, pages added past the
    parent's end); the second is cut short as its range is screened (a vacuum's truncation
    racing the scan; in the middle of a page, which PostgreSQL never does: the edge both
    ways must agree on)."""
    listing = write(
        root,
        {
            "base/5/1": b"".join(page(OLD, bytes([i])) for i in range(40)),
            "base/5/2": b"".join(page(OLD, bytes([100 + i])) for i in range(6)),
        },
    )
    scan(root, listing, None, tmp_path / "full.map")
    rel = root / "base/5/1"
    for index in (3, 4, 17, 31):
        rewrite_in_place(rel, index, page(PARENT_START + index, b"n"))
    rewrite_in_place(rel, 9, page(OLD, b"h"))  # hint bits only: vouched for
    rewrite_in_place(rel, 20, page(0, b"z"))  # never logged: read
    with open(rel, "ab") as grown:
        grown.write(page(OLD, b"e") * 3)  # past the parent's end: read
    rewrite_in_place(root / "base/5/2", 0, page(OLD, bytes([100])))  # written: not unchanged
    listing = [FileEntry(path=p, size=(root / p).stat().st_size) for p in ("base/5/1", "base/5/2")]
    screen_range = scan_module.screen_range
    second = root / "base/5/2"

    def truncating(path: Path, *args, **kwargs):
        if path == second:
            os.truncate(second, 3 * B + 100)
        return screen_range(path, *args, **kwargs)

    monkeypatch.setattr(scan_module, "screen_range", truncating)
    return listing


def scanned(tmp_path: Path, listing: list[FileEntry], name: str, mapped=None):
    """An incremental scan of the changed data into ``name``.map, the second file whole
    again as the scan lists it (a file not of its listed size is read whole, unscreened)."""
    root = tmp_path / "data"
    (root / "base/5/2").write_bytes(b"".join(page(OLD, bytes([100 + i])) for i in range(6)))
    return scan(root, listing, tmp_path / "full.map", tmp_path / f"{name}.map", screen(), mapped)


def test_a_mapped_screen_finds_what_reading_finds(tmp_path: Path, mapped, monkeypatch) -> None:
    monkeypatch.setattr(scan_module, "SCREEN_RANGE_READS", 1)
    monkeypatch.setattr(scan_module, "MAPPED_RANGE_READS", 1)
    monkeypatch.setattr(scan_module, "READ_BLOCKS", 8)  # ranges of 8 pages, either way
    root = tmp_path / "data"
    listing = changed_since_the_full(root, tmp_path, monkeypatch)
    judged = answered(mapped)

    read = scanned(tmp_path, listing, "read")
    through = scanned(tmp_path, listing, "mapped", mapped)

    assert len(judged) == 6 + 1  # every range of both files: 43 pages and 6, 8 at a time
    assert through.extents == read.extents
    assert through.screened_bytes == read.screened_bytes
    assert (tmp_path / "mapped.map").read_bytes() == (tmp_path / "read.map").read_bytes()
    # Pages 3, 4, 17, 20, 31 and 40 to 42 of the first; of the second (from page 43 of the
    # stream), pages 4 and 5 are zeros now, and page 3, cut short, keeps the parent's bytes
    # (its LSN vouches for it).
    first = [(3 * B, 2 * B), (17 * B, B), (20 * B, B), (31 * B, B), (40 * B, 3 * B)]
    assert read.extents == [*first, (47 * B, 2 * B)]
    assert read.screened_bytes == (35 + 4) * B


def test_a_helper_killed_mid_scan_leaves_its_ranges_to_the_reads(
    tmp_path: Path, mapped, monkeypatch, caplog
) -> None:
    """A helper killed by SIGBUS (what touching a mapped page past a truncated file's end
    does) answers nothing: the scan reads those ranges, the screener rests, then starts a
    new helper."""
    root = tmp_path / "data"
    listing = changed_since_the_full(root, tmp_path, monkeypatch)
    read = scanned(tmp_path, listing, "read")
    assert mapped.process is not None
    killed = mapped.process
    os.kill(killed.pid, signal.SIGBUS)
    killed.wait(timeout=10)
    judged = answered(mapped)

    with caplog.at_level(logging.WARNING, logger="shardvault.agent"):
        after = scanned(tmp_path, listing, "after", mapped)

    assert judged == []  # read, not mapped
    assert after.extents == read.extents
    assert (tmp_path / "after.map").read_bytes() == (tmp_path / "read.map").read_bytes()
    assert "killed by signal 7" in caplog.text
    assert mapped.process is None  # resting: no helper started again at once
    monkeypatch.setattr(mapped, "resting_until", 0.0)
    again = scanned(tmp_path, listing, "again", mapped)
    assert judged  # a new helper answered
    assert mapped.process is not None
    assert mapped.process.pid != killed.pid
    assert again.extents == read.extents


def test_the_helper_ends_with_its_agent(mapped) -> None:
    """The helper reads its requests from the agent's pipe: when the agent ends (its end of
    the pipe closes), so does the helper; no process is left behind."""
    process = mapped.process
    assert process is not None
    assert process.stdin is not None
    process.stdin.close()
    assert process.wait(timeout=10) == 0


def test_a_request_the_helper_cannot_judge_is_read(tmp_path: Path, mapped) -> None:
    """A screen that fails in the helper (here: not a screen) answers None, as does one that
    does not pickle (it never reaches the pipe), and the same helper goes on answering."""
    data = tmp_path / "rel"
    data.write_bytes(page(OLD, b"a") * 4)
    helper = mapped.process
    assert mapped.may_differ(data, 0, 4 * B, "not a screen", B) is None  # type: ignore[arg-type]
    unpicklable = threading.Lock()
    assert mapped.may_differ(data, 0, 4 * B, unpicklable, B) is None  # type: ignore[arg-type]
    assert mapped.may_differ(data, 0, 4 * B, screen(), B) == []
    assert mapped.process is helper
    assert mapped.may_differ(tmp_path / "gone", 0, 2 * B, screen(), B) == [0, 1]  # zeros


def test_a_paced_scan_reads_its_ranges(tmp_path: Path, mapped, monkeypatch) -> None:
    """A backup under a rate limit (or the adaptive throttle) takes from its limiter between
    reads a MiB at a time; a mapping would be judged a range at once, unpaced."""
    root = tmp_path / "data"
    listing = changed_since_the_full(root, tmp_path, monkeypatch)
    (root / "base/5/2").write_bytes(b"".join(page(OLD, bytes([100 + i])) for i in range(6)))
    judged = answered(mapped)
    paced = RateLimiter(10**12)  # a rate, if one that never waits here
    with BlockMap(tmp_path / "full.map") as parent:
        result = scan_module.scan_capture(
            root, listing, paced, parent, tmp_path / "paced.map", trusted_before=time.time(),
            screen=screen(), mapped=mapped,
        )  # fmt: skip

    assert judged == []
    assert result.extents == scanned(tmp_path, listing, "read").extents


def test_a_range_is_judged_alike_whatever_the_helpers_window(tmp_path: Path, monkeypatch) -> None:
    """The helper maps a range a window at a time: pages judged on either side of a window's
    edge, and a file cut short in the middle of a page, come out as from one mapping."""
    data = tmp_path / "rel"
    pages = [page(PARENT_START + i if i % 3 == 0 else OLD, bytes([i])) for i in range(10)]
    data.write_bytes(b"".join(pages)[: 9 * B + 100])  # the last page cut short, its LSN new
    whole = mappedscreen.judged(str(data), 0, 12 * B, screen(), B)
    monkeypatch.setattr(mappedscreen, "WINDOW_BYTES", 2 * B + 5)  # windows of two pages
    windowed = mappedscreen.judged(str(data), 0, 12 * B, screen(), B)
    assert windowed == whole == [0, 3, 6, 9, 10, 11]  # 10 and 11 past the file's end
    assert mappedscreen.judged(str(data), 4 * B, 4 * B, screen(), B) == [2]  # page 6, from 4
