"""Promotion into the vault: every verified backup lands in its storage class under Object
Lock, checked by checksum, manifest last; a promotion cut short resumes; restores read it back.
A request cannot weaken the vault, and the catalog records the lock the vault reports, never
the lock asked: a vault that keeps a weaker lock (or none) fails the promotion.

The local stack's vault is a bucket in moto's S3 (archive classes, Object Lock, thaw); the
server-side copy and its checksum carry-over are tested against MinIO, whose CopyObject is real.
"""

from __future__ import annotations

import functools
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace

import pytest
from boto3.s3.transfer import TransferConfig
from botocore.exceptions import ClientError

from shardvault.aws import lambda_support
from shardvault.aws.readback import load_manifest
from shardvault.aws.services import Services
from shardvault.aws.store import Bucket
from shardvault.client import operations as ops
from shardvault.contracts.models import BackupContext, LockMode, VaultTarget
from shardvault.data.planning import MiB
from shardvault.lifecycle import promote
from shardvault.local.demo import table_digests
from shardvault.pricing.prices import StorageClass

from .conftest import client_of, entered_states, output, run_cli
from .test_bad_requests import assert_rejected, assert_unchanged, run_raw

DEEP = VaultTarget(storage_class="DEEP_ARCHIVE", lock_mode="GOVERNANCE", lock_days=2)


def vault_objects(svc: Services, cluster: str) -> list[dict]:
    pages = svc.vault_s3.get_paginator("list_objects_v2").paginate(
        Bucket=svc.vault.bucket, Prefix=f"{svc.vault.prefix}/{cluster}/"
    )
    return [o for page in pages for o in page.get("Contents", [])]


def test_a_verified_backup_lands_in_the_vault_locked_in_its_class(make_cluster):
    cluster = make_cluster(nodes=3, size_mb=3)

    backup = cluster.backup(vault=DEEP)

    assert backup.status == "SUCCEEDED", backup.cause
    summary = output(backup)
    assert summary["location"] == "vault"
    assert summary["storage_class"] == "DEEP_ARCHIVE"
    # Each backup records what it costs, priced in its vault class.
    assert 0 < summary["estimated_storage_usd_per_month"] < 0.001  # 3 MiB in DEEP_ARCHIVE
    assert summary["estimated_overhead_usd"] > 0
    until = datetime.fromisoformat(summary["retain_until"])
    assert timedelta(days=1.9) < until - datetime.now(UTC) < timedelta(days=2.1)
    svc = cluster.stack.services()
    manifest = load_manifest(svc.vault_bucket, summary["vault_manifest_key"])
    keys = {o["Key"] for o in vault_objects(svc, cluster.name)}
    for obj in (o for s in manifest.shards for st in s.streams for o in st.objects):
        assert obj.key in keys
        head = svc.vault_s3.head_object(Bucket=svc.vault.bucket, Key=obj.key)
        assert head["StorageClass"] == "DEEP_ARCHIVE"
        assert head["ObjectLockMode"] == "GOVERNANCE"
        assert head["ObjectLockRetainUntilDate"] >= until - timedelta(seconds=1)
        # Locked: deleting this version before its date is refused.
        with pytest.raises(ClientError):
            svc.vault_s3.delete_object(
                Bucket=svc.vault.bucket, Key=obj.key, VersionId=head["VersionId"]
            )
    (record,) = cluster.records()
    assert record["location"] == "vault"
    assert "staging_left" not in record
    # The staging copy is gone: the vault holds the backup now, and restores read it there.
    staged = svc.store_s3.list_objects_v2(
        Bucket=svc.store.bucket, Prefix=record["manifest_key"].rsplit("/", 1)[0] + "/"
    )
    assert staged.get("KeyCount", 0) == 0
    # A retried promotion after success (a Lambda retry) finds it done, staging gone or not.
    again = promote.promote(context_of(cluster, record, DEEP), record, svc, 0)
    assert again["remaining"] == 0
    assert again["summary"]["vault_manifest_key"] == summary["vault_manifest_key"]


