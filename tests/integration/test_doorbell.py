"""Agents on the local stack wake on their doorbells: with the default idle periods (an inbox
read a minute, a heartbeat every five), each command of a backup is still taken at once."""

from __future__ import annotations

import time

import boto3

from shardvault.aws.tables import NodeRegistry, table
from shardvault.contracts.models import doorbell_name

# The defaults of the idle periods; commands turn an agent busy for half a second only, so
# that most commands of the backup reach an idle agent.
IDLE = {
    "idle_inbox_poll_seconds": 60.0,
    "idle_heartbeat_seconds": 300.0,
    "doorbell_wait_seconds": 20,
    "busy_window_seconds": 0.5,
}


def test_idle_agents_woken_by_their_doorbells_back_up_without_waiting(make_cluster):
    cluster = make_cluster(nodes=2, size_mb=2, agent=IDLE)
    registry = NodeRegistry(table(cluster.stack.settings.nodes_table))
    sqs = boto3.client("sqs")
    for config in cluster.configs:
        record = registry.get(config["node_id"])
        assert record.heartbeat_every == 300.0  # idle: the period it promised
        url = sqs.get_queue_url(QueueName=doorbell_name(config["node_id"]))["QueueUrl"]
        assert record.doorbell == url
    time.sleep(1.5)  # idle now: only a ring or the minute's safety poll reads the inbox
    started = time.monotonic()
    progress = cluster.backup()
    took = time.monotonic() - started
    assert progress.status == "SUCCEEDED", progress.cause
    # Without the rings the first command alone (flush, sent to idle agents) would wait for
    # the safety poll, up to a minute.
    assert took < 20, took
    for config in cluster.configs:
        assert "no doorbell" not in cluster.agent_log(config["node_id"])
