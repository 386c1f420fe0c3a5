"""MariaDB's binary logs in the log archive: their names and order, the archive's run and
expiry over them, where a replay stops in a file (from its events' headers), and the targets
a binary log cannot stop at."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
from shardvault_agent.engines.mariadb.binlogs import backup_position
from shardvault_agent.engines.mariadb.replay import (
    GTID_EVENT,
    MAGIC,
    group_bounds,
    time_stop,
)

from shardvault.contracts.catalog import BackupItem
from shardvault.contracts.models import BackupStatus, RestoreRequest
from shardvault.contracts.wal_archive import BINLOG_FILE, Batch, WalFile, log_order
from shardvault.errors import InvalidRequest, TargetUnsupported
from shardvault.wal.archive import batch_problems, binlog_archive, expired_keys
from shardvault.wal.pitr import base_backup

FORMAT, XID, ROWS, ROTATE = 15, 16, 30, 4


@pytest.mark.parametrize(
    ("name", "binlog"),
    [
        ("mysql-bin.000012", True),
        ("host-01-bin.1000000", True),
        ("x--y.000001", False),  # batch keys are split on "--"
        ("mysql-bin.index", False),
        ("000000010000000000000003", False),
    ],
)
def test_binary_log_names(name, binlog):
    assert bool(BINLOG_FILE.fullmatch(name)) is binlog


def test_a_seventh_digit_sorts_after_six():
    names = ["mysql-bin.1000000", "mysql-bin.999999", "mysql-bin.000012"]
    assert sorted(names, key=log_order) == [
        "mysql-bin.000012",
        "mysql-bin.999999",
        "mysql-bin.1000000",
    ]


def batch(*names: str, kind: str = "binlog", size: int = 100) -> Batch:
    return Batch(
        batch_id="0" * 32,
        shard_id="shard-1",
        files=[WalFile(name=n, size=size) for n in names],
        frame_size=1 << 20,
        frames="",
        stored_length=0,
        crc64nvme="AAAAAAAAAAA=",
        kind=kind,
    )


def test_a_batch_holds_files_of_its_kind_in_log_order_and_one_large_file_alone():
    with pytest.raises(ValueError, match="not a wal file's name"):
        batch("mysql-bin.000001", kind="wal")
    out_of_order = batch_problems(batch("mysql-bin.1000000", "mysql-bin.999999"))
    assert "its files are not in log order, each once" in out_of_order
    big = 300 * 1024 * 1024  # a transaction larger than max_binlog_size stays in one file
    assert not any("over" in p for p in batch_problems(batch("mysql-bin.000001", size=big)))
    two = batch_problems(batch("mysql-bin.000001", "mysql-bin.000002", size=big // 2))
    assert any("over" in p for p in two)


def index(*names: str, pushed: float = 0.0) -> dict:
    return {"files": [{"name": n, "size": 1, "pushed_at": pushed} for n in names]}


def test_the_run_is_the_consecutive_ordinals_from_the_base_and_stops_at_a_gap():
    indexes = [
        index("mysql-bin.000011", pushed=1.0),
        index("mysql-bin.000012", "mysql-bin.000013", pushed=2.0),
        index("mysql-bin.000015", pushed=4.0),  # 14 never archived (purged by someone else)
    ]
    run = binlog_archive("shard-1", "mysql-bin.000012", indexes)
    assert run.last == "mysql-bin.000013"
    assert run.reaches == 2.0
    assert run.batches == [indexes[1]]
    assert run.newest == "mysql-bin.000015"
    assert binlog_archive("shard-1", "mysql-bin.000020", indexes).last is None


def test_binlog_batches_before_the_oldest_kept_backups_file_expire():
    keys = [
        "p/_wal/shard-1/mysql-bin.000001--mysql-bin.000004--b1.wal",
        "p/_wal/shard-1/mysql-bin.000005--mysql-bin.000009--b2.wal",
        "p/_wal/shard-1/other.000001--other.000002--b3.wal",
    ]
    assert expired_keys(keys, {"shard-1": "mysql-bin.000005"}) == [keys[0]]


def test_a_backup_records_where_its_copy_ends_in_the_binary_logs(tmp_path):
    (tmp_path / "xtrabackup_binlog_info").write_text("mysql-bin.000012\t1234\t0-1-77\n")
    assert backup_position(tmp_path) == {
        "binlog_file": "mysql-bin.000012",
        "binlog_pos": "1234",
        "binlog_gtid": "0-1-77",
    }
    assert backup_position(tmp_path / "nothing") == {}


def binlog(path: Path, events: list[tuple[int, int, int]]) -> list[int]:
    """Writes a binary log of ``events`` (stamp, type, payload size); their offsets."""
    data, offsets = bytearray(MAGIC), []
    for stamp, kind, payload in events:
        offsets.append(len(data))
        size = 19 + payload
        data += struct.pack("<IBIIIH", stamp, kind, 1, size, len(data) + size, 0)
        data += b"\0" * payload
    path.write_bytes(data)
    return offsets


def test_a_time_stops_before_the_first_group_holding_a_later_event(tmp_path):
    path = tmp_path / "mysql-bin.000002"
    offsets = binlog(
        path,
        [
            (100, FORMAT, 40),  # the file opened at 100
            (100, GTID_EVENT, 10), (100, ROWS, 30), (100, XID, 8),
            (104, GTID_EVENT, 10), (104, ROWS, 30), (105, XID, 8),  # committed at 105
            (106, GTID_EVENT, 10), (106, ROWS, 30), (106, XID, 8),
            (110, ROTATE, 20),  # closed at 110
        ],
    )  # fmt: skip
    assert time_stop(path, 101) == offsets[4]  # the second group: its events from 104
    assert time_stop(path, 105) == offsets[4]  # its commit at 105: not before the target
    assert time_stop(path, 106) == offsets[7]
    assert time_stop(path, 107) is None  # the rotate's stamp is the file's, not a group's
    assert group_bounds(path) == [offsets[1], offsets[4], offsets[7], offsets[10]]


def complete(backup_id: str, binlog_file: str, at: float) -> BackupItem:
    return BackupItem(
        cluster="c1",
        backup_id=backup_id,
        status=BackupStatus.COMPLETE,
        engine="mariadb",
        completed_at=at,
        wal_from={"shard-1": binlog_file},
    )


@pytest.mark.parametrize(
    ("target", "error", "says"),
    [
        ({"lsn": "0/3000060"}, TargetUnsupported, "cannot stop at LSN 0/3000060"),
        ({"name": "before-migration"}, TargetUnsupported, "cannot stop at restore point"),
        ({"time": "2026-12-06T10:00:00.5+00:00"}, InvalidRequest, "by the second"),
    ],
)
def test_a_target_mariadb_cannot_stop_at_is_refused_by_name(target, error, says):
    request = RestoreRequest(cluster="c1", target_cluster="c2", target=target)
    with pytest.raises(error, match=says):
        base_backup(request, [complete("b1", "mysql-bin.000003", 1.0)])


def test_a_position_starts_from_the_newest_backup_ending_in_that_file_or_before():
    backups = [
        complete("b1", "mysql-bin.000003", 1.0),
        complete("b2", "mysql-bin.000007", 2.0),
        complete("b3", "mysql-bin.000009", 3.0),
    ]
    request = RestoreRequest(
        cluster="c1", target_cluster="c2", target={"position": "mysql-bin.000008:400"}
    )
    assert base_backup(request, backups).backup_id == "b2"
    with pytest.raises(InvalidRequest, match="not a binary log position"):
        RestoreRequest(cluster="c1", target_cluster="c2", target={"position": "mysql-bin:4"})


class FakeServer:
    """A server's binary logs as ``SHOW BINARY LOGS`` answers them; statements recorded."""

    def __init__(self, names: list[str], refuse_purge: bool = False, keep: str = "") -> None:
        self.logs = dict.fromkeys(names, 1000)
        self.said: list[str] = []
        self.refuse_purge = refuse_purge
        self.keep = keep  # a file it keeps through a purge, silently (its binlog checkpoint)
        self.gtid = "0-1-10"  # @@gtid_binlog_pos: moves with each commit

    def sql(self, statements: str) -> str:
        self.said.append(statements)
        if statements.startswith("PURGE"):
            if self.refuse_purge:
                raise RuntimeError("ERROR 1227: Access denied; you need BINLOG ADMIN")
            to = statements.split("'")[1]
            self.logs = {
                n: s
                for n, s in self.logs.items()
                if log_order(n) >= log_order(to) or n == self.keep
            }
            return ""
        if statements == "FLUSH BINARY LOGS":
            last = max(self.logs, key=log_order)
            base, ordinal = log_order(last)
            self.logs[f"{base}.{ordinal + 1:06d}"] = 300
            return ""
        rows = [f"{n}\t{s}" for n, s in self.logs.items()]
        return "\n".join([f"/var/lib/mysql/mysql-bin\t{self.gtid}", *rows])