def test_a_backup_of_a_cluster_without_vault_policy_stays_in_the_store(make_cluster):
    cluster = make_cluster(nodes=1, size_mb=1)
    backup = cluster.backup()
    assert backup.status == "SUCCEEDED"
    assert "location" not in output(backup)
    assert vault_objects(cluster.stack.services(), cluster.name) == []
    assert "Promote" not in entered_states(backup.record["execution_id"])


def test_a_vaulted_backup_restores_after_its_objects_thaw(make_cluster, make_target):
    cluster = make_cluster(nodes=3, size_mb=3)
    backup = cluster.backup(vault=DEEP)
    assert backup.status == "SUCCEEDED", backup.cause
    target = make_target(nodes=2)
    # DEEP_ARCHIVE has no Expedited tier: S3 would refuse the thaw hours into the restore;
    # refused before anything instead, with the tiers it has (issue 43).
    refused = run_cli(
        cluster.stack, "restore", cluster.name, "--into", target.name, "--tier", "Expedited",
        "--wait",
    )  # fmt: skip
    assert refused.returncode == 3, refused.stdout + refused.stderr
    assert "no Expedited thaw tier" in " ".join(refused.stderr.split())
    assert target.records() == []
    assert target.inbox_items() == []

    execution = target.start_restore(cluster.name, tier="Bulk")
    restored = ops.wait_restore(client_of(target.stack), execution, interval=0.2, timeout=300)

    assert restored.status == "SUCCEEDED", restored.cause
    assert "WaitForThaw" in entered_states(execution)  # DEEP_ARCHIVE must thaw first
    for shard_id, source in cluster.sources.items():
        (db,) = list(target.restore_dir(0).parent.glob(f"*/{shard_id}/*.db"))
        assert table_digests(db) == table_digests(source)


def context_of(cluster, record: dict, vault: VaultTarget) -> BackupContext:
    return BackupContext(
        backup_id=record["backup_id"], cluster=cluster.name, engine="sqlite", sources=[],
        store_url="s3://x/y", started_at=0, vault=vault,
    )  # fmt: skip


def test_a_promotion_cut_short_resumes_and_writes_its_manifest_last(make_cluster, monkeypatch):
    cluster = make_cluster(nodes=3, size_mb=3)
    backup = cluster.backup()
    assert backup.status == "SUCCEEDED"
    record = output(backup)
    svc = cluster.stack.services()
    context = context_of(cluster, record, DEEP)
    monkeypatch.setattr(svc.settings, "promote_budget_seconds", 0)
    real_copy = promote.copy_into_vault
    copies = []

    def failing_second(*args):
        copies.append(args[1].key)
        if len(copies) == 2:
            raise ClientError({"Error": {"Code": "SlowDown", "Message": "x"}}, "CopyObject")
        return real_copy(*args)

    monkeypatch.setattr(promote, "copy_into_vault", failing_second)

    first = promote.promote(context, record, svc, 0)  # one object per call at budget 0
    assert first["remaining"] == 5  # 3 data objects and 3 block maps, one copied
    with pytest.raises(ClientError):
        promote.promote(context, record, svc, 0)  # the copy fails partway
    # No manifest in the vault while objects are missing.
    assert not any(o["Key"].endswith("manifest.json") for o in vault_objects(svc, cluster.name))

    monkeypatch.setattr(promote, "copy_into_vault", real_copy)
    while (step := promote.promote(context, record, svc, 0))["remaining"]:
        pass
    assert step["summary"]["location"] == "vault"
    keys = [o["Key"] for o in vault_objects(svc, cluster.name)]
    assert sum(k.endswith("manifest.json") for k in keys) == 1
    assert len(keys) == 6 + 1


