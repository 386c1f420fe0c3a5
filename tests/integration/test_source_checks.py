"""The engine adapters never create a source and never act on the wrong one.

SQLite: a misspelled ``path`` fails flush and checkpoint with ``ShardDataMissing`` and is still
absent on disk afterwards (``sqlite3.connect`` would have created an empty database there,
which was then backed up as the shard). PostgreSQL, against real servers: a ``data_dir`` that
is missing, holds no ``PG_VERSION``, or belongs to another instance than ``conninfo`` reaches is
refused before anything is taken, so the server shows no replication slot and no agent session
afterwards; a symlink to the right directory is accepted.
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Callable, Iterator
from contextlib import closing
from pathlib import Path

import pytest
from shardvault_agent.config import AgentConfig, ShardConfig
from shardvault_agent.engines.postgres.adapter import PostgresAdapter
from shardvault_agent.engines.sqlite.adapter import SqliteAdapter

from shardvault.errors import EngineError, ShardDataMissing
from shardvault.local.postgres import PostgresInstance, init_instance


# --- SQLite -------------------------------------------------------------------------------------
def sqlite_adapter(tmp_path: Path, path: Path) -> tuple[SqliteAdapter, ShardConfig]:
    shard = ShardConfig(shard_id="s1", path=path)
    config = AgentConfig(
        node_id="n1", cluster="c", engine="sqlite", shards=[shard], state_dir=tmp_path / "state"
    )
    return SqliteAdapter(config), shard


def test_a_misspelled_sqlite_path_is_refused_by_name_and_never_created(tmp_path):
    misspelled = tmp_path / "shard-1.sqlite"  # the database is shard-1.db
    adapter, shard = sqlite_adapter(tmp_path, misspelled)
    with pytest.raises(ShardDataMissing, match=f"path {misspelled} does not exist"):
        adapter.flush(shard)
    with pytest.raises(ShardDataMissing, match=f"path {misspelled} does not exist"):
        adapter.checkpoint(shard, "b1", tmp_path / "work")
    assert not misspelled.exists()
    assert list(tmp_path.iterdir()) == []  # no snapshot, no state, nothing beside the path
    assert not adapter.holds(shard, "b1")


def test_an_empty_file_left_at_a_misspelled_path_is_not_backed_up(tmp_path):
    """What earlier versions left behind: flush's sqlite3.connect created an empty file."""
    leftover = tmp_path / "shard-1.sqlite"
    leftover.touch()
    adapter, shard = sqlite_adapter(tmp_path, leftover)
    with pytest.raises(ShardDataMissing, match="is an empty file, not a database"):
        adapter.checkpoint(shard, "b1", tmp_path / "work")
    assert not adapter.holds(shard, "b1")
    assert not (tmp_path / "state" / "snapshots" / "b1").exists()


def test_flush_and_checkpoint_of_a_real_database_still_work(tmp_path):
    db = tmp_path / "shard 1.db"  # a space: the path travels in a file: URI
    with closing(sqlite3.connect(db)) as conn:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("CREATE TABLE t(x)")
        conn.executemany("INSERT INTO t VALUES (randomblob(1024))", [()] * 50)
        conn.commit()
        assert (tmp_path / "shard 1.db-wal").stat().st_size > 0
        adapter, shard = sqlite_adapter(tmp_path, db)
        adapter.flush(shard)
        assert (tmp_path / "shard 1.db-wal").stat().st_size == 0  # checkpointed into the file
    capture = adapter.checkpoint(shard, "b1", tmp_path / "work")
    with closing(sqlite3.connect(capture.root / capture.files[0].path)) as snapshot:
        assert snapshot.execute("SELECT count(*) FROM t").fetchone()[0] == 50
    assert adapter.shard_bytes(shard) == db.stat().st_size > 0


def test_a_missing_source_counts_zero_bytes_and_says_so_once(tmp_path, caplog):
    missing = tmp_path / "gone.db"
    adapter, shard = sqlite_adapter(tmp_path, missing)
    with caplog.at_level(logging.WARNING, logger="shardvault.agent"):
        assert adapter.shard_bytes(shard) == 0
        assert adapter.shard_bytes(shard) == 0  # the next heartbeat: not logged again
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert f"shard s1 counted as 0 bytes: SQLite shard s1: path {missing} does not" in warnings[0]
    assert not missing.exists()


# --- PostgreSQL ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[PostgresInstance]]:
    root = tmp_path_factory.mktemp("source-checks")
    started: list[PostgresInstance] = []
    try:
        for name in ("a", "b"):
            started.append(init_instance(root / name))
        yield started
    finally:
        for server in started:
            server.stop(mode="immediate")


