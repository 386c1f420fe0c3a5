"""Verify of a vault copy: a backup as one copy target holds it (``verify --from-vault NAME``),
checked without a restore, as ``shardvault.assurance.verify`` checks the store's.

Terms:
- *by attributes*: each object the copy's manifest names is there in the *version* the copy
  recorded (GCS's generation, S3's version id), with the manifest's size, in the copy's
  class, retained at least until the copy's recorded retain-until. A GCS object's generation
  changes with every write of its bytes, and promotion proved that generation's bytes equal
  the manifest's (CRC64NVME of the streamed bytes, GCS's CRC32C and MD5 of the same); an S3
  version's bytes never change and S3 reports their CRC64NVME. So an unchanged version is the
  same proven bytes.
- *read data*: a sample of the objects is downloaded and its CRC64NVME compared with the
  manifest's (every GCS class reads at once; the read is billed at its class's retrieval).
- *check* (``shardvault check``, the probe's last step): a small object put into each copy
  target as promotion puts one, under ``<prefix>/check/``, at STANDARD and Locked for a day,
  and read back; and the bucket's retention settings read. The probe objects stay until their
  retention ends (a lifecycle rule on ``check/`` removes them: the guide's setup). A target
  with a *recovery key* (``shardvault.aws.keys``) also has a throwaway data key of the cluster
  made without plaintext, wrapped under it as promotion wraps one, and wrapped back as a
  restore's plan unwraps one: both halves of its key policy, before the first backup needs
  them.
"""

from __future__ import annotations

import io
import math
import random
from datetime import datetime
from typing import Any

from shardvault.aws.keys import Rewrapper, for_recovery, new_data_key
from shardvault.aws.readback import parse_manifest
from shardvault.aws.services import Services
from shardvault.config.targets import GcsTarget, VaultCopy, recovery_key_of
from shardvault.contracts.catalog import BackupItem, CopyRecord
from shardvault.contracts.models import Manifest, ObjectResult
from shardvault.data.checksums import crc64nvme_of_bytes, crc64nvme_of_stream
from shardvault.gcp.storage import target_bucket as gcs_bucket
from shardvault.lifecycle.copies import held_until
from shardvault.lifecycle.targets import TargetBucket, bucket_of, days_after, is_gone
from shardvault.restore.sources import copy_bucket


def copy_manifest(
    svc: Services, record: BackupItem, name: str, problems: list[str]
) -> tuple[Manifest | None, TargetBucket, CopyRecord | None]:
    """The copy's manifest in target ``name`` (None, with a problem, when there is none)."""
    held = record.vault_copies.get(name)
    session = f"verify-{record.backup_id}"
    bucket = copy_bucket(svc, record.cluster, name, held.bucket if held else None, session)
    if held is None or held.state != "COPIED" or not held.manifest_key:
        state = held.state if held else "never copied there"
        problems.append(f"{record.backup_id} has no copy in {name!r} ({state})")
        return None, bucket, held
    try:
        body = bucket.read_all(held.manifest_key, held.manifest_generation)
    except Exception as error:
        if not is_gone(error):
            raise
        problems.append(f"{record.backup_id}: its manifest is gone from {name!r}")
        return None, bucket, held
    return parse_manifest(body, f"{bucket.where}/{held.manifest_key}"), bucket, held


def attribute_problem(bucket: TargetBucket, obj: ObjectResult, held: CopyRecord) -> str:
    """'' when the target holds the object as the copy recorded it (its newest version: one
    written over the copy is a finding, though S3 keeps the locked one beneath)."""
    copy = bucket.read_back(obj.key)
    if copy is None:
        return f"{obj.key} is missing"
    if obj.version_id and copy.version != obj.version_id:
        return f"{obj.key} is version {copy.version}, not the copied {obj.version_id}"
    if copy.size != obj.stored_bytes:
        return f"{obj.key} holds {copy.size} bytes, the manifest says {obj.stored_bytes}"
    if held.storage_class and copy.storage_class != held.storage_class:
        return f"{obj.key} is in class {copy.storage_class}, not {held.storage_class}"
    until = datetime.fromisoformat(held.retain_until) if held.retain_until else None
    locked = held.retention_mode in ("Locked", "COMPLIANCE")
    if until and locked and not locked_until(copy.retain_until, until):
        return f"{obj.key} is retained until {copy.retain_until}, before {held.retain_until}"
    return ""


def locked_until(found: datetime | None, until: datetime) -> bool:
    return found is not None and found >= until