@pytest.mark.parametrize("copy", ["CopyObject", "UploadPartCopy"])
def test_server_side_copy_into_a_minio_vault_keeps_the_checksum(make_cluster, monkeypatch, copy):
    """Objects under 5 GiB are copied by CopyObject. Above, S3 copies parts (UploadPartCopy)
    and computes their checksums itself; MinIO refuses to (it wants a checksum no request can
    carry), so promotion streams those objects through instead (tests/unit/test_promote.py
    has the server-side part copy against moto)."""
    cluster = make_cluster(nodes=2, size_mb=12)
    backup = cluster.backup()
    assert backup.status == "SUCCEEDED"
    if copy == "UploadPartCopy":  # what objects of 5 GiB and more get, scaled down to 12 MiB
        small_parts = TransferConfig(multipart_threshold=5 * MiB, multipart_chunksize=5 * MiB)
        monkeypatch.setattr(promote, "COPY_CONFIG", small_parts)
    server_side = []
    copy_server_side = promote.copy_server_side
    monkeypatch.setattr(
        promote,
        "copy_server_side",
        lambda *a: server_side.append(copy_server_side(*a)) or server_side[-1],
    )
    stack = cluster.stack
    s3 = stack.store_client()
    bucket = f"vault-{cluster.name}"[:63]
    s3.create_bucket(Bucket=bucket, ObjectLockEnabledForBucket=True)
    settings = stack.settings.model_copy(
        update={
            "vault_url": f"s3://{bucket}/vault",
            "vault_endpoint": stack.settings.store_endpoint,
            "vault_access_key_id": stack.settings.store_access_key_id,
            "vault_secret_access_key": stack.settings.store_secret_access_key,
        }
    )
    svc = Services(settings)
    assert promote.same_server(svc)  # MinIO copies server-side, with its own checksum
    # MinIO keeps no archive class, and no request may ask for STANDARD: built unchecked.
    standard = VaultTarget.model_construct(
        storage_class=StorageClass.STANDARD, lock_mode=LockMode.GOVERNANCE, lock_days=1
    )
    record = output(backup)

    done = promote.promote(context_of(cluster, record, standard), record, svc, 0)

    assert done["remaining"] == 0
    manifest = load_manifest(Bucket(s3, bucket), done["summary"]["vault_manifest_key"])
    for obj in (o for s in manifest.shards for st in s.streams for o in st.objects):
        attrs = s3.get_object_attributes(Bucket=bucket, Key=obj.key, ObjectAttributes=["Checksum"])
        assert attrs["Checksum"]["ChecksumCRC64NVME"] == obj.crc64nvme
        assert s3.head_object(Bucket=bucket, Key=obj.key)["ObjectLockMode"] == "GOVERNANCE"
    # A data object and a block map per shard: the data copied whole by the server, or (in
    # parts) refused by MinIO and streamed; the small block maps are always one CopyObject.
    assert server_side == [copy == "CopyObject", True] * 2
    assert s3.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []  # none left open


# --- The vault's protection cannot be weakened, and what is recorded is what the vault holds ---
def vault_lock(svc: Services, key: str) -> tuple[str | None, datetime | None, str]:
    """The lock and class the vault reports for ``key`` (HeadObject: moto, the local vault,
    implements no GetObjectRetention)."""
    head = svc.vault_s3.head_object(Bucket=svc.vault.bucket, Key=key)
    until = head.get("ObjectLockRetainUntilDate")
    return head.get("ObjectLockMode"), until, head.get("StorageClass", "STANDARD")


@pytest.mark.parametrize(
    ("vault", "phrases"),
    [
        ({"lock_mode": "NONE"}, ["vault.lock_mode 'NONE'", "always locked"]),
        ({"storage_class": "BOGUS"}, ["vault.storage_class 'BOGUS'", "DEEP_ARCHIVE"]),
    ],
)
def test_a_vault_request_that_would_weaken_or_misname_the_vault_fails_at_validate(
    make_cluster, vault, phrases
):
    cluster = make_cluster(nodes=1, size_mb=1)

    progress = run_raw(cluster.stack, {"cluster": cluster.name, "vault": vault})

    assert_rejected(progress, "InvalidRequest", *phrases)
    assert_unchanged(cluster)  # no record, no lock item, nothing in the store or inboxes
    assert vault_objects(cluster.stack.services(), cluster.name) == []


