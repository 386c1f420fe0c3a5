"""Bad backup requests fail at once, with a named error and a fix, and change nothing."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid

import boto3
import pytest

from shardvault.client import operations as ops
from shardvault.errors import InvalidRequest

from .conftest import Cluster


def run_raw(stack, payload) -> ops.Progress:
    sfn = boto3.client("stepfunctions")
    name = f"raw-{uuid.uuid4().hex[:12]}"  # moto names every unnamed execution "None"
    arn = sfn.start_execution(
        stateMachineArn=stack.state_machine_arn, name=name, input=json.dumps(payload)
    )["executionArn"]
    client = ops.ClientConfig(stack.state_machine_arn, stack.settings.catalog_table)
    return ops.wait_backup(client, arn, interval=0.1, timeout=60)


def assert_unchanged(cluster: Cluster) -> None:
    assert cluster.records() == []
    assert cluster.store_keys() == []
    assert cluster.inbox_items() == []
    assert cluster.held_checkpoints() == []
    assert cluster.stack.services().catalog.lock_holder(cluster.name) is None


def assert_rejected(progress: ops.Progress, error: str, *phrases: str) -> None:
    assert progress.status == "FAILED"
    assert progress.error == error
    assert "Fix:" in progress.cause
    for phrase in phrases:
        assert phrase in progress.cause


def test_unknown_cluster(stack):
    started = time.monotonic()
    progress = run_raw(stack, {"cluster": "no-such-cluster"})
    assert_rejected(progress, "UnknownCluster", "no-such-cluster", "start the agents")
    assert time.monotonic() - started < 10  # at once, not after a timeout


def test_a_refused_scheduled_run_is_sent_to_the_notifications_topic(stack):
    """Nobody watches a schedule: its refused run reaches the topic, naming the cluster, the
    cause and the fix; a refusal a person asked for (the CLI) is shown to that person only."""
    sns, sqs = boto3.client("sns"), boto3.client("sqs")
    queue = sqs.create_queue(QueueName=f"alerts-{uuid.uuid4().hex[:8]}")["QueueUrl"]
    arn = sqs.get_queue_attributes(QueueUrl=queue, AttributeNames=["QueueArn"])["Attributes"]
    sns.subscribe(TopicArn=stack.settings.topic_arn, Protocol="sqs", Endpoint=arn["QueueArn"])

    manual = run_raw(stack, {"cluster": "nosuch-by-hand", "requested_by": "cli"})
    scheduled = run_raw(stack, {"cluster": "nosuch-nightly", "requested_by": "schedule:full"})

    assert_rejected(manual, "UnknownCluster")
    assert_rejected(scheduled, "UnknownCluster")
    messages = sqs.receive_message(QueueUrl=queue, MaxNumberOfMessages=10)["Messages"]
    notices = [json.loads(json.loads(m["Body"])["Message"]) for m in messages]
    (notice,) = notices
    assert notice["cluster"] == "nosuch-nightly"
    assert notice["requested_by"] == "schedule:full"
    assert notice["error"] == "UnknownCluster"
    assert "nosuch-nightly" in notice["cause"]
    assert notice["fix"]
    # ... and recorded: the night that did not happen is in the catalog, under its cluster.
    catalog = stack.services().catalog
    assert catalog.backups("nosuch-by-hand") == []
    (record,) = catalog.backups("nosuch-nightly")
    assert record.status == "REFUSED"
    assert record.backup_id == notice["backup_id"]
    assert record.error == "UnknownCluster"
    assert "nosuch-nightly" in (record.cause or "")
    assert "Fix:" in (record.cause or "")


def test_the_cli_refuses_an_unknown_cluster_before_a_run_starts(stack):
    """A script sees the refusal in the exit status (3: refused; 2 is a usage error) and on
    stderr, and no execution was started to fail later."""
    refused = subprocess.run(
        [sys.executable, "-m", "shardvault.client.cli", "backup", "no-such-cluster", "--stack-env",
         str(stack.root / "stack.env")],
        capture_output=True, text=True, timeout=120, check=False,
        env={"PATH": "/usr/bin:/bin", "COLUMNS": "200"},
    )  # fmt: skip
    assert refused.returncode == 3, refused.stdout + refused.stderr
    assert "UnknownCluster" in refused.stderr
    assert "no-such-cluster" in refused.stderr
    assert refused.stdout == ""
    executions = boto3.client("stepfunctions").list_executions(
        stateMachineArn=stack.state_machine_arn
    )["executions"]
    assert not [e for e in executions if e["name"].startswith("no-such-cluster")]

    usage = subprocess.run(
        [sys.executable, "-m", "shardvault.client.cli", "backup"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert usage.returncode == 2
    assert "required: cluster" in usage.stderr


def test_a_cluster_whose_agents_hold_no_shards(stack, make_target):
    empty = make_target(nodes=1)  # agents that only accept restores
    progress = run_raw(stack, {"cluster": empty.name})
    assert_rejected(progress, "NoShards", empty.configs[0]["node_id"], "hold no shards")
    assert stack.services().catalog.backups(empty.name) == []
    assert stack.services().catalog.lock_holder(empty.name) is None


@pytest.mark.parametrize(
    ("payload", "phrase"),
    [
        ({}, "cluster: Field required"),
        ({"cluster": "Bad Name!"}, "not a valid name"),
        ([1, 2], "JSON object"),
    ],
)
def test_malformed_request(stack, payload, phrase):
    assert_rejected(run_raw(stack, payload), "InvalidRequest", phrase)


def test_a_stopped_agent(make_cluster):
    cluster = make_cluster(nodes=3)
    stopped = cluster.configs[1]["node_id"]
    cluster.stack.stop_agent(stopped)  # a clean shutdown: the node says it is stopped
    progress = cluster.backup()
    assert_rejected(progress, "AgentUnavailable", stopped, "agent stopped", "--remove")
    assert_unchanged(cluster)
    # Forgetting the node as the fix says: its shard-2 now has only a follower left.
    client = ops.ClientConfig(
        cluster.stack.state_machine_arn,
        cluster.stack.settings.catalog_table,
        cluster.stack.settings.nodes_table,
    )
    ops.remove_node(client, stopped)
    assert stopped not in [n.node_id for n in ops.list_nodes(client, cluster.name)]
    assert_rejected(cluster.backup(), "ShardWithoutLeader", "shard-2")
    assert_unchanged(cluster)


def test_a_silent_agent(make_cluster):
    cluster = make_cluster(nodes=3)
    silent = cluster.configs[2]["node_id"]
    cluster.stack.stop_agent(silent, kill=True)  # killed: its record still says "up"
    time.sleep(cluster.stack.settings.heartbeat_max_age_seconds + 1)
    progress = cluster.backup()
    assert_rejected(progress, "AgentUnavailable", silent, "silent for")
    assert_unchanged(cluster)


def test_a_shard_with_no_leader(make_cluster):
    def demote_shard_2(configs):
        for config in configs:
            for shard in config["shards"]:
                if shard["shard_id"] == "shard-2":
                    shard["role"] = "follower"

    cluster = make_cluster(nodes=3, edit=demote_shard_2)
    progress = cluster.backup()
    assert_rejected(progress, "ShardWithoutLeader", "shard-2", "elect a leader")
    assert_unchanged(cluster)


def test_a_second_backup_while_one_runs(make_cluster):
    # A rate limit keeps the first backup running while the second is asked for.
    cluster = make_cluster(
        nodes=2, size_mb=12, agent={"rate_limit_bytes_per_second": 2 * 1024 * 1024}
    )
    first = cluster.start_backup()
    deadline = time.monotonic() + 30
    # Validate takes the lock, then writes the first backup's record: wait for both.
    while not cluster.records():
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert cluster.stack.services().catalog.lock_holder(cluster.name) is not None
    backups_before = [r["backup_id"] for r in cluster.records()]
    second = cluster.backup()
    assert_rejected(second, "BackupAlreadyRunning", first)
    assert [r["backup_id"] for r in cluster.records()] == backups_before
    assert ops.wait_backup(cluster.client, first, interval=0.2, timeout=300).status == "SUCCEEDED"


def test_a_shard_whose_database_went_missing_is_refused_by_name(make_cluster):
    """The agent started with its database in place; then the file went away (a misspelled
    path after a config edit, an unmounted disk). The heartbeat says so, and the backup is
    refused before anything runs: nothing creates the file, nothing backs up an empty one."""
    cluster = make_cluster(nodes=2)
    source = cluster.sources["shard-2"]
    source.rename(source.with_suffix(".moved"))
    time.sleep(1.5)  # the next heartbeats report the missing data
    progress = cluster.backup()
    assert_rejected(progress, "ShardDataMissing", "shard-2", str(source))
    assert not source.exists()
    assert_unchanged(cluster)


def test_the_policy_decides_which_agents_take_part(make_cluster, policy_for):
    """An agent's claim of a cluster is refused by name when the policy's nodes list leaves
    its node out, and a listed node that has not registered refuses the backup too."""
    cluster = make_cluster(nodes=2, size_mb=1)
    first, second = (c["node_id"] for c in cluster.configs)
    policy_for(cluster.name, nodes=f"[{first}]")
    assert_rejected(cluster.backup(), "NotAMember", second, "not in its policy's nodes")
    policy_for(cluster.name, nodes=f"[{first}, {second}, {cluster.name}-node-9]")
    assert_rejected(cluster.backup(), "NotAMember", f"{cluster.name}-node-9", "not registered")
    assert_unchanged(cluster)
    policy_for(cluster.name, nodes=f"[{first}, {second}]")
    assert cluster.backup().status == "SUCCEEDED"


def test_a_live_node_is_not_forgotten_unless_forced(make_cluster):
    """Issue 44 (also seen): nodes --remove on a live node removed its record."""
    cluster = make_cluster(nodes=1)
    live = cluster.configs[0]["node_id"]
    client = ops.ClientConfig(
        cluster.stack.state_machine_arn,
        cluster.stack.settings.catalog_table,
        cluster.stack.settings.nodes_table,
    )
    with pytest.raises(InvalidRequest, match="is up"):
        ops.remove_node(client, live)
    assert live in [n.node_id for n in ops.list_nodes(client, cluster.name)]
    # Forced, it goes (its agent registers again at its next heartbeat: that is the risk).
    assert ops.remove_node(client, live, force=True).node_id == live
