"""The ShardVault stack: composes the constructs and grants each function what it calls.

The *grants* below follow the code of ``shardvault/{backup,promote,restore,expire}.py`` call
by call; ``backups/`` keys are backup data (in the staging store and in the vault), ``_work/``
keys are work objects (plans, layouts and results). The *policy file* (CDK context ``policy``,
default ``examples/shardvault.yaml``) is validated at synth, handed to the functions and made
into schedules.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from aws_cdk import CfnOutput, Fn, Stack
from aws_cdk import aws_events as events
from aws_cdk import aws_events_targets as targets
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from aws_cdk import aws_s3 as s3
from cdk_nag import NagSuppressions
from constructs import Construct

from infra import policies
from infra.components.agent_access import AgentAccess
from infra.components.functions import BackupFunctions
from infra.components.monitoring import Monitoring
from infra.components.notifications import Notifications
from infra.components.operator_access import OperatorAccess
from infra.components.schedules import Schedules
from infra.components.storage import Storage
from infra.components.tables import NODES_BY_CLUSTER, Tables
from infra.components.workflow import Workflow
from infra.constants import (
    BACKUP_ASL,
    BACKUPS_PREFIX,
    CUT_ASL,
    DEFAULT_POLICY,
    DRILL_ASL,
    POWERTOOLS_METRICS_NAMESPACE,
    POWERTOOLS_SERVICE_NAME,
    PROBE_ASL,
    RESTORE_ASL,
    RESTORE_MACHINE_PLACEHOLDER,
    RETENTION_ASL,
    VERIFY_ASL,
    WORK_PREFIX,
    state_machine_name,
)
from infra.policies import POST, TABLE_READ
from shardvault.assurance.probe import PROBES_DIR
from shardvault.assurance.watch import NAMESPACE as WATCH_NAMESPACE
from shardvault.aws.services import ANSWERS_DIR
from shardvault.aws.vault_account import (
    COPY_READERS,
    COPY_WRITERS,
    KEY_UNWRAPPERS,
    KEY_WRAPPERS,
)
from shardvault.config.policy import Policy, load_policy
from shardvault.config.targets import AwsTarget
from shardvault.contracts.layout import ARCHIVE_DIR, STAGED_DIR
from shardvault.contracts.models import DOORBELL_PREFIX
from shardvault.lifecycle.copies import COPIES_DIR

# Lambda allows 4 KB of environment in all; the policy travels in it, beside the rest.
MAX_POLICY_CHARS = 2800


# GetObjectAttributes on a versioned bucket (the vault): both, instead of s3:GetObject and
# s3:GetObjectAttributes (the S3 API reference, GetObjectAttributes, "Permissions").
VERSIONED_ATTRIBUTES = ("s3:GetObjectVersion", "s3:GetObjectVersionAttributes")


class ShardVaultStack(Stack):
    def machine(self, workflow: str) -> str:
        """The name of this stack's state machine of ``workflow``."""
        return state_machine_name(self.stack_name, workflow)

    def __init__(self, scope: Construct, construct_id: str, **kwargs: Any) -> None:
        super().__init__(scope, construct_id, **kwargs)
        self.policy = deployed_policy(self)
        self.storage = Storage(self, "Storage")
        self.tables = Tables(self, "Tables")
        self.notifications = Notifications(self, "Notifications", alert_emails(self))
        # Wraps the data keys of clusters whose policy says encryption: kms
        # (shardvault/aws/keys.py).
        self.data_key = kms.Key(
            self,
            "DataKey",
            alias="shardvault-data",
            description="ShardVault: wraps the data keys that seal backup frames.",
            enable_key_rotation=True,
        )
        self.functions = BackupFunctions(self, "Functions", environment=self._environment())
        self._grant_functions()
        self._grant_vault_functions()
        self._grant_restore_functions()
        self._grant_copy_accounts()
        self.workflows = {
            name: Workflow(
                self,
                name.title(),
                functions=self.functions.functions,
                work_bucket=self.storage.bucket,
                alarm_topic=self.notifications.topic,
                definition=definition,
                name=machine,
            )
            for name, definition, machine in (
                ("backup", BACKUP_ASL, self.machine("backup")),
                ("restore", RESTORE_ASL, self.machine("restore")),
                ("retention", RETENTION_ASL, self.machine("retention")),
                ("verify", VERIFY_ASL, self.machine("verify")),
                ("probe", PROBE_ASL, self.machine("probe")),
                ("cut", CUT_ASL, self.machine("cut")),
            )
        }
        self.workflows["drill"] = Workflow(
            self,
            "Drill",
            functions=self.functions.functions,
            work_bucket=self.storage.bucket,
            alarm_topic=self.notifications.topic,
            definition=DRILL_ASL,
            name=self.machine("drill"),
            nested={
                RESTORE_MACHINE_PLACEHOLDER: (
                    self.machine("restore"),
                    self.workflows["restore"].state_machine,
                )
            },
        )
        self.workflow = self.workflows["backup"]
        self._reap_ended_executions()
        self.schedules = Schedules(
            self,
            "Schedules",
            policy=self.policy,
            backup=self.workflows["backup"].state_machine,
            retention=self.workflows["retention"].state_machine,
            drill=self.workflows["drill"].state_machine,
            cut=self.workflows["cut"].state_machine,
            alarms_to=self.notifications.topic,
        )
        self.monitoring = Monitoring(
            self,
            "Monitoring",
            policy=self.policy,
            functions=self.functions.functions,
            log_groups=self.functions.log_groups,
            machines={n: w.state_machine for n, w in self.workflows.items()},
            topic=self.notifications.topic,
        )
        self.agents = AgentAccess(
            self,
            "Agents",
            inbox=self.tables.inbox,
            nodes=self.tables.nodes,
            catalog=self.tables.catalog,
            node_clusters=agent_nodes(self, self.policy),
            data_key=self.data_key,
            archive_function=self.functions.functions["archive_wal"],
        )
        self.operators = OperatorAccess(
            self,
            "Operators",
            catalog=self.tables.catalog,
            nodes=self.tables.nodes,
            nodes_index=NODES_BY_CLUSTER,
            machine_names=[self.machine(w) for w in self.workflows],
        )
        self._outputs()

    def _environment(self) -> dict[str, str]:
        """The functions' settings (``shardvault/config/settings.py``) as environment variables."""
        bucket = self.storage.bucket.bucket_name
        return {
            "CATALOG_TABLE": self.tables.catalog.table_name,
            "NODES_TABLE": self.tables.nodes.table_name,
            "INBOX_TABLE": self.tables.inbox.table_name,
            "WORK_BUCKET": bucket,
            "WORK_PREFIX": WORK_PREFIX,
            "STORE_URL": f"s3://{bucket}/{BACKUPS_PREFIX.rstrip('/')}",
            "TOPIC_ARN": self.notifications.topic.topic_arn,
            "VAULT_URL": f"s3://{self.storage.vault.bucket_name}/{BACKUPS_PREFIX.rstrip('/')}",
            "POLICY": policy_text(self.policy),
            "DATA_KEY_ID": self.data_key.key_arn,
            "POWERTOOLS_SERVICE_NAME": POWERTOOLS_SERVICE_NAME,
            "POWERTOOLS_METRICS_NAMESPACE": POWERTOOLS_METRICS_NAMESPACE,
            # No handler returns a presigned URL or a key today (they go to the work bucket);
            # traces keep no responses at all, so none ever can, whatever a handler returns.
            "POWERTOOLS_TRACER_CAPTURE_RESPONSE": "false",
        }

    def _grant_functions(self) -> None:
        bucket, tables, grant = self.storage.bucket, self.tables, self.functions.grant
        grant(
            "validate_backup",
            # The cluster's backups (Query), the lock taken or taken over (a conditional
            # PutItem, read back: GetItem), the backup's record (PutItem) and a refused
            # scheduled run's; no Scan (shardvault/backup/admission.py). Cleanup's below.
            policies.table(
                tables.catalog, ("dynamodb:Query", "dynamodb:GetItem", "dynamodb:PutItem")
            ),
            policies.table(tables.nodes, TABLE_READ, indexes=(NODES_BY_CLUSTER,)),
            # To tell a stale cluster lock (its execution ended) from a live one.
            iam.PolicyStatement(
                actions=["states:DescribeExecution"],
                resources=policies.execution_arns(self, self.machine("backup"))[:1],
            ),
            # A wrapped data key per encrypted backup (never the plaintext: WithoutPlaintext),
            # always bound to a cluster's encryption context.
            data_key_statement(
                self.data_key,
                "kms:GenerateDataKeyWithoutPlaintext",
                {"StringLike": {CLUSTER_KEY: "*"}},
            ),
        )
        grant(
            "dispatch",
            policies.table(tables.nodes, ("dynamodb:GetItem",)),  # the node's record, by key
            policies.table(tables.inbox, POST),
            # Rings a node's doorbell after each post (shardvault/workflow/dispatch.py: ring).
            policies.queues(self, f"{DOORBELL_PREFIX}*", "sqs:GetQueueUrl", "sqs:SendMessage"),
        )
        grant(
            "plan_backup",
            # The parent's record; the plan's sizes and schedule kept on the backup's
            # (shardvault/backup/planner.py).
            policies.table(tables.catalog, ("dynamodb:GetItem", "dynamodb:UpdateItem")),
            policies.objects(bucket, WORK_PREFIX, "s3:PutObject", "s3:GetObject"),
            # Signs the PutObject URL of each object packed as it was listed that fits one
            # part (shardvault/backup/upload.py: sign_at_plan): S3 authorizes that PUT as this
            # role. The URL goes to the work bucket, like Sign's.
            policies.objects(bucket, BACKUPS_PREFIX, "s3:PutObject"),
        )
        # An incremental's parent: its record and manifest, and a presigned GET of each of its
        # block maps (the URL is authorized as this role: reading backups, nothing else),
        # written to _work/ for the dispatcher.
        grant(
            "prepare_scan",
            # The parent's and the chain root's records; the part size it chose, kept on the
            # backup's record (shardvault/backup/scanning.py).
            policies.table(tables.catalog, ("dynamodb:GetItem", "dynamodb:UpdateItem")),
            policies.objects(bucket, BACKUPS_PREFIX, "s3:GetObject"),
            # A promoted parent's: the versions its vault manifest names (see read_backups).
            policies.objects(
                self.storage.vault, BACKUPS_PREFIX, "s3:GetObject", "s3:GetObjectVersion"
            ),
            policies.objects(bucket, WORK_PREFIX, "s3:PutObject"),
        )
        # The role that signs the part URLs is the one S3 authorizes each part upload against.
        grant(
            "sign_parts",
            policies.objects(
                bucket,
                BACKUPS_PREFIX,
                "s3:PutObject",  # CreateMultipartUpload and the presigned UploadPart
                "s3:ListMultipartUploadParts",  # re-signing skips parts already uploaded
                # (no AbortMultipartUpload: an upload is aborted by cleanup and the sweep)
            ),
            # The URLs go to the work bucket for the dispatcher, never into execution history.
            policies.objects(bucket, WORK_PREFIX, "s3:PutObject"),
        )
        grant(
            "check_uploads",  # after the data phase's Upload map (the tail's: Finalize)
            # The plan and results; the results of the objects signed at plan, which it
            # verifies (shardvault/backup/upload.py: verified_results).
            policies.objects(bucket, WORK_PREFIX, "s3:GetObject", "s3:PutObject"),
            policies.list_prefix(bucket, WORK_PREFIX),
            *self._verify_statements(bucket),
            policies.table(tables.inbox, ("dynamodb:Query",)),  # the agents' failure notes
        )
        grant(
            "watch_clusters",  # shardvault/assurance/watch.py
            policies.table(tables.catalog, ("dynamodb:Query",)),  # each cluster's backups
            policies.table(tables.nodes, ("dynamodb:Scan",)),  # every registered agent
            iam.PolicyStatement(
                actions=["cloudwatch:PutMetricData"],
                resources=["*"],  # PutMetricData names no resource: the namespace binds it
                conditions={"StringEquals": {"cloudwatch:namespace": WATCH_NAMESPACE}},
            ),
        )
        grant(
            "synthesize_full",  # shardvault/backup/synthesis.py
            # What earlier calls verified, and the base Finalize reads; a first call finds no
            # progress, a 404 only with ListBucket (Services.find_work).
            policies.objects(bucket, WORK_PREFIX, "s3:GetObject", "s3:PutObject"),
            policies.list_prefix(bucket, WORK_PREFIX),
            # The chain's records; the copies' progress on the backup's.
            policies.table(tables.catalog, ("dynamodb:GetItem", "dynamodb:UpdateItem")),
            policies.objects(
                bucket,
                BACKUPS_PREFIX,
                # The chain's manifests and objects (CopyObject's source), and a read-back
                # where the store cannot report a copy's checksum.
                "s3:GetObject",
                "s3:PutObject",  # CopyObject's target
                "s3:GetObjectAttributes",  # each copy verified by its checksum
            ),
            # A chain's object gone from the store is then 404 (named), not 403.
            policies.list_prefix(bucket, BACKUPS_PREFIX),
        )
        self._grant_complete_upload(bucket)
        self._grant_finalize_and_cleanup(bucket)
        self._suppress_narrow_wildcards()

    def _grant_complete_upload(self, bucket: s3.IBucket) -> None:
        self.functions.grant(
            "complete_upload",
            policies.objects(
                bucket,
                BACKUPS_PREFIX,
                "s3:PutObject",  # CompleteMultipartUpload
                "s3:ListMultipartUploadParts",
            ),
            *self._verify_statements(bucket),
            policies.objects(bucket, WORK_PREFIX, "s3:PutObject"),  # the object's result
        )

    def _verify_statements(self, bucket: s3.IBucket) -> list[iam.PolicyStatement]:
        """What verifying a stored object and recording its progress calls
        (shardvault/backup/upload.py: verify_object, record_result)."""
        return [
            policies.objects(
                bucket,
                BACKUPS_PREFIX,
                "s3:GetObject",  # read-back verification
                "s3:GetObjectAttributes",  # verification by checksum, without a download
                # (no s3:GetObjectVersion: the staging bucket keeps no versions)
            ),
            policies.table(self.tables.catalog, ("dynamodb:UpdateItem",)),  # progress
        ]

    def _publish(self) -> list[iam.PolicyStatement]:
        """Publishing to the notifications topic: SNS encrypts each message with the topic's
        KMS key as the publisher, so a publisher needs both (or its message is refused)."""
        return [
            iam.PolicyStatement(
                actions=["sns:Publish"], resources=[self.notifications.topic.topic_arn]
            ),
            iam.PolicyStatement(
                actions=["kms:Decrypt", "kms:GenerateDataKey*"],
                resources=[self.notifications.key.key_arn],
            ),
        ]

    def _grant_finalize_and_cleanup(self, bucket: s3.IBucket) -> None:
        publish = self._publish()
        self.functions.grant(
            "finalize_backup",
            # The plan, listings and results; the results of the tail's objects signed at
            # plan, which it verifies first (shardvault/backup/upload.py: verified_results).
            policies.objects(bucket, WORK_PREFIX, "s3:GetObject", "s3:PutObject"),
            policies.list_prefix(bucket, WORK_PREFIX),
            *self._verify_statements(bucket),
            policies.table(self.tables.inbox, ("dynamodb:Query",)),  # the agents' failure notes
            # The manifest, and an archived tail's batch copies (shardvault/backup/archived.py:
            # the archive's batches read by CopyObject, found by listing the shard's archive).
            policies.objects(bucket, BACKUPS_PREFIX, "s3:PutObject"),
            policies.list_prefix(bucket, f"{BACKUPS_PREFIX}*/{ARCHIVE_DIR}/"),
            # The backup marked complete (UpdateItem, above) and the cluster's lock let go
            # (a conditional DeleteItem: shardvault/backup/manifest.py).
            policies.table(self.tables.catalog, ("dynamodb:DeleteItem",)),
            *publish,
        )
        # cleanup() (shardvault/backup/failure.py) runs in the failure path, in the reaper, and in
        # validation when it takes over the lock of a backup whose execution ended.
        for module in ("cleanup_backup", "reap_execution", "validate_backup"):
            self.functions.grant(module, *self._cleanup_statements(bucket), *publish)
        # The reaper finds the ended execution's backup or restore among the cluster's
        # (Query) and reads the backup's record (GetItem: clean_up_abandoned).
        self.functions.grant(
            "reap_execution",
            policies.table(self.tables.catalog, ("dynamodb:Query", "dynamodb:GetItem")),
        )

    def _cleanup_statements(self, bucket: s3.IBucket) -> list[iam.PolicyStatement]:
        """What a backup's cleanup calls: abort its uploads, delete its partial objects, post
        token-less releases, read the agents' failure notes and records (the cause)."""
        return [
            iam.PolicyStatement(
                actions=["s3:ListBucketMultipartUploads"], resources=[bucket.bucket_arn]
            ),
            policies.objects(bucket, BACKUPS_PREFIX, "s3:AbortMultipartUpload", "s3:DeleteObject"),
            policies.list_prefix(bucket, BACKUPS_PREFIX),
            policies.table(self.tables.inbox, ("dynamodb:Query", *POST)),
            policies.table(self.tables.nodes, ("dynamodb:GetItem",)),
            # The backup marked failed, the cluster's lock let go (a conditional DeleteItem).
            policies.table(self.tables.catalog, ("dynamodb:UpdateItem", "dynamodb:DeleteItem")),
            # Rings the doorbell of each node a release or abort was posted to.
            policies.queues(self, f"{DOORBELL_PREFIX}*", "sqs:GetQueueUrl", "sqs:SendMessage"),
        ]

    def _grant_vault_functions(self) -> None:
        bucket, vault, grant = self.storage.bucket, self.storage.vault, self.functions.grant
        publish = self._publish()
        # validate_backup reads the policy only; the promotion itself:
        grant(
            "promote_backup",
            # Read and tag the staging copy, then delete it once the vault holds the backup.
            policies.objects(
                bucket, BACKUPS_PREFIX, "s3:GetObject", "s3:PutObjectTagging", "s3:DeleteObject"
            ),
            policies.objects(
                vault,
                BACKUPS_PREFIX,
                "s3:PutObject",  # CopyObject / UploadPartCopy and the manifest
                # Object Lock headers on the copy; extending an incremental's ancestors' locks
                "s3:PutObjectRetention",
                "s3:GetObject",  # HeadObject (resuming)
                # GetObjectAttributes of a copy: on a versioned bucket (the vault) S3 asks for
                # the version actions, not s3:GetObject and s3:GetObjectAttributes.
                *VERSIONED_ATTRIBUTES,
                # Without it HeadObject omits the lock: promotion reads each copy's lock back.
                "s3:GetObjectRetention",
                "s3:AbortMultipartUpload",
            ),
            # Whether the vault holds a copy already: a missing key is then 404, not 403.
            policies.list_prefix(vault, BACKUPS_PREFIX),
            # The backup's and its ancestors' records read, the promotion recorded
            # (shardvault/lifecycle/promote.py: catalog.get and catalog.update); a weekly copy
            # target's earlier copies (shardvault/lifecycle/copies.py: catalog.backups).
            policies.table(
                self.tables.catalog, ("dynamodb:GetItem", "dynamodb:UpdateItem", "dynamodb:Query")
            ),
            # A copy target's progress between budgeted calls (copies.load_progress: a first
            # call finds none, a 404 only with ListBucket).
            iam.PolicyStatement(
                actions=["s3:GetObject", "s3:PutObject"],
                resources=[bucket.arn_for_objects(f"{WORK_PREFIX}*/{COPIES_DIR}/*")],
            ),
            policies.list_prefix(bucket, WORK_PREFIX),
            *publish,  # a copy target's failure (copies.failed)
        )
        grant(
            # promote.record_failure: whether the stack vault holds it, then one update
            "record_promotion_failure",
            policies.table(self.tables.catalog, ("dynamodb:GetItem", "dynamodb:UpdateItem")),
            *publish,
        )
        grant(
            # shardvault/lifecycle/expire.py: each cluster's backups, holds recorded
            "decide_retention",
            policies.table(self.tables.catalog, ("dynamodb:Query", "dynamodb:UpdateItem")),
            *publish,  # the budget alert
        )
        # expire.expire_backup lists every version (ListObjectVersions) and deletes each by
        # key and version id: DeleteObjectVersion in the versioned vault, DeleteObject in the
        # unversioned staging bucket (whose versions are all "null": deleted by key alone).
        deleting = []
        for store, delete in ((bucket, "s3:DeleteObject"), (vault, "s3:DeleteObjectVersion")):
            deleting += [
                iam.PolicyStatement(
                    actions=["s3:ListBucketVersions"],
                    resources=[store.bucket_arn],
                    conditions={"StringLike": {"s3:prefix": [f"{BACKUPS_PREFIX}*"]}},
                ),
                policies.objects(store, BACKUPS_PREFIX, delete),
            ]
        grant(
            "expire_backup",
            *deleting,
            policies.table(self.tables.catalog, ("dynamodb:UpdateItem",)),  # EXPIRING, EXPIRED
        )
        grant(
            # shardvault/lifecycle/sweep.py: the staging bucket only, never the vault
            "sweep_store",
            iam.PolicyStatement(
                actions=["s3:ListBucketMultipartUploads"], resources=[bucket.bucket_arn]
            ),
            policies.list_prefix(bucket, BACKUPS_PREFIX),
            policies.objects(bucket, BACKUPS_PREFIX, "s3:AbortMultipartUpload", "s3:DeleteObject"),
            policies.table(self.tables.catalog, ("dynamodb:Query",)),  # which backups run
            # The items of scheduled cuts the kept archive no longer reaches (IAM cannot narrow
            # a DeleteItem to keys beginning cut#: the code deletes nothing else).
            policies.table(self.tables.catalog, ("dynamodb:DeleteItem",)),
        )
        grant(
            "verify_backup",  # shardvault/assurance/verify.py: reads only, and records the outcome
            policies.table(self.tables.catalog, ("dynamodb:Query", "dynamodb:GetItem")),
            policies.table(self.tables.catalog, ("dynamodb:UpdateItem",)),
            policies.objects(bucket, BACKUPS_PREFIX, "s3:GetObject", "s3:GetObjectAttributes"),
            policies.objects(vault, BACKUPS_PREFIX, "s3:GetObject", *VERSIONED_ATTRIBUTES),
            # A missing object is then NoSuchKey, not AccessDenied: verify names it missing.
            *[policies.list_prefix(store, BACKUPS_PREFIX) for store in (bucket, vault)],
        )
        grant(
            # shardvault/assurance/probe.py: signs each agent's probe, then deletes it
            "probe_store",
            policies.table(self.tables.nodes, ("dynamodb:Query",), indexes=(NODES_BY_CLUSTER,)),
            policies.table(self.tables.inbox, ("dynamodb:Query",)),  # the agents' failure notes
            policies.objects(
                bucket,
                f"{WORK_PREFIX}{PROBES_DIR}/",
                "s3:PutObject",
                "s3:GetObject",
                "s3:DeleteObject",
            ),
            # The leftovers of a probe that died: found by listing, deleted by the next probe.
            policies.list_prefix(bucket, f"{WORK_PREFIX}{PROBES_DIR}/"),
            policies.objects(bucket, WORK_PREFIX, "s3:PutObject"),  # the URLs, for the dispatcher
        )
        grant(
            # shardvault/backup/cuts.py: picks the leaders, records the cut (one item, once)
            "cut_cluster",
            policies.table(self.tables.nodes, ("dynamodb:Query",), indexes=(NODES_BY_CLUSTER,)),
            policies.table(self.tables.catalog, ("dynamodb:PutItem",)),
            policies.table(self.tables.inbox, ("dynamodb:Query",)),  # the agents' failure notes
        )
        wal = f"{BACKUPS_PREFIX}*/{ARCHIVE_DIR}/"  # every cluster's WAL archive, nothing else
        grant(
            "archive_wal",  # shardvault/wal/archive.py: signs and records the agents' WAL batches
            policies.table(self.tables.nodes, ("dynamodb:GetItem",)),  # the caller's claim
            policies.table(self.tables.inbox, ("dynamodb:GetItem",)),  # its request item
            policies.table(self.tables.catalog, ("dynamodb:UpdateItem",)),  # #archive counters
            # The presigned PUT is authorized as this role: WAL batches, nowhere else; then
            # each batch's stored checksum, and its index beside it.
            policies.objects(bucket, wal, "s3:PutObject", "s3:GetObject", "s3:GetObjectAttributes"),
            policies.list_prefix(bucket, BACKUPS_PREFIX),  # a missing batch is NoSuchKey
            data_key_statement(
                self.data_key,
                "kms:GenerateDataKeyWithoutPlaintext",
                {"StringLike": {CLUSTER_KEY: "*"}},
            ),
        )
        expire_role = self.functions.functions["expire_backup"].role
        assert expire_role is not None
        self.storage.deny_vault_deletes_except(expire_role)

    def _reap_ended_executions(self) -> None:
        """An aborted or timed-out execution skips its failure path: this rule hands it to
        reap_execution, which runs the same cleanup (a backup: releases the checkpoints and
        aborts the uploads; a restore: the target nodes undo what it placed)."""
        machines = [self.workflows[name].state_machine for name in ("backup", "restore")]
        rule = events.Rule(
            self,
            "ReapEndedExecutions",
            description="Backup and restore executions that were aborted or timed out: clean "
            "up after them.",
            event_pattern=events.EventPattern(
                source=["aws.states"],
                detail_type=["Step Functions Execution Status Change"],
                detail={
                    "status": ["ABORTED", "TIMED_OUT"],
                    "stateMachineArn": [m.state_machine_arn for m in machines],
                },
            ),
        )
        rule.add_target(
            targets.LambdaFunction(self.functions.functions["reap_execution"], retry_attempts=4)
        )

    def _grant_restore_functions(self) -> None:
        """Restores read backups from the store or the vault; a presigned GET carries the
        signer's permissions, so sign_download's read-only grant is what scopes agents."""
        bucket, vault, tables, grant = (
            self.storage.bucket,
            self.storage.vault,
            self.tables,
            self.functions.grant,
        )
        # A backup is read from the vault once promoted (the record's location), else the store.
        # In the vault, the version promotion locked (its manifest records each): a read that
        # names a version is authorized as s3:GetObjectVersion, a presigned one too.
        read_backups = [
            policies.objects(bucket, BACKUPS_PREFIX, "s3:GetObject"),
            policies.objects(vault, BACKUPS_PREFIX, "s3:GetObject", "s3:GetObjectVersion"),
        ]
        update_catalog = policies.table(tables.catalog, ("dynamodb:UpdateItem",))
        staged = f"{BACKUPS_PREFIX}{STAGED_DIR}/"  # a copy target's objects, for the agents
        grant(
            "validate_restore",
            # Reads only: the source cluster's records (Catalog.backups: a Query; the backup's
            # own: a GetItem), the target's agents (NodeRegistry.in_cluster: a Query on the
            # index), the manifest and, for a point in time, the WAL archive's listing.
            policies.table(tables.catalog, ("dynamodb:Query", "dynamodb:GetItem")),
            policies.list_prefix(bucket, f"{BACKUPS_PREFIX}*/{ARCHIVE_DIR}/"),
            policies.index(tables.nodes, NODES_BY_CLUSTER, "dynamodb:Query"),
            *read_backups,
        )
        grant(
            "plan_restore",
            # A restore into another cluster: each data key wrapped again for the target's
            # context, which its agents may unwrap (shardvault/aws/keys.py: Rewrapper); the
            # plaintext stays in KMS.
            *[
                data_key_statement(self.data_key, action, {"StringLike": {CLUSTER_KEY: "*"}})
                for action in ("kms:ReEncryptFrom", "kms:ReEncryptTo")
            ],
            *read_backups,  # the manifest
            policies.list_prefix(bucket, f"{BACKUPS_PREFIX}*/{ARCHIVE_DIR}/"),  # WAL batches
            policies.objects(bucket, WORK_PREFIX, "s3:PutObject"),  # download items, layouts
            policies.table(tables.catalog, ("dynamodb:PutItem",)),  # the restore#<id> record
        )
        grant(
            "thaw_objects",
            *read_backups,  # the manifest, and HeadObject (authorized by s3:GetObject)
            # Only the vault's copies are ever in an archive class (the staging bucket has no
            # lifecycle transition: thaw finds its objects readable and asks nothing).
            policies.objects(vault, BACKUPS_PREFIX, "s3:RestoreObject"),
            update_catalog,  # how many objects are still frozen
            # A restore from a copy target: its objects staged into the store for the agents
            # (shardvault/restore/thaw.py: stage), each checked by the store's CRC64NVME, a
            # damaged one deleted; a managed upload aborts its multipart upload on failure.
            policies.objects(
                bucket,
                staged,
                "s3:PutObject",
                "s3:GetObjectAttributes",
                "s3:DeleteObject",
                "s3:AbortMultipartUpload",
            ),
            policies.list_prefix(bucket, staged),  # a copy not yet staged: 404, not 403
        )
        # The URL it signs is authorized as this role and bound to one GetObject: reading that
        # backup object is all an agent can do with it. The URL itself goes to the work bucket
        # for the dispatcher (never into execution history). It reads there the items a node
        # prefetches as it prepares (plan_restore wrote them).
        grant(
            "sign_download",
            *read_backups,
            policies.objects(bucket, WORK_PREFIX, "s3:GetObject", "s3:PutObject"),
        )
        for module in ("record_download", "finalize_restore", "cleanup_restore"):
            grant(module, update_catalog)
        for module in ("finalize_restore", "cleanup_restore"):  # failure.remove_staged
            grant(
                module,
                policies.list_prefix(bucket, staged),
                policies.objects(bucket, staged, "s3:DeleteObject"),
            )
        # The restore's record as the downloads left it (its objects, as planned).
        grant("finalize_restore", policies.table(tables.catalog, ("dynamodb:GetItem",)))
        publish = self._publish()
        grant("finalize_restore", *publish)
        grant("cleanup_restore", *publish, policies.table(tables.inbox, ("dynamodb:Query",)))
        self._grant_drill_functions(publish)
        # The dispatcher inlines from the work bucket (args_key) a node's restore layout and the
        # presigned URLs of a transfer; arguments too large for an inbox item it hands over as
        # a presigned GET URL of their work object, authorized by this same read.
        # It also signs, per listing command, a PUT of the node's answer: under answers/ only,
        # so that URL cannot replace a plan, a layout or another work object.
        grant(
            "dispatch",
            policies.objects(bucket, WORK_PREFIX, "s3:GetObject"),
            iam.PolicyStatement(
                actions=["s3:PutObject"],
                resources=[bucket.arn_for_objects(f"{WORK_PREFIX}*/{ANSWERS_DIR}/*")],
            ),
        )

    def _grant_drill_functions(self, publish: list[iam.PolicyStatement]) -> None:
        """Drills read the catalog (backups, restores, earlier drills) and write their own
        record; start_drill reads the policy from its environment and tells a running drill
        from one whose execution ended (its copy is stale)."""
        tables, grant = self.tables, self.functions.grant
        read = policies.table(tables.catalog, ("dynamodb:Query",))
        grant(
            "start_drill",
            read,
            # The drill's record, and its target's lock (a conditional put; read back when taken).
            policies.table(tables.catalog, ("dynamodb:PutItem", "dynamodb:GetItem")),
            *publish,  # a scheduled drill's refusal
            # Whether an earlier drill still runs: its execution, or its nested restore.
            iam.PolicyStatement(
                actions=["states:DescribeExecution"],
                resources=[
                    policies.execution_arns(self, name)[0]
                    for name in (self.machine("drill"), self.machine("restore"))
                ],
            ),
        )
        grant(
            "record_drill", read, policies.table(tables.catalog, ("dynamodb:UpdateItem",)), *publish
        )
        # Marks the copies that are gone; after the drill's own, releases the target's lock.
        grant(
            "note_teardown",
            policies.table(tables.catalog, ("dynamodb:UpdateItem", "dynamodb:DeleteItem")),
        )

    def _suppress_narrow_wildcards(self) -> None:
        probes = f"{WORK_PREFIX}{PROBES_DIR}/"
        staged = f"{BACKUPS_PREFIX}{STAGED_DIR}/"
        prefixes = "|".join(p.rstrip("/") for p in (BACKUPS_PREFIX, WORK_PREFIX, probes, staged))
        doorbells = f"{DOORBELL_PREFIX}\\*"
        # The dispatcher's answer URLs under a work prefix; the WAL archives under the backups'.
        answers = f"(\\/({ANSWERS_DIR}|{ARCHIVE_DIR}|{COPIES_DIR})\\/\\*)?"
        NagSuppressions.add_resource_suppressions(
            self.functions,
            [
                {
                    "id": "AwsSolutions-IAM5",
                    "reason": "Object keys hold generated cluster and backup ids, so a key "
                    "prefix (backups/ for data, backups/*/_wal/ for WAL archives, _work/ for work "
                    "objects, _work/*/answers/ for the agents' answers, _work/*/copies/ for a copy "
                    "target's progress, _work/probes/ for the store probes, backups/_staged/ "
                    "for a copy target's objects staged for a restore) is the narrowest "
                    "S3 resource; execution names are generated, so executions of the one "
                    "state machine are the narrowest for DescribeExecution; "
                    "kms:GenerateDataKey* is how SNS encrypts with the topic's key, the only "
                    "key granted; doorbell queues are created by the agents, one per node id, "
                    "so their name prefix is the narrowest resource the dispatcher rings.",
                    "appliesTo": [
                        {"regex": f"/^Resource::<.+\\.Arn>\\/({prefixes})\\/\\*{answers}$/"},
                        {"regex": "/^Resource::arn:<AWS::Partition>:states:.+:execution:.+$/"},
                        "Action::kms:GenerateDataKey*",
                        {"regex": f"/^Resource::arn:<AWS::Partition>:sqs:.+:{doorbells}$/"},
                    ],
                }
            ],
            apply_to_children=True,
        )

    def _grant_copy_accounts(self) -> None:
        """Each aws copy target's role in its own account, assumed by every function that
        writes or reads a copy (shardvault/aws/services.py: assumed_s3): exactly the roles
        the deployed policy names; the role's trust policy in that account allows the
        other half (shardvault copy-setup prints it). And each target's recovery key
        (shardvault/aws/keys.py): promotion wraps the data keys under it, from the stack's
        key; a restore's plan unwraps them from it, into the stack's key (ReEncrypt, the
        plaintext staying in KMS); the key's policy in that account allows the other half."""
        targets = [
            copy
            for cluster in self.policy.clusters.values()
            for copy in cluster.vault.copies
            if isinstance(copy, AwsTarget)
        ]
        roles = sorted({copy.role_arn for copy in targets})
        if not roles:
            return
        for module in (*COPY_WRITERS, *COPY_READERS):
            self.functions.grant(
                module, iam.PolicyStatement(actions=["sts:AssumeRole"], resources=roles)
            )
        recovery_keys = sorted({c.recovery_key for c in targets if c.recovery_key})
        if not recovery_keys:
            return
        any_cluster = {"StringLike": {CLUSTER_KEY: "*"}}
        for module in KEY_WRAPPERS:  # from the stack's key to a recovery key
            self.functions.grant(
                module, data_key_statement(self.data_key, "kms:ReEncryptFrom", any_cluster)
            )
            self.functions.grant(
                module,
                iam.PolicyStatement(
                    actions=["kms:ReEncryptTo"], resources=recovery_keys, conditions=any_cluster
                ),
            )
        for module in KEY_UNWRAPPERS:  # from a recovery key to the stack's (plan: has it)
            self.functions.grant(
                module,
                iam.PolicyStatement(
                    actions=["kms:ReEncryptFrom"], resources=recovery_keys, conditions=any_cluster
                ),
            )
        # check's probe: a throwaway data key to wrap, and back into the stack's key
        # (shardvault/assurance/copy_check.py: recovery_round_trip).
        for action in ("kms:GenerateDataKeyWithoutPlaintext", "kms:ReEncryptTo"):
            self.functions.grant(
                "probe_store", data_key_statement(self.data_key, action, any_cluster)
            )

    def _outputs(self) -> None:
        roles = {m: f.role.role_name for m, f in self.functions.functions.items() if f.role}
        role_arns = {m: f.role.role_arn for m, f in self.functions.functions.items() if f.role}
        values = {
            # What a GCS copy target's workload identity provider trusts (docs/guide/
            # vault-copies.md): the functions that write into it, and those that read from it.
            "CopyWriterRoleNames": Fn.join(",", [roles[m] for m in COPY_WRITERS]),
            "CopyReaderRoleNames": Fn.join(",", [roles[m] for m in COPY_READERS]),
            # What an aws copy target's role trusts in its account (shardvault copy-setup).
            "CopyRoleArns": Fn.join(",", [role_arns[m] for m in (*COPY_WRITERS, *COPY_READERS)]),
            "StagingBucketName": self.storage.bucket.bucket_name,
            "CatalogTableName": self.tables.catalog.table_name,
            "NodesTableName": self.tables.nodes.table_name,
            "InboxTableName": self.tables.inbox.table_name,
            "ArchiveFunctionName": self.functions.functions["archive_wal"].function_name,
            "BackupStateMachineArn": self.workflows["backup"].state_machine.state_machine_arn,
            "RestoreStateMachineArn": self.workflows["restore"].state_machine.state_machine_arn,
            "RetentionStateMachineArn": self.workflows["retention"].state_machine.state_machine_arn,
            "VerifyStateMachineArn": self.workflows["verify"].state_machine.state_machine_arn,
            "ProbeStateMachineArn": self.workflows["probe"].state_machine.state_machine_arn,
            "DrillStateMachineArn": self.workflows["drill"].state_machine.state_machine_arn,
            "CutStateMachineArn": self.workflows["cut"].state_machine.state_machine_arn,
            "VaultBucketName": self.storage.vault.bucket_name,
            "ScheduleDeadLetterQueueUrl": self.schedules.dead_letters.queue_url,
            "NotificationsTopicArn": self.notifications.topic.topic_arn,
            "AgentPolicyArn": self.agents.policy.managed_policy_arn,
            "OperatorPolicyArn": self.operators.operator.managed_policy_arn,
            "OperatorReadOnlyPolicyArn": self.operators.read_only.managed_policy_arn,
            **{
                "AgentRoleArn" + re.sub(r"[^A-Za-z0-9]", "", node.title()): role.role_arn
                for node, role in self.agents.roles.items()
            },
            # What an EC2 host of the node is launched with (aws ec2 run-instances
            # --iam-instance-profile Name=...).
            **{
                "AgentInstanceProfile" + re.sub(r"[^A-Za-z0-9]", "", node.title()): profile.ref
                for node, profile in self.agents.profiles.items()
            },
        }
        for name, value in values.items():
            CfnOutput(self, name, value=value)


