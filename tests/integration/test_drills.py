"""Restore drills on the local stack: scheduled, restored into drill nodes, validated, recorded,
torn down; a drill of a damaged backup fails and notifies. Each end state is read from outside
the drill's own report: the target nodes' directories and adoptions, the restore's record, the
notifications topic."""

from __future__ import annotations

import contextlib
import json
import subprocess
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import boto3

from shardvault.assurance import drills
from shardvault.assurance.drills import DrillRequest
from shardvault.aws.tables import Catalog, table
from shardvault.client import operations as ops
from shardvault.config.policy import load_policy
from shardvault.local import scheduler

from .conftest import entered_states, running_pg_cluster


def subscribe(stack) -> str:
    """A queue subscribed to the notifications topic: what an operator's inbox would get."""
    sqs = boto3.client("sqs")
    url = sqs.create_queue(QueueName=f"drill-notes-{datetime.now(UTC):%H%M%S%f}")["QueueUrl"]
    arn = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["QueueArn"])["Attributes"]
    boto3.client("sns").subscribe(
        TopicArn=stack.settings.topic_arn, Protocol="sqs", Endpoint=arn["QueueArn"]
    )
    return url


def subjects(url: str) -> list[str]:
    messages = (
        boto3.client("sqs")
        .receive_message(QueueUrl=url, MaxNumberOfMessages=10, WaitTimeSeconds=1)
        .get("Messages", [])
    )
    return [json.loads(m["Body"]).get("Subject", "") for m in messages]


def start_drill_into(cluster, target, **request) -> str:
    """Starts a drill of ``cluster`` into ``target`` (a Target or a Cluster)."""
    drill = DrillRequest(cluster=cluster.name, target_cluster=target.name, **request)
    return ops.start_drill(cluster.client, drill)


def finish_drill(cluster, execution: str, timeout: float = 600) -> ops.Progress:
    return ops.wait_drill(cluster.client, execution, interval=0.2, timeout=timeout)


def stop(execution: str) -> None:
    """Stops an execution and waits until it has ended (moto ends it from its worker)."""
    sfn = boto3.client("stepfunctions")
    sfn.stop_execution(executionArn=execution)
    deadline = time.monotonic() + 60
    while sfn.describe_execution(executionArn=execution)["status"] == "RUNNING":
        assert time.monotonic() < deadline, f"{execution} did not stop"
        time.sleep(0.1)


def shard_dirs(target) -> list[Path]:
    """Shard directories left on the target's nodes (staging excluded: it is hidden)."""
    return [
        p
        for i in range(len(target.configs))
        if target.restore_dir(i).exists()
        for p in target.restore_dir(i).iterdir()
        if not p.name.startswith(".")
    ]


def adoptions(target) -> dict:
    found = {}
    for config in target.configs:
        path = Path(config["state_dir"]) / "adopted.json"
        if path.exists():
            found |= json.loads(path.read_text())
    return found


def test_a_scheduled_drill_restores_validates_records_and_tears_down(
    make_cluster, make_target, policy_for, stack
):
    cluster = make_cluster(nodes=2, size_mb=4)
    backup = cluster.backup()
    assert backup.status == "SUCCEEDED", backup.cause
    target = make_target(nodes=2)
    policy_for(
        cluster.name,
        drill=f"{{cron: '*/5 * * * *', target_cluster: {target.name}, keep_minutes: 0, "
        "rto_target_minutes: 10, validation_queries: ['SELECT count(*) > 0 FROM items']}",
    )
    notes = subscribe(stack)
    policy = load_policy(stack.settings.policy_file)
    since = datetime(2026, 11, 27, 9, 1, tzinfo=UTC)

    started = scheduler.tick(policy, cluster.client, since, since + timedelta(minutes=5))

    (drill,) = [s for s in started if s["kind"] == "drill"]
    progress = finish_drill(cluster, drill["execution"])
    assert progress.status == "SUCCEEDED", (progress.error, progress.cause)
    states = entered_states(drill["execution"])
    assert states.index("Restore") < states.index("Record") < states.index("Teardown")
    (record,) = Catalog(table(stack.settings.catalog_table)).drills(cluster.name)
    record = ops.as_row(record)
    assert record["status"] == "passed"
    assert record["requested_by"] == "schedule:drill"
    assert record["source_backup_id"] == backup.record["backup_id"]
    assert 0 < record["rto_seconds"] < 600
    assert record["restore_seconds"] <= record["rto_seconds"]
    assert record["shards"] == 2
    assert record["checks_passed"] >= 4
    assert record["torn_down_at"] >= record["validated_at"]
    # The restore really ran (its own record says so) and its copy is gone from the nodes.
    (restored,) = target.records()
    assert restored["status"] == "COMPLETE"
    assert restored["validation"] == "passed"
    assert restored["restore_id"] == record["restore_id"]
    assert shard_dirs(target) == []
    assert adoptions(target) == {}
    assert any("drill of" in s and "passed" in s for s in subjects(notes))


