"""Bad restore requests fail at once, with a named error and a fix, and change nothing: no
restore record, no command sent, nothing written on any target node."""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import boto3
import pytest

from shardvault.aws.tables import Inbox, table
from shardvault.client import operations as ops
from shardvault.contracts.models import RestoreRequest
from tests.unit.support import catalog_item

from .conftest import Target, client_of

pytestmark = pytest.mark.usefixtures("stack")


@pytest.fixture
def backed_up(make_cluster):
    cluster = make_cluster(nodes=3, size_mb=2)
    assert cluster.backup().status == "SUCCEEDED"
    return cluster


def assert_unchanged(target: Target) -> None:
    assert target.records() == []
    inbox = Inbox(table(target.stack.settings.inbox_table))
    assert [i for c in target.configs for i in inbox.pending(c["node_id"])] == []
    for config in target.configs:
        root = Path(config["restore_dir"])
        assert not (root / ".incoming").exists() or not any((root / ".incoming").iterdir())


def assert_rejected(progress: ops.Progress, error: str, *phrases: str) -> None:
    assert progress.status == "FAILED"
    assert progress.error == error, progress.cause
    assert "Fix:" in progress.cause
    for phrase in phrases:
        assert phrase in progress.cause, progress.cause


def test_unknown_backup(backed_up, make_target):
    target = make_target(nodes=2)
    progress = target.restore(backed_up.name, backup_id="20200101T000000Z-000000")
    assert_rejected(progress, "BackupNotFound", "20200101T000000Z-000000", "shardvault list")
    assert_unchanged(target)


def test_cluster_without_backups(make_target):
    target = make_target(nodes=1)
    progress = target.restore("never-backed-up")
    assert_rejected(progress, "BackupNotFound", "never-backed-up")
    assert_unchanged(target)


def test_failed_backup(backed_up, make_target):
    catalog = backed_up.stack.services().catalog
    catalog.put(
        catalog_item(
            {
                "cluster": backed_up.name,
                "backup_id": "20200101T000000Z-dead00",
                "status": "FAILED",
                "cause": "the agent of node-2 stopped answering.",
            }
        )
    )
    target = make_target(nodes=2)
    progress = target.restore(backed_up.name, backup_id="20200101T000000Z-dead00")
    assert_rejected(progress, "BackupNotRestorable", "FAILED", "node-2 stopped answering")
    assert_unchanged(target)


def test_wrong_engine(backed_up, make_target):
    target = make_target(nodes=2, engine="postgres")
    progress = target.restore(backed_up.name)
    assert_rejected(progress, "EngineMismatch", "sqlite", "postgres")
    assert_unchanged(target)


def test_unknown_target(backed_up, stack):
    execution = ops.start_restore(
        client_of(stack),
        RestoreRequest(cluster=backed_up.name, target_cluster="nowhere"),
    )
    progress = ops.wait_restore(client_of(stack), execution, interval=0.1, timeout=60)
    assert_rejected(progress, "UnknownCluster", "nowhere")


def test_unhealthy_target(backed_up, make_target, stack):
    target = make_target(nodes=2)
    stack.stop_agent(target.configs[1]["node_id"])  # a clean stop: registered as stopped
    progress = target.restore(backed_up.name)
    assert_rejected(progress, "AgentUnavailable", target.configs[1]["node_id"])
    assert_unchanged(target)


def test_target_too_small(backed_up, make_target):
    target = make_target(nodes=2, capacity=1024 * 1024)
    progress = target.restore(backed_up.name)
    assert_rejected(progress, "TargetTooSmall", "GiB", "restore --plan-only")
    assert_unchanged(target)


def test_non_empty_target(backed_up, make_target):
    target = make_target(nodes=1)
    existing = target.restore_dir(0) / "shard-2" / "precious.db"
    existing.parent.mkdir(parents=True)
    existing.write_bytes(b"someone's data")
    time.sleep(1.5)  # the next heartbeats report the occupied directory
    progress = target.restore(backed_up.name)
    assert_rejected(progress, "TargetNotEmpty", "shard-2", '"replace": true')
    assert existing.read_bytes() == b"someone's data"
    assert_unchanged(target)


@pytest.mark.parametrize(
    "payload",
    [
        [1, 2],
        "restore please",
        {"cluster": "demo"},
        {"cluster": "Not A Name", "target_cluster": "t"},
        {"cluster": "demo", "target_cluster": "t", "tier": "Instant"},
        {"cluster": "demo", "target_cluster": "t", "surprise": True},
    ],
)
def test_malformed_input(stack, payload):
    sfn = boto3.client("stepfunctions")
    arn = sfn.start_execution(
        stateMachineArn=stack.restore_state_machine_arn,
        name=f"raw-{uuid.uuid4().hex[:12]}",
        input=json.dumps(payload),
    )["executionArn"]
    progress = ops.wait_restore(client_of(stack), arn, interval=0.1, timeout=60)
    assert_rejected(progress, "InvalidRequest")


@pytest.mark.parametrize(
    ("query", "named"),
    [
        ("DROP TABLE items; SELECT true", "2 statements"),
        ("COPY (SELECT 1) TO PROGRAM 'touch /tmp/shardvault-pwned'", "starts with COPY"),
        ("WITH d AS (DELETE FROM items RETURNING 1) SELECT true", "DELETE"),
        # One statement as PostgreSQL reads it, three as SQLite (the backup's engine) does.
        ("SELECT 1 /* /* */ ; DELETE FROM items; -- */", "as SQLite reads it"),
        ("SELECT $$;DELETE FROM items;$$ = ''", "as SQLite reads it"),
    ],
)
def test_a_validation_query_that_could_write_is_refused_before_anything_runs(
    backed_up, make_target, query, named
):
    target = make_target(nodes=1)
    sfn = boto3.client("stepfunctions")
    console_input = {
        "cluster": backed_up.name,
        "target_cluster": target.name,
        "validation_queries": [query],
    }
    arn = sfn.start_execution(
        stateMachineArn=target.stack.restore_state_machine_arn,
        name=f"raw-{uuid.uuid4().hex[:12]}",
        input=json.dumps(console_input),
    )["executionArn"]
    progress = ops.wait_restore(client_of(target.stack), arn, interval=0.1, timeout=60)
    assert_rejected(progress, "InvalidRequest", named, "read-only statement")
    assert_unchanged(target)
    assert not Path("/tmp/shardvault-pwned").exists()


def test_a_node_the_policy_gives_another_cluster_receives_no_restore(
    backed_up, make_target, policy_for
):
    """An agent writes its own claim: one whose node the policy lists under the backed-up
    cluster cannot join a restore target (a compromised node asking for another's data)."""
    target = make_target(nodes=2)
    intruder = target.configs[1]["node_id"]
    members = [c["node_id"] for c in backed_up.configs]
    policy_for(backed_up.name, nodes=f"[{', '.join([*members, intruder])}]")
    progress = target.restore(backed_up.name)
    assert_rejected(progress, "NotAMember", intruder, f"lists it under {backed_up.name!r}")
    assert_unchanged(target)
