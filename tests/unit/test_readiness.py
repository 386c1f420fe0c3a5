"""``shardvault check``'s findings: Validate's rules on the registry as it is now, and the
newest complete backup against the RPO and its last verification."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from shardvault.assurance.readiness import drill_findings, findings, probe_findings
from shardvault.backup.cuts import CUT_PROTOCOL
from shardvault.config.policy import PolicyError, parse_policy
from shardvault.contracts.catalog import BackupItem, DrillItem
from shardvault.contracts.models import AGENT_PROTOCOL, Engine, NodeRecord, ShardInfo
from tests.unit.support import backup_item

NOW = 1_800_000_000.0
POLICY_TEXT = """
clusters:
  a:
    engine: sqlite
    schedule: {full: '0 2 * * *'}
    vault: {storage_class: GLACIER_IR, object_lock: {mode: GOVERNANCE, days: 1}}
    retention: {keep_daily: 1}
"""
POLICY = parse_policy(POLICY_TEXT)


def node(node_id: str, *shards: tuple[str, str], heartbeat_at: float = NOW) -> NodeRecord:
    return NodeRecord(
        node_id=node_id,
        cluster="a",
        engine="sqlite",
        shards=[ShardInfo(shard_id=s, role=r) for s, r in shards],
        free_bytes=0,
        version="test",
        protocol=AGENT_PROTOCOL,
        heartbeat_at=heartbeat_at,
    )


VERIFIED = {"verified_at": 0, "objects": 1, "read": 1, "skipped": 0}


def backup(hours_ago: float, **fields: object) -> BackupItem:
    if isinstance(verify := fields.get("verify"), dict):
        fields["verify"] = VERIFIED | verify
    return backup_item(
        backup_id="20270115T000000Z-aaaaaa", completed_at=NOW - hours_ago * 3600, **fields
    )


def failed(found: list) -> dict[str, str]:
    return {f.check: f.detail for f in found if not f.ok}


def test_a_ready_cluster_passes_every_check() -> None:
    nodes = [node("n1", ("s1", "leader")), node("n2", ("s1", "follower"))]
    found = findings("a", nodes, [backup(3, verify={"result": "ok"})], POLICY, NOW, 30)
    assert failed(found) == {}
    assert {f.check: f.detail for f in found}["one leader per shard"] == "n1: s1"


def test_each_refusal_the_next_backup_would_meet_is_a_failed_check() -> None:
    nodes = [
        node("n1", ("s1", "leader")),
        node("n2", ("s1", "leader"), heartbeat_at=NOW - 600),
    ]
    problems = failed(findings("a", nodes, [backup(40)], POLICY, NOW, 30))
    assert "silent for 600 s" in problems["agents up"]
    assert "ShardWithManyLeaders" in problems["one leader per shard"]
    assert "shards readable, engines ready" not in problems  # not reached: no sources
    assert problems["newest complete backup within the RPO (30 h)"].endswith("40.0 h old")


def test_an_engine_not_ready_and_a_damaged_backup_are_named() -> None:
    ready = node("n1", ("s1", "leader"))
    sick = ready.model_copy(
        update={
            "shards": [
                ShardInfo(
                    shard_id="s1",
                    role="leader",
                    problem="no replication slot is free",
                    problem_error="EngineError",
                )
            ]
        }
    )
    damaged = backup(1, verify={"result": "damaged"})
    problems = failed(findings("a", [sick], [damaged], POLICY, NOW, 30))
    assert "ShardNotReady" in problems["shards readable, engines ready"]
    assert problems["newest backup's last verification"] == "damaged"


def test_no_agent_or_no_policy_is_said() -> None:
    (only,) = findings("a", [], [], POLICY, NOW, 30)
    assert not only.ok
    assert "UnknownCluster" in only.detail
    problems = failed(findings("a", [node("n1", ("s1", "leader"))], [], None, NOW, 30))
    assert problems["in the policy"].startswith("no policy file was given")
    assert "run only when asked" in problems["in the policy"]
    other = parse_policy(POLICY_TEXT.replace("\n  a:\n", "\n  b:\n"))
    problems = failed(findings("a", [node("n1", ("s1", "leader"))], [], other, NOW, 30))
    assert problems["in the policy"].startswith("the policy declares b, not a")


DRILLED = parse_policy(
    """
clusters:
  a:
    engine: sqlite
    schedule: {full: '0 2 * * *'}
    vault: {storage_class: GLACIER_IR, object_lock: {mode: GOVERNANCE, days: 1}}
    retention: {keep_daily: 1}
    drill: {cron: '0 9 * * 3', target_cluster: a-drill}
