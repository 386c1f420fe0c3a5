"""Leftovers nothing removes: whatever a stopped execution or a silent node leaves, a later
step removes. The end state is read from outside: ListMultipartUploads on the whole bucket,
the objects under the backup's prefix, the agents' state directories, the catalog item."""

from __future__ import annotations

import time

import boto3
import pytest

from shardvault.client import operations as ops
from shardvault.contracts import layout
from tests.unit.support import catalog_item


def bucket_uploads(cluster, backup_id: str) -> list[str]:
    """Open multipart uploads of one backup, listed bucket-wide (no prefix filter)."""
    svc = cluster.stack.services()
    return [u["Key"] for u in svc.store_bucket.open_uploads("") if backup_id in u["Key"]]


def held(cluster, backup_id: str) -> list:
    return [p for p in cluster.held_checkpoints() if backup_id in str(p)]


def wait_until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def test_the_next_backup_cleans_up_after_a_stopped_one_the_reaper_never_saw(make_cluster):
    slow = {"rate_limit_bytes_per_second": 2 * 2**20, "upload_parallelism": 1}
    cluster = make_cluster(nodes=2, size_mb=24, agent=slow)
    execution = cluster.start_backup()
    wait_until(cluster.open_uploads, 60, "no upload ever started")
    (stopped,) = cluster.records()
    cluster.stack.drop_reaper_event(execution)  # the next backup comes first
    sfn = boto3.client("stepfunctions")
    sfn.stop_execution(executionArn=execution)
    wait_until(
        lambda: sfn.describe_execution(executionArn=execution)["status"] == "ABORTED",
        30,
        "the execution never stopped",
    )

    following = cluster.start_backup()

    progress = ops.wait_backup(cluster.client, following, interval=0.2, timeout=600)
    assert progress.status == "SUCCEEDED", progress.cause
    old = next(r for r in cluster.records() if r["backup_id"] == stopped["backup_id"])
    assert old["status"] == "FAILED"
    assert old["error"] == "ExecutionEnded", old
    assert bucket_uploads(cluster, stopped["backup_id"]) == []
    assert not [k for k in cluster.store_keys() if stopped["backup_id"] in k]
    wait_until(lambda: not held(cluster, stopped["backup_id"]), 30, "snapshots still held")


def test_a_node_silent_during_cleanup_releases_its_snapshot_when_it_returns(make_cluster):
    slow = {"rate_limit_bytes_per_second": 2**20, "upload_parallelism": 1}
    cluster = make_cluster(nodes=2, size_mb=12, agent=slow)
    victim = cluster.configs[1]
    # 5 MiB parts: each node's 6 MB object is then a multipart upload (one part would be a
    # single PUT, which leaves no open upload to see it start by).
    execution = cluster.start_backup(part_size=5 * 2**20)
    wait_until(cluster.open_uploads, 60, "no upload ever started")
    (record,) = cluster.records()
    cluster.stack.stop_agent(victim["node_id"], kill=True)  # silent from now on

    progress = ops.wait_backup(cluster.client, execution, interval=0.5, timeout=300)

    assert progress.status == "FAILED"
    assert held(cluster, record["backup_id"]), "the silent node's snapshot should still be there"
    cluster.stack.start_agent(victim)  # it comes back
    wait_until(
        lambda: not held(cluster, record["backup_id"]), 30, "the returning node kept its snapshot"
    )
    assert bucket_uploads(cluster, record["backup_id"]) == []


def test_the_daily_retention_run_sweeps_what_no_running_backup_owns(
    make_cluster, policy_for, monkeypatch
):
    """Leftovers of a crash nothing cleaned up: an open upload and a partial object of a
    backup that is not running. The sweep removes them, and keeps a running backup's upload,
    a backup whose catalog record was lost (its manifest says it is a backup) and the
    cluster's WAL archive (no manifest: it is no backup)."""
    from shardvault.aws.lambda_support import services

    cluster = make_cluster(nodes=1, size_mb=1)
    kept = cluster.backup()
    assert kept.status == "SUCCEEDED", kept.cause
    svc = cluster.stack.services()
    s3, bucket, root = svc.store_s3, svc.store.bucket, f"{svc.store.prefix}/{cluster.name}"
    crashed = f"{root}/20200101T000000Z-dead00/shard-1/data-00000"
    orphan_upload = s3.create_multipart_upload(Bucket=bucket, Key=crashed)["UploadId"]
    s3.put_object(
        Bucket=bucket, Key=f"{root}/20200101T000000Z-dead01/shard-1/data-00000", Body=b"x"
    )
    wal = f"{root}/_wal/shard-1/000000010000000000000001--000000010000000000000001--{'a' * 32}.wal"
    s3.put_object(Bucket=bucket, Key=wal, Body=b"w")
    live = f"{root}/20200101T000000Z-live00/shard-1/data-00000"
    svc.catalog.put(
        catalog_item(
            {"cluster": cluster.name, "backup_id": "20200101T000000Z-live00", "status": "RUNNING"}
        )
    )
    s3.create_multipart_upload(Bucket=bucket, Key=live)
    svc.catalog.table.delete_item(
        Key={"cluster": cluster.name, "backup_id": kept.record["backup_id"]}
    )
    # A copy target's objects staged for a restore that ended without removing them.
    staged = f"{svc.store.prefix}/_staged/r20200101T000000Z-old000/shardvault/c/b/data-00000"
    s3.put_object(Bucket=bucket, Key=staged, Body=b"s")
    policy_for(cluster.name)
    monkeypatch.setattr(services().settings, "sweep_grace_seconds", 0.0)

    dry = ops.run_retention(cluster.client, cluster.name, dry_run=True)

    assert dry.status == "SUCCEEDED", dry.cause
    # The sweep covers the whole store; this test looks at its own cluster's prefix.
    assert "sweep" in dry.record, dry.record
    ours = [k for k in dry.record["sweep"]["aborted_uploads"] if k.startswith(root)]
    assert ours == [crashed]
    assert bucket_uploads(cluster, "dead00") == [crashed]  # a dry run removes nothing

    # Staged objects stay while a restore might still read them (its longest run).
    assert not [k for k in dry.record["sweep"]["deleted_prefixes"] if "/_staged/" in k]
    monkeypatch.setattr(layout, "RESTORE_LONGEST_SECONDS", 0)

    real = ops.run_retention(cluster.client, cluster.name, dry_run=False)

    assert real.status == "SUCCEEDED", real.cause
    deleted = [k for k in real.record["sweep"]["deleted_prefixes"] if k.startswith(f"{root}/")]
    assert deleted == [f"{root}/20200101T000000Z-dead01/"]
    assert bucket_uploads(cluster, "dead00") == []
    assert bucket_uploads(cluster, "live00") == [live]  # its backup is running
    assert not [k for k in cluster.store_keys() if "dead01" in k]
    assert [k for k in cluster.store_keys() if kept.record["backup_id"] in k]  # has a manifest
    assert wal in cluster.store_keys()  # the WAL archive is no backup
    assert staged.rsplit("/", 4)[0] + "/" in real.record["sweep"]["deleted_prefixes"]
    assert s3.list_objects_v2(Bucket=bucket, Prefix=staged).get("KeyCount", 0) == 0
    with pytest.raises(s3.exceptions.NoSuchUpload):
        s3.list_parts(Bucket=bucket, Key=crashed, UploadId=orphan_upload)
