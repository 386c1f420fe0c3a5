"""The cut on a real PostgreSQL server: one statement, sent ahead of the instant, that the
server times (``restore_point`` in the PostgreSQL engine).

What a user sees of it: the restore point lands at the instant, the commit pause lasts its
designed 12 ms however late the agent wakes, a commit that holds the lock leaves a best-effort
cut (never a failed backup), and the session's timeouts are as they were before.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime

import psycopg
import pytest
from psycopg.conninfo import make_conninfo
from shardvault_agent.config import AgentConfig, ShardConfig
from shardvault_agent.engines.postgres.adapter import PostgresAdapter, restore_point, take_cut

from shardvault.backup.planner import cut_summary
from shardvault.contracts.cut import (
    LOCK_TIMEOUT_SECONDS,
    PAUSE_HOLD_SECONDS,
    CutRequest,
)
from shardvault.contracts.models import Phase, ShardListing
from shardvault.errors import EngineError
from shardvault.local.postgres import PostgresInstance, init_instance

KEY = 4242
# How late a server's sleep may wake: a few ms on an idle machine, tens of ms on 2 vCPUs under
# the rest of the suite (a stop's CI failed on 5). Still far inside what the agent's own timing
# would add (its wake-ups and round trips: 100 ms and more).
WAKE = 0.03


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PostgresInstance]:
    instance = init_instance(tmp_path_factory.mktemp("cut") / "data")
    try:
        yield instance
    finally:
        instance.stop(mode="immediate")


def connect(server: PostgresInstance) -> psycopg.Connection:
    return psycopg.connect(server.conninfo, autocommit=True)


def cut_in(seconds: float, name: str, commit_lock: int | None = KEY) -> CutRequest:
    entered = datetime.fromtimestamp(time.time() + seconds, UTC).isoformat()
    return CutRequest(name=name, entered=entered, margin_seconds=0, commit_lock=commit_lock)


def shard(server: PostgresInstance) -> ShardConfig:
    return ShardConfig(shard_id="s1", data_dir=server.data_dir, conninfo="")


def pause_of(marker: dict[str, str]) -> tuple[float, float, float]:
    asked, locked, released = (float(v) for v in marker["cut_pause"].split())
    return asked, locked, released


def test_the_paused_cut_is_timed_by_the_server_around_the_instant(server) -> None:
    cut = cut_in(0.5, "cut-timed")
    with connect(server) as conn:
        marker = restore_point(conn, shard(server), cut)
        asked, locked, released = pause_of(marker)
        created = float(marker["cut_at"])
        # Asked at the instant, the point as soon as the lock is held, let go at the hold's
        # end: the server's sleeps wake within a few ms, nothing of the agent's timing is inside.
        assert cut.at <= asked <= locked <= created < cut.at + WAKE
        assert cut.at + PAUSE_HOLD_SECONDS <= released < cut.at + PAUSE_HOLD_SECONDS + 2 * WAKE
        assert released - asked < PAUSE_HOLD_SECONDS + WAKE
        assert float(marker["cut_late_seconds"]) < WAKE
        # The lock ended with the statement: a commit may take it again at once.
        with connect(server) as other:
            assert other.execute("SELECT pg_try_advisory_lock_shared(%s)", (KEY,)).fetchone()[0]
        # The point is in the WAL (the marker's LSN is where the tail ends).
        inserted = f"SELECT pg_current_wal_insert_lsn() >= '{marker['cut_lsn']}'::pg_lsn"
        assert server.psql(inserted) == "t"


def test_a_commit_that_holds_the_lock_leaves_a_best_effort_cut(server) -> None:
    with connect(server) as commit, connect(server) as conn:
        commit.execute("SELECT pg_advisory_lock_shared(%s)", (KEY,))  # a commit under way
        cut = cut_in(0.3, "cut-best-effort")
        marker = restore_point(conn, shard(server), cut)
        asked, locked, released = pause_of(marker)
        assert locked == 0  # not granted: the cut goes on without it
        assert released - asked == pytest.approx(LOCK_TIMEOUT_SECONDS, abs=0.02)
        created = float(marker["cut_at"])
        assert created >= cut.at + LOCK_TIMEOUT_SECONDS
        assert float(marker["cut_late_seconds"]) == pytest.approx(created - cut.at, abs=1e-5)
        # The session's settings are back to its defaults for whatever it runs next.
        assert conn.execute("SHOW lock_timeout").fetchone()[0] == "0"
        commit.execute("SELECT pg_advisory_unlock_shared(%s)", (KEY,))


def test_a_short_statement_timeout_does_not_fail_the_cut(server) -> None:
    """The statement sleeps until the instant (up to the cut's margin, 2 s with several
    nodes): a role's statement_timeout shorter than that must not fail the backup."""
    with connect(server) as conn:
        conn.execute("SET statement_timeout = 100")
        for lock in (KEY, None):
            cut = cut_in(0.4, "cut-timeout", commit_lock=lock)
            marker = restore_point(conn, shard(server), cut)
            assert float(marker["cut_at"]) >= cut.at
            assert ("cut_pause" in marker) is (lock is not None)


