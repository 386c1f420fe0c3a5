"""Verify: a backup is in the store as its manifest says, checked without a restore.

What ``shardvault verify`` runs (the verify state machine's one step, ``verify_backup``): the
backup's record, its manifest and, for an incremental, every ancestor's (a restore needs the
whole chain), each read from where the catalog says the backup is (the vault once promoted,
else the staging store). The outcome is recorded in the backup's catalog record
(``verified_at``, ``verify``), so ``show`` says when a backup was last found whole.

Terms:
- *manifest consistency*: the manifest names the backup and cluster of its record, its
  objects lie under the backup's own prefix, no key repeats, and its counts (objects, bytes,
  stored bytes) add up to its objects'; a PostgreSQL shard's tail lists its WAL without a
  gap from the backup's first segment to its last (``pgwal``).
- *by attributes*: each object's size and full-object CRC64NVME as the store reports them
  (``GetObjectAttributes``: no download, and it works on archived objects), against the
  manifest's.
- *WAL archive* (PostgreSQL, continuous archiving): each shard's archive runs without a gap
  from the segment the backup's own WAL ends in to the newest segment it holds on that
  timeline and the newer ones it was promoted into (what a point-in-time restore from this
  backup replays), and every batch is in the store with its index's size and checksum, by
  attributes.
- *read data*: a sample of ``read_data_percent`` of the objects (at least one when above 0,
  chosen at random) is downloaded and checksummed, as restic's ``check --read-data-subset``;
  an archived object (GLACIER, DEEP_ARCHIVE) cannot be read before a thaw and is counted as
  skipped, not failed.
"""

from __future__ import annotations

import functools
import math
import random
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Any

from botocore.exceptions import BotoCoreError, ClientError
from pydantic import Field

from shardvault.assurance import copy_check
from shardvault.aws.readback import load_manifest, manifest_place
from shardvault.aws.services import Services
from shardvault.aws.store import Bucket, is_missing, readable_now
from shardvault.contracts.catalog import BackupItem
from shardvault.contracts.engines import traits
from shardvault.contracts.models import (
    ClusterName,
    Frozen,
    Manifest,
    ObjectResult,
    Phase,
    RestoreRequest,
)
from shardvault.contracts.pgwal import segment_number, tail_problems
from shardvault.contracts.wal_archive import BINLOG_FILE, log_order
from shardvault.errors import BackupDamaged, BackupNotRestorable, ShardVaultError
from shardvault.restore.admission import resolve_backup
from shardvault.restore.sources import (
    COPY_SOURCE,
    copy_target,
    read_from,
    source_of,
    stack_vault_name,
)
from shardvault.wal.archive import after_backup

PARALLEL_HEADS = 16  # requests in flight: each waits on the store, not on this process
MAX_PROBLEMS = 20  # named in the outcome; the count says how many more


class VerifyRequest(Frozen):
    """The verify state machine's input."""

    cluster: ClusterName
    backup_id: str = "latest"
    read_data_percent: Annotated[float, Field(ge=0, le=100)] = 0.0
    # A copy target of the policy to verify the backup in (shardvault.assurance.copy_check);
    # None: where the catalog says the backup is.
    from_vault: str | None = Field(None, pattern=r"^[a-z][a-z0-9-]{0,39}$")


class Checked(Frozen):
    """One backup of the chain, as verified."""

    backup_id: str
    location: str  # "vault", "store" or "copy:NAME"
    objects: int
    bytes: int  # stored bytes checked by attributes
    read: int = 0  # objects read back
    skipped: int = 0  # sampled, but archived: not readable before a thaw
    # Vault keys whose newest version is not the locked one verify read (a delete marker or
    # a newer version over it): the backup is intact, but someone wrote into the vault.
    covered: list[str] = Field(default_factory=list)


