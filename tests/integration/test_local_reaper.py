"""The local stack reaps as AWS does: an execution stopped mid-upload (no failure path runs
after a stop) is handed to ``reap_execution`` by the stack's watcher, as EventBridge's rule
does on AWS, with nobody invoking the reaper by hand. Checked from outside: the catalog
item, the store bucket's multipart uploads and the agents' state directories."""

from __future__ import annotations

import time
from typing import Any

import boto3

from shardvault.local.stack import LocalStack

from .conftest import Cluster

SLOW = {"rate_limit_bytes_per_second": 2 * 2**20, "upload_parallelism": 1}


def uploads_of(stack: LocalStack, backup_id: str) -> list[dict[str, Any]]:
    """Open multipart uploads of the backup, from the whole bucket (no prefix: MinIO lists
    only an exact key's uploads for one)."""
    svc = stack.services()
    pages = svc.store_s3.get_paginator("list_multipart_uploads").paginate(Bucket=svc.store.bucket)
    return [
        upload
        for page in pages
        for upload in page.get("Uploads", [])
        if f"/{backup_id}/" in upload["Key"]
    ]


def wait_for(done: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, f"not reaped within {timeout} s: {what()}"
        time.sleep(0.2)


def test_a_stopped_backup_is_reaped_by_the_stack_with_nothing_left_behind(
    make_cluster: Any, stack: LocalStack
) -> None:
    cluster: Cluster = make_cluster(nodes=2, size_mb=24, agent=SLOW)
    execution = cluster.start_backup()
    deadline = time.monotonic() + 60
    while not cluster.open_uploads():  # mid-upload
        assert time.monotonic() < deadline, "no upload ever started"
        time.sleep(0.1)
    (record,) = cluster.records()
    backup_id = record["backup_id"]
    assert uploads_of(stack, backup_id)
    assert cluster.held_checkpoints()

    boto3.client("stepfunctions").stop_execution(executionArn=execution)

    def left() -> dict[str, Any]:
        (now,) = cluster.records()
        return {
            "status": now["status"],
            "uploads": [u["Key"] for u in uploads_of(stack, backup_id)],
            "held": cluster.held_checkpoints(),
        }

    wait_for(lambda: left() == {"status": "FAILED", "uploads": [], "held": []}, 60, left)
    (record,) = cluster.records()
    assert record["error"] == "States.Aborted"
    assert "reaper" in record["cause"]
    assert cluster.store_keys() == []  # no partial object either
    assert stack.services().catalog.lock_holder(cluster.name) is None