@pytest.fixture
def pg_adapter(
    tmp_path: Path,
) -> Iterator[Callable[[Path, str], tuple[PostgresAdapter, ShardConfig]]]:
    """Makes an adapter of one shard ``p1``; whatever it still holds is released after the
    test, so a checkpoint that should have been refused leaves no slot to the next test."""
    made: list[tuple[PostgresAdapter, ShardConfig]] = []

    def make(data_dir: Path, conninfo: str) -> tuple[PostgresAdapter, ShardConfig]:
        shard = ShardConfig(shard_id="p1", data_dir=data_dir, conninfo=conninfo)
        config = AgentConfig(
            node_id="n1",
            cluster="c",
            engine="postgres",
            shards=[shard],
            state_dir=tmp_path / "state",
        )
        made.append((PostgresAdapter(config), shard))
        return made[-1]

    yield make
    for adapter, shard in made:
        adapter.release(shard, "b1")


def untouched(server: PostgresInstance) -> None:
    """No slot, no backup-holding session of the agent, on the server."""
    assert server.psql("SELECT count(*) FROM pg_replication_slots") == "0"
    sessions = "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'shardvault-agent'"
    assert server.psql(sessions) == "0"


def test_a_data_dir_of_another_instance_is_refused_before_anything_is_taken(
    servers, pg_adapter, tmp_path
):
    a, b = servers
    adapter, shard = pg_adapter(b.data_dir, a.conninfo)  # b's files, a's server
    with pytest.raises(ShardDataMissing) as refused:
        adapter.checkpoint(shard, "b1", tmp_path / "work")
    message = str(refused.value)
    assert f"reaches the instance of {a.data_dir}, not that of data_dir {b.data_dir}" in message
    assert "Fix: point data_dir and conninfo at the same instance" in message
    assert not adapter.holds(shard, "b1")
    with pytest.raises(ShardDataMissing, match="reaches the instance of"):
        adapter.flush(shard)
    untouched(a)
    untouched(b)


@pytest.mark.parametrize("wrong", ["absent", "empty"])
def test_a_data_dir_that_is_no_data_directory_is_refused_by_name(
    servers, pg_adapter, tmp_path, wrong
):
    a, _ = servers
    data_dir = tmp_path / wrong
    if wrong == "empty":
        data_dir.mkdir()
    adapter, shard = pg_adapter(data_dir, a.conninfo)
    expected = "does not exist" if wrong == "absent" else "holds no PG_VERSION"
    with pytest.raises(ShardDataMissing, match=f"data_dir {data_dir} {expected}"):
        adapter.checkpoint(shard, "b1", tmp_path / "work")
    with pytest.raises(ShardDataMissing, match=expected):
        adapter.flush(shard)
    assert adapter.shard_bytes(shard) == 0
    assert data_dir.exists() == (wrong == "empty")
    untouched(a)


def test_a_symlink_to_the_right_data_dir_is_accepted(servers, pg_adapter, tmp_path):
    a, _ = servers
    link = tmp_path / "current"
    link.symlink_to(a.data_dir)
    adapter, shard = pg_adapter(link, a.conninfo)
    adapter.flush(shard)
    capture = adapter.checkpoint(shard, "b1", tmp_path / "work")
    try:
        assert "PG_VERSION" in {f.path for f in capture.files}
        assert a.psql("SELECT count(*) FROM pg_replication_slots") == "1"  # held until release
    finally:
        adapter.release(shard, "b1")
    untouched(a)


def test_a_role_that_cannot_read_data_directory_is_checked_by_the_postmasters_start(
    servers, pg_adapter, tmp_path
):
    """Without pg_read_all_settings the instance is confirmed by its start time: the same
    instance passes, another instance is still refused before anything is taken."""
    a, b = servers
    for server in (a, b):
        server.psql("CREATE ROLE plain_agent LOGIN REPLICATION")
        server.psql("GRANT pg_checkpoint TO plain_agent")
    plain = a.conninfo.replace("user=postgres", "user=plain_agent")
    adapter, shard = pg_adapter(a.data_dir, plain)
    adapter.flush(shard)  # a's conninfo, a's data_dir: confirmed
    wrong, other = pg_adapter(b.data_dir, plain)
    with pytest.raises(ShardDataMissing, match="another instance"):
        wrong.checkpoint(other, "b1", tmp_path / "work")
    untouched(a)
    untouched(b)


