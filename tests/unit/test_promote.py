"""Promotion against moto's S3.

The server-side copy as S3 does it: an object of 5 GiB and more is copied in parts
(UploadPartCopy), S3 computes each copied part's CRC64NVME itself, and the vault's copy carries
the staging object's full-object checksum. (MinIO refuses such part copies:
tests/integration/test_vault.py covers the streamed fallback.)

The lock is read back from the vault: a copy is trusted to be locked only when the vault says
so, until at least the date asked.
"""

from __future__ import annotations

import io
import os
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace

import pytest
from boto3.s3.transfer import TransferConfig

from shardvault.aws.store import Bucket
from shardvault.contracts.catalog import BackupItem
from shardvault.contracts.models import LockMode, ObjectResult, Phase, VaultTarget
from shardvault.data.checksums import crc64nvme_of_bytes
from shardvault.data.planning import MiB
from shardvault.errors import PromotionFailed
from shardvault.lifecycle import promote
from tests.unit.support import backup_item

from .support import moto_services

SMALL_PARTS = TransferConfig(multipart_threshold=5 * MiB, multipart_chunksize=5 * MiB)


@pytest.fixture
def svc(monkeypatch):
    with moto_services(
        monkeypatch, store_url="s3://staging-bucket/backups", vault_url="s3://vault-bucket/vault"
    ) as services:
        services.store_s3.create_bucket(Bucket="staging-bucket")
        services.vault_s3.create_bucket(Bucket="vault-bucket", ObjectLockEnabledForBucket=True)
        yield services


