"""PostgreSQL's archive_command into the agent's WAL spool (shardvault_agent.wal.walspool): every
file PostgreSQL archives is in the spool whole and in sequence, and a full spool makes
PostgreSQL keep its WAL and try again, never a gap.

The command runs as the server's user with the system's python3, as on a database host: the
push client imports nothing but the standard library."""

from __future__ import annotations

import shutil
import struct
import time
from pathlib import Path

import pytest
from shardvault_agent.wal import walspool

from shardvault.contracts.pgwal import DEFAULT_SEGMENT_SIZE, segment_number
from shardvault.local.postgres import (
    PostgresInstance,
    ensure_traversable,
    give_to_postgres,
    init_instance,
)

SYSTEM_PYTHON = Path("/usr/bin/python3")  # Debian's: what the server's user can run
SEGMENT = DEFAULT_SEGMENT_SIZE


def archiving_server(tmp_path: Path, max_bytes: int) -> tuple[PostgresInstance, Path]:
    assert SYSTEM_PYTHON.exists(), "the WAL push runs with the system's python3 (apt python3)"
    spool = tmp_path / "spool"
    spool.mkdir()
    give_to_postgres(spool)
    client = tmp_path / "walspool.py"
    shutil.copyfile(walspool.__file__, client)
    ensure_traversable(client.parent)
    command = f"{SYSTEM_PYTHON} {client} --spool {spool} --max-bytes {max_bytes} %p"
    server = init_instance(
        tmp_path / "pg", settings={"archive_mode": "on", "archive_command": command}
    )
    return server, spool


def switch(server: PostgresInstance, times: int) -> str:
    """Fills ``times`` segments with a little WAL each; returns the last one switched from."""
    server.psql("CREATE TABLE IF NOT EXISTS filler (n int)")
    last = ""
    for _ in range(times):
        server.psql("INSERT INTO filler SELECT generate_series(1, 1000)")
        last = server.psql("SELECT pg_walfile_name(pg_switch_wal())")
    return last


def archiver(server: PostgresInstance) -> tuple[str, int, str]:
    """pg_stat_archiver's last archived file, failures and last failed file."""
    row = server.psql(
        "SELECT coalesce(last_archived_wal, ''), failed_count, coalesce(last_failed_wal, '') "
        "FROM pg_stat_archiver"
    )
    archived, failed, failed_wal = row.split("|")
    return archived, int(failed), failed_wal


def wait_archived(server: PostgresInstance, segment: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while archiver(server)[0] < segment:
        assert time.monotonic() < deadline, f"{segment} not archived: {archiver(server)}"
        time.sleep(0.1)


def check_in_sequence(spool: Path, last: str) -> list[str]:
    """The spool's segments run without a gap up to ``last``, each one the segment its name
    says: its first page's address (XLogLongPageHeaderData.xlp_pageaddr) is its own."""
    names = sorted(p.name for p in spool.iterdir() if len(p.name) == 24)
    assert names, "nothing was spooled"
    assert names[-1] == last
    numbers = [segment_number(n) for n in names]
    assert numbers == list(range(numbers[0], numbers[0] + len(numbers))), names
    for name in names:
        data = (spool / name).read_bytes()
        assert len(data) == SEGMENT
        (page_address,) = struct.unpack_from("<Q", data, 8)
        assert page_address == segment_number(name) * SEGMENT, name
    return names


def test_every_segment_postgres_archives_is_spooled_whole_and_in_sequence(tmp_path) -> None:
    server, spool = archiving_server(tmp_path, max_bytes=1 << 34)
    try:
        last = switch(server, 5)
        wait_archived(server, last)
        names = check_in_sequence(spool, last)
        assert len(names) >= 5
        assert archiver(server)[1] == 0
        assert not list(spool.glob(".push-*"))  # no temporary file left behind
    finally:
        server.stop()


def test_a_full_spool_makes_postgres_keep_its_wal_and_nothing_is_lost(tmp_path) -> None:
    server, spool = archiving_server(tmp_path, max_bytes=3 * SEGMENT)
    try:
        switch(server, 6)
        deadline = time.monotonic() + 30
        while archiver(server)[1] == 0:  # the fourth push is refused
            assert time.monotonic() < deadline, archiver(server)
            time.sleep(0.1)
        archived, _, failed_wal = archiver(server)
        assert len([p for p in spool.iterdir() if len(p.name) == 24]) == 3
        assert segment_number(failed_wal) == segment_number(archived) + 1
        # PostgreSQL keeps what it could not archive: the refused segment is still in pg_wal,
        # marked ready to archive.
        status = server.data_dir / "pg_wal" / "archive_status"
        assert (status / f"{failed_wal}.ready").exists()
        assert (server.data_dir / "pg_wal" / failed_wal).exists()
        # The agent stores spooled segments and removes them (here: moves them aside): the
        # archiver goes on where it stopped.
        stored = tmp_path / "stored"
        stored.mkdir()
        last = switch(server, 1)
        deadline = time.monotonic() + 60
        while archiver(server)[0] < last:
            assert time.monotonic() < deadline, archiver(server)
            for path in spool.iterdir():
                shutil.move(path, stored / path.name)
            server.psql("SELECT pg_reload_conf()")  # wakes the archiver, as a new segment would
            time.sleep(0.2)
        for path in spool.iterdir():
            shutil.move(path, stored / path.name)
        check_in_sequence(stored, last)  # no segment was dropped
    finally:
        server.stop()


def test_a_name_pushed_again_is_taken_with_its_bytes_and_refused_with_others(tmp_path) -> None:
    spool, wal = tmp_path / "spool", tmp_path / "pg_wal"
    spool.mkdir()
    wal.mkdir()
    segment = wal / "000000010000000000000007"
    segment.write_bytes(b"a" * 4096)
    assert walspool.push(segment, spool, 1 << 20) is False
    assert walspool.push(segment, spool, 1 << 20) is True  # archived again after a crash
    segment.write_bytes(b"b" * 4096)
    with pytest.raises(walspool.PushRefused, match="never overwritten"):
        walspool.push(segment, spool, 1 << 20)
    assert (spool / segment.name).read_bytes() == b"a" * 4096
    # A push that died left its temporary file: the next push removes it.
    (spool / ".push-000000010000000000000008-999999999").write_bytes(b"partial")
    other = wal / "000000010000000000000008"
    other.write_bytes(b"c" * 4096)
    walspool.push(other, spool, 1 << 20)
    assert sorted(p.name for p in spool.iterdir()) == [segment.name, other.name]


def test_a_push_of_what_is_not_a_wal_file_says_how_to_set_the_command(tmp_path, capsys) -> None:
    (tmp_path / "spool").mkdir()
    (tmp_path / "postgresql.conf").write_text("")
    code = walspool.main(
        ["--spool", str(tmp_path / "spool"), "--max-bytes", "1", str(tmp_path / "postgresql.conf")]
    )
    assert code == walspool.EXIT_MISCONFIGURED
    assert "is not a WAL file" in capsys.readouterr().err
