"""A cluster whose nodes run different engines: refused unless the policy lists the engines,
then backed up with each shard's engine recorded and restored onto nodes of that engine."""

from __future__ import annotations

import pytest

from shardvault.assurance.readiness import findings
from shardvault.backup.admission import check_engines
from shardvault.config.policy import PolicyError, parse_policy
from shardvault.contracts.models import AGENT_PROTOCOL, Engine, Manifest, NodeRecord, ShardInfo
from shardvault.errors import EngineMismatch, InvalidRequest, MixedEngines
from shardvault.restore.placement import place_by_engine

NOW = 1_800_000_000.0
GiB = 2**30


def policy(engine: str):
    return parse_policy(
        f"""
clusters:
  a:
    engine: {engine}
    schedule: {{full: '0 2 * * *'}}
    vault: {{storage_class: GLACIER_IR, object_lock: {{mode: GOVERNANCE, days: 1}}}}
    retention: {{keep_daily: 1}}
"""
    )


def node(node_id: str, engine: str, shard: str) -> NodeRecord:
    return NodeRecord(
        node_id=node_id,
        cluster="a",
        engine=engine,
        shards=[ShardInfo(shard_id=shard, role="leader")],
        free_bytes=0,
        version="test",
        protocol=AGENT_PROTOCOL,
        heartbeat_at=NOW,
    )


MIXED = [node("n1", "sqlite", "s1"), node("n2", "sqlite", "s2"), node("n3", "rocksdb", "s3")]


def test_a_list_of_engines_is_a_mixed_cluster_and_one_engine_is_not() -> None:
    assert policy("[sqlite, rocksdb]").clusters["a"].engines == {Engine.SQLITE, Engine.ROCKSDB}
    assert policy("postgres").clusters["a"].engines == {Engine.POSTGRES}
    with pytest.raises(PolicyError, match="engine lists sqlite twice"):
        policy("[sqlite, rocksdb, sqlite]")
    with pytest.raises(PolicyError, match="engine lists no engine"):
        policy("[]")
    with pytest.raises(PolicyError, match="engine"):
        policy("[sqlite, oracle]")


def test_nodes_of_several_engines_are_refused_unless_the_policy_lists_them() -> None:
    for declared in (None, policy("sqlite").clusters["a"]):
        with pytest.raises((MixedEngines, EngineMismatch)) as refused:
            check_engines("a", MIXED, declared)
        assert "n3" in refused.value.message
    with pytest.raises(MixedEngines) as refused:
        check_engines("a", MIXED, None)
    assert "clusters.a.engine: [rocksdb, sqlite]" in refused.value.fix  # how to allow it

    assert check_engines("a", MIXED, policy("[sqlite, rocksdb]").clusters["a"]) is None
    assert check_engines("a", MIXED[:2], policy("[sqlite, rocksdb]").clusters["a"]) == "sqlite"
    assert check_engines("a", MIXED[:2], None) == "sqlite"


def test_a_node_whose_engine_the_policy_does_not_name_is_refused_by_name() -> None:
    with pytest.raises(EngineMismatch) as refused:
        check_engines("a", [node("n1", "postgres", "s1")], policy("sqlite").clusters["a"])
    assert "declares cluster 'a' as sqlite" in refused.value.message
    assert "n1 (postgres)" in refused.value.message


def test_check_says_what_a_mixed_cluster_runs() -> None:
    found = {f.check: f for f in findings("a", MIXED, [], policy("[rocksdb, sqlite]"), NOW, 30)}
    assert found["engines"].ok
    assert found["engines"].detail == "mixed: rocksdb+sqlite"
    found = {f.check: f for f in findings("a", MIXED, [], None, NOW, 30)}
    assert not found["engines"].ok
    assert "MixedEngines" in found["engines"].detail


def test_each_shard_is_placed_on_a_node_of_its_engine() -> None:
    shards = {"s1": GiB, "s2": GiB, "s3": 3 * GiB}
    shard_engine = {"s1": "sqlite", "s2": "sqlite", "s3": "rocksdb"}
    room = {"t1": 10 * GiB, "t2": 10 * GiB, "t3": 10 * GiB}
    node_engine = {"t1": "rocksdb", "t2": "sqlite", "t3": "sqlite"}
    placed = {
        p.shard_id: p.node_id for p in place_by_engine(shards, room, {}, shard_engine, node_engine)
    }
    assert placed["s3"] == "t1"  # the roomiest node is rocksdb's alone
    assert {placed["s1"], placed["s2"]} == {"t2", "t3"}  # spread over the sqlite nodes

    with pytest.raises(InvalidRequest, match=r"s3 \(rocksdb\) on t2 \(sqlite\)"):
        place_by_engine(shards, room, {"s3": "t2"}, shard_engine, node_engine)


def manifest(engine: str | None, shard_engines: list[str | None]) -> dict:
    return {
        "backup_id": "b",
        "cluster": "a",
        "engine": engine,
        "started_at": NOW,
        "completed_at": NOW,
        "checkpoint_skew_seconds": 0,
        "part_size": 0,
        "shards": [
            {
                "shard_id": f"s{i}",
                "node_id": "n",
                "marker": {},
                "checkpoint_at": NOW,
                "streams": [],
                "engine": e,
            }
            for i, e in enumerate(shard_engines)
        ],
        "bytes": 0,
        "objects": 0,
        "parts": 0,
        "verification": "",
    }


def test_a_mixed_manifest_names_each_shards_engine() -> None:
    mixed = Manifest.model_validate(manifest(None, ["sqlite", "rocksdb"]))
    assert mixed.engines == [Engine.ROCKSDB, Engine.SQLITE]
    assert [mixed.engine_of(s) for s in mixed.shards] == [Engine.SQLITE, Engine.ROCKSDB]
    older = Manifest.model_validate(manifest("postgres", [None]))  # before mixed clusters
    assert older.engines == [Engine.POSTGRES]
    with pytest.raises(ValueError, match="s1 name no engine"):
        Manifest.model_validate(manifest(None, ["sqlite", None]))
