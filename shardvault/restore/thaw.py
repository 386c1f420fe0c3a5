"""Thaw: objects in an archive storage class are restored (RestoreObject) at the requested
tier before they can be read; the state machine polls with growing waits.

A restore from a copy target (``copy:NAME``) *stages* its objects: copies them from the
provider into the store where the agents read them (``shardvault.restore.sources``), for at
most a time budget per call; each staged copy must hold the manifest's CRC64NVME. An aws
target's objects in an archive class are thawed in account B first, as the stack vault's are.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from botocore.exceptions import ClientError

from shardvault.aws.services import Services
from shardvault.aws.store import Bucket, is_missing
from shardvault.contracts.catalog import RestoreItem, restore_key
from shardvault.contracts.models import (
    THAW_DAYS,
    ObjectResult,
    RestoreContext,
    RetrievalTier,
)
from shardvault.errors import ChecksumMismatch
from shardvault.lifecycle.targets import TargetBucket, is_gone
from shardvault.restore.sources import (
    PARALLEL_READS,
    chain_manifests,
    copy_bucket,
    copy_name,
    source_of,
    staged_key,
)

THAW_MAX_WAIT = 3600


def thaw(context: RestoreContext, attempt: int, svc: Services) -> dict[str, Any]:
    """Requests a restore of every archived object not yet thawed; returns how many are still
    frozen and how long to wait before asking again (doubling, up to an hour)."""
    if copy_name(context.source) is not None:
        return stage(context, attempt, svc)
    objects = [
        (source_of(svc, source), obj.key, obj.version_id)
        for manifest, source in chain_manifests(context, svc)  # a full: itself alone
        for shard in manifest.shards
        for stream in shard.streams
        for obj in stream.objects
    ]
    with ThreadPoolExecutor(PARALLEL_READS) as pool:
        states = list(pool.map(lambda o: thaw_object(*o, tier=context.tier), objects))
    frozen = sum(state != "readable" for state in states)
    requested = states.count("requested")
    key = restore_key(context.restore_id)
    svc.catalog.update(context.target_cluster, key, RestoreItem.changes(frozen=frozen))
    first = svc.settings.thaw_first_wait_seconds
    wait = min(first * 2**attempt, THAW_MAX_WAIT)
    return {"frozen": frozen, "requested": requested, "attempt": attempt + 1, "wait_seconds": wait}


def thaw_object(bucket: Bucket, key: str, version_id: str | None, *, tier: RetrievalTier) -> str:
    """``readable``, ``thawing`` or ``requested`` (a restore of it was asked for now)."""
    return bucket.thawed(key, version_id, THAW_DAYS, tier.value)


STAGE_WAIT = 1  # seconds between two staging calls: there is nothing to wait for


def stage(context: RestoreContext, attempt: int, svc: Services) -> dict[str, Any]:
    """Copies the copy target's objects (a chain's too) into the store, at least one per call
    and until the budget runs out, asking account B to thaw the archived ones first; returns
    how many remain as ``frozen``."""
    name = copy_name(context.source) or ""
    bucket = copy_bucket(svc, context.cluster, name, session=f"restore-{context.restore_id}")
    deadline = time.monotonic() + svc.settings.stage_budget_seconds
    objects = [
        obj
        for manifest, _ in chain_manifests(context, svc)
        for shard in manifest.shards
        for stream in shard.streams
        for obj in stream.objects
    ]
    with ThreadPoolExecutor(PARALLEL_READS) as pool:  # boto3 clients may be shared by threads
        done = list(pool.map(lambda o: staged(svc, context.restore_id, o), objects))
    remaining = [o for o, there in zip(objects, done, strict=True) if not there]
    thawing = requested = 0
    for obj in list(remaining):
        state = thawed(bucket, name, obj, context.tier)
        if state == "readable":
            stage_object(svc, bucket, name, context.restore_id, obj)
            remaining.remove(obj)
        else:
            thawing += 1
            requested += state == "requested"
        if time.monotonic() >= deadline:
            break
    key = restore_key(context.restore_id)
    svc.catalog.update(context.target_cluster, key, RestoreItem.changes(frozen=len(remaining)))
    first = svc.settings.thaw_first_wait_seconds
    wait = min(first * 2**attempt, THAW_MAX_WAIT) if thawing else STAGE_WAIT
    return {
        "frozen": len(remaining),
        "requested": requested,
        "attempt": attempt + 1,
        "wait_seconds": wait,
    }


def staged(svc: Services, restore_id: str, obj: ObjectResult) -> bool:
    """Whether the store holds the object's staged copy with the manifest's checksum."""
    try:
        crc, size = svc.store_bucket.stored_checksum(staged_key(svc, restore_id, obj.key))
    except ClientError as error:
        if is_missing(error):
            return False
        raise
    return (crc, size) == (obj.crc64nvme, obj.stored_bytes)


def thawed(bucket: TargetBucket, name: str, obj: ObjectResult, tier: RetrievalTier) -> str:
    """The object's thaw in the target (``TargetBucket.thawed``); one that is gone is refused
    by name, as staging refuses it."""
    try:
        return bucket.thawed(obj.key, obj.version_id, THAW_DAYS, tier.value)
    except Exception as error:
        if not is_gone(error):
            raise
        raise missing_copy(name, obj) from None


def missing_copy(name: str, obj: ObjectResult) -> ChecksumMismatch:
    return ChecksumMismatch(
        f"vault target {name!r} lacks {obj.key} (version {obj.version_id}), which the "
        "copy's manifest names.",
        fix="restore this backup from another vault target (--from-vault, or leave it out "
        "for the stack vault); check who could delete in that bucket.",
    )


def stage_object(
    svc: Services, bucket: TargetBucket, name: str, restore_id: str, obj: ObjectResult
) -> None:
    """Streams one object from the copy target into the store; refuses a copy whose bytes
    are not the manifest's, by name."""
    key = staged_key(svc, restore_id, obj.key)
    try:
        with bucket.open(obj.key, obj.version_id) as body:
            svc.store_bucket.upload(body, key, {"ChecksumAlgorithm": "CRC64NVME"})
    except Exception as error:
        if not is_gone(error):
            raise
        raise missing_copy(name, obj) from None
    crc, size = svc.store_bucket.stored_checksum(key)
    if (crc, size) != (obj.crc64nvme, obj.stored_bytes):
        svc.store_bucket.delete_batch([(key, None)])
        raise ChecksumMismatch(
            f"vault target {name!r} holds a damaged copy of {obj.key}: {size} bytes with "
            f"CRC64NVME {crc}, where the manifest says {obj.stored_bytes} bytes with "
            f"{obj.crc64nvme}.",
            fix="restore this backup from another vault target (--from-vault, or leave it out "
            "for the stack vault), and run a drill against this target to find what else it "
            "lost.",
        )