def test_a_node_that_comes_after_the_instant_cuts_at_once_and_says_how_late(server) -> None:
    with connect(server) as conn:
        cut = cut_in(-0.25, "cut-late", commit_lock=None)
        started = time.time()
        marker = restore_point(conn, shard(server), cut)
        assert time.time() - started < 0.2
        assert float(marker["cut_late_seconds"]) == pytest.approx(0.25, abs=0.1)


def test_a_node_late_to_the_instant_still_holds_commits_for_the_hold(server) -> None:
    """A stall that makes every node late together must not leave their pauses without a
    shared moment: a late node holds the lock a hold's length after taking it."""
    with connect(server) as conn:
        cut = cut_in(-0.05, "cut-late-paused")
        marker = restore_point(conn, shard(server), cut)
        _, locked, released = pause_of(marker)
        assert locked >= cut.at + 0.05
        assert released - locked >= PAUSE_HOLD_SECONDS
        assert float(marker["cut_late_seconds"]) == pytest.approx(0.05, abs=0.05)


def test_a_cut_without_a_commit_lock_is_on_disk_when_it_returns(server) -> None:
    """Its statement's commit flushes the point, so the backup's stop does not wait for the
    WAL writer (up to 200 ms on a quiet server)."""
    with connect(server) as conn:
        for name in ("cut-flushed-1", "cut-flushed-2", "cut-flushed-3"):
            marker = restore_point(conn, shard(server), cut_in(0, name, commit_lock=None))
            flushed = "SELECT pg_current_wal_flush_lsn() >= %s::pg_lsn"
            assert conn.execute(flushed, (marker["cut_lsn"],)).fetchone()[0], marker
            time.sleep(0.3)  # the WAL writer has been and gone: the next one must not need it


@pytest.fixture(scope="module")
def bank(server: PostgresInstance) -> str:
    """The application's database; the agent's conninfo names ``postgres``."""
    server.psql("CREATE DATABASE bank")
    return "bank"


def agent_shard(server: PostgresInstance, **conninfo: str) -> ShardConfig:
    """The shard as an agent configures it: its conninfo on ``postgres``, as in issue 44."""
    reach = make_conninfo(server.conninfo_for("postgres"), **conninfo)
    return ShardConfig(shard_id="s1", data_dir=server.data_dir, conninfo=reach)


def cut_into(database: str | None, name: str, seconds: float = 0.3) -> CutRequest:
    return cut_in(seconds, name).model_copy(update={"database": database})


WAITING_IN = """
SELECT d.datname FROM pg_locks l JOIN pg_database d ON d.oid = l.database
WHERE l.locktype = 'advisory' AND l.mode = 'ExclusiveLock' AND NOT l.granted
  AND l.classid = 0 AND l.objid = %s AND l.objsubid = 1
"""


def databases_the_cut_waited_in(server: PostgresInstance, cutting: threading.Thread) -> set[str]:
    """Watching from outside while ``cutting`` runs: the databases where a session asked for
    the commit lock exclusively and waited (a bigint advisory key: classid, objid, 1)."""
    seen: set[str] = set()
    with connect(server) as watcher:
        while cutting.is_alive():
            seen |= {row[0] for row in watcher.execute(WAITING_IN, (KEY,)).fetchall()}
    return seen