def test_a_drill_of_a_damaged_backup_fails_notifies_and_leaves_nothing(
    make_cluster, make_target, stack
):
    cluster = make_cluster(nodes=2, size_mb=3)
    assert cluster.backup().status == "SUCCEEDED"
    svc = stack.services()
    key = sorted(k for k in cluster.store_keys() if "/shard-2/data-" in k)[0]
    body = svc.store_s3.get_object(Bucket=svc.store.bucket, Key=key)["Body"].read()
    damaged = body[:100] + bytes([body[100] ^ 0xFF]) + body[101:]
    svc.store_s3.put_object(Bucket=svc.store.bucket, Key=key, Body=damaged)
    target = make_target(nodes=2)
    notes = subscribe(stack)

    execution = start_drill_into(cluster, target)
    progress = finish_drill(cluster, execution)

    assert progress.status == "FAILED"
    assert progress.error == "ChecksumMismatch", progress.cause
    (record,) = Catalog(table(stack.settings.catalog_table)).drills(cluster.name)
    record = ops.as_row(record)
    assert record["status"] == "failed"
    assert record["error"] == "ChecksumMismatch"
    assert key in record["cause"]  # the node's own words, through the restore's record
    assert record.get("torn_down_at")
    assert shard_dirs(target) == []
    assert adoptions(target) == {}
    staged = [p for i in range(2) for p in (target.restore_dir(i) / ".incoming").rglob("*")]
    assert staged == []  # nothing half-restored in staging either
    assert any("FAILED (ChecksumMismatch)" in s for s in subjects(notes))


def test_a_drill_into_a_backed_up_cluster_is_refused_before_anything(make_cluster, stack):
    cluster = make_cluster(nodes=1, size_mb=2)
    assert cluster.backup().status == "SUCCEEDED"
    production = make_cluster(nodes=1, size_mb=2)  # not in the policy, but backed up
    assert production.backup().status == "SUCCEEDED"
    before = sorted(p.name for p in production.root.rglob("*.db"))

    execution = start_drill_into(cluster, production)
    progress = finish_drill(cluster, execution, timeout=120)

    assert progress.status == "FAILED"
    assert progress.error == "InvalidRequest", progress.cause
    assert "is backed up" in progress.cause
    assert "StartDrill" in entered_states(execution)
    assert "Restore" not in entered_states(execution)
    assert Catalog(table(stack.settings.catalog_table)).drills(cluster.name) == []
    assert sorted(p.name for p in production.root.rglob("*.db")) == before


def test_a_scheduled_drill_that_is_refused_is_recorded_and_reaches_the_inbox(make_cluster, stack):
    cluster = make_cluster(nodes=1, size_mb=1)
    assert cluster.backup().status == "SUCCEEDED"
    production = make_cluster(nodes=1, size_mb=1)  # backed up: never a drill's target
    assert production.backup().status == "SUCCEEDED"
    inbox = subscribe(stack)

    execution = start_drill_into(cluster, production, requested_by="schedule:drill")
    progress = finish_drill(cluster, execution, timeout=120)

    assert progress.status == "FAILED"
    (drill,) = Catalog(table(stack.settings.catalog_table)).drills(cluster.name)
    assert (drill.status, drill.error) == (drills.REFUSED, "InvalidRequest")
    # Published by the drill's role through the topic's KMS key (nobody watches a schedule).
    assert f"ShardVault: scheduled drill of {cluster.name} refused (InvalidRequest)" in (
        subjects(inbox)
    )


