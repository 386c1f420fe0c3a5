"""What several unit tests set up alike: the control plane's services on moto (with the
local stack's tables), an agent of one SQLite shard, and a restore target's agent."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import boto3
import pytest
from moto import mock_aws
from shardvault_agent.commands import Commands
from shardvault_agent.config import AgentConfig, ShardConfig

from shardvault.aws.services import Services
from shardvault.config.settings import Settings
from shardvault.contracts.catalog import (
    BackupItem,
    CatalogItem,
    kind_of,
)
from shardvault.contracts.commands import ARGUMENTS, ListingArgs, parse_args
from shardvault.contracts.models import AGENT_PROTOCOL, BackupContext, NodeRecord, ShardInfo, Source
from shardvault.local import moto_fidelity
from shardvault.local.stack import create_tables

TABLES = {"catalog_table": "c", "nodes_table": "n", "inbox_table": "i"}


@contextmanager
def moto_services(monkeypatch: pytest.MonkeyPatch, **settings: Any) -> Iterator[Services]:
    """Services against moto, its tables created (named as ``TABLES``); ``settings`` add to
    or override the defaults (e.g. ``store_url``; no bucket is created)."""
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    moto_fidelity.install()  # item writes atomic, as DynamoDB's (the agents write from threads)
    with mock_aws():
        create_tables(boto3.client("dynamodb"), **TABLES)
        defaults = {**TABLES, "work_bucket": "w", "store_url": "s3://store/backups"}
        yield Services(Settings(**{**defaults, **settings}))


def with_buckets(svc: Services, *names: str) -> Services:
    """``svc`` with the buckets ``names`` made (moto's), e.g. its work bucket and a store."""
    for name in names:
        svc.work_s3.create_bucket(Bucket=name)
    return svc


def requests_made(*clients: Any) -> list[str]:
    """The names of the operations ``clients`` (boto3 clients) make from now on, in order."""
    made: list[str] = []
    for client in clients:
        client.meta.events.register("before-call", lambda model, **_: made.append(model.name))
    return made


def backup_context(engine: str = "sqlite") -> BackupContext:
    """A backup ``b`` of cluster ``c``: shard s1 on node n1, s2 on n2."""
    return BackupContext(
        backup_id="b",
        cluster="c",
        engine=engine,
        sources=[Source(node_id="n1", shard_ids=["s1"]), Source(node_id="n2", shard_ids=["s2"])],
        store_url="s3://bucket/p",
        started_at=0.0,
    )


def lone_node_context(backup_id: str, **fields: Any) -> BackupContext:
    """A backup of cluster ``c`` whose only source is node n1 with shard s1 (the agent of
    ``sqlite_agent``), stored under ``s3://store/backups``; ``fields`` add to it."""
    return BackupContext(
        backup_id=backup_id,
        cluster="c",
        engine="sqlite",
        sources=[Source(node_id="n1", shard_ids=["s1"])],
        store_url="s3://store/backups",
        started_at=0.0,
        **fields,
    )


def sqlite_agent(tmp_path: Path, rows: int = 0, **agent: Any) -> AgentConfig:
    """An agent of one SQLite shard ``s1`` holding ``rows`` rows of 1 KiB."""
    db = tmp_path / "s1.db"
    with sqlite3.connect(db) as conn:
        conn.execute("CREATE TABLE t(x)")
        conn.executemany("INSERT INTO t VALUES (randomblob(1024))", [()] * rows)
    return AgentConfig(
        node_id="n1",
        cluster="c",
        engine="sqlite",
        shards=[ShardConfig(shard_id="s1", path=db)],
        state_dir=tmp_path / "state",
        **agent,
    )


def restore_target(tmp_path: Path) -> AgentConfig:
    """The agent of a restore target node ``n1``: no shards of its own, a ``restore_dir``."""
    return AgentConfig(
        node_id="n1",
        cluster="t",
        engine="sqlite",
        shards=[],
        state_dir=tmp_path / "state",
        restore_dir=tmp_path / "restored",
    )


def leader_node(cluster: str, heartbeat_at: float) -> NodeRecord:
    """The registry record of ``<cluster>-n1``, an SQLite node leading shard s1."""
    return NodeRecord(
        node_id=f"{cluster}-n1",
        cluster=cluster,
        engine="sqlite",
        shards=[ShardInfo(shard_id="s1", role="leader")],
        free_bytes=2**30,
        version="test",
        protocol=AGENT_PROTOCOL,
        heartbeat_at=heartbeat_at,
    )


def catalog_item(fields: dict[str, object]) -> CatalogItem:
    """A catalog item of the kind its key names (a backup, ``restore#...``, ``drill#...``),
    as a test writes it: checked like every writer's."""
    return kind_of(str(fields["backup_id"])).model_validate(fields)


def backup_item(**fields: Any) -> BackupItem:
    """A backup's catalog item: complete, of cluster ``c``, unless ``fields`` say otherwise."""
    return BackupItem.model_validate({"cluster": "c", "status": "COMPLETE"} | fields)


def handle(commands: Commands, command: str, args: dict[str, Any]) -> dict[str, Any]:
    """Runs agent command ``command``'s handler on ``args`` read into its model, and answers
    as the agent sends it (``Commands.run``), but a listing command's answer comes back whole
    (its answer URL is never used). A pack's or upload's backup is its object's."""
    if issubclass(ARGUMENTS[command], ListingArgs):
        args = {"answer_url": "https://answers.invalid/unused", **args}
    if "object" in args and "backup_id" not in args:
        args = {"backup_id": args["object"]["backup_id"], **args}
    handler = commands.handler(command)
    answer = handler(parse_args(command, args))
    return answer.model_dump(mode="json", exclude_unset=True)
