"""A cluster whose nodes run different engines (two SQLite nodes and a RocksDB node): its
backup is refused by name until the policy lists both engines; then a full and an incremental
record each shard's engine, and the incremental restores into a target of both engines, each
shard on a node of its own, equal to its source. A target without a RocksDB node is refused
before anything is written."""

from __future__ import annotations

from pathlib import Path

from shardvault.aws.readback import load_manifest
from shardvault.local.demo import change_sqlite, table_digests

from .conftest import output
from .test_bad_requests import assert_rejected, assert_unchanged
from .test_restore_requests import assert_unchanged as assert_target_unchanged
from .test_rocksdb import check_prefix, write


def test_a_mixed_cluster_is_backed_up_only_as_the_policy_says_and_restored_by_engine(
    make_cluster, make_target, policy_for, tmp_path
):
    rocks = tmp_path / "rocks" / "shard-3"
    write(rocks, 0, 2000).wait(timeout=60)

    def third_node_runs_rocksdb(configs: list[dict]) -> None:
        configs[2].update(
            engine="rocksdb",
            shards=[{"shard_id": "shard-3", "role": "leader", "data_dir": str(rocks)}],
        )
        # The first node followed shard-3 as a SQLite copy: shard-3 is RocksDB's now.
        configs[0]["shards"] = [s for s in configs[0]["shards"] if s["shard_id"] != "shard-3"]

    cluster = make_cluster(nodes=3, size_mb=3, edit=third_node_runs_rocksdb)
    refused = cluster.backup()
    assert_rejected(refused, "MixedEngines", "node-3=rocksdb", "engine: [rocksdb, sqlite]")
    assert_unchanged(cluster)

    policy_for(cluster.name, engine="[sqlite, rocksdb]")
    full = cluster.backup()
    assert full.status == "SUCCEEDED", full.cause
    change_sqlite(cluster.sources["shard-1"], 0.05)
    write(rocks, 2000, 3000).wait(timeout=60)
    incremental = cluster.backup(incremental=True)
    assert incremental.status == "SUCCEEDED", incremental.cause

    records = {r["backup_id"]: r for r in cluster.records()}
    record = records[incremental.record["backup_id"]]
    assert record["kind"] == "incremental"
    assert record["engine"] == "rocksdb+sqlite"
    svc = cluster.stack.services()
    manifest = load_manifest(svc.vault_bucket, record["vault_manifest_key"])
    assert manifest.engine is None  # mixed: each shard names its own
    assert {s.shard_id: s.engine for s in manifest.shards} == {
        "shard-1": "sqlite",
        "shard-2": "sqlite",
        "shard-3": "rocksdb",
    }

    no_rocksdb = make_target(nodes=2)
    progress = no_rocksdb.restore(cluster.name)
    assert_rejected(progress, "EngineMismatch", "shard-3", "no target node runs rocksdb")
    assert_target_unchanged(no_rocksdb)

    target = make_target(nodes=3, engine=["sqlite", "sqlite", "rocksdb"])
    restored = target.restore(cluster.name)
    assert restored.status == "SUCCEEDED", restored.cause
    placed = {s["shard_id"]: s for s in output(restored)["shards"]}
    engine_of = {c["node_id"]: c["engine"] for c in target.configs}
    assert {shard: engine_of[s["node_id"]] for shard, s in placed.items()} == {
        "shard-1": "sqlite",
        "shard-2": "sqlite",
        "shard-3": "rocksdb",
    }
    for shard_id in ("shard-1", "shard-2"):
        (db,) = list(target.restore_dir(0).parent.glob(f"*/{shard_id}/*.db"))
        assert table_digests(db) == table_digests(cluster.sources[shard_id]), shard_id
    assert list(placed["shard-3"]["checks"].values()) == ["ok"]  # every pair's digest
    assert check_prefix(Path(placed["shard-3"]["path"])) == 5000  # the incremental's keys
