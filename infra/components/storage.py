"""Storage: the *staging bucket*, which holds backup data under ``backups/`` and the state
machine's *work objects* (plans, listings, per-object results) under ``_work/``."""

from __future__ import annotations

from aws_cdk import Duration, RemovalPolicy
from aws_cdk import aws_s3 as s3
from cdk_nag import NagSuppressions
from constructs import Construct

from infra.constants import WORK_PREFIX


class Storage(Construct):
    def __init__(self, scope: Construct, construct_id: str, *, work_expiry_days: int = 30) -> None:
        super().__init__(scope, construct_id)
        self.bucket = s3.Bucket(
            self,
            "Staging",
            block_public_access=s3.BlockPublicAccess.BLOCK_ALL,
            # SSE-S3, not SSE-KMS: agents upload tens of thousands of parts through presigned
            # URLs, and SSE-KMS would add a KMS request (and a key grant) to every one.
            encryption=s3.BucketEncryption.S3_MANAGED,
            enforce_ssl=True,
            minimum_tls_version=1.2,
            versioned=False,
            object_ownership=s3.ObjectOwnership.BUCKET_OWNER_ENFORCED,
            removal_policy=RemovalPolicy.RETAIN,
            lifecycle_rules=[
                # No filter (so no tag filter, which AbortIncompleteMultipartUpload forbids):
                # parts of an upload that neither completed nor was aborted stop billing.
                s3.LifecycleRule(
                    id="AbortIncompleteUploads",
                    abort_incomplete_multipart_upload_after=Duration.days(2),
                ),
                # Work objects matter only while their backup runs (and for a post-mortem).
                s3.LifecycleRule(
                    id="ExpireWorkObjects",
                    prefix=WORK_PREFIX,
                    expiration=Duration.days(work_expiry_days),
                ),
            ],
        )
        NagSuppressions.add_resource_suppressions(
            self.bucket,
            [
                {
                    "id": "AwsSolutions-S1",
                    "reason": "Server access logs are optional for the staging bucket: every "
                    "write comes from this stack's roles or from URLs they presigned, and the "
                    "catalog records each backup. Enable CloudTrail S3 data events for an "
                    "audit trail instead of a second, unbounded log bucket.",
                }
            ],
        )
