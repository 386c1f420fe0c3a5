"""Promotion: a verified backup moves from the staging store into the vault.

Terms:
- *store* (staging): where agents upload. Once the vault holds a backup (every copy checked,
  manifest written, catalog updated) its staging copy is deleted: restores read promoted
  backups from the vault, and the copy would cost a day and a half at STANDARD (more than all
  of the backup's requests: docs/BENCHMARKS.md). Each staging object is tagged first, so a
  lifecycle rule expires what a failed deletion leaves.
- *vault*: a bucket with versioning and Object Lock that agents cannot reach; each object lands
  in the policy's storage class, locked until *retain-until* (completion + the policy's days).
- *read-back*: the class and lock the vault reports for each copy and for the vault's manifest
  (``HeadObject``). Promotion succeeds only if every one is locked at least as asked; the
  catalog then records what was read (the weakest mode, the earliest retain-until), never
  what was asked. A copy the store kept unlocked (moto keeps no lock from a multipart upload;
  S3 does) is locked once by ``PutObjectRetention`` and read again.
- *promotion*: every object copied (server-side when the vault is on the store's endpoint,
  managed multipart copy in 5 GiB parts above 5 GiB; streamed otherwise), each copy's
  CRC64NVME checked against the manifest, then the manifest written last. A call copies for
  at most ``promote_budget_seconds`` and reports what remains; the next call skips objects
  already in the vault with the right checksum, so a promotion that fails partway resumes, and
  no vault manifest ever names an object the vault lacks.
- *chain lock*: an incremental restores only with its ancestors' objects, so its promotion
  extends every ancestor's vault lock (objects, block map and manifest) to at least its own
  retain-until, reads each back, and records the ancestor's new lock in its catalog item: no
  backup an incremental needs is locked for less time than the incremental itself, and a
  child is not promoted while an ancestor is missing from the vault (``PromotionFailed``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from boto3.s3.transfer import TransferConfig
from botocore.exceptions import ClientError

from shardvault.aws.readback import load_manifest
from shardvault.aws.services import Services
from shardvault.aws.store import Bucket, is_missing
from shardvault.contracts.catalog import BackupItem
from shardvault.contracts.models import (
    BackupContext,
    BackupKind,
    LockMode,
    Manifest,
    ObjectResult,
    Phase,
    VaultTarget,
    lock_strength,
)
from shardvault.errors import ChecksumMismatch, InvalidRequest, PromotionFailed
from shardvault.lifecycle import copies
from shardvault.lifecycle.retention import deletion_batches
from shardvault.lifecycle.targets import days_after, moved_key, moved_manifest
from shardvault.pricing.prices import ARCHIVE_CLASSES, StorageClass
from shardvault.workflow.causes import readable_cause

log = logging.getLogger("shardvault.lifecycle.promote")
PROMOTED_TAG = "shardvault:promoted"  # infra's lifecycle rule expires staging objects so tagged
# One CopyObject up to 5 GiB (S3's limit for it); above, UploadPartCopy in the largest parts S3
# takes (5 GiB): each part is a request at the vault class's PUT price (costs.COPY_PART_SIZE).
COPY_CONFIG = TransferConfig(multipart_threshold=5 * 1024**3, multipart_chunksize=5 * 1024**3)


def retain_until(vault: VaultTarget, now: float) -> datetime:
    """``now`` + the lock's days, in whole seconds (rounded up), so the date the store
    reports back compares exactly with the date asked."""
    return days_after(now, vault.lock_days)


MANIFEST_CLASS = "STANDARD"  # the vault's manifest is read without a thaw


@dataclass(frozen=True)
class StoredLock:
    """What the vault reports of one object: its storage class and its Object Lock (mode and
    retain-until are None when it keeps none)."""

    key: str
    storage_class: str
    mode: str | None
    retain_until: datetime | None
    version_id: str | None = None  # the version read (the vault is versioned)

    def problem(self, vault: VaultTarget, until: datetime, storage_class: str) -> str | None:
        """Why this copy is not held as asked (None: it is)."""
        if self.mode not in list(LockMode) or self.retain_until is None:
            seen = f" (it reports mode {self.mode!r})" if self.mode else ""
            return "keeps no Object Lock" + seen
        if lock_strength(LockMode(self.mode)) < lock_strength(vault.lock_mode):
            return f"is locked in {self.mode} mode, not {vault.lock_mode}"
        if self.retain_until < until:
            return f"is locked until {self.retain_until.isoformat()}, before {until.isoformat()}"
        if self.storage_class != storage_class:
            return f"is in storage class {self.storage_class}, not {storage_class}"
        return None


def read_lock(svc: Services, key: str, version_id: str | None = None) -> StoredLock:
    """The vault's class and lock of ``key`` (its newest version, or ``version_id``):
    HeadObject shows the lock only to a caller allowed s3:GetObjectRetention; without it the
    copy reads as unlocked."""
    head = vault_of(svc).head(key, version_id)
    until = head.get("ObjectLockRetainUntilDate")
    return StoredLock(
        key=key,
        storage_class=head.get("StorageClass", "STANDARD"),  # S3 names no class for STANDARD
        mode=head.get("ObjectLockMode"),
        retain_until=until.astimezone(UTC) if until else None,
        version_id=head.get("VersionId"),
    )


def confirm_lock(
    svc: Services, key: str, vault: VaultTarget, until: datetime, storage_class: str
) -> StoredLock:
    """Reads back the class and lock of a copy just written; locks it if the store kept no
    lock (moto's multipart uploads); raises ``PromotionFailed`` unless it is held as asked."""
    stored = read_lock(svc, key)
    if stored.mode is None:
        try:
            vault_of(svc).lock(key, None, vault.lock_mode.value, until)
        except ClientError as error:
            problem = f"keeps no Object Lock and refused one ({error})"
            raise unlocked(stored.key, problem, vault, until) from None
        stored = read_lock(svc, key)
    if problem := stored.problem(vault, until, storage_class):
        raise unlocked(key, problem, vault, until)
    return stored


def unlocked(key: str, problem: str, vault: VaultTarget, until: datetime) -> PromotionFailed:
    return PromotionFailed(
        f"the vault's copy of {key} {problem}; asked: {vault.lock_mode} until "
        f"{until.isoformat()}. Nothing was recorded as locked.",
        fix="check that the vault bucket has Object Lock enabled and that the promote "
        "function may set and read retention (s3:PutObjectRetention, s3:GetObjectRetention); "
        "the backup stays complete and restorable from the store.",
    )


def recorded_lock(
    objects: list[StoredLock], manifest: StoredLock, locks: list[StoredLock] | None = None
) -> dict[str, Any]:
    """What the catalog records of a promotion, all read back from the vault: the objects'
    class (each checked to be the one asked), and the lock every copy holds at least (the
    weakest mode, the earliest retain-until, the manifest's included)."""
    locks = [*(objects if locks is None else locks), manifest]
    mode = min((s.mode for s in locks), key=lambda m: lock_strength(LockMode(m)))
    until = min(s.retain_until for s in locks if s.retain_until)
    storage_class = (objects or [manifest])[0].storage_class
    return {"storage_class": storage_class, "lock_mode": mode, "retain_until": until.isoformat()}


def promote(
    context: BackupContext, summary: dict[str, Any], svc: Services, now: float
) -> dict[str, Any]:
    """Copies what the vault still lacks, then what each copy target lacks, for at most the
    time budget; the stack vault's manifest is written once its objects are there, each
    target's once its are. Returns ``remaining`` (objects still to copy: call again) and,
    when done, the backup's summary with its vault fields."""
    if context.vault is None or svc.vault is None:
        raise PromotionFailed("the backup has no vault to go to.", fix="nothing to promote.")
    record = svc.catalog.get(context.cluster, context.backup_id)
    targets = copies.targets_of(svc, context.cluster)
    in_vault = record is not None and record.location == "vault"
    try:
        manifest = load_manifest(svc.store_bucket, summary["manifest_key"])
    except InvalidRequest:  # the staging copy is gone: a retried call after success, or a
        if not in_vault:  # target added to the policy after it went
            raise
        copies.skip_unsettled(context, targets, svc, "its staging copy was gone")
        return finished(summary, svc.catalog.get(context.cluster, context.backup_id))
    deadline = time.monotonic() + svc.settings.promote_budget_seconds
    if not in_vault and (
        remaining := promote_to_stack(context, summary, manifest, svc, now, deadline)
    ):
        return {"remaining": remaining, "summary": summary}
    if remaining := copies.copy_out(
        context, manifest, summary["manifest_key"], targets, svc, now, deadline
    ):
        return {"remaining": remaining, "summary": summary}
    # Every target settled. A call that died below is retried from here: tagging and deleting
    # are idempotent, and once the manifest is gone the call above finds nothing to do.
    keep = keeps_chain(svc, context.cluster)
    if context.kind == BackupKind.FULL:  # a new chain: no later backup copies an older one
        records = svc.catalog.backups(context.cluster)
        release_kept_chains(svc, context.cluster, context.backup_id, records)
    elif not keep:  # the policy stopped synthesizing: this chain's kept copies go
        records = ancestor_records(svc, context)
        release_kept_chains(svc, context.cluster, context.backup_id, records)
    if keep:
        kept = BackupItem.changes(staging_kept=True)
        svc.catalog.update(context.cluster, context.backup_id, kept)
    elif left := release_staging_copy(svc, manifest, summary["manifest_key"]):
        left_over = BackupItem.changes(staging_left=left)
        svc.catalog.update(context.cluster, context.backup_id, left_over)
    return finished(summary, svc.catalog.get(context.cluster, context.backup_id))


def keeps_chain(svc: Services, cluster: str) -> bool:
    """Whether promotion keeps the staging copy: the cluster's policy synthesizes fulls, which
    copy the newest chain inside the store (``shardvault.backup.synthesis``)."""
    policy = svc.policy()
    entry = policy.clusters.get(cluster) if policy else None
    return entry is not None and entry.incremental.synthesized_fulls > 0


def release_staging_copy(svc: Services, manifest: Manifest, manifest_key: str) -> int:
    """Tags, then deletes, a promoted backup's staging copy; how many keys are left."""
    staging_keys = [*(o.key for s in manifest.shards for o in s.objects), manifest_key]
    for key in staging_keys:  # every target holds it now (or failed and raised its alarm)
        mark_promoted(svc, key)
    return remove_staging_copy(svc, staging_keys)


def ancestor_records(svc: Services, context: BackupContext) -> list[BackupItem]:
    """The catalog records of an incremental's ancestors when its chain's copies were kept,
    which its parent's record says (one read; none where nothing was kept)."""
    link = context.chain
    parent = svc.catalog.get(context.cluster, link.parent_id) if link else None
    if link is None or parent is None or not parent.staging_kept:
        return []
    others = (svc.catalog.get(context.cluster, a) for a in link.ancestors[:-1])
    return [*(r for r in others if r is not None), parent]


def release_kept_chains(
    svc: Services, cluster: str, newer: str, records: Iterable[BackupItem]
) -> None:
    """Deletes the staging copies kept (``keeps_chain``) of ``records`` older than ``newer``
    and records them released: nothing copies them any more."""
    for record in records:
        if not record.staging_kept or record.backup_id >= newer:
            continue
        try:
            kept = load_manifest(svc.store_bucket, record.manifest_key or "")
        except InvalidRequest:  # already gone: a retried call
            kept = None
        try:
            left = release_staging_copy(svc, kept, record.manifest_key or "") if kept else 0
            changes = {"staging_kept": False} | ({"staging_left": left} if left else {})
            svc.catalog.update(cluster, record.backup_id, BackupItem.changes(**changes))
        except ClientError as error:  # housekeeping: the next full's promotion tries again
            log.warning("kept staging copy of %s not released (%s)", record.backup_id, error)


def finished(summary: dict[str, Any], record: BackupItem | None) -> dict[str, Any]:
    fields = _promotion_of(record) if record else {}
    if record and record.vault_copies:
        # Each copy target's state (the catalog item holds what each reported back).
        fields["copies"] = {name: c.state for name, c in record.vault_copies.items()}
    return {"remaining": 0, "summary": {**summary, **fields}}


def promote_to_stack(
    context: BackupContext,
    summary: dict[str, Any],
    manifest: Manifest,
    svc: Services,
    now: float,
    deadline: float,
) -> int:
    """The stack vault's share of a call: copies its missing objects, and once none is
    missing writes its manifest and records the promotion. Returns how many remain."""
    assert context.vault is not None
    until = retain_until(context.vault, summary.get("completed_at", now))
    objects = [o for s in manifest.shards for o in s.objects]
    # Each call reads back every object's lock: those already held, and those it copies.
    held = {o.key: held_in_vault(svc, o, vault_for(o, context.vault), until) for o in objects}
    remaining = [o for o in objects if held[o.key] is None]
    while remaining:  # at least one object per call, however small the budget
        obj = remaining.pop(0)
        held[obj.key] = copy_into_vault(svc, obj, vault_for(obj, context.vault), until)
        if time.monotonic() >= deadline:
            break
    if remaining:
        return len(remaining)
    hold_ancestors(svc, context.cluster, manifest, until)
    versions = {key: lock.version_id for key, lock in held.items()}
    vault_key, manifest_version = write_vault_manifest(
        svc, manifest, summary["manifest_key"], context.vault, until, versions
    )
    manifest_lock = confirm_lock(svc, vault_key, context.vault, until, MANIFEST_CLASS)
    promotion = {
        "location": "vault",
        "vault_manifest_key": vault_key,
        # Restores and verifies read this version (its objects' are in it): see ObjectResult.
        "vault_manifest_version": manifest_version,
        # As read back, not as asked; the class is the data's (block maps stay readable).
        **recorded_lock(
            [held[o.key] for o in objects if o.phase != Phase.BLOCKMAP] or list(held.values()),
            manifest_lock,
            locks=list(held.values()),
        ),
        "promoted_at": time.time(),
    }
    svc.catalog.update(context.cluster, context.backup_id, BackupItem.changes(**promotion))
    return 0


PROMOTION_FIELDS = (
    "location",
    "vault_manifest_key",
    "vault_manifest_version",
    "storage_class",
    "lock_mode",
    "retain_until",
    "promoted_at",
    "promotion",
)


def hold_ancestors(svc: Services, cluster: str, manifest: Manifest, until: datetime) -> None:
    """Extends the vault lock of every backup an incremental's restore reads (its ancestors)
    to at least ``until``, before the incremental's own vault manifest is written: the vault
    never names a restore point whose chain may be deleted before it. An ancestor already
    recorded as held that long (read back at an earlier extension) costs no request."""
    for backup_id in manifest.chain.ancestors if manifest.chain else []:
        record = svc.catalog.get(cluster, backup_id)
        if record is None or record.location != "vault" or record.retain_until is None:
            state = (record.promotion or record.status) if record else "no record"
            raise PromotionFailed(
                f"backup {manifest.backup_id} is an incremental of {backup_id}, which is not in "
                f"the vault ({state}): "
                "a vault copy of it could not be restored on its own.",
                fix="start a full backup (a new chain): an incremental bound for the vault "
                "continues only a parent already there, so its chain lost a vault copy since; "
                "this backup stays complete and restorable from the store.",
            )
        held = datetime.fromisoformat(record.retain_until)
        if held >= until:
            continue
        locks = [extend_lock(svc, *place, until) for place in vault_keys_of(svc, record)]
        earliest = min(s.retain_until for s in locks if s.retain_until)
        svc.catalog.update(
            cluster, backup_id, BackupItem.changes(retain_until=earliest.isoformat())
        )
        log.info("vault lock of %s extended to %s for %s", backup_id, until, manifest.backup_id)


def vault_keys_of(svc: Services, record: BackupItem) -> list[tuple[str, str | None]]:
    """Every (key, locked version) of a promoted backup in the vault: its objects, block maps
    and manifest (no version: promoted before versions were recorded, the newest is read)."""
    manifest_key, manifest_version = record.vault_manifest_key or "", record.vault_manifest_version
    manifest = load_manifest(vault_of(svc), manifest_key, manifest_version)
    objects = [(o.key, o.version_id) for s in manifest.shards for o in s.objects]
    return [*objects, (manifest_key, manifest_version)]


def extend_lock(svc: Services, key: str, version_id: str | None, until: datetime) -> StoredLock:
    """Extends one vault object's lock to ``until`` in the mode it already holds (Object Lock
    lets any lock be extended, never shortened), and returns the lock read back."""
    stored = read_lock(svc, key, version_id)
    if stored.mode is not None and stored.retain_until is not None and stored.retain_until < until:
        vault_of(svc).lock(key, version_id, stored.mode, until)
        stored = read_lock(svc, key, version_id)
    if stored.mode is None or stored.retain_until is None or stored.retain_until < until:
        raise PromotionFailed(
            f"the vault's copy of {key}, which a newer incremental needs, is locked until "
            f"{stored.retain_until} ({stored.mode or 'no lock'}), not until {until.isoformat()}, "
            "and could not be extended. Nothing was recorded as locked.",
            fix="check that the promote function may set and read retention "
            "(s3:PutObjectRetention, s3:GetObjectRetention); the incremental stays complete "
            "and restorable from the store.",
        )
    return stored


def _promotion_of(record: BackupItem) -> dict[str, Any]:
    return record.model_dump(mode="json", include=set(PROMOTION_FIELDS), exclude_none=True)


def remove_staging_copy(svc: Services, keys: list[str]) -> int:
    """Deletes the staging copy of a promoted backup in batches of up to 1,000 keys (the
    manifest in the last); returns how many keys are left (tagged: the lifecycle rule expires
    them)."""
    left, batches = 0, deletion_batches(keys)  # the store is not versioned: keys suffice
    for done, batch in enumerate(batches):
        try:
            errors = svc.store_bucket.delete_batch([(key, None) for key in batch])
        except ClientError as error:
            log.warning("staging copy not deleted (%s): lifecycle expires it", error)
            return left + sum(len(b) for b in batches[done:])
        left += len(errors)
    return left


def vault_of(svc: Services) -> Bucket:
    """The vault's bucket; a promotion is refused before any call when there is none."""
    if svc.vault_bucket is None:
        raise PromotionFailed("the backup has no vault to go to.", fix="nothing to promote.")
    return svc.vault_bucket


def vault_key(svc: Services, store_key: str) -> str:
    """The vault keeps the store's layout under its own prefix."""
    return moved_key(svc, store_key, svc.vault.prefix if svc.vault else "")


def held_in_vault(
    svc: Services, obj: ObjectResult, vault: VaultTarget, until: datetime
) -> StoredLock | None:
    """The vault's lock of this object when the vault already holds it with the manifest's
    checksum and the lock asked; None: copy it (again: a new, locked version)."""
    key = vault_key(svc, obj.key)
    try:
        crc, size = vault_of(svc).stored_checksum(key)
    except ClientError as error:
        if is_missing(error):
            return None
        raise
    if crc != obj.crc64nvme or size != obj.stored_bytes:
        return None
    stored = read_lock(svc, key)
    return None if stored.problem(vault, until, vault.storage_class) else stored


def vault_for(obj: ObjectResult, vault: VaultTarget) -> VaultTarget:
    """Where an object goes in the vault: a block map stays readable without a thaw (the
    next incremental may have to read it; it is a few MiB per TiB), the rest in the vault's
    class."""
    if obj.phase == Phase.BLOCKMAP and vault.storage_class in ARCHIVE_CLASSES:
        return vault.model_copy(update={"storage_class": StorageClass.GLACIER_IR})
    return vault


def copy_into_vault(
    svc: Services, obj: ObjectResult, vault: VaultTarget, until: datetime
) -> StoredLock:
    """Copies one object into the vault, checks the copy's checksum, and returns its lock as
    read back (``confirm_lock``)."""
    key = vault_key(svc, obj.key)
    extra = {
        "StorageClass": vault.storage_class.value,
        "ObjectLockMode": vault.lock_mode.value,
        "ObjectLockRetainUntilDate": until,
        "ChecksumAlgorithm": "CRC64NVME",
    }
    if not (same_server(svc) and copy_server_side(svc, obj.key, key, extra)):
        # Another server (a local store, or staging outside AWS), or one that cannot copy
        # parts into a checksummed upload: stream it through.
        body = svc.store_bucket.get(obj.key)["Body"]
        vault_of(svc).upload(body, key, extra)
    crc, size = vault_of(svc).stored_checksum(key)
    if crc != obj.crc64nvme or size != obj.stored_bytes:
        raise ChecksumMismatch(
            f"the vault's copy of {obj.key} holds {size} bytes with CRC64NVME {crc}; the "
            f"manifest says {obj.stored_bytes} bytes with {obj.crc64nvme}.",
            fix="the promotion is retried from this object on; the backup stays restorable "
            "from the store meanwhile.",
        )
    return confirm_lock(svc, key, vault, until, vault.storage_class)


def copy_server_side(svc: Services, store_key: str, key: str, extra: dict[str, Any]) -> bool:
    """Copies within the server (one CopyObject up to 5 GiB, UploadPartCopy above). False
    when the server refuses to copy parts into an upload with a checksum algorithm: S3
    computes each copied part's checksum itself (there is no parameter to send one), but
    MinIO asks for one (``checksum missing, want "CRC64NVME"``) and cannot be given it."""
    try:
        vault_of(svc).copy_from(svc.store_bucket, store_key, key, extra, COPY_CONFIG)
    except ClientError as error:
        info = error.response.get("Error", {})
        if info.get("Code") == "InvalidArgument" and "checksum" in info.get("Message", "").lower():
            log.info("server-side copy of %s refused (%s): streaming it", store_key, info)
            return False
        raise
    return True


def mark_promoted(svc: Services, key: str) -> None:
    """Tags the staging copy: should its deletion fail, the store's lifecycle rule expires it.
    A key already gone needs no tag."""
    try:
        svc.store_bucket.tag(key, {PROMOTED_TAG: "true"})
    except ClientError as error:
        if not is_missing(error):
            raise


def same_server(svc: Services) -> bool:
    return svc.store.endpoint == svc.vault.endpoint and (
        svc.store.credentials == svc.vault.credentials
    )


def write_vault_manifest(
    svc: Services,
    manifest: Manifest,
    store_key: str,
    vault: VaultTarget,
    until: datetime,
    versions: dict[str, str | None],
) -> tuple[str, str | None]:
    """The vault's own manifest: the store's, with keys in the vault and the version of each
    copy (``versions``, by store key). Written last; returns its key and version."""
    moved = moved_manifest(manifest, lambda k: vault_key(svc, k), versions)
    key = vault_key(svc, store_key)
    written = vault_of(svc).put(
        key,
        moved.model_dump_json(indent=1).encode(),
        ContentType="application/json",
        ChecksumAlgorithm="CRC64NVME",
        ObjectLockMode=vault.lock_mode.value,
        ObjectLockRetainUntilDate=until,
    )
    return key, written.get("VersionId")


def record_failure(
    context: BackupContext, error: dict[str, Any], svc: Services, now: float
) -> dict[str, Any]:
    """The backup stays complete and restorable from the store; its promotion is failed (or
    PARTIAL, when the stack vault holds it and a copy target's step is what failed)."""
    record = svc.catalog.get(context.cluster, context.backup_id)
    in_vault = record is not None and record.location == "vault"
    outcome = {
        "promotion": "PARTIAL" if in_vault else "FAILED",
        "promotion_error": error.get("Error", "States.Runtime"),
        "promotion_cause": readable_cause(str(error.get("Cause") or ""))[:2000],
        "promotion_failed_at": now,
    }
    svc.catalog.update(context.cluster, context.backup_id, BackupItem.changes(**outcome))
    svc.notify(
        f"ShardVault backup {context.backup_id}: promotion {outcome['promotion']}",
        {"backup_id": context.backup_id, **outcome},
    )
    return outcome
