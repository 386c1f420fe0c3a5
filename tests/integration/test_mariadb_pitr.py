"""MariaDB point-in-time restores: the server's binary logs archived by the agent (read from
the server, stored as PostgreSQL's WAL is, purged once stored), replayed onto a backup.

A server with binary logging under a write load (transfers between accounts, each move one
transaction) is backed up; marker rows are then written 2.2 s apart and the binary logs
archived. A restore to a time between two markers (whole seconds: the logs stamp events by
the second) holds exactly the markers committed before it, and the transfers stay consistent
(``consistent``); a restore to a position holds what was committed before it; targets the
archive cannot reach are refused by name.
"""

from __future__ import annotations

import math
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest
from shardvault_agent.engines.mariadb.server import MariadbServer

from shardvault.contracts.wal_archive import WAL_DIR
from shardvault.local import demo
from shardvault.local.mariadb import ACCOUNTS, BALANCE, Transfers, consistent, init_server
from shardvault.local.mariadb import stop_server as stop_mariadb
from shardvault.wal import archive

from .conftest import FAST_AGENT, Cluster, names, output

MARKS = 8
GAP_SECONDS = 2.2  # between two markers: a whole second apart whatever the rounding


@pytest.fixture
def binlog_node(stack, tmp_path, policy_for):
    name = f"mpitr{next(names)}"
    server = init_server(tmp_path / "maria" / "node-1", binlog=True)
    try:
        Transfers(server).create()
        server.sql("CREATE TABLE marks (n INT PRIMARY KEY, at DATETIME(6))", database="bank")
        shard = {
            "shard_id": "shard-1",
            "role": "leader",
            "data_dir": str(server.data_dir),
            "socket": str(server.socket),
            "archive_binlogs": True,
        }
        config = demo.agent_config(tmp_path, name, f"{name}-n1", "mariadb", [shard])
        config |= FAST_AGENT | {"archive_poll_seconds": 0.2}
        policy_for(name, engine="mariadb", archive="{max_delay_seconds: 0.5}")
        stack.start_agent(config)
        stack.wait_for_nodes([config["node_id"]])
        cluster = Cluster(stack, name, tmp_path, [config], {"shard-1": server.data_dir})
        yield cluster, server
        cluster.stop()
    finally:
        stop_mariadb(server.data_dir)


def write_marks(server: MariadbServer) -> tuple[list[float], str]:
    """Markers 0..MARKS-1, GAP_SECONDS apart; when each had committed (this host's clock, the
    server's), and the binary log position right after marker 4's commit."""
    committed, position = [], ""
    for n in range(MARKS):
        server.sql(f"INSERT INTO marks VALUES ({n}, NOW(6))", database="bank")
        committed.append(time.time())
        if n == 4:
            file, pos, *_ = server.sql("SHOW MASTER STATUS").split("\t")
            position = f"{file}:{pos}"
        time.sleep(GAP_SECONDS)
    return committed, position


def settled(server: MariadbServer, timeout: float = 60) -> None:
    """Every binary log closed and archived: the agent purged all but the open one."""
    server.sql("FLUSH BINARY LOGS")
    deadline = time.monotonic() + timeout
    while len(server.sql("SHOW BINARY LOGS").splitlines()) > 1:
        assert time.monotonic() < deadline, server.sql("SHOW BINARY LOGS")
        time.sleep(0.2)


def after_mark(committed: list[float], n: int) -> str:
    """A whole second after marker ``n`` committed and before marker n+1 started."""
    return datetime.fromtimestamp(math.floor(committed[n]) + 1, UTC).isoformat()


def restored(progress) -> tuple[MariadbServer, dict]:
    (shard,) = output(progress)["shards"]
    return MariadbServer(Path(shard["path"]), Path(shard["socket"])), shard


def marks_of(server: MariadbServer) -> list[int]:
    return [int(n) for n in server.sql("SELECT n FROM marks ORDER BY n", database="bank").split()]


def test_binary_logs_are_archived_and_replayed_to_times_and_a_position(
    binlog_node, make_target, stack
):
    cluster, server = binlog_node
    load = Transfers(server)
    load.start()
    try:
        time.sleep(1)
        backup = cluster.backup()
        assert backup.status == "SUCCEEDED", backup.cause
        committed, position = write_marks(server)
    finally:
        load.stop()
    settled(server)
    batches = archive.archived_batches(stack.services(), cluster.name, "shard-1")
    assert batches
    assert {b["kind"] for b in batches} == {"binlog"}
    into = make_target(nodes=1, engine="mariadb")

    for n in (2, 6):
        progress = into.restore(
            cluster.name, target={"time": after_mark(committed, n)}, replace=True
        )
        assert progress.status == "SUCCEEDED", progress.cause
        copy, shard = restored(progress)
        assert marks_of(copy) == list(range(n + 1)), n
        total, _ = consistent(copy)
        assert total == ACCOUNTS * BALANCE
        assert shard["recovery_target"] == "time"
        assert shard["checks"]["mariadb-check --all-databases"] == "ok"
        assert not (Path(shard["path"]) / WAL_DIR).exists()  # replayed, then removed

    at = into.restore(cluster.name, target={"position": position}, replace=True)
    assert at.status == "SUCCEEDED", at.cause
    copy, shard = restored(at)
    assert marks_of(copy) == list(range(5))
    assert shard["replayed_to"] == position
    consistent(copy)

    latest = into.restore(cluster.name, target={"latest": True}, replace=True)
    assert latest.status == "SUCCEEDED", latest.cause
    copy, _ = restored(latest)
    assert marks_of(copy) == list(range(MARKS))
    _, moves = consistent(copy)
    assert moves == int(server.sql("SELECT COUNT(*) FROM moves", database="bank"))


def test_targets_a_binary_log_cannot_stop_at_are_refused_by_name(binlog_node, make_target):
    cluster, server = binlog_node
    backup = cluster.backup()
    assert backup.status == "SUCCEEDED", backup.cause
    server.sql("INSERT INTO marks VALUES (0, NOW(6))", database="bank")
    settled(server)
    into = make_target(nodes=1, engine="mariadb")
    now = datetime.now(UTC).replace(microsecond=0)
    refused = {
        "a fraction of a second": {"time": now.replace(microsecond=500_000).isoformat()},
        "an LSN": {"lsn": "0/3000060"},
        "a year ahead": {"time": now.replace(year=now.year + 1).isoformat()},
        "a file not archived": {"position": "mysql-bin.900000:4"},
    }
    said = {}
    for what, target in refused.items():
        progress = into.restore(cluster.name, target=target)
        assert progress.status == "FAILED", what
        said[what] = progress.cause or ""
    assert "stamps its log by the second" in said["a fraction of a second"]
    assert "cannot stop at LSN 0/3000060" in said["an LSN"]
    assert "restorable range is from" in said["a year ahead"]
    # In the binary logs' own words, with what closes one (no PostgreSQL setting).
    assert "is past the binary log archive" in said["a year ahead"]
    assert "archive.max_delay_seconds" in said["a year ahead"]
    assert "is not in shard shard-1's archived binary logs" in said["a file not archived"]
    # Each was refused before a node wrote anything.
    assert not [p for p in into.restore_dir(0).rglob("*") if not p.name.startswith(".")]
