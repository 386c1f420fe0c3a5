"""Integration fixtures: one local stack per session (moto control plane, real MinIO store,
in-process Lambda handlers) and SQLite clusters whose agents run as separate processes.

MinIO is required: a missing binary fails the tests with the fix, it never skips them.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
import pytest
from shardvault_agent.wal import walspool

from shardvault.aws.tables import Catalog, Inbox, table
from shardvault.client import operations as ops
from shardvault.contracts.models import BackupRequest, RestoreRequest
from shardvault.local import demo
from shardvault.local.mariadb import stop_server as stop_mariadb
from shardvault.local.postgres import (
    PostgresInstance,
    ensure_traversable,
    give_to_postgres,
    stop_server,
)
from shardvault.local.postgres import init_instance as init_postgres
from shardvault.local.stack import ACCOUNT, LocalStack
from shardvault.wal import archive

SYSTEM_PYTHON = Path("/usr/bin/python3")  # the WAL push runs as the server's user, as on a host
ARCHIVE_MARKER = "archive-marker-7f3a"  # in the rows ArchivingNode writes
# Idle periods short too: a stopped agent is judged silent by the period it promised
# (idle_heartbeat_seconds), and token-less commands (a cleanup's releases) are not rung.
FAST_AGENT = {
    "heartbeat_interval_seconds": 0.5,
    "idle_heartbeat_seconds": 0.5,
    "idle_inbox_poll_seconds": 1.0,
    "task_heartbeat_seconds": 2,
    "poll_interval_seconds": 0.1,
}
names = itertools.count(1)

# The slowest files first (a `make test` run's durations): with two workers, each running one
# file at a time (pytest-xdist's loadfile), the last file to start is then a short one, not
# the PostgreSQL tests.
SLOWEST_FIRST = (
    "test_postgres.py",
    "test_point_in_time.py",
    "test_leftovers.py",
    "test_demo.py",
    "test_wal_archive.py",
    "test_throttle.py",
    "test_mariadb.py",
    "test_restore.py",
    "test_incremental.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        name = item.path.name
        return SLOWEST_FIRST.index(name) if name in SLOWEST_FIRST else len(SLOWEST_FIRST)

    items.sort(key=rank)  # stable: each file's tests keep their order


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    root = tmp_path_factory.mktemp("stack")
    # The agents heartbeat their tasks every 2 s (FAST_AGENT): a killed one is noticed in 30 s
    # (the state machines' 60 s otherwise), with room for a busy machine's late heartbeats.
    with LocalStack(
        root, require_minio=True, heartbeat_max_age=5.0, task_heartbeat_seconds=30
    ) as running:
        # The CLI's operations the tests call in this process act as the operator, as a CLI in
        # another shell does with the stack.env key: its policy judges each call.
        ops.act_as(running.operator_binding())
        try:
            yield running
        finally:
            ops.act_as(None)
        record = os.environ.get("SHARDVAULT_IAM_RECORD")  # a directory: the calls-vs-grants check
        if record:
            worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
            running.gate.recorder.dump(Path(record) / f"{worker}-{os.getpid()}.json")


@dataclass
class Cluster:
    stack: LocalStack
    name: str
    root: Path
    configs: list[dict[str, Any]]
    sources: dict[str, Path]

    @property
    def client(self) -> ops.ClientConfig:
        return client_of(self.stack)

    def backup(self, **request: Any) -> ops.Progress:
        execution = self.start_backup(**request)
        return ops.wait_backup(self.client, execution, interval=0.2, timeout=600)

    def start_backup(self, **request: Any) -> str:
        return ops.start_backup(self.client, BackupRequest(cluster=self.name, **request))

    def records(self) -> list[dict[str, Any]]:
        """The cluster's backup items as the table holds them."""
        backups = Catalog(table(self.stack.settings.catalog_table)).backups(self.name)
        return [ops.as_row(item) for item in backups]

    def store_keys(self) -> list[str]:
        svc = self.stack.services()
        prefix = f"{svc.store.prefix}/{self.name}/"
        pages = svc.store_s3.get_paginator("list_objects_v2").paginate(
            Bucket=svc.store.bucket, Prefix=prefix
        )
        return [o["Key"] for page in pages for o in page.get("Contents", [])]

    def open_uploads(self) -> list[dict[str, Any]]:
        svc = self.stack.services()
        return svc.store_bucket.open_uploads(f"{svc.store.prefix}/{self.name}/")

    def inbox_items(self) -> list[dict[str, Any]]:
        inbox = Inbox(table(self.stack.settings.inbox_table))
        return [item for c in self.configs for item in inbox.pending(c["node_id"])]

    def held_checkpoints(self) -> list[Path]:
        """Backup state an agent still holds (captures, spool, snapshots)."""
        held = []
        for config in self.configs:
            state = Path(config["state_dir"])
            held += [p for p in glob_under_removal(state / "backups", "*") if p.is_dir()]
            held += [p for p in glob_under_removal(state / "snapshots", "*/*") if p.is_dir()]
        return held

    def agent_log(self, node_id: str) -> str:
        return (self.stack.root / "agents" / f"{node_id}.log").read_text()

    def full_then_incremental(self) -> tuple[str, str]:
        """A full backup, a change to every 50th row of the first shard, and an incremental:
        the ids of the two, both succeeded."""
        full = self.backup()
        assert full.status == "SUCCEEDED", full.cause
        source = next(iter(self.sources.values()))
        with sqlite3.connect(source) as conn:
            conn.execute("UPDATE items SET payload = randomblob(200) WHERE rowid % 50 = 0")
        incremental = self.backup(incremental=True)
        assert incremental.status == "SUCCEEDED", incremental.cause
        return full.record["backup_id"], incremental.record["backup_id"]

    def stop(self) -> None:
        for config in self.configs:
            self.stack.stop_agent(config["node_id"])