def verify(request: VerifyRequest, svc: Services, now: float) -> dict[str, Any]:
    """Verifies the backup and its ancestors; records and returns the outcome, or raises
    ``BackupDamaged`` (after recording it) naming the first problems."""
    copy = copy_of(request, svc)
    record = resolve_backup(
        RestoreRequest(
            cluster=request.cluster,
            target_cluster=request.cluster,
            backup_id=request.backup_id,
            from_vault=copy,
        ),
        svc.catalog,
    )
    if record.status != "COMPLETE":
        raise BackupNotRestorable(
            f"backup {record.backup_id} is {record.status}, not COMPLETE: "
            "there is nothing whole to verify.",
            fix="verify a complete backup ('shardvault list' shows their status).",
        )
    checked: list[Checked] = []
    problems: list[str] = []
    one = verify_one if copy is None else functools.partial(verify_copy, copy)
    manifest = one(record, request, svc, checked, problems)
    for ancestor in manifest.chain.ancestors if manifest and manifest.chain else []:
        parent = svc.catalog.get(request.cluster, ancestor)
        if parent is None:
            problems.append(f"{ancestor} (an ancestor of the chain) has no catalog record")
            continue
        one(parent, request, svc, checked, problems)
    # The WAL archive is the store's, whichever copy is verified.
    archives = archive_problems(svc, manifest, problems) if manifest and copy is None else {}
    outcome = {
        "backup_id": record.backup_id,
        "cluster": request.cluster,
        "verified_at": now,
        "result": "damaged" if problems else "ok",
        "chain": [c.model_dump() for c in checked],
        "objects": sum(c.objects for c in checked),
        "read": sum(c.read for c in checked),
        "skipped": sum(c.skipped for c in checked),
        "covered": [note for c in checked for note in c.covered][:MAX_PROBLEMS],
        "wal_archive": archives,
        "problems": problems[:MAX_PROBLEMS],
        "more_problems": max(0, len(problems) - MAX_PROBLEMS),
    }
    if copy is not None:
        outcome["copy"] = copy
        copy_check.record_verdict(svc, record, copy, now, problems)
    else:
        verdict = {k: v for k, v in outcome.items() if k not in ("chain", "cluster", "backup_id")}
        verified = BackupItem.changes(verified_at=now, verify=verdict)
        svc.catalog.update(request.cluster, record.backup_id, verified)
    if problems:
        raise BackupDamaged(
            f"backup {record.backup_id} of {request.cluster} failed verification: "
            + "; ".join(problems[:3])
            + (f" (and {len(problems) - 3} more)" if len(problems) > 3 else "")
            + ".",
            fix="restore from another backup ('shardvault list'); run a new full backup so the "
            "cluster has an intact one, and look at the store for what removed or changed "
            "these objects.",
        )
    return outcome


def copy_of(request: VerifyRequest, svc: Services) -> str | None:
    """The copy target to verify in: None for the stack vault (by its name) or the catalog's
    place; an unknown name is refused by name."""
    name = request.from_vault
    if name is None or name == stack_vault_name(svc, request.cluster):
        return None
    copy_target(svc, request.cluster, name)
    return name


def verify_copy(
    name: str,
    record: BackupItem,
    request: VerifyRequest,
    svc: Services,
    checked: list[Checked],
    problems: list[str],
) -> Manifest | None:
    """Verifies one backup of the chain in copy target ``name`` (``copy_check``)."""
    backup_id = record.backup_id
    found: list[str] = []
    manifest, bucket, held = copy_check.copy_manifest(svc, record, name, found)
    if manifest is None or held is None:
        problems += found
        return None
    found += consistency_problems(manifest, record, held.manifest_key or "")
    objects = [o for shard in manifest.shards for o in shard.objects]
    with ThreadPoolExecutor(PARALLEL_HEADS) as pool:
        found += [
            p
            for p in pool.map(lambda o: copy_check.attribute_problem(bucket, o, held), objects)
            if p
        ]
    read = copy_check.read_sample(
        bucket, objects, request.read_data_percent, found, held.storage_class
    )
    problems += [f"{backup_id} in {name!r}: {p}" for p in found]
    checked.append(
        Checked(
            backup_id=backup_id,
            location=COPY_SOURCE + name,
            objects=len(objects),
            bytes=sum(o.stored_bytes for o in objects),
            read=read,
        )
    )
    return manifest