def read_sample(
    bucket: TargetBucket,
    objects: list[ObjectResult],
    percent: float,
    problems: list[str],
    storage_class: str | None = None,
) -> int:
    """Downloads a random ``percent`` of the objects (at least one when above 0) and checks
    each one's CRC64NVME; returns how many were read. A copy in a class that needs a thaw
    (GLACIER, DEEP_ARCHIVE in account B) is not read: a drill from it proves its bytes."""
    readable = storage_class is None or bucket.readable_class(storage_class) == storage_class
    if percent <= 0 or not objects or not readable:
        return 0
    sample = random.sample(objects, max(1, math.ceil(len(objects) * percent / 100)))
    for obj in sample:
        try:
            with bucket.open(obj.key, obj.version_id) as body:
                crc = crc64nvme_of_stream(body)
        except Exception as error:
            if not is_gone(error):
                raise
            problems.append(f"{obj.key} (version {obj.version_id}) cannot be read: it is gone")
            continue
        if crc != obj.crc64nvme:
            problems.append(
                f"{obj.key} reads back with CRC64NVME {crc}; the manifest says {obj.crc64nvme}"
            )
    return len(sample)


def record_verdict(
    svc: Services, record: BackupItem, name: str, now: float, problems: list[str]
) -> None:
    """The copy's verdict, on its own record: the backup's ``verify`` stays the store's."""
    fresh = svc.catalog.get(record.cluster, record.backup_id) or record
    held = fresh.vault_copies.get(name)
    if held is None:
        return
    verdict: dict[str, Any] = {"verified_at": now, "verify": "damaged" if problems else "ok"}
    copies = {**fresh.vault_copies, name: held.model_copy(update=verdict)}
    svc.catalog.update(record.cluster, record.backup_id, BackupItem.changes(vault_copies=copies))


# --- check: can the promote path reach each target, as it will -----------------------------
CHECK_PREFIX = "check"  # under the target's prefix: probes, each retained a day
CHECK_BYTES = b"shardvault check: a probe of this bucket's copy path\n"
CHECK_CLASS = "STANDARD"  # no minimum billed duration: a probe costs its day only
CHECK_DAYS = 1
CHECK_RETRY_SECONDS = 10.0


def check_target(
    target: VaultCopy, svc: Services, probe_id: str, now: float, cluster: str
) -> dict[str, Any]:
    """Puts a small object into the target as promotion does (proven, Locked a day, never
    over an existing key), reads it back, and reads the bucket's retention settings; wraps a
    data key of ``cluster`` under its recovery key and back; the target's finding: ``ok``, with
    what was read back, or the error."""
    key = f"{target.prefix.strip('/')}/{CHECK_PREFIX}/{probe_id}"
    try:
        bucket = checked_bucket(target, svc, probe_id, now)
        if isinstance(bucket, str):
            return refused(target, bucket)
        until = days_after(now, CHECK_DAYS)
        by_bucket = isinstance(target, GcsTarget) and target.retention.style == "bucket"
        copy = bucket.copy_in(
            lambda: io.BytesIO(CHECK_BYTES),
            key,
            len(CHECK_BYTES),
            crc64nvme_of_bytes(CHECK_BYTES),
            CHECK_CLASS,
            None if by_bucket else until,
        )
        bucket.check_held(copy, CHECK_CLASS, None if by_bucket else until)
        wrapped = recovery_round_trip(target, svc, cluster, probe_id)
    except Exception as error:  # any failure is this target's finding, named
        return refused(target, f"{type(error).__name__}: {error}")
    held = f"{copy.retention_mode} until {copy.retain_until}" if copy.retain_until else "bucket"
    return {
        "name": target.name,
        "ok": True,
        "detail": f"put and read back {bucket.where}/{key} ({held})" + wrapped,
    }


def recovery_round_trip(target: VaultCopy, svc: Services, cluster: str, probe_id: str) -> str:
    """A throwaway data key of ``cluster`` wrapped under the target's recovery key and back
    (the module's *check*); what the finding adds ("" without a recovery key)."""
    recovery_key = recovery_key_of(target)
    if not recovery_key:
        return ""
    probe = new_data_key(svc, cluster, f"check-{probe_id}")
    Rewrapper(svc, cluster)(for_recovery(svc, probe, recovery_key))
    return f"; a data key wrapped under recovery key {recovery_key} and back"


def checked_bucket(
    target: VaultCopy, svc: Services, probe_id: str, now: float
) -> TargetBucket | str:
    """The target's bucket, or why it cannot take copies (a GCS bucket's retention)."""
    if not isinstance(target, GcsTarget):
        return bucket_of(target, svc, f"check-{probe_id}")
    # A short retry: one unreachable target must not hold the probe past its timeout.
    settings = svc.settings.model_copy(update={"gcs_retry_seconds": CHECK_RETRY_SECONDS})
    bucket = gcs_bucket(target, settings)
    if target.retention.style == "bucket":
        held_until(target, bucket, now)  # a locked bucket policy, long enough
    elif not bucket.object_retention_enabled():
        return f"GCS bucket {target.bucket} has object retention disabled"
    return bucket


def refused(target: VaultCopy, why: str) -> dict[str, Any]:
    return {"name": target.name, "ok": False, "detail": why[:1000]}