def test_the_pause_takes_its_lock_in_the_database_the_policy_names(server, bank) -> None:
    """Advisory locks are per database: with the agent's session on ``postgres`` and the
    application's commits in ``bank``, a lock taken on the agent's session would hold none
    of them (issue 44: 0 lock retries, every cut "paused", half-transfers restored). The cut
    takes it in ``bank``: seen from outside in pg_locks as an exclusive request in bank that
    a commit holding the lock there makes wait, then goes around (best-effort, not paused);
    a commit holding the same key in ``postgres`` holds nothing the cut asks for."""
    shard_config = agent_shard(server)
    with (
        psycopg.connect(server.conninfo_for(bank), autocommit=True) as commit,
        connect(server) as conn,
    ):
        commit.execute("SELECT pg_advisory_lock_shared(%s)", (KEY,))  # the app's, in bank
        markers: list[dict[str, str]] = []
        cut = cut_into(bank, "cut-bank")
        cutting = threading.Thread(target=lambda: markers.append(take_cut(conn, shard_config, cut)))
        cutting.start()
        assert databases_the_cut_waited_in(server, cutting) == {bank}
        _, locked, _ = pause_of(markers[0])
        assert locked == 0  # the application's commit held it: waited for, not passed over
        commit.execute("SELECT pg_advisory_unlock_shared(%s)", (KEY,))

        # The same key held in the agent's database is another lock: the cut in bank takes
        # its own at once (it would have paused nothing had it been taken there).
        conn.execute("SELECT pg_advisory_lock_shared(%s)", (KEY,))
        _, locked, _ = pause_of(take_cut(conn, shard_config, cut_into(bank, "cut-bank-2")))
        assert locked > 0
        conn.execute("SELECT pg_advisory_unlock_shared(%s)", (KEY,))
    # The cut's own session to bank is gone (no session of the agent's left behind).
    sessions = server.psql(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = 'bank' "
        "AND application_name = 'shardvault-agent'"
    )
    assert sessions == "0"


def test_a_pause_that_names_no_database_is_best_effort_never_paused(server) -> None:
    """A control plane older than cut.database sends the lock alone: where the application
    takes it is unknown, so the cut goes without it and says so, though nothing holds it."""
    with connect(server) as conn:
        marker = take_cut(conn, agent_shard(server), cut_into(None, "cut-no-database"))
    asked, locked, released = pause_of(marker)
    assert locked == 0
    assert asked <= released == float(marker["cut_at"])
    assert cut_summary([tail_of(marker)], "cut-no-database")["cut_paused"] is False


def tail_of(marker: dict[str, str]) -> ShardListing:
    return ShardListing(
        shard_id="s1",
        node_id="n1",
        phase=Phase.TAIL,
        files=[],
        marker={"stop_lsn": "0/0", **marker},
    )


def test_a_database_the_agent_cannot_reach_fails_the_cut_by_name(server) -> None:
    shard_config = agent_shard(server)
    with connect(server) as conn, pytest.raises(EngineError) as refused:
        take_cut(conn, shard_config, cut_into("nosuchdb", "cut-nowhere", 0.1))
    assert "database 'nosuchdb'" in refused.value.message
    assert 'GRANT CONNECT ON DATABASE "nosuchdb"' in refused.value.fix
    with pytest.raises(EngineError) as checked:  # what check asks before a backup meets it
        PostgresAdapter(AgentConfig.model_construct()).check_cut_database(shard_config, "nosuchdb")
    assert checked.value.message == refused.value.message


def test_function_grants_are_per_database_and_the_cut_needs_its_own(server, bank) -> None:
    """A role granted pg_create_restore_point in the database its conninfo names (what the
    heartbeat checks) may not create it from the pause's database: refused by name before
    the instant, then allowed once granted there."""
    server.psql("CREATE ROLE cutter LOGIN")
    server.psql("GRANT EXECUTE ON FUNCTION pg_create_restore_point(text) TO cutter")
    shard_config = agent_shard(server, user="cutter")
    adapter = PostgresAdapter(AgentConfig.model_construct())
    with pytest.raises(EngineError) as refused:
        adapter.check_cut_database(shard_config, bank)
    assert "may not create the backup's restore point" in refused.value.message
    assert "in database 'bank': GRANT EXECUTE" in refused.value.fix
    server.psql("GRANT EXECUTE ON FUNCTION pg_create_restore_point(text) TO cutter", dbname=bank)
    adapter.check_cut_database(shard_config, bank)
    with psycopg.connect(shard_config.conninfo, autocommit=True) as conn:
        marker = take_cut(conn, shard_config, cut_into(bank, "cut-granted"))
    assert pause_of(marker)[1] > 0