def staged(svc, data: bytes, key: str = "backups/c/b1/s1/data-00000") -> ObjectResult:
    """An object in the staging bucket, as the manifest records it."""
    svc.store_s3.upload_fileobj(
        io.BytesIO(data), "staging-bucket", key,
        ExtraArgs={"ChecksumAlgorithm": "CRC64NVME"}, Config=SMALL_PARTS,
    )  # fmt: skip
    return ObjectResult(
        key=key, node_id="n1", shard_id="s1", phase=Phase.DATA, index=0, stream_offset=0,
        length=len(data), part_size=5 * MiB, part_count=-(-len(data) // (5 * MiB)),
        crc64nvme=crc64nvme_of_bytes(data), verified_by="attributes",
    )  # fmt: skip


def retention(svc, key: str) -> tuple[str | None, datetime | None]:
    """The lock the vault holds on ``key`` (HeadObject: moto implements no GetObjectRetention)."""
    head = svc.vault_s3.head_object(Bucket="vault-bucket", Key=key)
    return head.get("ObjectLockMode"), head.get("ObjectLockRetainUntilDate")


VAULT = VaultTarget(storage_class="DEEP_ARCHIVE", lock_mode="GOVERNANCE", lock_days=1)


def streamed(monkeypatch) -> None:
    """Small objects are streamed (PutObject): moto's CopyObject refuses lock headers unless
    an SDK checksum header comes with them, which S3 does not ask for."""
    monkeypatch.setattr(promote, "same_server", lambda svc: False)


def test_a_large_object_is_copied_in_parts_by_the_server_with_its_checksum(svc, monkeypatch):
    data = os.urandom(12 * MiB)  # three copy parts at 5 MiB, as 5 GiB parts would be
    obj = staged(svc, data)
    monkeypatch.setattr(promote, "COPY_CONFIG", SMALL_PARTS)
    part_copies, creates = [], []
    svc.vault_s3.meta.events.register(
        "before-call.s3.UploadPartCopy", lambda **kw: part_copies.append(kw["params"])
    )
    svc.vault_s3.meta.events.register(
        "before-call.s3.CreateMultipartUpload", lambda **kw: creates.append(kw["params"])
    )
    assert promote.same_server(svc)
    until = promote.retain_until(VAULT, datetime.now(UTC).timestamp())

    stored = promote.copy_into_vault(svc, obj, VAULT, until)

    assert len(part_copies) == 3  # copied by the server, part by part: nothing streamed
    copied = promote.vault_key(svc, obj.key)
    vault = Bucket(svc.vault_s3, "vault-bucket")
    assert vault.stored_checksum(copied) == (obj.crc64nvme, len(data))
    assert svc.vault_s3.head_object(Bucket="vault-bucket", Key=copied)["StorageClass"] == (
        "DEEP_ARCHIVE"
    )
    # The upload is created locked (moto keeps no lock from CreateMultipartUpload, S3 does).
    (create,) = creates
    assert create["headers"]["x-amz-object-lock-mode"] == "GOVERNANCE"
    assert "x-amz-object-lock-retain-until-date" in create["headers"]
    # moto's copy came out unlocked: promotion locked it, and what it reports is what is held.
    assert retention(svc, copied) == ("GOVERNANCE", until)
    assert (stored.mode, stored.retain_until, stored.storage_class) == (
        "GOVERNANCE", until, "DEEP_ARCHIVE",
    )  # fmt: skip


def ignore_object_lock(svc) -> None:
    """Makes the vault behave as a store that accepts Object Lock requests and keeps no lock:
    lock parameters are dropped from writes, and PutObjectRetention answers 200 unheard."""

    def drop_lock(params, **_):
        params.pop("ObjectLockMode", None)
        params.pop("ObjectLockRetainUntilDate", None)

    for operation in ("PutObject", "CopyObject", "CreateMultipartUpload"):
        svc.vault_s3.meta.events.register(f"before-parameter-build.s3.{operation}", drop_lock)
    svc.vault_s3.meta.events.register(
        "before-call.s3.PutObjectRetention",
        lambda **_: (SimpleNamespace(status_code=200, headers={}), {}),
    )


@pytest.mark.parametrize("size", [1 * MiB, 12 * MiB])  # streamed PutObject; server part copy
def test_a_vault_that_keeps_no_lock_fails_the_copy_by_name(svc, monkeypatch, size):
    obj = staged(svc, os.urandom(size))
    monkeypatch.setattr(promote, "COPY_CONFIG", SMALL_PARTS)
    if size < 5 * MiB:
        streamed(monkeypatch)
    ignore_object_lock(svc)
    until = promote.retain_until(VAULT, datetime.now(UTC).timestamp())

    with pytest.raises(PromotionFailed, match="keeps no Object Lock") as failed:
        promote.copy_into_vault(svc, obj, VAULT, until)

    assert "Nothing was recorded as locked" in failed.value.message
    assert "s3:GetObjectRetention" in failed.value.fix
    # Indeed unlocked: the error was no false alarm.
    assert retention(svc, promote.vault_key(svc, obj.key)) == (None, None)


def test_a_lock_shorter_than_asked_fails_the_copy_by_name(svc, monkeypatch):
    obj = staged(svc, os.urandom(MiB))
    streamed(monkeypatch)
    until = promote.retain_until(VAULT, datetime.now(UTC).timestamp())
    shorter = until - timedelta(hours=12)

    def shorten(params, **_):
        params["ObjectLockRetainUntilDate"] = shorter

    svc.vault_s3.meta.events.register("before-parameter-build.s3.PutObject", shorten)

    with pytest.raises(PromotionFailed) as failed:
        promote.copy_into_vault(svc, obj, VAULT, until)
    assert f"locked until {shorter.isoformat()}, before {until.isoformat()}" in str(failed.value)
    assert retention(svc, promote.vault_key(svc, obj.key)) == ("GOVERNANCE", shorter)


def test_a_copy_already_in_the_vault_counts_only_while_its_lock_holds(svc, monkeypatch):
    """A promotion that resumes skips copies already in the vault, but not an unlocked one:
    it is copied again (a new version, locked) rather than trusted."""
    obj = staged(svc, os.urandom(MiB))
    streamed(monkeypatch)
    until = promote.retain_until(VAULT, datetime.now(UTC).timestamp())
    copied = promote.vault_key(svc, obj.key)
    svc.vault_s3.copy_object(  # the right checksum, no lock
        CopySource={"Bucket": "staging-bucket", "Key": obj.key},
        Bucket="vault-bucket",
        Key=copied,
        StorageClass="DEEP_ARCHIVE",
        ChecksumAlgorithm="CRC64NVME",
    )
    assert promote.held_in_vault(svc, obj, VAULT, until) is None

    promote.copy_into_vault(svc, obj, VAULT, until)

    held = promote.held_in_vault(svc, obj, VAULT, until)
    assert held is not None
    assert held.retain_until == until
    compliance = VAULT.model_copy(update={"lock_mode": LockMode.COMPLIANCE})
    assert promote.held_in_vault(svc, obj, compliance, until) is None  # a stricter mode asked
    assert promote.held_in_vault(svc, obj, VAULT, until + timedelta(days=1)) is None  # longer


class OneRecordCatalog:
    def __init__(self, record: dict) -> None:
        self.record = backup_item(**record)

    def get(self, cluster: str, backup_id: str) -> BackupItem | None:
        return self.record if backup_id == self.record.backup_id else None


@pytest.mark.parametrize(
    "parent",
    [
        {"backup_id": "p", "status": "COMPLETE", "promotion": "FAILED"},
        {"backup_id": "p", "status": "COMPLETE"},  # never promoted
        {"backup_id": "other"},  # the catalog lost it
    ],
)
def test_an_incremental_whose_chain_is_not_in_the_vault_is_not_promoted(parent) -> None:
    """Its vault copy could not be restored: promotion fails by name before any manifest."""
    svc = SimpleNamespace(catalog=OneRecordCatalog(parent))
    child = SimpleNamespace(backup_id="c", chain=SimpleNamespace(ancestors=["p"]))
    until = datetime.now(UTC) + timedelta(days=1)

    with pytest.raises(PromotionFailed, match="incremental of p, which is not in the vault"):
        promote.hold_ancestors(svc, "orders", child, until)
