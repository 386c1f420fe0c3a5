"""Vault copies: a verified backup copied to each of its cluster's copy targets
(``vault.copies``, ``shardvault.config.targets``) once the stack's vault holds it.

Terms:
- *target*: one entry of ``vault.copies``: a GCS bucket (``shardvault.gcp.storage``) or an
  Object Lock bucket in another AWS account (``shardvault.aws.copy_target``). Both are
  reached as a *target bucket*, which copies an object in and proves it, reads it back,
  extends its retention and reads its bytes; this module knows neither provider.
- *source*: the backup's staging copy in the store. Every target copies from it, never from
  the stack's vault, whose archive classes cannot be read without a thaw; so the staging copy
  is removed only once every target has *settled*.
- *settled*: the catalog records the target's ``CopyRecord``: COPIED (with what the provider
  reports), SKIPPED (the target's selection does not take this backup) or FAILED. A failed
  target leaves the others' copies, and the stack vault's, in place: the backup is marked
  ``promotion: PARTIAL`` and an alarm is sent.
- *progress*: the proof of every object already copied in an earlier budgeted call (and the
  time spent so far), kept in the work bucket, so a resumed copy goes on from the next
  object. An object that landed without its proof being kept (a call that died just then) is
  proven equal again (``copy_in``).
- *chain hold*: a copied incremental extends the retention of its ancestors' copies in that
  target to at least its own, as the stack vault does with Object Lock.
- *recovery key*: a target's ``recovery_key``: the target's manifest wraps the backup's data
  key under it instead of the stack's (``keys.for_recovery``), so restoring the copy needs no
  key of the stack's account; every object's bytes are the store's, unchanged.
"""

from __future__ import annotations

import io
import logging
import re
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from botocore import exceptions as botocore_errors
from botocore.exceptions import ClientError
from google.api_core import exceptions as gcs_errors

from shardvault.aws.keys import for_recovery, same_key
from shardvault.aws.services import Services
from shardvault.config.targets import GcsTarget, Selection, VaultCopy, recovery_key_of
from shardvault.contracts.catalog import BackupItem, CopyRecord
from shardvault.contracts.models import BackupContext, Encryption, Manifest, ObjectResult
from shardvault.data.checksums import crc64nvme_of_bytes
from shardvault.errors import PromotionFailed
from shardvault.gcp.storage import GcsBucket
from shardvault.lifecycle.targets import (
    HeldCopy,
    TargetBucket,
    bucket_of,
    days_after,
    moved_key,
    moved_manifest,
)

log = logging.getLogger("shardvault.lifecycle.copies")
# Errors worth another call: the provider busy or unreachable once its client's retries ran
# out (google.api_core's RetryError, 429, 5xx), a connection lost.
TRANSIENT = (
    botocore_errors.ConnectionError,  # botocore's own: endpoint, connect, closed
    botocore_errors.HTTPClientError,  # and read timeouts, a stream cut short
    gcs_errors.RetryError,
    gcs_errors.TooManyRequests,
    gcs_errors.ServerError,
    ConnectionError,
    TimeoutError,
)
# AWS's answers worth another call (botocore's own retries ran out on them).
TRANSIENT_CODES = frozenset(
    {
        "Throttling",
        "ThrottlingException",
        "SlowDown",
        "RequestTimeout",
        "InternalError",
        "ServiceUnavailable",
        "500",
        "502",
        "503",
        "504",
    }
)
COPY_ATTEMPTS = 3
QUERY = re.compile(r"(https?://[^\s?'\"]+)\?[^\s'\"]*")
COPIES_DIR = "copies"  # under a backup's work prefix: each target's progress (infra grants it)
BUCKET_POLICY = "bucket policy"  # the retention mode recorded for a bucket-style target


def targets_of(svc: Services, cluster: str) -> list[VaultCopy]:
    """The cluster's copy targets in the deployed policy ([] without a policy)."""
    policy = svc.policy()
    if policy is None or cluster not in policy.clusters:
        return []
    return list(policy.cluster(cluster).vault.copies)


