"""Demo clusters for the local stack: three nodes, each leading one shard and following
another, with SQLite shards (the embedded default) or PostgreSQL instances.

Terms:
- *change*: the demo's writes between its full and its incremental backup: one contiguous
  range of rows (1 % of each shard's rows) rewritten on every leader.
- *digests*: per table of a shard, a hash of all its rows: a restored shard equals its source
  when their digests are equal (the source taken with no write since its backup)."""

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
    servers: dict[str, Any] = field(default_factory=dict)  # shard id -> PostgreSQL instance

    def stop(self) -> None:
        for server in self.servers.values():
            server.stop()

    def change(self, fraction: float = 0.01) -> int:
        """Rewrites one contiguous range of ``fraction`` of each leader's rows; returns the
        number of rows changed in all."""
        changed = 0
        for shard_id, source in self.sources.items():
            if self.engine == "sqlite":
                changed += change_sqlite(source, fraction)
            else:
                changed += change_postgres(self.servers[shard_id], fraction)
        return changed

    def digests(self) -> dict[str, dict[str, str]]:
        """Each leader's table digests, by shard id."""
        if self.engine == "sqlite":
            return {shard_id: table_digests(path) for shard_id, path in self.sources.items()}
        return {shard_id: pg_digests(server.psql) for shard_id, server in self.servers.items()}


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
        cluster.servers[shard_id] = instance
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


def demo_cluster(engine: str, root: Path, *, size_mb: int, scale: int) -> DemoCluster:
    """The demo's cluster of ``engine``: SQLite files of ``size_mb`` in all, or PostgreSQL
    servers filled by pgbench at ``scale``."""
    if engine == "sqlite":
        return sqlite_cluster(root, size_mb=size_mb)
    return postgres_cluster(root, scale=scale)


def agent_config(
    root: Path, cluster: str, node_id: str, engine: str, shards: list[dict]
) -> dict[str, Any]:
    return {
        "node_id": node_id,
        "cluster": cluster,
        "engine": engine,
        "shards": shards,
        "state_dir": str(root / "agent-state" / node_id),
        # The local stack's requests cost nothing: idle agents listen without a pause.
        "idle_listen_pause_seconds": 0,
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


def change_sqlite(db_path: Path, fraction: float) -> int:
    with sqlite3.connect(db_path) as db:
        (rows,) = db.execute("SELECT max(id) FROM items").fetchone()
        count = max(1, int(rows * fraction))
        first = rows // 3  # a range inside the table, not at its end
        db.execute(
            "UPDATE items SET payload = randomblob(?) WHERE id BETWEEN ? AND ?",
            (ROW_BYTES, first, first + count - 1),
        )
        return count


PGBENCH_TABLES = ("pgbench_accounts", "pgbench_branches", "pgbench_tellers", "pgbench_history")


def change_postgres(server: Any, fraction: float) -> int:
    rows = int(server.psql("SELECT max(aid) FROM pgbench_accounts"))
    count = max(1, int(rows * fraction))
    first = rows // 3
    server.psql(
        f"UPDATE pgbench_accounts SET abalance = abalance + 1 "
        f"WHERE aid BETWEEN {first} AND {first + count - 1}"
    )
    return count


def pg_digests(psql: Any) -> dict[str, str]:
    """Row count and the sum of every row's hash, per pgbench table (``psql`` runs a query)."""
    return {
        name: psql(f"SELECT count(*) || ':' || coalesce(sum(hashtext(t::text)), 0) FROM {name} t")
        for name in PGBENCH_TABLES
    }


def restored_digests(engine: str, shard: dict[str, Any]) -> dict[str, str]:
    """The table digests of a restored shard (its entry in the restore's summary): a SQLite
    file, or the PostgreSQL server the restore left running."""
    if engine == "sqlite":
        (database,) = Path(shard["path"]).glob("*.db")  # the shard's directory holds one
        return table_digests(database)
    from shardvault.local.postgres import restored_instance

    return pg_digests(restored_instance(shard).psql)