def test_closed_logs_wait_and_are_purged_only_up_to_the_oldest_not_recorded():
    from shardvault_agent.engines.mariadb.binlogs import BinlogSource

    names = [f"mysql-bin.{n:06d}" for n in range(1, 5)]  # the 4th is open
    server = FakeServer(names)
    source = BinlogSource("shard-1", lambda: server)
    assert [p.name for p in source.waiting()] == names[:3]
    source.let_go([names[1]])  # a later batch recorded first: nothing purged early
    assert not any(s.startswith("PURGE") for s in server.said)
    assert [p.name for p in source.waiting()] == [names[0], names[2]]
    source.let_go([names[0]])
    assert [s for s in server.said if s.startswith("PURGE")] == [
        f"PURGE BINARY LOGS TO '{names[2]}'"
    ]
    assert sorted(server.logs, key=log_order) == names[2:]
    refusing = FakeServer(names, refuse_purge=True)
    quiet = BinlogSource("shard-1", lambda: refusing)
    quiet.let_go([names[0]])  # logged, not raised: a failed send would store it again
    assert [p.name for p in quiet.waiting()] == names[1:3]


def test_an_open_log_with_changes_is_closed_after_the_delay():
    from shardvault_agent.engines.mariadb.binlogs import BinlogSource

    server = FakeServer(["mysql-bin.000001"])
    source = BinlogSource("shard-1", lambda: server)
    source.look(100.0, 5.0)  # first seen: it may hold changes already
    source.look(104.0, 5.0)
    assert "FLUSH BINARY LOGS" not in server.said
    source.look(105.0, 5.0)
    assert "FLUSH BINARY LOGS" in server.said
    flushes = server.said.count("FLUSH BINARY LOGS")
    source.look(106.0, 5.0)  # the new open file, as first seen
    source.look(200.0, 5.0)  # no change in it since: never closed for nothing
    assert server.said.count("FLUSH BINARY LOGS") == flushes
    server.gtid = "0-1-11"  # a commit into the new file, right after the flush
    source.look(201.0, 5.0)
    source.look(206.0, 5.0)
    assert server.said.count("FLUSH BINARY LOGS") == flushes + 1