def settled(record: BackupItem, targets: list[VaultCopy]) -> bool:
    return all(t.name in record.vault_copies for t in targets)


def copy_out(
    context: BackupContext,
    manifest: Manifest,
    manifest_key: str,
    targets: list[VaultCopy],
    svc: Services,
    now: float,
    deadline: float,
) -> int:
    """Copies the backup to every target not yet settled, in the policy's order, until the
    budget runs out; records each target as it settles. Returns how many objects remain."""
    for target in targets:
        record = svc.catalog.get(context.cluster, context.backup_id)
        if record is None or target.name in record.vault_copies:
            continue
        outcome: CopyRecord | int
        if reason := skipped_because(target, record, svc):
            outcome = CopyRecord(state="SKIPPED", reason=reason)
        else:
            try:
                outcome = copy_to_target(
                    target, context, manifest, manifest_key, svc, now, deadline
                )
            except Exception as error:  # one target's failure never stops the others
                reason = scrubbed(f"{type(error).__name__}: {error}")
                log.warning("copy of %s to %s failed: %s", context.backup_id, target.name, reason)
                outcome = retried_or_failed(context, target, error, reason, svc)
        if isinstance(outcome, int):
            return outcome
        settle(svc, context, target.name, outcome)
    return 0


def skip_unsettled(
    context: BackupContext, targets: list[VaultCopy], svc: Services, reason: str
) -> None:
    """Settles every target not yet settled as SKIPPED, saying why."""
    record = svc.catalog.get(context.cluster, context.backup_id)
    for target in targets:
        if record is not None and target.name not in record.vault_copies:
            settle(svc, context, target.name, CopyRecord(state="SKIPPED", reason=reason))


def settle(svc: Services, context: BackupContext, name: str, outcome: CopyRecord) -> None:
    record = svc.catalog.get(context.cluster, context.backup_id)
    held = dict(record.vault_copies) if record else {}
    changes: dict[str, Any] = {"vault_copies": {**held, name: outcome}}
    if outcome.state == "FAILED":
        changes["promotion"] = "PARTIAL"
    svc.catalog.update(context.cluster, context.backup_id, BackupItem.changes(**changes))


def retried_or_failed(
    context: BackupContext, target: VaultCopy, error: Exception, reason: str, svc: Services
) -> CopyRecord | int:
    """A transient error (the provider busy or unreachable after its client's own retries, a
    throttled AWS call) leaves the target unsettled for the next call, ``COPY_ATTEMPTS`` times
    over; any other error, or the last attempt, settles it FAILED."""
    if transient(error):
        progress = load_progress(svc, context.backup_id, target.name)
        progress["attempts"] = progress.get("attempts", 0) + 1
        save_progress(svc, context.backup_id, target.name, progress)
        if progress["attempts"] < COPY_ATTEMPTS:
            return 1
    return failed(context, target, error, reason, svc)


def transient(error: BaseException) -> bool:
    """A busy or unreachable provider (``error``, or what it wraps: a KMS call's answer)."""
    if isinstance(error, ClientError):
        return error.response.get("Error", {}).get("Code") in TRANSIENT_CODES
    if isinstance(error, TRANSIENT):
        return True
    return error.__cause__ is not None and transient(error.__cause__)


def scrubbed(text: str) -> str:
    """An error's text without any URL's query: a resumable upload's session URI (its
    ``upload_id``) works as a bearer token for a week, and must reach no record or log."""
    return QUERY.sub(r"\1?...", text)


def failed(
    context: BackupContext, target: VaultCopy, error: Exception, reason: str, svc: Services
) -> CopyRecord:
    """The target's failure, named, and the alarm: the backup is in the stack's vault and
    every other target that took it."""
    fix = getattr(error, "fix", "")
    reason += f" Fix: {fix}" if fix else ""
    svc.notify(
        f"ShardVault backup {context.backup_id}: copy to {target.name} FAILED (PARTIAL)",
        {"backup_id": context.backup_id, "target": target.name, "reason": reason[:2000]},
    )
    return CopyRecord(state="FAILED", kind=target.kind, bucket=target.bucket, reason=reason[:2000])