def test_the_record_holds_the_lock_read_back_from_the_vault(make_cluster):
    """One object of 24 MiB per shard: streamed into the moto vault as a multipart upload,
    which moto leaves unlocked (S3 would not). Promotion locks it and records what the vault
    then reports, object by object."""
    cluster = make_cluster(nodes=1, size_mb=24)

    backup = cluster.backup(vault=DEEP)

    assert backup.status == "SUCCEEDED", backup.cause
    (record,) = cluster.records()
    svc = cluster.stack.services()
    keys = [o["Key"] for o in vault_objects(svc, cluster.name)]
    assert any(not k.endswith("manifest.json") for k in keys)
    for key in keys:
        mode, until, storage_class = vault_lock(svc, key)
        assert mode == record["lock_mode"] == "GOVERNANCE"
        assert until == datetime.fromisoformat(record["retain_until"])
        expected = "STANDARD" if key.endswith("manifest.json") else record["storage_class"]
        if "/blockmap-" in key:  # readable without a thaw: the next incremental may read it
            expected = "GLACIER_IR"
        assert storage_class == expected
    assert record["storage_class"] == "DEEP_ARCHIVE"
    # 'shardvault show' prints the record: the same, read-back date.
    shown = ops.show_backup(cluster.client, cluster.name, record["backup_id"])
    assert shown.retain_until == record["retain_until"]


PROMOTE = "promote_backup"


def keep_weaker_locks(svc: Services, how: str) -> None:
    """Makes the vault keep less than it is asked: ``shorter`` locks (half a day less than
    asked), or ``none`` at all (lock parameters dropped and PutObjectRetention answered 200
    unheard, as by a store that ignores Object Lock)."""

    def tamper(params, **_):
        if how == "none":
            params.pop("ObjectLockMode", None)
            params.pop("ObjectLockRetainUntilDate", None)
        elif "ObjectLockRetainUntilDate" in params:
            params["ObjectLockRetainUntilDate"] -= timedelta(hours=12)

    for operation in ("PutObject", "CopyObject", "CreateMultipartUpload"):
        svc.vault_s3.meta.events.register(f"before-parameter-build.s3.{operation}", tamper)
    svc.vault_s3.meta.events.register(
        "before-call.s3.PutObjectRetention",
        lambda **_: (SimpleNamespace(status_code=200, headers={}), {}),
    )


@pytest.mark.parametrize(
    ("how", "phrase"), [("none", "keeps no Object Lock"), ("shorter", "is locked until")]
)
def test_a_vault_that_keeps_a_weaker_lock_fails_the_promotion_and_records_none(
    make_cluster, monkeypatch, how, phrase
):
    cluster = make_cluster(nodes=1, size_mb=1)
    gate = cluster.stack.gate  # the promotion's clients, for this test, with its role's grants
    lambdas = Services(
        cluster.stack.settings, bind=functools.partial(gate.bind, principal=gate.function(PROMOTE))
    )
    keep_weaker_locks(lambdas, how)
    monkeypatch.setitem(lambda_support._by_function, PROMOTE, lambdas)

    backup = cluster.backup(vault=DEEP)

    assert backup.status == "FAILED"
    assert backup.error == "PromotionFailed"
    assert phrase in backup.cause
    assert "Nothing was recorded as locked" in backup.cause
    (record,) = cluster.records()
    assert record["status"] == "COMPLETE"  # still restorable from the store
    assert record["promotion"] == "FAILED"
    assert not {"location", "lock_mode", "retain_until"} & set(record)
    assert cluster.store_keys()  # the staging copy is kept
    # What the vault holds is indeed weaker than the lock asked (2 days).
    svc = cluster.stack.services()
    (copied, *_) = [o["Key"] for o in vault_objects(svc, cluster.name)]
    mode, until, _ = vault_lock(svc, copied)
    if how == "none":
        assert (mode, until) == (None, None)
    else:
        assert until < datetime.now(UTC) + timedelta(days=1.9)
