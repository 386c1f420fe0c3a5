"""Storage: the *staging bucket*, which holds backup data under ``backups/`` and the state
machines' *work objects* (plans, listings, per-object results) under ``_work/``; and the
*vault*, where verified backups are promoted: versioned, under Object Lock, deletes denied to
everyone but the retention function, TLS only, unreachable for agents.

A staging object is tagged ``shardvault:promoted=true`` once its backup's vault manifest is
written; a lifecycle rule expires tagged objects, so a backup that was never promoted (a
cluster without a vault) is never expired by lifecycle."""

from __future__ import annotations

from aws_cdk import Duration, RemovalPolicy
from aws_cdk import aws_iam as iam
from aws_cdk import aws_s3 as s3
from cdk_nag import NagSuppressions
from constructs import Construct

from infra.constants import BACKUPS_PREFIX, NODE_ID_TAG, PROMOTED_TAG, WORK_PREFIX


class Storage(Construct):
    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        work_expiry_days: int = 30,
        promoted_expiry_days: int = 1,
    ) -> None:
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
                # The staging copy of a promoted backup: the vault holds it now.
                s3.LifecycleRule(
                    id="ExpirePromotedBackups",
                    prefix=BACKUPS_PREFIX,
                    tag_filters={PROMOTED_TAG: "true"},
                    expiration=Duration.days(promoted_expiry_days),
                ),
            ],
        )
        self.vault = self._vault()
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

    def _vault(self) -> s3.Bucket:
        vault = s3.Bucket(
            self,
            "Vault",
            block_public_access=s3.BlockPublicAccess.BLOCK_ALL,
            encryption=s3.BucketEncryption.S3_MANAGED,
            enforce_ssl=True,
            minimum_tls_version=1.2,
            versioned=True,  # Object Lock requires it
            object_lock_enabled=True,  # each object carries its own mode and retain-until
            object_ownership=s3.ObjectOwnership.BUCKET_OWNER_ENFORCED,
            removal_policy=RemovalPolicy.RETAIN,
        )
        # Agents never touch the vault, whatever else a role of theirs is given.
        vault.add_to_resource_policy(
            iam.PolicyStatement(
                sid="DenyAgents",
                effect=iam.Effect.DENY,
                principals=[iam.AnyPrincipal()],
                actions=["s3:*"],
                resources=[vault.bucket_arn, vault.arn_for_objects("*")],
                conditions={"Null": {f"aws:PrincipalTag/{NODE_ID_TAG}": "false"}},
            )
        )
        NagSuppressions.add_resource_suppressions(
            vault,
            [
                {
                    "id": "AwsSolutions-S1",
                    "reason": "Objects reach the vault only by this stack's promotion function "
                    "and leave only by its retention function; CloudTrail S3 data events are "
                    "the audit trail, not a second, unbounded log bucket.",
                }
            ],
        )
        return vault

    def deny_vault_deletes_except(self, *roles: iam.IRole) -> None:
        """Only ``roles`` (the retention function's) may delete from the vault, and Object
        Lock still refuses them anything locked."""
        self.vault.add_to_resource_policy(
            iam.PolicyStatement(
                sid="DenyDeletes",
                effect=iam.Effect.DENY,
                principals=[iam.AnyPrincipal()],
                actions=[
                    "s3:DeleteObject",
                    "s3:DeleteObjectVersion",
                    "s3:PutLifecycleConfiguration",
                ],
                resources=[self.vault.bucket_arn, self.vault.arn_for_objects("*")],
                conditions={"ArnNotEquals": {"aws:PrincipalArn": [r.role_arn for r in roles]}},
            )
        )