NODE_ID = re.compile(r"[a-z0-9][a-z0-9._-]{0,62}")  # as the agent's config requires


CLUSTER_KEY = "kms:EncryptionContext:shardvault:cluster"


def data_key_statement(
    key: kms.IKey, action: str, conditions: dict[str, dict[str, str]]
) -> iam.PolicyStatement:
    """One KMS action on the data key, under the given conditions."""
    return iam.PolicyStatement(actions=[action], resources=[key.key_arn], conditions=conditions)


def agent_nodes(scope: Construct, policy: Policy) -> dict[str, str | None]:
    """Node ids from the CDK context ``agentNodes`` (a JSON list or a comma-separated string),
    each optionally with its cluster (``node-1=orders``; without one, the cluster whose
    policy ``nodes`` list it): one agent role and instance profile is made for each, tagged
    with both; a node's agent may unwrap data keys of its own cluster only, so a node without
    one cannot back up or restore an encrypted cluster. A cluster that disagrees with the
    policy's membership fails the synth."""
    value = scope.node.try_get_context("agentNodes") or []
    entries = [n.strip() for n in (value.split(",") if isinstance(value, str) else value)]
    nodes = {}
    for entry in entries:
        node, _, cluster = entry.partition("=")
        if not NODE_ID.fullmatch(node) or (cluster and not NODE_ID.fullmatch(cluster)):
            raise ValueError(
                f"agentNodes: {entry!r} is not a node id, or node=cluster (each 1-63 of a-z, "
                "0-9, '.', '_', '-')."
            )
        member_of = policy.cluster_of(node)
        if cluster and member_of and cluster != member_of:
            raise ValueError(
                f"agentNodes: {entry!r} puts node {node!r} in cluster {cluster!r}, but the "
                f"policy lists it under {member_of!r}; give it one cluster in both."
            )
        nodes[node] = cluster or member_of
    return nodes


