"""MariaDB through mariabackup: two real servers under a write load backed up, restored into
one node (prepared, started, every table checked), an incremental of them restored too.

The load moves amounts between accounts, each move one transaction that also logs it: a copy
consistent at one instant keeps the balances' sum, and every balance is explained by the log.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from shardvault_agent.engines.mariadb.server import MariadbServer, running_pid

from shardvault.local import demo
from shardvault.local.mariadb import ACCOUNTS, BALANCE, Transfers, consistent, init_server
from shardvault.local.mariadb import stop_server as stop_mariadb

from .conftest import FAST_AGENT, Cluster, names, output


@pytest.fixture
def maria_cluster(stack, tmp_path):
    name = f"maria{next(names)}"
    servers, loads, configs, sources = [], [], [], {}
    try:
        for i in (1, 2):
            server = init_server(tmp_path / "maria" / f"node-{i}")
            servers.append(server)
            Transfers(server).create()
            shard = {
                "shard_id": f"shard-{i}",
                "role": "leader",
                "data_dir": str(server.data_dir),
                "socket": str(server.socket),
            }
            config = demo.agent_config(tmp_path, name, f"{name}-node-{i}", "mariadb", [shard])
            configs.append(config | FAST_AGENT)
            sources[shard["shard_id"]] = server.data_dir
        for config in configs:
            stack.start_agent(config)
        cluster = Cluster(stack, name, tmp_path, configs, sources)
        stack.wait_for_nodes([c["node_id"] for c in configs])
        loads = [Transfers(server) for server in servers]
        yield cluster, servers, loads
        cluster.stop()
    finally:
        for load in loads:
            load.stop()
        for server in servers:
            stop_mariadb(server.data_dir)


def restored_servers(progress) -> dict[str, MariadbServer]:
    return {
        shard["shard_id"]: MariadbServer(Path(shard["path"]), Path(shard["socket"]))
        for shard in output(progress)["shards"]
    }


def test_a_backup_under_writes_restores_into_one_node_and_its_incremental_into_three(
    maria_cluster, make_target
):
    cluster, servers, loads = maria_cluster
    for load in loads:
        load.start()
    time.sleep(1)  # the load is running before the backup starts
    full = cluster.backup()
    assert full.status == "SUCCEEDED", full.cause
    time.sleep(1)
    incremental = cluster.backup(incremental=True)
    for load in loads:
        load.stop()
    assert incremental.status == "SUCCEEDED", incremental.cause
    assert all(load.committed > 100 for load in loads)
    records = {r["backup_id"]: r for r in cluster.records()}
    assert records[incremental.record["backup_id"]]["kind"] == "incremental"
    # The copies mariabackup made are gone once the backups ended.
    copies_left = [
        p for c in cluster.configs for p in (Path(c["state_dir"]) / "mariabackup").glob("*/*")
    ]
    assert copies_left == []
    assert cluster.held_checkpoints() == []

    query = f"SELECT SUM(balance) = {ACCOUNTS * BALANCE} FROM bank.accounts"
    sources = dict(zip(["shard-1", "shard-2"], servers, strict=True))
    first_moves: dict[str, int] = {}
    for backup, nodes in ((full, 1), (incremental, 3)):
        target = make_target(nodes=nodes, engine="mariadb")
        restored = target.restore(
            cluster.name, backup_id=backup.record["backup_id"], validation_queries=[query]
        )
        assert restored.status == "SUCCEEDED", restored.cause
        copies = restored_servers(restored)
        assert sorted(copies) == ["shard-1", "shard-2"]
        for shard in output(restored)["shards"]:
            assert shard["checks"]["mariadb-check --all-databases"] == "ok"
            assert shard["checks"][query] == "ok"
        moves = {}
        for shard_id, copy in copies.items():
            total, moves[shard_id] = consistent(copy)
            assert total == ACCOUNTS * BALANCE, shard_id
            assert moves[shard_id] > 0
            # One writer per server: the copy holds exactly the source's first moves.
            assert moves_digest(copy, moves[shard_id]) == moves_digest(
                sources[shard_id], moves[shard_id]
            )
        if backup is incremental:  # later than the full: more moves in every copy
            assert all(moves[s] > first_moves[s] for s in moves)
        first_moves = moves
        for copy in copies.values():
            stop_mariadb(copy.data_dir)
            assert running_pid(copy.data_dir) is None


def moves_digest(server: MariadbServer, upto: int) -> str:
    return server.sql(
        "SELECT COUNT(*), SUM(CRC32(CONCAT_WS(',', id, src, dst, amount))) FROM moves "
        f"WHERE id <= {upto}",
        database="bank",
    )
