"""Vault copies into another AWS account (account B): each verified backup is copied into an
Object Lock bucket of a second moto account, through a role there that the promote function
assumes with an external ID. IAM is enforced both sides: the template's grants (the function
may assume exactly the policy's role), B's trust policy (the stack's function roles, the
external ID), B's role permissions and B's bucket policy (COMPLIANCE only, a cap on the lock,
B's KMS key only, no deletes), all as ``shardvault copy-setup`` prints them. What B holds is
read back as B's owner sees it, not from ShardVault's report.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest
from botocore.exceptions import ClientError

from shardvault.aws.services import Services
from shardvault.client import operations as ops
from shardvault.config.targets import AwsTarget
from shardvault.contracts.models import Manifest
from shardvault.local.account_b import ACCOUNT_B, KMS_KEY, RECOVERY_KEY, ROLE_ARN
from shardvault.local.demo import table_digests

from .conftest import output, run_cli
from .test_vault_copies import vault_with

EXTERNAL_ID = "local-shardvault-b"


@pytest.fixture
def account_b(stack):
    """B's owner: ``new_target(name, ...)`` makes a bucket and role as the guide says and
    returns the target as the policy names it (YAML)."""
    made = iter(range(1000))

    class Owner:
        s3 = stack.account_b.client("s3")

        @staticmethod
        def new_target(name: str, storage_class: str = "GLACIER_IR", **more: str) -> str:
            fields = {
                "name": name,
                "kind": "aws",
                "account": ACCOUNT_B,
                "bucket": f"vault-b-{next(made)}-{datetime.now(UTC):%H%M%S%f}",
                "region": "us-east-1",
                "role_arn": ROLE_ARN,
                "external_id": EXTERNAL_ID,
                "kms_key": KMS_KEY,
                "storage_class": storage_class,
                "object_lock": {"days": 2},
                **more,
            }
            stack.account_b.add(AwsTarget.model_validate({**fields, "external_id": EXTERNAL_ID}))
            Owner.last_bucket = fields["bucket"]
            return json.dumps(fields)

    return Owner


def as_function(stack, module: str) -> Services:
    """The services of the function ``module``, its clients bound to its role."""
    return Services(stack.settings, bind=stack._bind_for(module))


def test_a_verified_backup_is_copied_into_account_b_locked_in_compliance(
    make_cluster, policy_for, account_b, stack
):
    cluster = make_cluster(nodes=2, size_mb=3)
    policy_for(cluster.name, vault=vault_with(account_b.new_target("air-gapped")))
    bucket = account_b.last_bucket

    backup = cluster.backup()

    assert backup.status == "SUCCEEDED", backup.cause
    assert output(backup)["copies"] == {"air-gapped": "COPIED"}
    (record,) = cluster.records()
    copy = record["vault_copies"]["air-gapped"]
    assert (copy["state"], copy["kind"], copy["bucket"]) == ("COPIED", "aws", bucket)
    assert (copy["storage_class"], copy["retention_mode"]) == ("GLACIER_IR", "COMPLIANCE")
    until = datetime.fromisoformat(copy["retain_until"])
    assert timedelta(days=1.9) < until - datetime.now(UTC) < timedelta(days=2.1)
    # What B holds, as B's owner reads it: the manifest's version names every object, each in
    # its class, locked in COMPLIANCE at least that long, under B's key, with the vault's bytes.
    s3 = account_b.s3
    version = copy["manifest_generation"]
    body = s3.get_object(Bucket=bucket, Key=copy["manifest_key"], VersionId=version)
    manifest = Manifest.model_validate_json(body["Body"].read())
    objects = [o for s in manifest.shards for o in s.objects]
    assert objects
    assert len(objects) == copy["objects"]
    svc = stack.services()
    vault_manifest = Manifest.model_validate_json(
        svc.vault_bucket.read(record["vault_manifest_key"], record["vault_manifest_version"])
    )
    vaulted = {o.crc64nvme: o for s in vault_manifest.shards for o in s.objects}
    for obj in objects:
        head = s3.head_object(Bucket=bucket, Key=obj.key, VersionId=obj.version_id)
        assert head.get("StorageClass") == "GLACIER_IR"
        assert head["ObjectLockMode"] == "COMPLIANCE"
        assert head["ObjectLockRetainUntilDate"] >= until
        assert head["SSEKMSKeyId"] == KMS_KEY
        held = s3.get_object(Bucket=bucket, Key=obj.key, VersionId=obj.version_id)["Body"].read()
        assert held == svc.vault_bucket.read(vaulted[obj.crc64nvme].key)
    # COMPLIANCE: even B's owner cannot delete a copy before its lock ends.
    with pytest.raises(ClientError):
        s3.delete_object(Bucket=bucket, Key=objects[0].key, VersionId=objects[0].version_id)
    assert cluster.store_keys() == []  # every target holds it: the staging copy is gone


def test_the_promote_role_puts_and_reads_in_account_b_but_never_deletes_or_shortens(
    policy_for, account_b, stack
):
    target = AwsTarget.model_validate_json(account_b.new_target("b"))
    promote = as_function(stack, "promote_backup")
    s3 = promote.assumed_s3(ROLE_ARN, EXTERNAL_ID, "us-east-1", "test")
    key = "shardvault/backups/probe"
    soon = datetime.now(UTC) + timedelta(days=2)
    locked = {"ObjectLockMode": "COMPLIANCE", "ObjectLockRetainUntilDate": soon}
    sse = {"ServerSideEncryption": "aws:kms", "SSEKMSKeyId": KMS_KEY}

    put = s3.put_object(Bucket=target.bucket, Key=key, Body=b"copy", **locked, **sse)
    assert s3.get_object(Bucket=target.bucket, Key=key)["Body"].read() == b"copy"

    refusals = {
        "delete": lambda: s3.delete_object(
            Bucket=target.bucket, Key=key, VersionId=put["VersionId"]
        ),
        "shorten": lambda: s3.put_object_retention(
            Bucket=target.bucket,
            Key=key,
            VersionId=put["VersionId"],
            Retention={"Mode": "COMPLIANCE", "RetainUntilDate": soon - timedelta(days=1)},
        ),
        "governance": lambda: s3.put_object(
            Bucket=target.bucket,
            Key=key + "-g",
            Body=b"x",
            ObjectLockMode="GOVERNANCE",
            ObjectLockRetainUntilDate=soon,
            **sse,
        ),
        "decades": lambda: s3.put_object(
            Bucket=target.bucket,
            Key=key + "-d",
            Body=b"x",
            ObjectLockMode="COMPLIANCE",
            ObjectLockRetainUntilDate=soon + timedelta(days=9000),
            **sse,
        ),
        "another key": lambda: s3.put_object(
            Bucket=target.bucket,
            Key=key + "-k",
            Body=b"x",
            **locked,
            ServerSideEncryption="aws:kms",
            SSEKMSKeyId=KMS_KEY.replace("6a1f", "0000"),
        ),
        "outside the prefix": lambda: s3.put_object(
            Bucket=target.bucket, Key="elsewhere", Body=b"x", **locked, **sse
        ),
    }
    with stack.gate.expecting_refusals():
        for what, call in refusals.items():
            with pytest.raises(ClientError) as refused:
                call()
            assert refused.value.response["Error"]["Code"] == "AccessDenied", what
        # The role is assumed with the target's external ID, by the policy's functions only.
        with pytest.raises(ClientError, match="sts:AssumeRole"):
            promote.assumed_s3(ROLE_ARN, "another-id", "us-east-1", "test")
        with pytest.raises(ClientError, match="sts:AssumeRole"):
            as_function(stack, "plan_backup").assumed_s3(ROLE_ARN, EXTERNAL_ID, "us-east-1", "t")
    # As B's owner sees it: the copy and its lock are as they were.
    head = account_b.s3.head_object(Bucket=target.bucket, Key=key, VersionId=put["VersionId"])
    assert head["ObjectLockRetainUntilDate"] >= soon.replace(microsecond=0)
    listed = account_b.s3.list_objects_v2(Bucket=target.bucket).get("Contents", [])
    assert [o["Key"] for o in listed] == [key]


def test_a_restore_from_account_b_thaws_and_stages_it_into_another_node_count(
    make_cluster, make_target, policy_for, account_b, stack
):
    cluster = make_cluster(nodes=3, size_mb=3)
    policy_for(cluster.name, vault=vault_with(account_b.new_target("b", "DEEP_ARCHIVE")))
    _full_id, incremental_id = cluster.full_then_incremental()
    target = make_target(nodes=2)

    restored = target.restore(cluster.name, backup_id=incremental_id, from_vault="b")

    assert restored.status == "SUCCEEDED", restored.cause
    assert target.records()[0]["source"] == "copy:b"
    for shard_id, source in cluster.sources.items():
        (db,) = list(target.restore_dir(0).parent.glob(f"*/{shard_id}/*.db"))
        assert table_digests(db) == table_digests(source)
    svc = stack.services()
    assert not svc.store_bucket.holds_any(f"{svc.store.prefix}/_staged/")
    # What the restore read was thawed in B first (DEEP_ARCHIVE reads only after a
    # RestoreObject); each manifest is at STANDARD, read without one.
    s3, bucket = account_b.s3, account_b.last_bucket
    copies = {r["backup_id"]: r["vault_copies"]["b"] for r in cluster.records()}
    for copy in copies.values():
        body = s3.get_object(
            Bucket=bucket, Key=copy["manifest_key"], VersionId=copy["manifest_generation"]
        )
        manifest = Manifest.model_validate_json(body["Body"].read())
        for obj in (o for s in manifest.shards for st in s.streams for o in st.objects):
            head = s3.head_object(Bucket=bucket, Key=obj.key, VersionId=obj.version_id)
            assert head["StorageClass"] == "DEEP_ARCHIVE"
            assert 'ongoing-request="false"' in head["Restore"]
        manifest_head = s3.head_object(Bucket=bucket, Key=copy["manifest_key"])
        assert "StorageClass" not in manifest_head  # S3 names no class for STANDARD
        assert copy["storage_class"] == "DEEP_ARCHIVE"  # the data's, not the manifest's
    # DEEP_ARCHIVE has no Expedited thaw: refused before anything, by the copy's class.
    expedited = make_target(nodes=1).restore(
        cluster.name, backup_id=incremental_id, from_vault="b", tier="Expedited"
    )
    assert expedited.status == "FAILED"
    assert "DEEP_ARCHIVE, which has no Expedited thaw tier" in expedited.cause
    # Verify reads the archived copy by its attributes; its bytes are a drill's to prove.
    verified = ops.run_verify(cluster.client, cluster.name, incremental_id, 100.0, from_vault="b")
    assert verified.status == "SUCCEEDED", verified.cause
    assert verified.record["read"] == 0


def test_verify_and_check_reach_account_b_as_promotion_does(
    make_cluster, policy_for, account_b, tmp_path
):
    cluster = make_cluster(nodes=1, size_mb=2)
    policy_for(cluster.name, vault=vault_with(account_b.new_target("b")))
    _full_id, incremental_id = cluster.full_then_incremental()

    verified = ops.run_verify(cluster.client, cluster.name, incremental_id, 100.0, from_vault="b")
    checked = run_cli(
        cluster.stack, "check", cluster.name, "--policy", str(tmp_path / "policy.yaml"), "--json"
    )

    assert verified.status == "SUCCEEDED", verified.cause
    assert [c["location"] for c in verified.record["chain"]] == ["copy:b"] * 2
    assert verified.record["read"] > 0
    copies = {r["backup_id"]: r["vault_copies"]["b"] for r in cluster.records()}
    assert copies[incremental_id]["verify"] == "ok"
    # The incremental extended its full's lock in B to its own, read back.
    full = next(c for i, c in copies.items() if i != incremental_id)
    assert full["retain_until"] >= copies[incremental_id]["retain_until"]
    finding = {c["check"]: c for c in json.loads(checked.stdout)["checks"]}["vault copy target b"]
    assert finding["ok"], finding
    assert "COMPLIANCE" in finding["detail"]


def test_a_target_whose_trust_refuses_the_stack_leaves_the_vault_copy_and_says_so(
    make_cluster, policy_for, account_b, stack
):
    cluster = make_cluster(nodes=1, size_mb=1)
    good = account_b.new_target("good")
    wrong = json.loads(account_b.new_target("wrong"))
    wrong["external_id"] = "not-the-trusted-one"
    policy_for(cluster.name, vault=vault_with(json.dumps(wrong), good))

    with stack.gate.expecting_refusals():
        backup = cluster.backup()

    assert backup.status == "SUCCEEDED", backup.cause
    (record,) = cluster.records()
    assert (record["location"], record["promotion"]) == ("vault", "PARTIAL")
    refused = record["vault_copies"]["wrong"]
    assert refused["state"] == "FAILED"
    assert "sts:AssumeRole" in refused["reason"]
    assert record["vault_copies"]["good"]["state"] == "COPIED"
    assert account_b.s3.list_objects_v2(Bucket=wrong["bucket"]).get("KeyCount", 0) == 0


def test_an_encrypted_copy_restores_through_account_bs_recovery_key_alone(
    make_cluster, make_target, policy_for, account_b, stack
):
    """The copy's manifests wrap the chain's data key under B's recovery key only, so a
    restore from the copy unwraps it there (B's key policy decides), never with the stack's
    key: the copy stays restorable if the stack's account loses its key."""
    cluster = make_cluster(nodes=2, size_mb=2)
    target_fields = account_b.new_target("b", recovery_key=RECOVERY_KEY)
    policy_for(cluster.name, vault=vault_with(target_fields), encryption="kms")
    s3, bucket = account_b.s3, account_b.last_bucket
    policies = stack.gate.key_policies
    kept = policies[RECOVERY_KEY]

    # B's key policy does not let promotion wrap under the key yet: the copy fails by name
    # before a byte lands, and is locked, in B.
    policies[RECOVERY_KEY] = [s for s in kept if s["Sid"] != "PromotionWrapsDataKeys"]
    try:
        with stack.gate.expecting_refusals():
            unwrapped = cluster.backup()
    finally:
        policies[RECOVERY_KEY] = kept
    assert unwrapped.status == "SUCCEEDED", unwrapped.cause
    (record,) = cluster.records()
    assert record["promotion"] == "PARTIAL"
    assert "kms:ReEncryptTo" in record["vault_copies"]["b"]["reason"]
    assert s3.list_objects_v2(Bucket=bucket).get("KeyCount", 0) == 0

    _full_id, incremental_id = cluster.full_then_incremental()

    # What B holds, as B's owner reads it: every data key under B's key, none under the stack's.
    svc = stack.services()
    copied = [r for r in cluster.records() if r["vault_copies"]["b"]["state"] == "COPIED"]
    assert len(copied) == 2
    for record in copied:
        copy = record["vault_copies"]["b"]
        assert copy["data_key"] == RECOVERY_KEY
        body = s3.get_object(
            Bucket=bucket, Key=copy["manifest_key"], VersionId=copy["manifest_generation"]
        )["Body"].read()
        held = Manifest.model_validate_json(body)
        assert held.encryption is not None
        assert held.encryption.key_id == RECOVERY_KEY
        assert held.encryption.context["shardvault:cluster"] == cluster.name
        stacks = Manifest.model_validate_json(
            svc.vault_bucket.read(record["vault_manifest_key"], record["vault_manifest_version"])
        )
        assert stacks.encryption is not None
        assert stacks.encryption.wrapped_key not in body.decode()

    # B's owner withdraws the restores' use of the key: a restore from the copy is refused by
    # B's key policy, naming the key (a restore that reached for the stack's key would not
    # have noticed).
    policies[RECOVERY_KEY] = [s for s in kept if s["Sid"] != "RestoresUnwrapDataKeys"]
    try:
        with stack.gate.expecting_refusals():
            refused = make_target(nodes=1).restore(
                cluster.name, backup_id=incremental_id, from_vault="b"
            )
    finally:
        policies[RECOVERY_KEY] = kept
    assert refused.status == "FAILED"
    assert refused.error == "KeyUnavailable", refused.cause
    assert RECOVERY_KEY in refused.cause
    assert "kms:ReEncryptFrom" in refused.cause

    target = make_target(nodes=2)
    restored = target.restore(cluster.name, backup_id=incremental_id, from_vault="b")
    assert restored.status == "SUCCEEDED", restored.cause
    for shard_id, source in cluster.sources.items():
        (db,) = list(target.restore_dir(0).parent.glob(f"*/{shard_id}/*.db"))
        assert table_digests(db) == table_digests(source)


def test_check_proves_the_recovery_key_both_ways_before_any_backup(
    make_cluster, policy_for, account_b, stack, tmp_path
):
    """``shardvault check`` wraps a throwaway data key under the copy's recovery key and back,
    as promotion and a restore will: a key policy that refuses either is named before the
    first night, not found by its first copy."""
    cluster = make_cluster(nodes=1, size_mb=1)
    target_fields = account_b.new_target("b", recovery_key=RECOVERY_KEY)
    policy_for(cluster.name, vault=vault_with(target_fields), encryption="kms")

    def finding() -> dict:
        checked = run_cli(
            cluster.stack, "check", cluster.name, "--policy", str(tmp_path / "policy.yaml"),
            "--json",
        )  # fmt: skip
        return {c["check"]: c for c in json.loads(checked.stdout)["checks"]}["vault copy target b"]

    proven = finding()
    assert proven["ok"], proven
    assert f"recovery key {RECOVERY_KEY} and back" in proven["detail"]

    policies = stack.gate.key_policies
    kept = policies[RECOVERY_KEY]
    policies[RECOVERY_KEY] = [s for s in kept if s["Sid"] != "RestoresUnwrapDataKeys"]
    try:
        with stack.gate.expecting_refusals():
            refused = finding()
    finally:
        policies[RECOVERY_KEY] = kept
    assert not refused["ok"]
    assert "kms:ReEncryptFrom" in refused["detail"]
    assert RECOVERY_KEY in refused["detail"]
    assert cluster.records() == []  # no backup was needed to find it