def glob_under_removal(root: Path, pattern: str, *, tries: int = 20) -> list[Path]:
    """`root.glob(pattern)` over a tree an agent may be removing while a test polls it.

    Python 3.11's glob raises FileNotFoundError when a directory it is about to list goes
    between its parent's listing and its own: a walk that met a removal is simply walked again.
    """
    for _ in range(tries - 1):
        with contextlib.suppress(FileNotFoundError):
            return list(root.glob(pattern))
    return list(root.glob(pattern))


def client_of(stack: LocalStack) -> ops.ClientConfig:
    return stack.client_config()


@dataclass
class Target:
    """An empty cluster whose agents accept restores."""

    stack: LocalStack
    name: str
    configs: list[dict[str, Any]]

    def restore(self, source: str, **request: Any) -> ops.Progress:
        execution = self.start_restore(source, **request)
        return ops.wait_restore(client_of(self.stack), execution, interval=0.2, timeout=900)

    def start_restore(self, source: str, **request: Any) -> str:
        restore = RestoreRequest(cluster=source, target_cluster=self.name, **request)
        return ops.start_restore(client_of(self.stack), restore)

    def inbox_items(self) -> list[dict[str, Any]]:
        inbox = Inbox(table(self.stack.settings.inbox_table))
        return [item for c in self.configs for item in inbox.pending(c["node_id"])]

    def restore_dir(self, node: int) -> Path:
        return Path(self.configs[node]["restore_dir"])

    def check_tables_equal(self, sources: dict[str, Path]) -> None:
        """Every restored SQLite shard, on whichever node holds it (exactly one), has its
        source's tables (``sources``: the source cluster's databases by shard id)."""
        from shardvault.local.demo import table_digests

        for shard_id, source in sources.items():
            (db,) = [
                path for i in range(len(self.configs))
                for path in self.restore_dir(i).glob(f"{shard_id}/*.db")
            ]  # fmt: skip
            assert table_digests(db) == table_digests(source), shard_id

    def records(self) -> list[dict[str, Any]]:
        """The restore items into this cluster as the table holds them."""
        restores = Catalog(table(self.stack.settings.catalog_table)).restores(self.name)
        return [ops.as_row(item) for item in restores]

    def agent_log(self, node: int) -> str:
        return (self.stack.root / "agents" / f"{self.configs[node]['node_id']}.log").read_text()


