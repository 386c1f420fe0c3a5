"""Account B's side of an aws vault copy: the IAM documents its owner applies there, written
once here so the guide shows them (``shardvault copy-setup``) and the local stack enforces
exactly them (``shardvault.local.account_b``).

Terms:

- *the role*: the role in account B that the stack's functions assume (``role_arn``). Its
  *trust policy* names the stack's functions' roles and asks for the target's external ID;
  its *permissions* write copies, set and read their locks, read them back and thaw them,
  under the target's prefix, and use B's KMS key; never delete, never bypass a lock.
- *the recovery key's policy* (a target with ``recovery_key``, ``shardvault.aws.keys``): B's
  own account administers the key; the stack's promote function may wrap data keys under it
  (``kms:ReEncryptTo``) and a restore's plan may unwrap them from it into the stack's key
  (``kms:ReEncryptFrom``), and check's probe both (a throwaway key), each only in a ShardVault
  cluster's encryption context. Neither may
  ``Decrypt``, grant, disable or delete: the plaintext never leaves KMS, and the key's life is
  B's alone.
- *the bucket policy*: what B's bucket refuses to anyone, the role included: a lock in a mode
  other than COMPLIANCE, a lock longer than the *cap* (so a taken-over source account cannot
  write objects locked for decades), a KMS key other than B's, plain HTTP, and to the role
  any delete or change of the bucket's own settings. A write without a lock gets the
  bucket's default COMPLIANCE retention.
"""

from __future__ import annotations

from typing import Any

from shardvault.config.targets import AwsTarget

VERSION = "2012-10-17"
# The functions that write to a copy target: promotion, and shardvault check's probe object
# (shardvault/assurance/copy_check.py).
COPY_WRITERS = ("promote_backup", "probe_store")
# The functions that read a copy target: manifests at Validate and Plan, objects staged at Thaw
# (shardvault/restore/sources.py), and verify --from-vault (shardvault/assurance/copy_check.py).
COPY_READERS = ("validate_restore", "plan_restore", "thaw_objects", "verify_backup")
# The functions that use a copy's recovery key: promotion wraps the data keys under it, and a
# restore's plan (a drill's too) unwraps them from it (shardvault/aws/keys.py); check's probe
# does both with a throwaway key (shardvault/assurance/copy_check.py).
KEY_WRAPPERS = ("promote_backup", "probe_store")
KEY_UNWRAPPERS = ("plan_restore", "probe_store")
CLUSTER_CONTEXT_KEY = "kms:EncryptionContext:shardvault:cluster"
# The role's S3 actions on copies: write one (with its lock), extend a lock, read a copy and
# its lock and checksum back (a versioned bucket: the version actions), thaw an archived one,
# and abort a failed upload of its own (nothing locked is lost by that).
COPY_ACTIONS = (
    "s3:PutObject",
    "s3:PutObjectRetention",
    "s3:GetObject",
    "s3:GetObjectVersion",
    "s3:GetObjectVersionAttributes",
    "s3:GetObjectRetention",
    "s3:RestoreObject",
    "s3:AbortMultipartUpload",
)
# What the bucket refuses the role outright, whatever B's IAM grants it by mistake.
NEVER = (
    "s3:DeleteObject",
    "s3:DeleteObjectVersion",
    "s3:BypassGovernanceRetention",
    "s3:PutObjectLegalHold",  # a hold has no end: it would escape the cap on locks
    "s3:PutBucketPolicy",
    "s3:DeleteBucketPolicy",
    "s3:PutLifecycleConfiguration",
    "s3:PutBucketObjectLockConfiguration",
    "s3:PutBucketVersioning",
    "s3:PutEncryptionConfiguration",
)


def cap_days(target: AwsTarget) -> int:
    """The longest lock the bucket accepts: the target's days and one for rounding (an
    incremental's chain is extended to its own retain-until, never further)."""
    return target.object_lock.days + 1


def bucket_arn(target: AwsTarget) -> str:
    return f"arn:aws:s3:::{target.bucket}"


def copies_arn(target: AwsTarget) -> str:
    return f"{bucket_arn(target)}/{target.prefix.strip('/')}/*"


def trust_policy(target: AwsTarget, stack_roles: list[str]) -> dict[str, Any]:
    """The role's trust policy: the stack's functions' roles (``stack_roles``, their ARNs), with
    the target's external ID."""
    return {
        "Version": VERSION,
        "Statement": [
            {
                "Sid": "ShardVaultFunctions",
                "Effect": "Allow",
                "Principal": {"AWS": sorted(stack_roles)},
                "Action": "sts:AssumeRole",
                "Condition": {"StringEquals": {"sts:ExternalId": target.external_id}},
            }
        ],
    }


