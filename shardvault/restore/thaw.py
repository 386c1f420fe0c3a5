"""Thaw: objects in an archive storage class are restored (RestoreObject) at the requested
tier before they can be read; the state machine polls with growing waits."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

from shardvault.aws.services import Services
from shardvault.aws.store import Bucket, readable_now
from shardvault.contracts.catalog import RestoreItem, restore_key
from shardvault.contracts.models import (
    THAW_DAYS,
    RestoreContext,
    RetrievalTier,
)
from shardvault.restore.sources import PARALLEL_READS, chain_manifests, source_of

THAW_MAX_WAIT = 3600


def thaw(context: RestoreContext, attempt: int, svc: Services) -> dict[str, Any]:
    """Requests a restore of every archived object not yet thawed; returns how many are still
    frozen and how long to wait before asking again (doubling, up to an hour)."""
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
    head = bucket.head(key, version_id)
    if readable_now(head):  # not archived, or thawed
        return "readable"
    if head.get("Restore"):
        return "thawing"
    bucket.thaw(key, version_id, THAW_DAYS, tier.value)
    return "requested"