def verify_one(
    record: BackupItem,
    request: VerifyRequest,
    svc: Services,
    checked: list[Checked],
    problems: list[str],
) -> Manifest | None:
    """Verifies one backup of the chain; appends what it checked and what it found."""
    backup_id = record.backup_id
    if record.status != "COMPLETE":
        problems.append(f"{backup_id} is {record.status}, not COMPLETE")
        return None
    location = read_from(record, svc)
    key, version = manifest_place(record, location)
    bucket = source_of(svc, location)
    try:
        manifest = load_manifest(bucket, key, version)
    except ShardVaultError as error:
        problems.append(f"{backup_id}: {error.message}")
        return None
    problems += [f"{backup_id}: {p}" for p in consistency_problems(manifest, record, key)]
    objects = [o for shard in manifest.shards for o in shard.objects]
    with ThreadPoolExecutor(PARALLEL_HEADS) as pool:  # boto3 clients may be shared by threads
        found = list(pool.map(lambda o: attribute_problem(bucket, o), objects))
    problems += [f"{backup_id}: {p}" for p in found if p]
    read, skipped = read_sample(bucket, objects, request.read_data_percent, problems)
    locked = [(o.key, o.version_id) for o in objects if o.version_id]
    locked += [(key, version)] if version else []
    with ThreadPoolExecutor(PARALLEL_HEADS) as pool:
        covered = [note for note in pool.map(lambda p: cover_of(bucket, *p), locked) if note]
    checked.append(
        Checked(
            backup_id=backup_id,
            location=location,
            objects=len(objects),
            bytes=sum(o.stored_bytes for o in objects),
            read=read,
            skipped=skipped,
            covered=covered,
        )
    )
    return manifest


def cover_of(bucket: Bucket, key: str, locked: str) -> str:
    """What covers the locked version of a vault key ('' when it is still the newest): a
    delete marker, or a newer version. Object Lock allows both to anyone who may write the
    bucket; reads by version still find the backup, but someone wrote into the vault."""
    try:
        newest = bucket.head(key).get("VersionId")
    except ClientError as error:
        if is_missing(error):
            return f"{key}: a delete marker hides its locked version"
        raise
    return "" if newest == locked else f"{key}: a newer version covers its locked version"


def consistency_problems(manifest: Manifest, record: BackupItem, key: str) -> list[str]:
    """What makes a manifest disagree with its record or with itself."""
    problems = []
    if manifest.backup_id != record.backup_id or manifest.cluster != record.cluster:
        problems.append(f"its manifest names backup {manifest.backup_id} of {manifest.cluster}")
    prefix = key.rsplit("/", 1)[0] + "/"
    objects = [o for shard in manifest.shards for o in shard.objects]
    keys = [o.key for o in objects]
    if len(set(keys)) != len(keys):
        problems.append("its manifest names an object twice")
    outside = [k for k in keys if not k.startswith(prefix)]
    if outside:
        problems.append(f"its manifest names {outside[0]}, outside the backup's prefix")
    streamed = [o for shard in manifest.shards for s in shard.streams for o in s.objects]
    if len(streamed) != manifest.objects:
        problems.append(f"its manifest counts {manifest.objects} objects but lists {len(streamed)}")
    if sum(o.length for o in streamed) != manifest.bytes:
        problems.append("its manifest's byte count differs from its objects' lengths")
    return problems + wal_problems(manifest)


def wal_problems(manifest: Manifest) -> list[str]:
    """Each PostgreSQL shard's tail holds its WAL without a gap, from the backup's first
    segment to its last (``pgwal``: continuity)."""
    problems = []
    for shard in manifest.shards:
        if not traits(manifest.engine_of(shard)).logged_tail:
            continue
        wal = {
            f.path.removeprefix("pg_wal/"): f.size
            for stream in shard.streams
            if stream.phase == Phase.TAIL
            for f in stream.files
            if f.path.startswith("pg_wal/")
        }
        problems += tail_problems(shard.shard_id, shard.marker, wal)
    return problems


def archive_problems(
    svc: Services, manifest: Manifest, problems: list[str]
) -> dict[str, dict[str, Any]]:
    """Per shard with a WAL archive after the backup: what a point-in-time restore from it
    could replay (``from`` .. ``to``); appends a gap, and a batch the store does not hold as
    its index says, to ``problems``."""
    found: dict[str, dict[str, Any]] = {}
    for shard in manifest.shards:
        log = traits(manifest.engine_of(shard))
        if not log.point_in_time:
            continue
        run = after_backup(svc, manifest, shard.shard_id)
        if run is None or not run.indexes:
            continue  # a backup older than cuts and stops, or a shard not archived
        first, indexes = run.first, run.indexes
        newest = run.newest or first
        if run.last is None or log_place(run.last) < log_place(newest):
            stops = run.last or f"before {first}"
            problems.append(
                f"shard {shard.shard_id}'s {log.log} archive misses {log.log_file}s after "
                f"{stops} (it holds {log.log} up to {newest}): a point-in-time restore from "
                f"{manifest.backup_id} cannot pass the gap"
            )
        for index in indexes:
            problem = batch_problem(svc.store_bucket, index)
            if problem:
                problems.append(f"shard {shard.shard_id}'s {log.log} archive: {problem}")
        found[shard.shard_id] = {
            "from": first, "to": run.last, "batches": len(indexes), "log": log.log,
        }  # fmt: skip
    return found