def test_a_server_a_backup_cannot_use_is_named_before_one_starts(servers, pg_adapter):
    """What the leader's agent reports with each heartbeat (check_ready), so validation
    refuses the backup by name (ShardNotReady) instead of failing at its checkpoint: no free
    replication slot, a role without REPLICATION, pg_backup_start or pg_create_restore_point,
    a server that is down."""
    server = servers[0]
    adapter, shard = pg_adapter(server.data_dir, server.conninfo)
    adapter.check_ready(shard)  # the test server is ready: nothing to say

    free = int(server.psql("SHOW max_replication_slots"))
    for i in range(free):
        server.psql(f"SELECT pg_create_physical_replication_slot('filler_{i}')")
    try:
        with pytest.raises(EngineError, match="no replication slot is free"):
            adapter.check_ready(shard)
    finally:
        for i in range(free):
            server.psql(f"SELECT pg_drop_replication_slot('filler_{i}')")
    adapter.check_ready(shard)

    server.psql("CREATE ROLE plain LOGIN")
    try:
        plain, as_plain = pg_adapter(server.data_dir, f"{server.conninfo} user=plain")
        with pytest.raises(EngineError, match=r"lacks REPLICATION.*may not run pg_backup_start"):
            plain.check_ready(as_plain)
        # The backup's grants without the flush's and the cut's: both are named, alone.
        # (Issue 44, 9: a role with what the README listed then failed at the flush.)
        server.psql("ALTER ROLE plain REPLICATION")
        server.psql("GRANT EXECUTE ON FUNCTION pg_backup_start, pg_backup_stop TO plain")
        with pytest.raises(
            EngineError, match=r"backed up: [^;]*CHECKPOINT[^;]*; [^;]*restore point \(GRANT"
        ) as refused:
            plain.check_ready(as_plain)
        assert "REPLICATION" not in str(refused.value)
        server.psql("GRANT pg_checkpoint TO plain")
        with pytest.raises(EngineError, match=r"backed up: [^;]*restore point \(GRANT"):
            plain.check_ready(as_plain)
        server.psql("GRANT EXECUTE ON FUNCTION pg_create_restore_point TO plain")
        plain.check_ready(as_plain)
    finally:
        server.psql("REVOKE ALL ON FUNCTION pg_backup_start, pg_backup_stop FROM plain")
        server.psql("REVOKE ALL ON FUNCTION pg_create_restore_point FROM plain")
        server.psql("REVOKE pg_checkpoint FROM plain")
        server.psql("DROP ROLE plain")
    untouched(server)


def test_an_archived_shard_lets_its_slot_go_past_the_threshold_when_its_tail_is_copied(
    servers, pg_adapter, tmp_path
):
    """A shard this agent archives: past ``archive_handoff_mib`` of held WAL its backup drops
    its slot (the archive keeps the WAL) when the checkpoint command says the control plane
    copies archived tails, and holds it as before when it does not (an older control plane).
    check_ready asks such a shard for archive_mode."""
    server = servers[0]
    adapter, shard = pg_adapter(server.data_dir, server.conninfo)
    adapter.use_log_archive({shard.shard_id})
    with pytest.raises(EngineError, match="has a wal_spool_dir but archive_mode is off"):
        adapter.check_ready(shard)  # this server does not archive
    slots = "SELECT count(*) FROM pg_replication_slots"
    adapter.config.archive_handoff_mib = 32.0
    server.psql("CREATE TABLE IF NOT EXISTS filler (n int)")

    for log_archived, kept in ((False, "1"), (True, "0")):
        server.psql("CHECKPOINT")  # the slot reserves from the last checkpoint's redo point
        adapter.checkpoint(shard, "b1", tmp_path / "work", log_archived=log_archived)
        try:
            held = adapter.held_log(shard, "b1")
            assert held is not None
            assert held.bytes < 32 * 2**20  # under the threshold: the slot holds it
            assert server.psql(slots) == "1"
            for _ in range(4):  # a segment each: past 32 MiB
                server.psql("INSERT INTO filler VALUES (1)")
                server.psql("SELECT pg_switch_wal()")
            held = adapter.held_log(shard, "b1")
            assert held is not None
            assert held.bytes + held.let_go > 32 * 2**20  # held until now
            assert (held.let_go > 0) == log_archived  # let go, not held: the guard's limits
            assert server.psql(slots) == kept  # the archive keeps the WAL, or the slot
            held = adapter.held_log(shard, "b1")
            assert held is not None
            assert (held.bytes == 0) == log_archived
        finally:
            adapter.release(shard, "b1")
    untouched(server)