def test_a_copy_left_by_a_stopped_drill_is_torn_down_by_the_next_one(
    make_cluster, make_target, stack
):
    cluster = make_cluster(nodes=2, size_mb=3)
    assert cluster.backup().status == "SUCCEEDED"
    target = make_target(nodes=2)
    catalog = Catalog(table(stack.settings.catalog_table))
    first = start_drill_into(cluster, target, keep_minutes=30)
    deadline = time.monotonic() + 300
    while not [r for r in catalog.drills(cluster.name) if r.status == "passed"]:
        assert time.monotonic() < deadline, "the first drill never validated its copy"
        time.sleep(0.2)
    # Its copy is up (kept for 30 minutes) when its execution is stopped: nothing tears it down.
    assert len(shard_dirs(target)) == 2
    stop(first)
    # A second drill of the cluster is not refused: the first one's execution ended.
    second = start_drill_into(cluster, target, keep_minutes=0)
    progress = finish_drill(cluster, second)

    assert progress.status == "SUCCEEDED", (progress.error, progress.cause)
    states = entered_states(second)
    assert states.count("Teardown") == 2  # the stale copy first, then its own
    assert states.index("Teardown") < states.index("Restore")
    records = {r.drill_id: r for r in catalog.drills(cluster.name)}
    assert all(r.torn_down_at for r in records.values()), records
    assert [r["status"] for r in target.records()] == ["COMPLETE", "COMPLETE"]
    assert shard_dirs(target) == []
    assert adoptions(target) == {}


def test_a_second_drill_is_refused_while_the_first_runs(make_cluster, make_target, stack):
    cluster = make_cluster(nodes=1, size_mb=2)
    assert cluster.backup().status == "SUCCEEDED"
    target = make_target(nodes=1)
    catalog = Catalog(table(stack.settings.catalog_table))
    first = start_drill_into(cluster, target, keep_minutes=30)
    try:
        deadline = time.monotonic() + 120
        while not catalog.drills(cluster.name):
            assert time.monotonic() < deadline, "the first drill never started"
            time.sleep(0.1)
        second = start_drill_into(cluster, target, keep_minutes=0)
        refused = finish_drill(cluster, second, timeout=120)
        assert refused.status == "FAILED"
        assert refused.error == "DrillAlreadyRunning", refused.cause
        assert len(catalog.drills(cluster.name)) == 1  # refused before its record
    finally:  # the first drill, and its restore (moto does not stop a nested execution)
        stop(first)
        for record in catalog.drills(cluster.name):
            restore = drills.restore_execution_arn(stack.restore_state_machine_arn, record.drill_id)
            with contextlib.suppress(Exception):
                stop(restore)


def test_a_postgres_drill_stops_its_server_and_leaves_nothing_beside_it(
    stack, make_target, tmp_path
):
    with running_pg_cluster(stack, tmp_path, nodes=1, scale=1) as (cluster, _):
        assert cluster.backup().status == "SUCCEEDED"
        target = make_target(nodes=1, engine="postgres")

        progress = finish_drill(cluster, start_drill_into(cluster, target, keep_minutes=0))

        assert progress.status == "SUCCEEDED", (progress.error, progress.cause)
        (restored,) = target.records()
        (shard,) = restored["shards"]
        assert shard["checks"]["pg_amcheck --all"] == "ok"  # its server ran for the checks
        assert shard["port"]
        # Torn down: the server stopped, the data directory, its socket directory and its
        # log removed; only the node's (empty) staging directory is left.
        assert [p.name for p in target.restore_dir(0).iterdir()] == [".incoming"]
        assert not subprocess.run(
            ["pgrep", "-f", str(target.restore_dir(0))], capture_output=True, check=False
        ).stdout