@pytest.fixture
def make_target(stack: LocalStack, tmp_path: Path) -> Iterator[Callable[..., Target]]:
    targets: list[Target] = []

    def make(
        *,
        nodes: int,
        engine: str | list[str] = "sqlite",
        agent: dict[str, Any] | None = None,
        **options: Any,
    ) -> Target:
        """``engine``: the nodes' engine, or each node's (a mixed cluster)."""
        name = f"t{next(names)}-{tmp_path.name[-12:].lower().replace('_', '-')}".strip("-")
        each = [engine] * nodes if isinstance(engine, str) else engine
        configs = demo.restore_targets(tmp_path, name=name, engine=each[0], nodes=nodes, **options)
        for config, node_engine in zip(configs, each, strict=True):
            config.update(FAST_AGENT | (agent or {}), engine=node_engine)
            stack.start_agent(config)
        stack.wait_for_nodes([c["node_id"] for c in configs])
        targets.append(Target(stack, name, configs))
        return targets[-1]

    yield make
    for target in targets:
        for config in target.configs:
            stack.stop_agent(config["node_id"])
            for pid_file in Path(config["restore_dir"]).glob("*/postmaster.pid"):
                stop_server(pid_file.parent, mode="immediate")  # restored servers
            for pid_file in Path(config["restore_dir"]).glob("*/mariadbd.pid"):
                stop_mariadb(pid_file.parent, immediate=True)


@pytest.fixture
def make_cluster(stack: LocalStack, tmp_path: Path) -> Iterator[Callable[..., Cluster]]:
    clusters: list[Cluster] = []

    def make(
        *,
        nodes: int = 3,
        size_mb: int = 6,
        agent: dict[str, Any] | None = None,
        env: dict[str, str] | None = None,
        edit: Callable[[list[dict[str, Any]]], None] | None = None,
    ) -> Cluster:
        name = f"c{next(names)}-{tmp_path.name[-12:].lower().replace('_', '-')}".strip("-")
        built = demo.sqlite_cluster(tmp_path, name=name, nodes=nodes, size_mb=size_mb)
        for config in built.agent_configs:
            config["node_id"] = f"{name}-{config['node_id']}"
            config.update(FAST_AGENT | (agent or {}))
        if edit:
            edit(built.agent_configs)
        cluster = Cluster(stack, name, tmp_path, built.agent_configs, built.sources)
        clusters.append(cluster)
        for config in built.agent_configs:
            stack.start_agent(config, env)
        stack.wait_for_nodes([c["node_id"] for c in built.agent_configs])
        return cluster

    yield make
    for cluster in clusters:
        cluster.stop()


@contextlib.contextmanager
def running_pg_cluster(
    stack: LocalStack, tmp_path: Path, *, nodes: int, scale: int
) -> Iterator[tuple[Cluster, list[PostgresInstance]]]:
    """A PostgreSQL demo cluster (pgbench data of ``scale`` per node) with its agents started
    and registered; its servers (shard-1, shard-2, ...) stopped after."""
    name = f"pg{next(names)}"
    built = demo.postgres_cluster(tmp_path, name=name, nodes=nodes, scale=scale)
    for config in built.agent_configs:
        config["node_id"] = f"{name}-{config['node_id']}"
        config.update(FAST_AGENT)
        stack.start_agent(config)
    cluster = Cluster(stack, built.name, tmp_path, built.agent_configs, built.sources)
    try:
        stack.wait_for_nodes([c["node_id"] for c in built.agent_configs])
        yield cluster, list(built.servers.values())
    finally:
        cluster.stop()
        built.stop()