def log_place(name: str) -> tuple[str, int]:
    """Where a log file lies in its log: a segment by its number (a newer timeline's copy of
    a segment is the same place), a binary log by its ordinal."""
    return log_order(name) if BINLOG_FILE.fullmatch(name) else ("", segment_number(name))


def batch_problem(bucket: Bucket, index: dict[str, Any]) -> str:
    """'' when the store holds the batch with its index's size and checksum."""
    try:
        crc, size = bucket.stored_checksum(index["key"])
    except ClientError as error:
        return f"{index['key']} is missing ({error.response['Error'].get('Code')})"
    if (crc, size) != (index["crc64nvme"], index["stored_length"]):
        return f"{index['key']} is {size} bytes with CRC64NVME {crc}, not as its index says"
    return ""


def attribute_problem(bucket: Bucket, obj: ObjectResult) -> str:
    """'' when the store holds the object (the version the vault's manifest names, if any)
    with the manifest's size and checksum. An object whose store reports no full-object
    CRC64NVME (every object ShardVault writes has one; a stored object replaced without one
    has not) is read back instead, unless archived."""
    key = obj.key
    try:
        crc, size = bucket.stored_checksum(key, obj.version_id)
    except ClientError as error:
        if is_missing(error):
            return f"{key} is missing"
        return f"{key} cannot be read ({error.response['Error']['Code']})"
    if size != obj.stored_bytes:
        return f"{key} holds {size} bytes, the manifest says {obj.stored_bytes}"
    if crc is None:
        if not readable_now(bucket.head(key, obj.version_id)):
            return f"{key} has no CRC64NVME checksum attribute and is archived (unreadable)"
        try:
            crc, size = bucket.readback_checksum(key, obj.version_id)
        except (ClientError, BotoCoreError) as error:
            return unreadable(key, error)
    if crc != obj.crc64nvme or size != obj.stored_bytes:
        return (
            f"{key} holds {size} bytes with CRC64NVME {crc}, the manifest says "
            f"{obj.stored_bytes} bytes with {obj.crc64nvme}"
        )
    return ""


def unreadable(key: str, error: ClientError | BotoCoreError) -> str:
    """A read-back the store broke off: a store that checks what it serves (MinIO's bitrot
    protection) stops sending an object it finds damaged, mid-body or with an error."""
    if isinstance(error, ClientError):
        what = error.response.get("Error", {}).get("Code", "an error")
    else:
        what = type(error).__name__
    return (
        f"{key} cannot be read back: the store broke off ({what}), as it does for an object "
        "it finds damaged"
    )


def read_sample(
    bucket: Bucket, objects: list[Any], percent: float, problems: list[str]
) -> tuple[int, int]:
    """Reads back a random ``percent`` of the objects (at least one when above 0); returns how
    many were read and how many were skipped as archived."""
    if percent <= 0 or not objects:
        return 0, 0
    sample = random.sample(objects, max(1, math.ceil(len(objects) * percent / 100)))
    read = skipped = 0
    for obj in sample:
        if not readable_now(bucket.head(obj.key, obj.version_id)):
            skipped += 1
            continue
        read += 1
        try:
            crc, size = bucket.readback_checksum(obj.key, obj.version_id)
        except (ClientError, BotoCoreError) as error:
            problems.append(unreadable(obj.key, error))
            continue
        if crc != obj.crc64nvme or size != obj.stored_bytes:
            problems.append(
                f"{obj.key} reads back as {size} bytes with CRC64NVME {crc}; the manifest says "
                f"{obj.stored_bytes} bytes with {obj.crc64nvme}"
            )
    return read, skipped
