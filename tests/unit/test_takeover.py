"""A stale lock (its execution ended without the failure path) is taken over after cleanup,
even when the abandoned backup's record was written by an older version whose context no
longer parses: cleanup must never be what blocks every later backup of a cluster."""

from __future__ import annotations

import boto3

from shardvault.backup import TAKEN_OVER, clean_up_abandoned, take_lock
from shardvault.contracts.models import BackupRequest
from tests.unit.support import catalog_item

from .support import moto_services

ENDED = "arn:aws:states:us-east-1:123456789012:execution:shardvault-backup:gone"


def test_an_abandoned_backup_with_an_unreadable_context_is_cleaned_and_its_lock_taken(
    monkeypatch,
):
    with moto_services(monkeypatch) as svc:
        s3 = boto3.client("s3")
        s3.create_bucket(Bucket="store")
        s3.put_object(Bucket="store", Key="backups/c1/old/shard-1/data-00000", Body=b"partial")
        upload = s3.create_multipart_upload(Bucket="store", Key="backups/c1/old/shard-1/x")
        svc.catalog.put(
            catalog_item(
                {
                    "cluster": "c1",
                    "backup_id": "old",
                    "status": "RUNNING",
                    "execution_id": ENDED,
                    "context": '{"vault": {"lock_mode": "NONE"}}',  # an older version's
                }
            )
        )
        assert svc.catalog.try_lock("c1", "old", ENDED) is None

        taken = take_lock(svc, BackupRequest(cluster="c1", execution_id="arn:new"), "new")

        assert taken == "new"
        assert svc.catalog.lock_holder("c1").holder == "new"
        old = svc.catalog.get("c1", "old")
        assert (old.status, old.error) == ("FAILED", TAKEN_OVER["Error"])
        assert "Contents" not in s3.list_objects_v2(Bucket="store", Prefix="backups/c1/old/")
        uploads = s3.list_multipart_uploads(Bucket="store").get("Uploads", [])
        assert upload["UploadId"] not in [u["UploadId"] for u in uploads]
        # Cleaning up twice changes nothing and does not fail.
        assert clean_up_abandoned("c1", "old", TAKEN_OVER, svc, 0.0)["status"] == "FAILED"