EMAIL = re.compile(r"[^@\s,]+@[^@\s,]+\.[^@\s,]+")


def alert_emails(scope: Construct) -> tuple[str, ...]:
    """Addresses from the CDK context ``alertEmail`` (one, or several comma-separated):
    subscribed to the notifications topic, which the alarms and failed backups publish to."""
    value = scope.node.try_get_context("alertEmail") or ""
    emails = tuple(e.strip() for e in str(value).split(",") if e.strip())
    bad = [e for e in emails if not EMAIL.fullmatch(e)]
    if bad:
        raise ValueError(
            f"alertEmail: {bad[0]!r} is not an e-mail address; give one or several, "
            "comma-separated (-c alertEmail=oncall@example.com)."
        )
    return emails


def deployed_policy(scope: Construct) -> Policy:
    """The policy file from the CDK context ``policy`` (a path), validated now: a bad file
    fails ``cdk synth`` with every problem named."""
    path = Path(scope.node.try_get_context("policy") or DEFAULT_POLICY)
    return load_policy(path)


def policy_text(policy: Policy) -> str:
    text = json.dumps(policy.model_dump(mode="json", exclude_defaults=True), separators=(",", ":"))
    if len(text) > MAX_POLICY_CHARS:
        raise ValueError(
            f"the policy is {len(text)} characters as JSON; Lambda's 4 KB environment holds "
            f"at most {MAX_POLICY_CHARS}. Fix: declare fewer clusters per deployment."
        )
    return text
