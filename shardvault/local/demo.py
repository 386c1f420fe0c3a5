"""Demo clusters for the local stack: three nodes, each leading one shard and following
another, with SQLite shards (the embedded default) or PostgreSQL instances."""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROW_BYTES = 4000


@dataclass
class DemoCluster:
    name: str
    engine: str
    agent_configs: list[dict[str, Any]]
    sources: dict[str, Path] = field(default_factory=dict)  # shard id -> leader's data
    servers: list[Any] = field(default_factory=list)  # PostgreSQL instances to stop

    def stop(self) -> None:
        for server in self.servers:
            server.stop()


def make_sqlite_shard(path: Path, shard_id: str, size_mb: int) -> None:
    """A WAL-mode database of about ``size_mb`` MiB of incompressible rows."""
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = max(1, size_mb * 1024 * 1024 // ROW_BYTES)
    with sqlite3.connect(path) as db:
        db.execute("PRAGMA journal_mode=WAL")
        db.execute(
            "CREATE TABLE IF NOT EXISTS items(id INTEGER PRIMARY KEY, shard TEXT, payload BLOB)"
        )
        db.execute(
            "WITH RECURSIVE n(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM n WHERE x < ?) "
            "INSERT INTO items(shard, payload) SELECT ?, randomblob(?) FROM n",
            (rows, shard_id, ROW_BYTES),
        )


def sqlite_cluster(
    root: Path, *, name: str = "demo", nodes: int = 3, size_mb: int = 240
) -> DemoCluster:
    """Node i leads shard i and follows shard i-1 (a stale copy the backup must not read)."""
    shard_mb = max(1, size_mb // nodes)
    node_ids = [f"node-{i + 1}" for i in range(nodes)]
    shard_ids = [f"shard-{i + 1}" for i in range(nodes)]
    cluster = DemoCluster(name=name, engine="sqlite", agent_configs=[])
    for i, shard_id in enumerate(shard_ids):
        leader = root / "data" / node_ids[i] / f"{shard_id}.db"
        if not leader.exists():
            make_sqlite_shard(leader, shard_id, shard_mb)
        cluster.sources[shard_id] = leader
    for i, node_id in enumerate(node_ids):
        followed = shard_ids[i - 1]
        follower = root / "data" / node_id / f"{followed}.db"
        if nodes > 1 and not follower.exists():
            make_sqlite_shard(follower, followed, 1)
        shards = [
            {"shard_id": shard_ids[i], "role": "leader", "path": str(cluster.sources[shard_ids[i]])}
        ]
        if nodes > 1:
            shards.append({"shard_id": followed, "role": "follower", "path": str(follower)})
        cluster.agent_configs.append(agent_config(root, name, node_id, "sqlite", shards))
    return cluster


def postgres_cluster(
    root: Path, *, name: str = "pgdemo", nodes: int = 3, scale: int = 10
) -> DemoCluster:
    """One PostgreSQL instance per node, each the leader of its own shard, filled by pgbench."""
    from shardvault.local.postgres import init_instance, pgbench_init

    cluster = DemoCluster(name=name, engine="postgres", agent_configs=[])
    for i in range(nodes):
        node_id, shard_id = f"node-{i + 1}", f"shard-{i + 1}"
        instance = init_instance(root / "pg" / node_id)
        cluster.servers.append(instance)
        pgbench_init(instance, scale)
        cluster.sources[shard_id] = instance.data_dir
        shard = {
            "shard_id": shard_id,
            "role": "leader",
            "data_dir": str(instance.data_dir),
            "conninfo": instance.conninfo,
        }
        cluster.agent_configs.append(agent_config(root, name, node_id, "postgres", [shard]))
    return cluster


def agent_config(
    root: Path, cluster: str, node_id: str, engine: str, shards: list[dict]
) -> dict[str, Any]:
    return {
        "node_id": node_id,
        "cluster": cluster,
        "engine": engine,
        "shards": shards,
        "state_dir": str(root / "agent-state" / node_id),
    }


def restore_targets(
    root: Path, *, name: str, engine: str, nodes: int, capacity: int | None = None
) -> list[dict[str, Any]]:
    """Agent configs of an empty cluster of ``nodes`` nodes that accepts restores."""
    configs = []
    for i in range(nodes):
        node_id = f"{name}-node-{i + 1}"
        config = agent_config(root, name, node_id, engine, [])
        config["restore_dir"] = str(root / "restored" / node_id)
        if capacity is not None:
            config["restore_capacity_bytes"] = capacity
        configs.append(config)
    return configs


def table_digests(db_path: Path) -> dict[str, str]:
    """An ordered hash of every table's rows: equal digests, equal data."""
    import hashlib

    with sqlite3.connect(f"file:{db_path}?mode=ro", uri=True) as db:
        tables = [r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")]
        out = {}
        for name in sorted(tables):
            digest = hashlib.sha256()
            for row in db.execute(f'SELECT * FROM "{name}" ORDER BY rowid'):
                digest.update(repr(row).encode())
            out[name] = digest.hexdigest()
        return out
