"""Promotion: a verified backup moves from the staging store into the vault.

Terms:
- *store* (staging): where agents upload. Once the vault holds a backup (every copy checked,
  manifest written, catalog updated) its staging copy is deleted: restores read promoted
  backups from the vault, and the copy would cost a day and a half at STANDARD (more than all
  of the backup's requests: docs/BENCHMARKS.md). Each staging object is tagged first, so a
  lifecycle rule expires what a failed deletion leaves.
- *vault*: a bucket with versioning and Object Lock that agents cannot reach; each object lands
  in the policy's storage class, locked until *retain-until* (now + the policy's days).
- *promotion*: every object copied (server-side when the vault is on the store's endpoint,
  managed multipart copy in 5 GiB parts above 5 GiB; streamed otherwise), each copy's
  CRC64NVME checked against the manifest, then the manifest written last. A call copies for
  at most ``promote_budget_seconds`` and reports what remains; the next call skips objects
  already in the vault with the right checksum, so a promotion that fails partway resumes, and
  no vault manifest ever names an object the vault lacks.
"""

from __future__ import annotations

import logging
import time
from datetime import UTC, datetime, timedelta
from typing import Any

from boto3.s3.transfer import TransferConfig
from botocore.exceptions import ClientError

from shardvault.causes import readable_cause
from shardvault.errors import ChecksumMismatch, PromotionFailed
from shardvault.models import BackupContext, Manifest, ObjectResult, VaultTarget
from shardvault.readback import load_manifest
from shardvault.retention import deletion_batches
from shardvault.services import Services
from shardvault.store import stored_checksum

log = logging.getLogger("shardvault.promote")
PROMOTED_TAG = "shardvault:promoted"  # infra's lifecycle rule expires staging objects so tagged
# One CopyObject up to 5 GiB (S3's limit for it); above, UploadPartCopy in the largest parts S3
# takes (5 GiB): each part is a request at the vault class's PUT price (costs.COPY_PART_SIZE).
COPY_CONFIG = TransferConfig(multipart_threshold=5 * 1024**3, multipart_chunksize=5 * 1024**3)


def retain_until(vault: VaultTarget, now: float) -> datetime:
    return datetime.fromtimestamp(now, UTC) + timedelta(days=vault.lock_days)


def promote(
    context: BackupContext, summary: dict[str, Any], svc: Services, now: float
) -> dict[str, Any]:
    """Copies what the vault still lacks, for at most the time budget; once nothing remains,
    writes the vault's manifest and records the promotion. Returns ``remaining`` (objects
    still to copy: call again) and, when done, the backup's summary with its vault fields."""
    if context.vault is None or svc.vault is None:
        raise PromotionFailed("the backup has no vault to go to.", fix="nothing to promote.")
    record = svc.catalog.get(context.cluster, context.backup_id) or {}
    if record.get("location") == "vault":  # a retried call after success: staging is gone
        return {"remaining": 0, "summary": {**summary, **_promotion_of(record)}}
    manifest = load_manifest(svc.store_s3, svc.store.bucket, summary["manifest_key"])
    until = retain_until(context.vault, summary.get("completed_at", now))
    deadline = time.monotonic() + svc.settings.promote_budget_seconds
    objects = [o for s in manifest.shards for st in s.streams for o in st.objects]
    remaining = [o for o in objects if not in_vault(svc, o)]
    while remaining:  # at least one object per call, however small the budget
        copy_into_vault(svc, remaining.pop(0), context.vault, until)
        if time.monotonic() >= deadline:
            break
    if remaining:
        return {"remaining": len(remaining), "summary": summary}
    vault_key = write_vault_manifest(svc, manifest, summary["manifest_key"], context.vault, until)
    staging_keys = [*(o.key for o in objects), summary["manifest_key"]]
    for key in staging_keys:
        mark_promoted(svc, key)
    promotion = {
        "location": "vault",
        "vault_manifest_key": vault_key,
        "storage_class": context.vault.storage_class,
        "lock_mode": context.vault.lock_mode,
        "retain_until": until.isoformat(),
        "promoted_at": time.time(),
    }
    svc.catalog.update(context.cluster, context.backup_id, **promotion)
    left = remove_staging_copy(svc, staging_keys)
    if left:
        svc.catalog.update(context.cluster, context.backup_id, staging_left=left)
    return {"remaining": 0, "summary": {**summary, **promotion}}


PROMOTION_FIELDS = (
    "location",
    "vault_manifest_key",
    "storage_class",
    "lock_mode",
    "retain_until",
    "promoted_at",
)


def _promotion_of(record: dict[str, Any]) -> dict[str, Any]:
    return {name: record[name] for name in PROMOTION_FIELDS if name in record}


def remove_staging_copy(svc: Services, keys: list[str]) -> int:
    """Deletes the staging copy of a promoted backup in batches of up to 1,000 keys (the
    manifest in the last); returns how many keys are left (tagged: the lifecycle rule expires
    them)."""
    left, batches = 0, deletion_batches(keys)  # the store is not versioned: keys suffice
    for done, batch in enumerate(batches):
        try:
            response = svc.store_s3.delete_objects(
                Bucket=svc.store.bucket,
                Delete={"Objects": [{"Key": key} for key in batch], "Quiet": True},
            )
        except ClientError as error:
            log.warning("staging copy not deleted (%s): lifecycle expires it", error)
            return left + sum(len(b) for b in batches[done:])
        left += len(response.get("Errors", []))
    return left