# --- Selection --------------------------------------------------------------------------------
def skipped_because(target: VaultCopy, record: BackupItem, svc: Services) -> str | None:
    """Why the target does not take this backup (None: it does). A target keeps whole
    chains: an incremental goes only where its parent has a copy."""
    if record.is_incremental:
        if target.select != Selection.ALL:
            return f"select: {target.select} takes fulls only"
        parent = svc.catalog.get(record.cluster, record.parent_id or "")
        held = parent.vault_copies.get(target.name) if parent else None
        if held is None or held.state != "COPIED":
            return f"its parent {record.parent_id} has no copy there, so it could not be restored"
        recovery_key = recovery_key_of(target)
        if recovery_key and not (held.data_key and same_key(held.data_key, recovery_key)):
            return (
                f"its parent {record.parent_id}'s copy there is not under the recovery key (it "
                "was copied before the key was set), so the chain would need the stack's key: "
                "the next full starts a chain there"
            )
        return None
    if target.select == Selection.WEEKLY and (copied := week_copy(target, record, svc)):
        return f"select: weekly, and {copied} is this ISO week's copy"
    return None


def week_copy(target: VaultCopy, record: BackupItem, svc: Services) -> str | None:
    """Another backup of the cluster copied to the target in the same ISO week (UTC)."""
    week = iso_week(record.completed_at or time.time())
    for other in svc.catalog.backups(record.cluster):
        held = other.vault_copies.get(target.name)
        copied = held is not None and held.state == "COPIED"
        if (
            copied
            and other.backup_id != record.backup_id
            and iso_week(other.completed_at or 0) == week
        ):
            return other.backup_id
    return None


def iso_week(at: float) -> tuple[int, int]:
    year, week, _ = datetime.fromtimestamp(at, UTC).isocalendar()
    return year, week


# --- The copy ---------------------------------------------------------------------------------
def copy_to_target(
    target: VaultCopy,
    context: BackupContext,
    manifest: Manifest,
    store_manifest_key: str,
    svc: Services,
    now: float,
    deadline: float,
) -> CopyRecord | int:
    """Copies what the target lacks, at least one object per call; once every object is
    there, holds the chain and writes the target's manifest last. Returns the copy's record,
    or how many objects remain."""
    started = time.monotonic()
    bucket = bucket_of(target, svc, f"promote-{context.backup_id}")
    record = svc.catalog.get(context.cluster, context.backup_id)
    completed = (record.completed_at if record else None) or now
    until = held_until(target, bucket, completed)
    progress = load_progress(svc, context.backup_id, target.name)
    proofs: dict[str, dict[str, Any]] = progress.setdefault("objects", {})
    objects = [o for s in manifest.shards for o in s.objects]
    # Every data key wrapped under the recovery key first: a key that refuses fails the copy
    # before a byte lands (and is locked) in the target.
    wrap = recovery_wrap(svc, target)
    if wrap is not None:
        for encryption in (manifest.encryption, *(o.encryption for o in objects)):
            if encryption is not None:
                wrap(encryption)

    def save() -> None:
        progress["seconds"] = progress.get("seconds", 0.0) + time.monotonic() - started
        save_progress(svc, context.backup_id, target.name, progress)

    for index, obj in enumerate(o for o in objects if o.key not in proofs):
        if index and time.monotonic() >= deadline:
            save()
            return sum(o.key not in proofs for o in objects)
        proofs[obj.key] = proof_of(copy_object(bucket, target, obj, svc, until))
    if until is not None:
        hold_chain(bucket, target, svc, context.cluster, manifest, until)
    moved = moved_manifest(
        manifest,
        lambda key: target_key(svc, target, key),
        {key: version_of(p) for key, p in proofs.items()},
        wrap,
    )
    data = moved.model_dump_json(indent=1).encode()
    manifest_key = target_key(svc, target, store_manifest_key)
    # Read without a thaw: by the next incremental's chain hold, by restores and verifies.
    manifest_class = bucket.readable_class(target.storage_class)
    written = bucket.copy_in(
        lambda: io.BytesIO(data),
        manifest_key,
        len(data),
        crc64nvme_of_bytes(data),
        manifest_class,
        until,
    )
    bucket.check_held(written, manifest_class, until)
    save()
    held = [written.retain_until, *(_when(p["retain_until"]) for p in proofs.values())]
    earliest = min((h for h in held if h is not None), default=None)
    return CopyRecord(
        state="COPIED",
        kind=target.kind,
        bucket=target.bucket,
        manifest_key=manifest_key,
        manifest_generation=written.version,
        # The data's class, as read back (each checked against the target's); the manifest's
        # may be a readable one (an archive class in account B).
        storage_class=next(
            (p.get("storage_class", target.storage_class) for p in proofs.values()),
            written.storage_class,
        ),
        retention_mode=bucket.retention_mode if until is not None else BUCKET_POLICY,
        retain_until=earliest.isoformat() if earliest else None,
        objects=len(objects),
        bytes=sum(o.stored_bytes for o in objects),
        proof=bucket.proof_text,
        copied_at=time.time(),
        seconds=round(progress["seconds"], 3),
        data_key=held_key(bucket, target, manifest_key, written.version),
    )