def role_policy(target: AwsTarget) -> dict[str, Any]:
    """The role's permissions in account B."""
    return {
        "Version": VERSION,
        "Statement": [
            {
                "Sid": "WriteAndReadCopies",
                "Effect": "Allow",
                "Action": list(COPY_ACTIONS),
                "Resource": copies_arn(target),
            },
            {
                # A copy not there yet answers 404 (403 without it), which resuming reads.
                # No s3:prefix condition: whether S3 sets one when it decides between 404 and
                # 403 is not documented, and B's bucket holds nothing but copies.
                "Sid": "ListCopies",
                "Effect": "Allow",
                "Action": "s3:ListBucket",
                "Resource": bucket_arn(target),
            },
            {
                "Sid": "EncryptUnderTheVaultKey",
                "Effect": "Allow",
                "Action": ["kms:GenerateDataKey", "kms:Decrypt"],
                "Resource": target.kms_key,
            },
        ],
    }


def bucket_policy(target: AwsTarget) -> dict[str, Any]:
    """The bucket's policy in account B (the module docstring)."""
    objects = f"{bucket_arn(target)}/*"
    key_id = "s3:x-amz-server-side-encryption-aws-kms-key-id"
    return {
        "Version": VERSION,
        "Statement": [
            {
                "Sid": "TlsOnly",
                "Effect": "Deny",
                "Principal": "*",
                "Action": "s3:*",
                "Resource": [bucket_arn(target), objects],
                "Condition": {"Bool": {"aws:SecureTransport": "false"}},
            },
            {
                "Sid": "ComplianceLocksOnly",
                "Effect": "Deny",
                "Principal": "*",
                "Action": ["s3:PutObject", "s3:PutObjectRetention"],
                "Resource": objects,
                "Condition": {
                    "StringNotEquals": {"s3:object-lock-mode": "COMPLIANCE"},
                    "Null": {"s3:object-lock-mode": "false"},
                },
            },
            {
                "Sid": "LocksUpToTheCap",
                "Effect": "Deny",
                "Principal": "*",
                "Action": ["s3:PutObject", "s3:PutObjectRetention"],
                "Resource": objects,
                "Condition": {
                    "NumericGreaterThan": {
                        "s3:object-lock-remaining-retention-days": str(cap_days(target))
                    }
                },
            },
            {
                "Sid": "TheVaultKeyOnly",
                "Effect": "Deny",
                "Principal": "*",
                "Action": "s3:PutObject",
                "Resource": objects,
                "Condition": {
                    "StringNotEquals": {key_id: target.kms_key},
                    "Null": {key_id: "false"},
                },
            },
            {
                "Sid": "NoDeletesFromTheSourceAccount",
                "Effect": "Deny",
                "Principal": {"AWS": target.role_arn},
                "Action": list(NEVER),
                "Resource": [bucket_arn(target), objects],
            },
        ],
    }


def recovery_key_policy(target: AwsTarget, stack_roles: dict[str, str]) -> dict[str, Any]:
    """The recovery key's policy in account B (the module docstring); ``stack_roles``: the
    stack's functions' role ARNs, by function."""
    in_a_cluster = {"StringLike": {CLUSTER_CONTEXT_KEY: "*"}}
    return {
        "Version": VERSION,
        "Statement": [
            {
                "Sid": "AccountBAdministersTheKey",
                "Effect": "Allow",
                "Principal": {"AWS": f"arn:aws:iam::{target.account}:root"},
                "Action": "kms:*",
                "Resource": "*",
            },
            {
                "Sid": "PromotionWrapsDataKeys",
                "Effect": "Allow",
                "Principal": {"AWS": [stack_roles[m] for m in KEY_WRAPPERS]},
                "Action": "kms:ReEncryptTo",
                "Resource": "*",
                "Condition": in_a_cluster,
            },
            {
                "Sid": "RestoresUnwrapDataKeys",
                "Effect": "Allow",
                "Principal": {"AWS": [stack_roles[m] for m in KEY_UNWRAPPERS]},
                "Action": "kms:ReEncryptFrom",
                "Resource": "*",
                "Condition": in_a_cluster,
            },
        ],
    }


def merged(documents: list[dict[str, Any]]) -> dict[str, Any]:
    """One policy of several (a role that several targets name): every statement, each Sid
    numbered after the first document's, as IAM wants them unique."""
    statements = []
    for number, document in enumerate(documents):
        for statement in document["Statement"]:
            sid = statement["Sid"] + (str(number + 1) if number else "")
            statements.append({**statement, "Sid": sid})
    return {"Version": VERSION, "Statement": statements}


def role_documents(
    targets: list[AwsTarget], stack_roles: list[str]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The trust policy and the permissions of a role that ``targets`` all name."""
    trust = merged([trust_policy(t, stack_roles) for t in targets])
    return trust, merged([role_policy(t) for t in targets])
