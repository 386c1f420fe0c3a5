"""Adaptive throttling and the source guard against a real PostgreSQL: the probe sees the
server's other clients; a backup under pgbench is held back by what its agent measured,
records that and the WAL it held, and leaves no session of its own behind; a backup that holds
more WAL than its policy allows fails by name and lets it go."""

from __future__ import annotations

import os
import time
from pathlib import Path

import psycopg
import pytest
from shardvault_agent.config import AgentConfig, ShardConfig
from shardvault_agent.engines.postgres.adapter import PostgresAdapter

from shardvault.config.policy import Upload
from shardvault.data.planning import MiB
from shardvault.local import demo
from shardvault.local.postgres import init_instance, start_pgbench, stop_process

from .conftest import FAST_AGENT, Cluster, names

SCALE = 10


def test_the_probe_sees_other_clients_and_the_server_is_its_postmaster(tmp_path):
    instance = init_instance(tmp_path / "data")
    try:
        shard = ShardConfig(shard_id="s1", data_dir=instance.data_dir, conninfo=instance.conninfo)
        config = AgentConfig(
            node_id="n1", cluster="c", engine="postgres", state_dir=tmp_path / "state",
            shards=[shard],
        )  # fmt: skip
        adapter = PostgresAdapter(config)
        probe = adapter.health_probe(shard)
        assert probe is not None
        try:
            assert probe.ask() is False  # only ShardVault's own sessions
            with psycopg.connect(instance.conninfo, application_name="app"):
                assert probe.ask() is True
            # A client's close reaches its backend after the client returns, and the backend
            # leaves pg_stat_activity as it exits: give it the moment (CI saw it still there).
            assert until_false(probe.ask, seconds=10)
        finally:
            probe.close()
        with psycopg.connect(instance.conninfo) as conn:  # its backend read while it lives
            backend = conn.execute("SELECT pg_backend_pid()").fetchone()[0]
            parent = next(
                int(line.split()[1])
                for line in Path(f"/proc/{backend}/status").read_text().splitlines()
                if line.startswith("PPid:")
            )
        assert adapter.server_pid(shard) == parent
    finally:
        instance.stop(mode="immediate")
    assert adapter.health_probe(shard) is None  # a server that does not answer: no probe


def until_false(ask, seconds: float) -> bool:
    """Whether ``ask`` answers False within ``seconds``, asked every 50 ms."""
    deadline = time.monotonic() + seconds
    while ask():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.fixture
def loaded_node(stack, tmp_path, policy_for):
    """One PostgreSQL node under pgbench; its policy's ``upload`` and its agent's settings as
    the test gives them."""
    made = []

    def make(upload: str | None, **agent: object) -> tuple[Cluster, object]:
        name = f"pgt{next(names)}"
        built = demo.postgres_cluster(tmp_path / name, name=name, nodes=1, scale=SCALE)
        (config,) = built.agent_configs
        config["node_id"] = f"{name}-{config['node_id']}"
        config.update(FAST_AGENT, **agent)
        stack.start_agent(config)
        if upload is not None:  # None: a cluster the policy does not name
            policy_for(name, engine="postgres", upload=upload)
        cluster = Cluster(stack, built.name, tmp_path, built.agent_configs, built.sources)
        (server,) = built.servers.values()
        made.append((built, cluster, start_pgbench(server, clients=2, seconds=120)))
        stack.wait_for_nodes([config["node_id"]])
        return cluster, server

    try:
        yield make
    finally:
        for built, cluster, load in made:
            stop_process(load)
            cluster.stop()
            built.stop()


def agent_sessions(server) -> int:
    """The agent's sessions on the server, once the backup let them go (10 s at most)."""
    deadline = time.monotonic() + 10
    while True:
        with psycopg.connect(server.conninfo, autocommit=True) as conn:
            left = conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'shardvault-agent'"
            ).fetchone()[0]
        if left == 0 or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def test_an_adaptive_backup_under_load_is_held_back_and_says_so(loaded_node):
    """The agent's targets are strict, so the backup's own load crosses them. The floor is
    higher than the default, so that the copy held back to it still ends in seconds."""
    cluster, server = loaded_node(
        "{throttle: adaptive, throttle_floor_mib_per_second: 16}",
        throttle_stall_margin=0.001,
        throttle_latency_ratio=1.01,
        throttle_latency_slack_ms=0.0,
    )
    time.sleep(1.0)  # pgbench connected: the probe's baseline is the loaded server's

    backup = cluster.backup()

    assert backup.status == "SUCCEEDED", backup.cause
    record = next(r for r in cluster.records() if r["backup_id"] == backup.record["backup_id"])
    throttle = record["throttle"]
    assert throttle["mode"] == "adaptive"
    assert throttle["cuts"] >= 1, throttle  # held back by what the agent measured...
    assert throttle["lowest_rate_bytes_per_second"] >= throttle["floor_bytes_per_second"]
    assert any(name.endswith("latency") for name in throttle["pressures"]), throttle
    if os.path.exists("/proc/pressure/cpu"):
        assert "cpu stall" in throttle["pressures"]
    assert record["held_log_bytes"] > 0  # the slot's WAL, reported
    # ...and nothing of the agent's stays connected once the backup is released.
    assert agent_sessions(server) == 0


def test_a_cluster_the_policy_does_not_name_is_never_held_below_the_default_floor(loaded_node):
    """Issue 44 (8), read from the backup's catalog record: a cluster missing from the policy
    gets the policy's defaults, ``auto`` (adaptive, since pgbench is connected) and its floor;
    held back by strict targets, the backup never reads slower than that floor. Without it
    the rate was cut to 23 KB/s and a 3.9 GB full took 456 s."""
    strict = {"throttle_latency_ratio": 1.01, "throttle_latency_slack_ms": 0.0}
    cluster, _ = loaded_node(None, throttle_stall_margin=0.001, **strict)
    time.sleep(1.0)  # pgbench connected: the source is in use as the backup starts

    backup = cluster.backup()

    assert backup.status == "SUCCEEDED", backup.cause
    record = next(r for r in cluster.records() if r["backup_id"] == backup.record["backup_id"])
    throttle = record["throttle"]
    assert throttle["mode"] == "adaptive", throttle
    default_floor = Upload().throttle_floor_mib_per_second * MiB
    assert throttle["floor_bytes_per_second"] >= default_floor, throttle
    if throttle["lowest_rate_bytes_per_second"] is not None:
        assert throttle["lowest_rate_bytes_per_second"] >= throttle["floor_bytes_per_second"]


def test_a_backup_that_holds_too_much_wal_fails_by_name_and_lets_it_go(loaded_node):
    """A slow backup (2 MiB/s) of a busy server, allowed to hold 16 MiB of WAL: it fails with
    SourceLogFull, and the server keeps no session of the agent's (so no backup mode) and no
    slot."""
    cluster, server = loaded_node("{rate_limit_mib_per_second: 2, max_held_wal_mib: 16}")

    started = time.monotonic()
    backup = cluster.backup()

    assert backup.status == "FAILED"
    assert "SourceLogFull" in backup.error, (backup.error, backup.cause)
    assert "max_held_wal_mib (16)" in backup.cause
    assert time.monotonic() - started < 60  # long before the whole copy at 2 MiB/s
    assert agent_sessions(server) == 0  # its backup mode ended with its session
    with psycopg.connect(server.conninfo, autocommit=True) as conn:
        slots = conn.execute("SELECT slot_name FROM pg_replication_slots").fetchall()
    assert slots == []  # the WAL is free to go
    assert cluster.open_uploads() == []