def record_posts(monkeypatch, record) -> None:
    """Calls ``record(command, args)`` for every command posted to an inbox, then posts it."""
    from shardvault.aws.tables import Inbox

    post = Inbox.post

    def recording(self, node_id, command_id, command, args, token):
        record(command, args)
        return post(self, node_id, command_id, command, args, token)

    monkeypatch.setattr(Inbox, "post", recording)


def entered_states(arn: str) -> list[str]:
    return [
        e["stateEnteredEventDetails"]["name"]
        for e in ops.execution_history(arn)
        if "stateEnteredEventDetails" in e
    ]


def output(progress: ops.Progress) -> dict[str, Any]:
    return json.loads(json.dumps(progress.record or {}))


@pytest.fixture
def policy_for(stack, tmp_path, monkeypatch):
    """Points the stack at a policy file declaring the given cluster (keep one per day)."""

    def write(cluster: str, **options: str) -> None:
        """``options``: more fields of the cluster's entry, e.g. ``encryption="kms"``."""
        engine = options.pop("engine", "sqlite")
        vault = options.pop(
            "vault", "{storage_class: GLACIER_IR, object_lock: {mode: GOVERNANCE, days: 1}}"
        )
        path = tmp_path / "policy.yaml"
        path.write_text(
            "version: 1\n"
            "clusters:\n"
            f"  {cluster}:\n"
            f"    engine: {engine}\n"
            "    schedule: {full: '0 2 * * *'}\n"
            f"    vault: {vault}\n"
            "    retention: {keep_daily: 1}\n"
            + "".join(f"    {name}: {value}\n" for name, value in options.items())
        )
        monkeypatch.setattr(stack.settings, "policy_file", str(path))

    return write


