"""``shardvault check``'s findings: Validate's rules on the registry as it is now, and the
newest complete backup against the RPO and its last verification."""

from __future__ import annotations

from shardvault.models import NodeRecord, ShardInfo
from shardvault.policy import parse_policy
from shardvault.readiness import findings

NOW = 1_800_000_000.0
POLICY = parse_policy(
    """
clusters:
  a:
    engine: sqlite
    schedule: {full: '0 2 * * *'}
    vault: {storage_class: GLACIER_IR, object_lock: {mode: GOVERNANCE, days: 1}}
    retention: {keep_daily: 1}
"""
)


def node(node_id: str, *shards: tuple[str, str], heartbeat_at: float = NOW) -> NodeRecord:
    return NodeRecord(
        node_id=node_id,
        cluster="a",
        engine="sqlite",
        shards=[ShardInfo(shard_id=s, role=r) for s, r in shards],
        free_bytes=0,
        version="test",
        heartbeat_at=heartbeat_at,
    )


def backup(hours_ago: float, **fields: object) -> dict:
    return {
        "backup_id": "20270115T000000Z-aaaaaa",
        "status": "COMPLETE",
        "completed_at": NOW - hours_ago * 3600,
        **fields,
    }


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
    assert "does not declare the cluster" in problems["in the policy"]
