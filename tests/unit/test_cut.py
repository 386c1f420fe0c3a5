"""The cluster's cut: its instant, its restore point's name, and what a backup records of it."""

from __future__ import annotations

import pytest
from psycopg.conninfo import conninfo_to_dict
from shardvault_agent.engines.postgres.adapter import WHOLE_SEGMENT, copy_wal_up_to, cut_conninfo
from shardvault_agent.engines.postgres.restore import recovery_to_cut, short_of_target

from shardvault.backup.planner import cut_summary
from shardvault.client.records import cut_cell
from shardvault.config.policy import PolicyError, parse_policy
from shardvault.contracts.cut import CutRequest, cut_margin_seconds
from shardvault.contracts.models import Phase, ShardListing
from shardvault.errors import InvalidRequest, RestoreValidationFailed
from tests.unit.support import backup_item


def test_every_node_computes_the_same_instant_from_the_stop_steps_start() -> None:
    # Step Functions writes EnteredTime with a Z; moto with +00:00: the same instant.
    aws = CutRequest(name="b1", entered="2026-11-25T04:00:00.250Z", margin_seconds=1.006)
    moto = CutRequest(name="b1", entered="2026-11-25T04:00:00.250000+00:00", margin_seconds=1.006)
    assert aws.at == moto.at == pytest.approx(1795579201.256)


def test_one_node_cuts_at_once_and_a_wider_cluster_waits_longer() -> None:
    assert cut_margin_seconds(1) == 0.0
    assert cut_margin_seconds(3) == pytest.approx(2.006)
    assert cut_margin_seconds(1000) == pytest.approx(4.0)


@pytest.mark.parametrize("name", ["", "x' ; archive_command = 'rm", "a" * 64, "-leading"])
def test_a_name_that_could_not_be_written_into_a_config_file_is_refused(name: str) -> None:
    with pytest.raises(InvalidRequest, match="cannot name a restore point"):
        CutRequest(name=name, entered="2026-11-25T04:00:00Z")


def tail(shard: str, **marker: str) -> ShardListing:
    return ShardListing(shard_id=shard, node_id=f"n-{shard}", phase=Phase.TAIL, files=[],
                        marker={"stop_lsn": "0/3000100", **marker})  # fmt: skip


def test_the_skew_is_the_spread_of_the_restore_points_and_lateness_is_kept() -> None:
    summary = cut_summary(
        [
            tail("s1", cut_name="b1", cut_at="100.000500", cut_late_seconds="0.000000"),
            tail("s2", cut_name="b1", cut_at="100.012500", cut_late_seconds="0.250000"),
        ],
        "b1",
    )
    assert summary == {
        "cut_name": "b1",
        "cut_skew_seconds": 0.012,
        "cut_late_seconds": 0.25,
        "cut_shards": 2,
    }
    assert (
        cut_cell(backup_item(backup_id="b1", **summary))
        == "restore point b1, skew 12.0 ms (a node came 250 ms after the cut instant)"
    )


def paused(shard: str, asked: float, locked: float, released: float) -> ShardListing:
    cut_pause = f"{asked:.6f} {locked:.6f} {released:.6f}"
    return tail(shard, cut_name="b1", cut_at=f"{released - 0.001:.6f}", cut_pause=cut_pause)


def test_a_pause_every_node_held_at_one_moment_makes_the_cut_paused() -> None:
    summary = cut_summary(
        [paused("s1", 100.000, 100.002, 100.009), paused("s2", 100.001, 100.004, 100.012)], "b1"
    )
    assert summary["cut_paused"] is True
    assert summary["cut_pause_seconds"] == pytest.approx(0.011)  # s2: asked to let go
    cell = cut_cell(backup_item(backup_id="b1", **summary))
    assert cell.endswith("; commits paused at most 11.0 ms")


@pytest.mark.parametrize(
    "second",
    [
        (100.010, 100.020, 100.030),  # locked after s1 had let go: no shared moment
        (100.001, 0.0, 100.051),  # its lock never granted (a commit under way)
    ],
)
def test_a_pause_not_held_everywhere_at_once_leaves_a_best_effort_cut(second) -> None:
    summary = cut_summary([paused("s1", 100.000, 100.002, 100.009), paused("s2", *second)], "b1")
    assert summary["cut_paused"] is False
    assert cut_cell(backup_item(backup_id="b1", **summary)).endswith("best-effort")


def test_a_cut_without_a_pause_asked_records_none() -> None:
    summary = cut_summary([tail("s1", cut_name="b1", cut_at="100.0")], "b1")
    assert "cut_paused" not in summary


def test_a_backup_without_a_cut_says_where_its_nodes_restore_to() -> None:
    assert cut_summary([tail("s1"), tail("s2")], "b1") == {}


@pytest.mark.parametrize(
    "marker",
    [
        {"cut_name": "b0", "cut_at": "100.0"},
        {"cut_name": "b1", "cut_at": "soon"},
        {"cut_name": "b1", "cut_at": "100.0", "cut_pause": "100.0 100.1"},
    ],
)
def test_a_tail_that_records_another_point_or_no_time_is_refused(marker: dict) -> None:
    tails = [tail("s1", cut_name="b1", cut_at="100.0"), tail("s2", **marker)]
    with pytest.raises(InvalidRequest, match="restore point b1"):
        cut_summary(tails, "b1")
    no_cut = cut_cell(backup_item(backup_id="b1"))
    assert no_cut == "none (each shard restores to where its own copy ends)"


