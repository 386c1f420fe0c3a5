"""The watch publishes what no run can say about itself: each cluster's backup age (what its
RPO alarm compares) and the agents that went silent, read back from CloudWatch."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta

import boto3

from functions.watch_clusters import lambda_handler
from shardvault.local.lambda_bridge import LambdaContext

CONTEXT = LambdaContext(function_name="shardvault-watch_clusters")


def published(metric: str, dimensions: list[dict[str, str]]) -> list[float]:
    """The values CloudWatch holds for ``metric`` in the last ten minutes."""
    now = datetime.now(UTC)
    answer = boto3.client("cloudwatch").get_metric_statistics(
        Namespace="ShardVault",
        MetricName=metric,
        Dimensions=dimensions,
        StartTime=now - timedelta(minutes=10),
        EndTime=now + timedelta(minutes=1),
        Period=60,
        Statistics=["Maximum"],
    )
    return [p["Maximum"] for p in answer["Datapoints"]]


def test_the_watch_publishes_each_clusters_backup_age_and_the_silent_agents(
    stack, make_cluster, policy_for
):
    cluster = make_cluster(nodes=2, size_mb=1)
    policy_for(cluster.name)
    by_cluster = [{"Name": "Cluster", "Value": cluster.name}]

    # Never attempted: no age yet (the alarm has nothing to compare, and stays quiet).
    assert cluster.name not in lambda_handler({}, CONTEXT)["backup_age_hours"]
    assert published("NewestBackupAgeHours", by_cluster) == []

    assert cluster.backup().status == "SUCCEEDED"
    before = time.time()
    observed = lambda_handler({}, CONTEXT)
    assert 0 <= observed["backup_age_hours"][cluster.name] < 0.1
    ages = published("NewestBackupAgeHours", by_cluster)
    assert ages
    assert max(ages) < 0.1 + (time.time() - before) / 3600

    stopped = cluster.configs[1]["node_id"]
    stack.stop_agent(stopped)
    observed = lambda_handler({}, CONTEXT)
    assert f"{cluster.name}/{stopped}" in observed["silent_nodes"]
    assert f"{cluster.name}/{cluster.configs[0]['node_id']}" not in observed["silent_nodes"]
    assert max(published("SilentAgents", [])) >= 1