def recovery_wrap(svc: Services, target: VaultCopy) -> Callable[[Encryption], Encryption] | None:
    """The target's *recovery key* wrapping, each data key once (None: no recovery key)."""
    recovery_key = recovery_key_of(target)
    if recovery_key is None:
        return None
    done: dict[str, Encryption] = {}

    def wrap(encryption: Encryption) -> Encryption:
        if encryption.wrapped_key not in done:
            done[encryption.wrapped_key] = for_recovery(svc, encryption, recovery_key)
        return done[encryption.wrapped_key]

    return wrap


def held_key(
    bucket: TargetBucket, target: VaultCopy, manifest_key: str, version: str | None
) -> str | None:
    """The key the target's manifest, read back, wraps the data key under; refused when the
    target has a recovery key and the manifest names another."""
    held = Manifest.model_validate_json(bucket.read_all(manifest_key, version))
    key = held.encryption.key_id if held.encryption else None
    recovery_key = recovery_key_of(target)
    if key and recovery_key and not same_key(key, recovery_key):
        raise PromotionFailed(
            f"the manifest {manifest_key} in {target.name!r} reads back with its data key under "
            f"{key}, not the recovery key {recovery_key}.",
            fix="report this: the copy needs the stack's key; the next backup is copied again.",
        )
    return key


def held_until(target: VaultCopy, bucket: TargetBucket, completed: float) -> datetime | None:
    """The retention (or lock) each object gets; None for a GCS bucket-style target, whose
    locked retention policy is read back first and must be long enough."""
    if not isinstance(target, GcsTarget) or target.retention.style == "object":
        return days_after(completed, target.held_days)
    assert isinstance(bucket, GcsBucket)
    days = bucket.locked_retention_days()
    if days is None or days < target.retention.days:
        held = "no locked retention policy" if days is None else f"a {days:g}-day policy"
        raise PromotionFailed(
            f"GCS bucket {target.bucket} has {held}; copy {target.name!r} asks for a locked "
            f"{target.retention.days}-day one.",
            fix="set and lock the bucket's retention policy (gcloud storage buckets update "
            "--retention-period, then --lock-retention-period), or use retention.style: object.",
        )
    return None


def copy_object(
    bucket: TargetBucket,
    target: VaultCopy,
    obj: ObjectResult,
    svc: Services,
    until: datetime | None,
) -> HeldCopy:
    copy = bucket.copy_in(
        lambda: svc.store_bucket.get(obj.key)["Body"],
        target_key(svc, target, obj.key),
        obj.stored_bytes,
        obj.crc64nvme,
        target.storage_class,
        until,
    )
    bucket.check_held(copy, target.storage_class, until)
    return copy