class ArchivingNode:
    """One PostgreSQL node, the leader of shard-1 of its own cluster, whose archive_command
    pushes into its agent's spool (the system's python3, as the server's user)."""

    def __init__(
        self,
        stack: Any,
        tmp_path: Path,
        delay: float,
        *,
        cluster: str | None = None,
        index: int = 1,
        settings: dict[str, str] | None = None,
        **policy: str,
    ) -> None:
        """``cluster``: a cluster of several such nodes (node ``index`` leads shard-<index>);
        ``settings``: more of the server's postgresql.conf."""
        self.stack, self.cluster = stack, cluster or f"wal{next(names)}"
        self.node_id, self.shard_id = f"{self.cluster}-n{index}", f"shard-{index}"
        root = tmp_path if index == 1 else tmp_path / f"n{index}"
        self.spool = root / "spool"
        self.spool.mkdir(parents=True)
        give_to_postgres(self.spool)
        client = root / "push" / "walspool.py"
        client.parent.mkdir()
        shutil.copyfile(walspool.__file__, client)
        ensure_traversable(client.parent)
        command = f"{SYSTEM_PYTHON} {client} --spool {self.spool} --max-bytes {1 << 34} %p"
        archiving = {"archive_mode": "on", "archive_command": command}
        self.server: PostgresInstance = init_postgres(
            root / "pg", settings=archiving | (settings or {})
        )
        self.config = demo.agent_config(
            root,
            self.cluster,
            self.node_id,
            "postgres",
            [
                {
                    "shard_id": self.shard_id,
                    "role": "leader",
                    "data_dir": str(self.server.data_dir),
                    "conninfo": self.server.conninfo,
                    "wal_spool_dir": str(self.spool),
                }
            ],
        )
        self.config.update(FAST_AGENT | {"archive_poll_seconds": 0.2})
        self.policy = {"engine": "postgres", "archive": f"{{max_delay_seconds: {delay}}}", **policy}

    def start_agent(self) -> None:
        self.stack.start_agent(self.config)
        self.stack.wait_for_nodes([self.node_id])

    def stop(self) -> None:
        self.stack.stop_agent(self.node_id)
        self.server.stop()

    def write_segments(self, count: int) -> str:
        """Fills ``count`` segments with rows that carry the marker; the last one's name."""
        self.server.psql(
            f"CREATE TABLE IF NOT EXISTS filler (n int, note text DEFAULT '{ARCHIVE_MARKER}')"
        )
        last = ""
        for _ in range(count):
            self.server.psql("INSERT INTO filler (n) SELECT generate_series(1, 2000)")
            last = self.server.psql("SELECT pg_walfile_name(pg_switch_wal())")
        return last

    def backup(self) -> ops.Progress:
        client = client_of(self.stack)
        execution = ops.start_backup(client, BackupRequest(cluster=self.cluster))
        return ops.wait_backup(client, execution, interval=0.2, timeout=600)

    def batches(self) -> list[dict[str, Any]]:
        return archive.archived_batches(self.stack.services(), self.cluster, self.shard_id)

    def archived(self) -> list[str]:
        return sorted(f["name"] for b in self.batches() for f in b["files"])

    def wait_archived(self, last: str, timeout: float = 60) -> list[str]:
        """Waits until ``last`` is in the store and the spool is empty."""
        deadline = time.monotonic() + timeout
        while True:
            names_ = self.archived()
            spooled = [p.name for p in self.spool.iterdir()]
            if last in names_ and not spooled:
                return names_
            assert time.monotonic() < deadline, (last, names_[-3:], spooled)
            time.sleep(0.2)

    def leftovers(self, settle: float = 10) -> dict[str, list[str]]:
        """What archiving leaves behind once it is done: nothing. A send empties the spool
        before it removes its batch's state and request (``Archiver.send``), so what is left
        is read again for up to ``settle`` seconds; a real leftover stays."""
        deadline = time.monotonic() + settle
        while True:
            left = self._leftovers()
            if not any(left.values()) or time.monotonic() > deadline:
                return left
            time.sleep(0.2)

    def _leftovers(self) -> dict[str, list[str]]:
        state = Path(self.config["state_dir"]) / "archive"
        inbox = table(self.stack.settings.inbox_table)
        items = inbox.query(
            KeyConditionExpression=boto3.dynamodb.conditions.Key("node_id").eq(self.node_id)
        )["Items"]
        return {
            "state": sorted(p.name for p in state.iterdir()) if state.exists() else [],
            "requests": [
                i["command_id"] for i in items if i["command_id"].startswith(archive.REQUEST_PREFIX)
            ],
        }


@pytest.fixture
def archiving(stack, tmp_path, policy_for):
    made: list[ArchivingNode] = []

    def make(delay: float = 0.5, **policy: str) -> ArchivingNode:
        node = ArchivingNode(stack, tmp_path, delay, **policy)
        policy_for(node.cluster, **node.policy)
        made.append(node)
        return node

    yield make
    for node in made:
        node.stop()


def run_cli(stack: LocalStack, *args: str, columns: int = 200) -> subprocess.CompletedProcess:
    """``shardvault ARGS`` against the stack, as a script runs it: a bare environment (no AWS
    variables but the stack's env file) and ``columns`` wide."""
    return subprocess.run(
        [sys.executable, "-m", "shardvault.client.cli", *args,
         "--stack-env", str(stack.root / "stack.env")],
        capture_output=True, text=True, timeout=300, check=False,
        env={"PATH": "/usr/bin:/bin", "COLUMNS": str(columns)},
    )  # fmt: skip


def rot_in_vault(stack: LocalStack, key: str, offset: int) -> None:
    """Flips one byte of the vault's newest version of ``key`` where moto keeps it: bitrot
    under the lock, which no S3 call can cause (a write adds a version; the locked one stays).
    The checksum the store reports keeps the original's, as a disk's bitrot would."""
    from moto.s3.models import s3_backends

    bucket = s3_backends[ACCOUNT]["aws"].get_bucket(stack.services().vault.bucket)
    version = bucket.keys.getlist(key)[-1]
    body = bytearray(version.value)
    body[offset] ^= 0xFF
    version.value = bytes(body)
