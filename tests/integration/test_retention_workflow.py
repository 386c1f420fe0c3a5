"""The retention state machine on the local stack: keep counts from the policy file decide,
a dry run deletes nothing, a real run deletes every object of the expired backups and nothing
else, and backups under Object Lock are reported as locked, not deleted."""

from __future__ import annotations

import json

import boto3

from shardvault import operations as ops
from shardvault.models import VaultTarget

from .conftest import client_of

LOCKED = VaultTarget(storage_class="GLACIER_IR", lock_mode="GOVERNANCE", lock_days=1)


def backup_keys(cluster, backup_id: str) -> list[str]:
    return [k for k in cluster.store_keys() if f"/{backup_id}/" in k]


def test_a_dry_run_decides_and_a_real_run_deletes_only_the_expired(make_cluster, policy_for):
    cluster = make_cluster(nodes=1, size_mb=1)
    ids = []
    for _ in range(3):
        backup = cluster.backup()
        assert backup.status == "SUCCEEDED", backup.cause
        ids.append(backup.record["backup_id"])
    newest, older = ids[-1], ids[:-1]
    # Declared only now: these backups were not promoted, so nothing locks them.
    policy_for(cluster.name)
    client = client_of(cluster.stack)

    dry = ops.run_retention(client, cluster.name, dry_run=True)

    assert dry.status == "SUCCEEDED", dry.cause
    (decision,) = dry.record["decisions"]
    assert sorted(decision["expire"]) == sorted(older)
    assert [k["backup_id"] for k in decision["keep"]] == [newest]
    assert all(backup_keys(cluster, b) for b in ids)  # a dry run deletes nothing

    real = ops.run_retention(client, cluster.name, dry_run=False)

    assert real.status == "SUCCEEDED", real.cause
    for b in older:
        assert backup_keys(cluster, b) == []
    assert backup_keys(cluster, newest)
    status = {r["backup_id"]: r["status"] for r in cluster.records()}
    assert status == {**dict.fromkeys(older, "EXPIRED"), newest: "COMPLETE"}


def test_backups_under_object_lock_are_kept_until_their_date(make_cluster, policy_for):
    cluster = make_cluster(nodes=1, size_mb=1)
    policy_for(cluster.name)
    ids = [cluster.backup(vault=LOCKED).record["backup_id"] for _ in range(2)]

    result = ops.run_retention(client_of(cluster.stack), cluster.name, dry_run=False)

    assert result.status == "SUCCEEDED", result.cause
    (decision,) = result.record["decisions"]
    assert decision["expire"] == []
    assert [lk["backup_id"] for lk in decision["locked"]] == [ids[0]]
    assert {r["status"] for r in cluster.records()} == {"COMPLETE"}


def test_a_cluster_missing_from_the_policy_is_refused_by_name(make_cluster, policy_for):
    cluster = make_cluster(nodes=1, size_mb=1)
    policy_for("someone-else")
    result = ops.run_retention(client_of(cluster.stack), cluster.name, dry_run=True)
    assert result.status == "FAILED"
    assert result.error == "PolicyError"
    assert cluster.name in result.cause


def test_a_cluster_forecast_over_its_budget_is_alerted(make_cluster, stack, tmp_path, monkeypatch):
    cluster = make_cluster(nodes=1, size_mb=1)
    assert cluster.backup().status == "SUCCEEDED"
    path = tmp_path / "budget.yaml"
    path.write_text(
        "version: 1\nclusters:\n"
        f"  {cluster.name}:\n"
        "    engine: sqlite\n"
        "    schedule: {full: '0 2 * * *'}\n"  # a full a day: its requests alone pass $0.01
        "    vault: {storage_class: GLACIER_IR, object_lock: {mode: GOVERNANCE, days: 1}}\n"
        "    retention: {keep_daily: 30}\n"
        "    budget_usd_per_month: 0.01\n"
    )
    monkeypatch.setattr(stack.settings, "policy_file", str(path))
    sns, sqs = boto3.client("sns"), boto3.client("sqs")
    queue = sqs.create_queue(QueueName=f"alerts-{cluster.name}")["QueueUrl"]
    arn = sqs.get_queue_attributes(QueueUrl=queue, AttributeNames=["QueueArn"])["Attributes"]
    sns.subscribe(TopicArn=stack.settings.topic_arn, Protocol="sqs", Endpoint=arn["QueueArn"])

    result = ops.run_retention(client_of(stack), cluster.name, dry_run=True)

    assert result.status == "SUCCEEDED", result.cause
    (alert,) = result.record["budget_alerts"]
    assert "over its budget of $0.01" in alert
    assert cluster.name in alert
    messages = sqs.receive_message(QueueUrl=queue, MaxNumberOfMessages=10)["Messages"]
    bodies = [json.loads(m["Body"]) for m in messages]
    assert any(cluster.name in b.get("Message", "") for b in bodies)