def test_the_last_segment_is_kept_up_to_the_cut_and_zero_past_it(tmp_path) -> None:
    segment = tmp_path / "000000010000000000000003"
    segment.write_bytes(b"W" * 8192 + b"old recycled WAL" * 1024)  # 24 KiB "segment"
    copy = tmp_path / "copy"
    copy_wal_up_to(segment, copy, 8192 + 40)
    data = copy.read_bytes()
    assert len(data) == segment.stat().st_size  # a segment keeps its size
    assert data[:8232] == segment.read_bytes()[:8232]
    assert data[8232:] == bytes(len(data) - 8232)  # recovery reads zeros as the WAL's end
    copy_wal_up_to(segment, copy, WHOLE_SEGMENT)  # the cut on a boundary: all of it
    assert copy.read_bytes() == segment.read_bytes()


def test_a_restored_copy_recovers_to_the_named_point_and_opens() -> None:
    settings = recovery_to_cut("20261125T041736Z-ccb959")
    assert "recovery_target_name = '20261125T041736Z-ccb959'\n" in settings
    assert "recovery_target_action = 'promote'\n" in settings
    # Targeted recovery requires a restore_command; this one finds nothing, so the WAL is
    # read from pg_wal, where the tail put it.
    assert "restore_command = 'false'\n" in settings


def test_a_copy_whose_wal_ends_before_the_cut_is_refused_by_name() -> None:
    log = (
        "pg_ctl: could not start server\nServer log x.log:\n"
        "LOG:  redo done at 0/4000110\n"
        "FATAL:  recovery ended before configured recovery target was reached\n"
    )
    refused = short_of_target(log, "shard-2", "20261125T041736Z-ccb959", None)
    assert isinstance(refused, RestoreValidationFailed)
    assert "shard shard-2" in refused.message
    assert "restore point 20261125T041736Z-ccb959" in refused.message
    assert short_of_target("FATAL:  could not bind IPv4 address", "shard-2", "b1", None) is None
    assert short_of_target(log, "shard-2", None, None) is None  # no cut asked for: not this failure


# --- The commit pause's database (advisory locks are per database) ---------------------------
@pytest.mark.parametrize(
    ("conninfo", "kept"),
    [
        ("host=/run/postgresql port=5433 user=agent dbname=postgres", {"port": "5433"}),
        ("postgresql://agent@db1:5433/postgres?sslmode=require", {"sslmode": "require"}),
        # The README's example names no database: libpq then takes the user's name.
        ("host=/var/run/postgresql user=agent", {"host": "/var/run/postgresql"}),
    ],
)
def test_the_cut_session_goes_to_the_policys_database_on_the_agents_conninfo(
    conninfo: str, kept: dict[str, str]
) -> None:
    reached = conninfo_to_dict(cut_conninfo(conninfo, "bank"))
    assert reached["dbname"] == "bank"
    assert reached["user"] == "agent"
    assert kept.items() <= reached.items()


def test_a_database_name_travels_as_one_quoted_parameter() -> None:
    odd = "bank' host=evil dbname='x"
    reached = conninfo_to_dict(cut_conninfo("host=/run/postgresql user=agent", odd))
    assert reached == {"host": "/run/postgresql", "user": "agent", "dbname": odd}


@pytest.mark.parametrize("name", ["", "  ", "a" * 64, "\u00e9" * 32, "bank\nx", "bank\x00"])
def test_a_cut_naming_a_database_postgresql_cannot_have_is_refused(name: str) -> None:
    with pytest.raises(InvalidRequest, match=r"cut\.database"):
        CutRequest(name="b1", entered="2026-11-25T04:00:00Z", commit_lock=4242, database=name)


@pytest.mark.parametrize("name", ["bank", "My-App", "a" * 63, "\u00e9" * 31])
def test_any_name_postgresql_can_have_is_taken_as_it_is(name: str) -> None:
    cut = CutRequest(name="b1", entered="2026-11-25T04:00:00Z", commit_lock=4242, database=name)
    assert cut.database == name


PAUSED_POLICY = """
clusters:
  a:
    engine: postgres
    schedule: {full: '0 2 * * *'}
    vault: {storage_class: GLACIER_IR, object_lock: {mode: GOVERNANCE, days: 1}}
    retention: {keep_daily: 1}
    cut: %s
"""


@pytest.mark.parametrize(
    ("cut", "problem"),
    [
        # Defaulting to the agents' conninfo database was issue 44's pause in name only.
        ("{commit_lock: 4242}", "commit_lock without database"),
        ("{database: bank}", "database without commit_lock"),
        ("{commit_lock: 4242, database: ''}", "is empty"),
        ("{commit_lock: 4242, database: %s}" % ("\u00e9" * 32), "longer than PostgreSQL's 63"),
        ("{commit_lock: 4242, database: 5}", "valid string"),
    ],
)
def test_a_pause_without_the_database_its_lock_is_taken_in_is_refused(
    cut: str, problem: str
) -> None:
    with pytest.raises(PolicyError) as refused:
        parse_policy(PAUSED_POLICY % cut)
    (found,) = refused.value.problems
    assert found.path.startswith("clusters.a.cut")
    assert problem in found.message
    assert found.fix


def test_a_pause_names_its_database() -> None:
    cut = parse_policy(PAUSED_POLICY % "{commit_lock: 4242, database: bank}").clusters["a"].cut
    assert (cut.commit_lock, cut.database) == (4242, "bank")