def version_of(proof: dict[str, Any]) -> str | None:
    """A kept proof's version (progress kept by an earlier release names a GCS generation)."""
    if proof.get("version"):
        return str(proof["version"])
    return str(proof["generation"]) if "generation" in proof else None


def proof_of(copy: HeldCopy) -> dict[str, Any]:
    """What the progress keeps of a copied object: its version (or generation), what the
    provider reported of it, and its retain-until."""
    return {
        **copy.proof(),
        "storage_class": copy.storage_class,
        "retain_until": copy.retain_until.isoformat() if copy.retain_until else None,
    }


def hold_chain(
    bucket: TargetBucket,
    target: VaultCopy,
    svc: Services,
    cluster: str,
    manifest: Manifest,
    until: datetime,
) -> None:
    """Extends the retention of every ancestor's copy in the target to at least ``until``
    before the incremental's own manifest is written there."""
    for backup_id in manifest.chain.ancestors if manifest.chain else []:
        ancestor = svc.catalog.get(cluster, backup_id)
        held = ancestor.vault_copies.get(target.name) if ancestor else None
        if held is None or held.state != "COPIED" or held.manifest_key is None:
            raise PromotionFailed(
                f"backup {manifest.backup_id} is an incremental of {backup_id}, which has no "
                f"copy in {target.name!r}.",
                fix="start a full backup (a new chain); this one stays in the stack vault.",
            )
        if held.retain_until and datetime.fromisoformat(held.retain_until) >= until:
            continue
        places = [*copied_places(bucket, held), (held.manifest_key, held.manifest_generation)]
        extended = [bucket.extend(key, until, version) for key, version in places]
        if short := [c.key for c in extended if c.retain_until is None or c.retain_until < until]:
            raise PromotionFailed(
                f"{target.name!r} holds {short[0]} (of {backup_id}, which "
                f"{manifest.backup_id} needs) retained short of {until.isoformat()} after "
                "extending it.",
                fix="check that the target's identity may set retention (GCS: "
                "storage.objects.setRetention; account B: s3:PutObjectRetention); this "
                "incremental stays in the stack vault.",
            )
        earliest = min(c.retain_until for c in extended if c.retain_until)
        copies = {**ancestor.vault_copies}  # type: ignore[union-attr]
        copies[target.name] = held.model_copy(update={"retain_until": earliest.isoformat()})
        svc.catalog.update(cluster, backup_id, BackupItem.changes(vault_copies=copies))


def copied_places(bucket: TargetBucket, held: CopyRecord) -> list[tuple[str, str | None]]:
    """The objects (key, version) a copy's manifest in the target names."""
    body = bucket.read_all(held.manifest_key or "", held.manifest_generation)
    copied = Manifest.model_validate_json(body)
    return [(o.key, o.version_id) for s in copied.shards for o in s.objects]


def target_key(svc: Services, target: VaultCopy, store_key: str) -> str:
    return moved_key(svc, store_key, target.prefix)


def _when(value: str | None) -> datetime | None:
    return datetime.fromisoformat(value) if value else None


# --- Progress between budgeted calls ----------------------------------------------------------
def progress_key(svc: Services, backup_id: str, name: str) -> str:
    return svc.work_key(backup_id, COPIES_DIR, f"{name}.json")


def load_progress(svc: Services, backup_id: str, name: str) -> dict[str, Any]:
    """``objects``: each copied object's proof, by store key; ``seconds``: the time copying
    took so far, over every call."""
    return dict(svc.find_work(progress_key(svc, backup_id, name)) or {})


def save_progress(svc: Services, backup_id: str, name: str, progress: dict[str, Any]) -> None:
    svc.put_work(progress_key(svc, backup_id, name), progress)