def vault_key(svc: Services, store_key: str) -> str:
    """The vault keeps the store's layout under its own prefix."""
    relative = store_key.removeprefix(svc.store.prefix.strip("/") + "/")
    prefix = svc.vault.prefix.strip("/")
    return f"{prefix}/{relative}" if prefix else relative


def in_vault(svc: Services, obj: ObjectResult) -> bool:
    """Whether the vault already holds this object with the manifest's checksum."""
    try:
        crc, size = stored_checksum(svc.vault_s3, svc.vault.bucket, vault_key(svc, obj.key))
    except ClientError as error:
        if error.response["Error"]["Code"] in ("NoSuchKey", "404", "NotFound"):
            return False
        raise
    return crc == obj.crc64nvme and size == obj.length


def copy_into_vault(svc: Services, obj: ObjectResult, vault: VaultTarget, until: datetime) -> None:
    key = vault_key(svc, obj.key)
    extra = {
        "StorageClass": vault.storage_class,
        "ObjectLockMode": vault.lock_mode,
        "ObjectLockRetainUntilDate": until,
        "ChecksumAlgorithm": "CRC64NVME",
    }
    if not (same_server(svc) and copy_server_side(svc, obj.key, key, extra)):
        # Another server (a local store, or staging outside AWS), or one that cannot copy
        # parts into a checksummed upload: stream it through.
        body = svc.store_s3.get_object(Bucket=svc.store.bucket, Key=obj.key)["Body"]
        svc.vault_s3.upload_fileobj(body, svc.vault.bucket, key, ExtraArgs=extra)
    crc, size = stored_checksum(svc.vault_s3, svc.vault.bucket, key)
    if crc != obj.crc64nvme or size != obj.length:
        raise ChecksumMismatch(
            f"the vault's copy of {obj.key} holds {size} bytes with CRC64NVME {crc}; the "
            f"manifest says {obj.length} bytes with {obj.crc64nvme}.",
            fix="the promotion is retried from this object on; the backup stays restorable "
            "from the store meanwhile.",
        )


def copy_server_side(svc: Services, store_key: str, key: str, extra: dict[str, Any]) -> bool:
    """Copies within the server (one CopyObject up to 5 GiB, UploadPartCopy above). False
    when the server refuses to copy parts into an upload with a checksum algorithm: S3
    computes each copied part's checksum itself (there is no parameter to send one), but
    MinIO asks for one (``checksum missing, want "CRC64NVME"``) and cannot be given it."""
    source = {"Bucket": svc.store.bucket, "Key": store_key}
    try:
        svc.vault_s3.copy(source, svc.vault.bucket, key, ExtraArgs=extra, Config=COPY_CONFIG)
    except ClientError as error:
        info = error.response.get("Error", {})
        if info.get("Code") == "InvalidArgument" and "checksum" in info.get("Message", "").lower():
            log.info("server-side copy of %s refused (%s): streaming it", store_key, info)
            return False
        raise
    return True


def mark_promoted(svc: Services, key: str) -> None:
    """Tags the staging copy: should its deletion fail, the store's lifecycle rule expires it."""
    svc.store_s3.put_object_tagging(
        Bucket=svc.store.bucket,
        Key=key,
        Tagging={"TagSet": [{"Key": PROMOTED_TAG, "Value": "true"}]},
    )


def same_server(svc: Services) -> bool:
    return svc.store.endpoint == svc.vault.endpoint and (
        svc.store.credentials == svc.vault.credentials
    )


def write_vault_manifest(
    svc: Services, manifest: Manifest, store_key: str, vault: VaultTarget, until: datetime
) -> str:
    """The vault's own manifest: the store's, with keys in the vault. Written last."""
    moved = manifest.model_copy(
        update={
            "shards": [
                shard.model_copy(
                    update={
                        "streams": [
                            stream.model_copy(
                                update={
                                    "objects": [
                                        o.model_copy(update={"key": vault_key(svc, o.key)})
                                        for o in stream.objects
                                    ]
                                }
                            )
                            for stream in shard.streams
                        ]
                    }
                )
                for shard in manifest.shards
            ]
        }
    )
    key = vault_key(svc, store_key)
    svc.vault_s3.put_object(
        Bucket=svc.vault.bucket,
        Key=key,
        Body=moved.model_dump_json(indent=1).encode(),
        ContentType="application/json",
        ChecksumAlgorithm="CRC64NVME",
        ObjectLockMode=vault.lock_mode,
        ObjectLockRetainUntilDate=until,
    )
    return key


def record_failure(
    context: BackupContext, error: dict[str, Any], svc: Services, now: float
) -> dict[str, Any]:
    """The backup stays complete and restorable from the store; its promotion is failed."""
    outcome = {
        "promotion": "FAILED",
        "promotion_error": error.get("Error", "States.Runtime"),
        "promotion_cause": readable_cause(str(error.get("Cause") or ""))[:2000],
        "promotion_failed_at": now,
    }
    svc.catalog.update(context.cluster, context.backup_id, **outcome)
    svc.notify(
        f"ShardVault backup {context.backup_id}: promotion to the vault FAILED",
        {"backup_id": context.backup_id, **outcome},
    )
    return outcome