def test_a_file_the_server_keeps_through_a_purge_is_not_stored_again():
    from shardvault_agent.engines.mariadb.binlogs import BinlogSource

    names = [f"mysql-bin.{n:06d}" for n in range(1, 5)]
    server = FakeServer(names, keep=names[1])
    source = BinlogSource("shard-1", lambda: server)
    source.let_go(names[:3])
    assert names[1] in server.logs  # still listed by the server, after the purge
    assert source.waiting() == []  # known as archived: not in a batch again
    server.keep = ""  # its checkpoint moved on
    source.look(0.0, 60.0)  # the next look purges it
    assert names[1] not in server.logs


def test_a_look_asks_the_server_once_and_a_flush_is_seen_at_once():
    from shardvault_agent.engines.mariadb.binlogs import BinlogSource

    names = [f"mysql-bin.{n:06d}" for n in range(1, 4)]
    server = FakeServer(names)
    source = BinlogSource("shard-1", lambda: server)
    source.look(100.0, 5.0)
    for _ in range(3):  # the batches the look packs, and the heartbeat
        assert [p.name for p in source.waiting()] == names[:2]
    assert len(server.said) == 1  # one client process for the whole look
    source.look(105.0, 5.0)  # closes the open file: the listing is read again after it
    assert "FLUSH BINARY LOGS" in server.said
    assert [p.name for p in source.waiting()] == names