"""
)


def drill_node(node_id: str, restore_dir: bool = True) -> NodeRecord:
    record = node(node_id).model_copy(update={"cluster": "a-drill"})
    return record.model_copy(update={"restore_free_bytes": 1 << 30 if restore_dir else None})


def drill(hours_ago: float, status: str = "passed", **fields: object) -> DrillItem:
    return DrillItem.model_validate(
        {
            "cluster": "a",
            "backup_id": "drill#d1",
            "drill_id": "d1",
            "status": status,
            "started_at": NOW - hours_ago * 3600,
            "rto_seconds": 42.0,
        }
        | fields
    )


def test_a_cluster_without_a_drill_is_told_so_without_failing() -> None:
    (found,) = drill_findings("a", POLICY, [], [], NOW, 60)
    assert found.ok
    assert "none scheduled" in found.detail


def test_a_weekly_drill_that_passed_days_ago_with_its_nodes_up_passes() -> None:
    found = drill_findings("a", DRILLED, [drill(72)], [drill_node("d1")], NOW, 60)
    assert [f.ok for f in found] == [True, True]
    assert "passed, RTO 42 s" in found[1].detail


def test_drill_nodes_down_or_without_restore_dir_and_bad_or_stale_drills_fail() -> None:
    def fails(drills: list, nodes: list) -> dict[str, str]:
        return failed(drill_findings("a", DRILLED, drills, nodes, NOW, 60))

    assert (
        "TargetNotReady"
        in fails([drill(1)], [drill_node("d1", restore_dir=False)])["drill nodes ready (a-drill)"]
    )
    assert "UnknownCluster" in fails([drill(1)], [])["drill nodes ready (a-drill)"]
    assert fails([], [drill_node("d1")]) == {"newest drill": "never drilled"}
    failed_drill = drill(1, "failed", error="ChecksumMismatch", cause="object k differs")
    assert "failed" in fails([failed_drill], [drill_node("d1")])["newest drill"]
    # Weekly: a drill more than two weeks old means its schedule is not running.
    assert "337.0 h ago" in fails([drill(337)], [drill_node("d1")])["newest drill"]
    # A drill running now is not the newest verdict: the one before it is.
    assert fails([drill(1), drill(0, "running")], [drill_node("d1")]) == {}


def test_check_says_in_which_database_the_pause_takes_its_lock() -> None:
    paused = parse_policy(POLICY_TEXT + "    cut: {commit_lock: 4242, database: bank}\n")
    found = {f.check: f for f in findings("a", [node("n1", ("s1", "leader"))], [], paused, NOW, 30)}
    assert found["commit pause"].ok
    assert "lock 4242 taken in database 'bank'" in found["commit pause"].detail


def test_a_commit_lock_without_its_database_is_refused_with_the_fix() -> None:
    with pytest.raises(PolicyError) as refused:
        parse_policy(POLICY_TEXT + "    cut: {commit_lock: 4242}\n")
    (problem,) = refused.value.problems
    assert problem.path == "clusters.a.cut"
    assert "per database" in problem.message
    assert "add 'database: <that database>' under cut" in problem.fix


def probed(**node: object) -> SimpleNamespace:
    """A probe run as ``operations.run_probe`` returns it, its one node as given."""
    round_trip = {"node_id": "n1", "ok": True, "put_seconds": 0.1, "get_seconds": 0.1}
    return SimpleNamespace(status="SUCCEEDED", record={"nodes": [round_trip | node]})


def test_the_probe_says_whether_each_node_can_cut_in_the_pauses_database() -> None:
    assert [f.check for f in probe_findings(probed())] == ["store round trip (n1)"]
    reached = probe_findings(probed(cut_database={"database": "bank", "problems": []}))[1]
    assert (reached.check, reached.ok) == ("commit pause database (n1)", True)
    assert "'bank'" in reached.detail
    problem = {
        "message": "shard s1: database 'bank', where the commit pause takes its lock, cannot "
        "be reached: FATAL: permission denied for database bank",
        "fix": 'GRANT CONNECT ON DATABASE "bank" TO the agent\'s role.',
    }
    refused = probe_findings(probed(cut_database={"database": "bank", "problems": [problem]}))[1]
    assert not refused.ok
    assert "database 'bank'" in refused.detail
    assert refused.fix.startswith("GRANT CONNECT")


def test_scheduled_cuts_the_leaders_cannot_take_are_a_failed_check() -> None:
    """A policy that schedules cuts on leaders whose WAL no agent archives (or whose agents
    predate the cut command) fails ``check`` by name, not each cut's run later."""
    policy = parse_policy(
        POLICY_TEXT.replace("engine: sqlite", "engine: postgres") + "    cut: {every_minutes: 15}\n"
    )
    archiving = ShardInfo(shard_id="s1", role="leader", wal_spool_bytes=0)
    leader = node("n1", ("s1", "leader")).model_copy(
        update={"engine": Engine.POSTGRES, "protocol": CUT_PROTOCOL, "shards": [archiving]}
    )
    found = {f.check: f for f in findings("a", [leader], [backup(3)], policy, NOW, 30)}
    assert found["scheduled cuts (every 15 min)"].ok
    bare = leader.model_copy(update={"shards": [ShardInfo(shard_id="s1", role="leader")]})
    found = {f.check: f for f in findings("a", [bare], [backup(3)], policy, NOW, 30)}
    refused = found["scheduled cuts (every 15 min)"]
    assert not refused.ok
    assert "archive no WAL" in refused.detail
    assert "wal-archiving" in refused.fix
    assert "scheduled cuts (every 15 min)" not in {
        f.check for f in findings("a", [bare], [backup(3)], POLICY, NOW, 30)
    }
