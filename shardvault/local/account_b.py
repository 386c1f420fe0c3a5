"""Account B on the local stack: a second moto account holding the buckets of aws vault copies,
and the IAM their owner applies there (``shardvault.aws.vault_account``), enforced by the gate.

moto serves several accounts at once: a request's account is the one its access key belongs
to (an ``AssumeRole`` session of B's role is B's), or the ``x-moto-account-id`` header (B's
owner here, making buckets). Bucket names are global, as on AWS. A target's recovery key is
a key of B's KMS, made with the id its ARN names and judged by its key policy in the gate (a
``ReEncrypt`` across the two accounts is moto_fidelity's). What stays unmodelled: SSE-KMS in
B (moto's S3 stores the key id an object names without asking KMS, so ``KMS_KEY`` is a name,
not a key), the one-hour cap on a chained session, and a read's ``kms:Decrypt``.
"""

from __future__ import annotations

import json
from typing import Any

import boto3

from shardvault.aws.vault_account import (
    COPY_READERS,
    COPY_WRITERS,
    bucket_policy,
    recovery_key_policy,
    role_documents,
)
from shardvault.config.targets import AwsTarget
from shardvault.local.iam.gate import Gate

ACCOUNT_B = "222233334444"
# The role examples/shardvault.yaml names: the synthesized template grants sts:AssumeRole on
# exactly the roles of the policy it was made from, so local targets use this one.
ROLE_ARN = f"arn:aws:iam::{ACCOUNT_B}:role/shardvault-vault-writer"
ROLE_NAME = ROLE_ARN.rsplit("/", 1)[1]
KMS_KEY = f"arn:aws:kms:us-east-1:{ACCOUNT_B}:key/6a1f0c7e-5b0d-4a59-9c3e-2b9d7e4f8a10"
# The recovery key examples/shardvault.yaml names (the template grants ReEncrypt on exactly
# the policy's keys), made in B's KMS by ``add``.
RECOVERY_KEY = f"arn:aws:kms:us-east-1:{ACCOUNT_B}:key/0d4e7b52-8c1f-4e3a-9b6d-5f2a1c8e7d34"
ACCOUNT_HEADER = "x-moto-account-id"


class AccountB:
    """B's owner: makes each aws target's bucket and role as the guide does, and has the
    gate judge B's role and bucket by the documents the guide prints."""

    def __init__(self, endpoint: str, region: str, gate: Gate) -> None:
        self.endpoint, self.region, self.gate = endpoint, region, gate
        self.targets: dict[str, AwsTarget] = {}  # by bucket

    def client(self, service: str) -> Any:
        """A client of B's owner (not judged by the gate: the owner may do anything in B)."""
        client = boto3.client(service, endpoint_url=self.endpoint, region_name=self.region)
        client.meta.events.register(f"before-sign.{service}", _as_account_b)
        return client

    def add(self, target: AwsTarget) -> None:
        """The target's bucket (Object Lock, versioned, a COMPLIANCE default retention as
        the backstop, its bucket policy in the gate) and its role (trust policy and
        permissions, in moto's IAM and in the gate)."""
        if target.account != ACCOUNT_B or target.role_arn != ROLE_ARN:
            raise ValueError(f"local aws targets are account {ACCOUNT_B}'s, role {ROLE_ARN}")
        s3 = self.client("s3")
        if target.bucket not in {b["Name"] for b in s3.list_buckets()["Buckets"]}:
            s3.create_bucket(Bucket=target.bucket, ObjectLockEnabledForBucket=True)
        s3.put_object_lock_configuration(
            Bucket=target.bucket,
            ObjectLockConfiguration={
                "ObjectLockEnabled": "Enabled",
                "Rule": {"DefaultRetention": {"Mode": "COMPLIANCE", "Days": 1}},
            },
        )
        # The bucket policy is the gate's to judge, not moto's: moto evaluates a bucket's
        # Deny statements without their conditions (TLS-only would refuse every request).
        self.targets[target.bucket] = target
        if target.recovery_key:
            made_key(target.recovery_key, "a vault copy's recovery key")
        self._apply_role()

    def _apply_role(self) -> None:
        """The role as the targets that name it together ask (``role_documents``), in moto's
        IAM and in the gate; and the targets' recovery keys' policies, in the gate."""
        by_module = {
            m: self.gate.names.role_arn(f"function:{m}") for m in (*COPY_WRITERS, *COPY_READERS)
        }
        stack_roles = list(by_module.values())
        trust, permissions = role_documents(list(self.targets.values()), stack_roles)
        iam = self.client("iam")
        try:
            iam.update_assume_role_policy(RoleName=ROLE_NAME, PolicyDocument=json.dumps(trust))
        except iam.exceptions.NoSuchEntityException:
            iam.create_role(RoleName=ROLE_NAME, AssumeRolePolicyDocument=json.dumps(trust))
        iam.put_role_policy(
            RoleName=ROLE_NAME,
            PolicyName="shardvault-copies",
            PolicyDocument=json.dumps(permissions),
        )
        self.gate.add_account(
            {ROLE_ARN: (trust["Statement"], permissions["Statement"])},
            {bucket: bucket_policy(t)["Statement"] for bucket, t in self.targets.items()},
            {
                t.recovery_key: recovery_key_policy(t, by_module)["Statement"]
                for t in self.targets.values()
                if t.recovery_key
            },
        )


def made_key(arn: str, description: str) -> None:
    """A symmetric key of B's KMS with the id ``arn`` names (moto picks its own ids: the
    policy file names the key before it exists), once."""
    from moto.kms.models import kms_backends

    region, account, key_id = arn.split(":")[3], arn.split(":")[4], arn.rsplit("/", 1)[1]
    backend = kms_backends[account][region]
    if key_id in backend.keys:
        return
    key = backend.create_key(None, "ENCRYPT_DECRYPT", "SYMMETRIC_DEFAULT", description, None)
    del backend.keys[key.id]
    key.id, key.arn = key_id, arn
    backend.keys[key_id] = key


def _as_account_b(request: Any, **_: Any) -> None:
    request.headers[ACCOUNT_HEADER] = ACCOUNT_B
