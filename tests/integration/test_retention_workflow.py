"""The retention state machine on the local stack: keep counts from the policy file decide,
a dry run deletes nothing, a real run deletes every object of the expired backups and nothing
else, and backups under Object Lock are reported as locked, not deleted."""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime, timedelta

import boto3

from shardvault.aws.tables import Catalog, table
from shardvault.client import operations as ops
from shardvault.client import records
from shardvault.contracts.catalog import BackupItem
from shardvault.contracts.models import VaultTarget
from shardvault.lifecycle import expire
from shardvault.pricing.prices import STORAGE, StorageClass

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


def vault_keys(cluster, backup_id: str) -> list[str]:
    svc = cluster.stack.services()
    pages = svc.vault_s3.get_paginator("list_object_versions").paginate(
        Bucket=svc.vault.bucket, Prefix=f"{svc.vault.prefix}/{cluster.name}/{backup_id}/"
    )
    return [v["Key"] for page in pages for v in page.get("Versions", [])]


def age(cluster, backup_id: str, days: float) -> None:
    """Moves a promoted backup ``days`` into the past in the catalog, its Object Lock date
    with it (the vault's own lock is left alone: a held backup is never deleted)."""
    then = time.time() - days * 86_400
    until = datetime.fromtimestamp(then + 86_400, UTC).isoformat()
    aged = BackupItem.changes(completed_at=then, promoted_at=then, retain_until=until)
    Catalog(table(cluster.stack.settings.catalog_table)).update(cluster.name, backup_id, aged)


def test_an_expired_backup_is_held_until_its_classs_paid_minimum(make_cluster, policy_for):
    cluster = make_cluster(nodes=1, size_mb=1)
    policy_for(cluster.name)  # a vault (GLACIER_IR, 1-day lock), keep_daily: 1
    old, new = (cluster.backup().record["backup_id"] for _ in range(2))
    record = {r["backup_id"]: r for r in cluster.records()}[old]
    assert record["location"] == "vault"
    minimum = STORAGE[StorageClass(record["storage_class"])].minimum_days  # 30 or 90 days
    age(cluster, old, days=10)  # kept by no rule, past its lock, short of its minimum
    client = client_of(cluster.stack)

    result = ops.run_retention(client, cluster.name, dry_run=False)

    assert result.status == "SUCCEEDED", result.cause
    (decision,) = result.record["decisions"]
    assert decision["expire"] == []
    assert [h["backup_id"] for h in decision["held"]] == [old]
    # Nothing deleted: the backup is whole in the vault, listed and restorable, with its hold.
    assert vault_keys(cluster, old)
    after = {r["backup_id"]: r for r in cluster.records()}
    assert after[old]["status"] == "COMPLETE"
    until = datetime.fromisoformat(after[old]["held_until"])
    landed = datetime.fromtimestamp(after[old]["promoted_at"], UTC)
    assert until == landed + timedelta(days=minimum)
    assert after[old]["held_for"] == f"paid minimum of {record['storage_class']}"
    assert records.hold_note(BackupItem.model_validate(after[old])).startswith(
        f"held until {until.date()}: paid minimum of"
    )
    assert "held_until" not in after[new]


def test_a_policy_for_erasure_deletes_before_the_paid_minimum(
    make_cluster, stack, tmp_path, monkeypatch
):
    cluster = make_cluster(nodes=1, size_mb=1)
    path = tmp_path / "erasure.yaml"
    path.write_text(
        "version: 1\nclusters:\n"
        f"  {cluster.name}:\n"
        "    engine: sqlite\n"
        "    schedule: {full: '0 2 * * *'}\n"
        "    vault: {storage_class: GLACIER_IR, object_lock: {mode: GOVERNANCE, days: 1},\n"
        "            delete_before_paid_minimum: true}\n"
        "    retention: {keep_daily: 1}\n"
    )
    monkeypatch.setattr(stack.settings, "policy_file", str(path))
    old, _ = (cluster.backup().record["backup_id"] for _ in range(2))
    age(cluster, old, days=10)

    result = ops.run_retention(client_of(cluster.stack), cluster.name, dry_run=True)

    assert result.status == "SUCCEEDED", result.cause
    (decision,) = result.record["decisions"]
    assert decision["expire"] == [old]
    assert decision["held"] == []
    assert [e["backup_id"] for e in decision["early_deletions"]] == [old]


def test_an_expiry_cut_short_after_its_catalog_update_is_finished_by_the_next_run(
    make_cluster, policy_for
):
    cluster = make_cluster(nodes=1, size_mb=1)
    old, new = (cluster.backup().record["backup_id"] for _ in range(2))
    policy_for(cluster.name)  # declared now: neither backup is in the vault
    # What a crash right after expire_backup's first catalog update leaves: the record says
    # EXPIRING, every object is still there.
    expiring = BackupItem.changes(status=expire.EXPIRING, expiring_at=time.time())
    Catalog(table(cluster.stack.settings.catalog_table)).update(cluster.name, old, expiring)
    assert backup_keys(cluster, old)

    result = ops.run_retention(client_of(cluster.stack), cluster.name, dry_run=False)

    assert result.status == "SUCCEEDED", result.cause
    (decision,) = result.record["decisions"]
    assert decision["unfinished"] == [old]
    assert backup_keys(cluster, old) == []
    assert backup_keys(cluster, new)
    status = {r["backup_id"]: r["status"] for r in cluster.records()}
    assert status == {old: "EXPIRED", new: "COMPLETE"}
