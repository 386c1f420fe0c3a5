"""Finalize: the tail phase's objects signed at plan verified (the last Upload map's check,
``upload.verified_results``); an archived tail's WAL copied from the archive
(``shardvault.backup.archived``); the manifest, built from the listings and verified objects,
stored beside the objects; the backup recorded as complete with its summary and cost
estimate; the lock released.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

from shardvault.aws.services import Services
from shardvault.backup.archived import with_archived_wal
from shardvault.backup.planner import cut_summary, skew_seconds
from shardvault.backup.synthesis import read_base
from shardvault.backup.upload import verified_results
from shardvault.contracts.catalog import BackupItem
from shardvault.contracts.layout import manifest_key
from shardvault.contracts.models import (
    BackupContext,
    BackupStatus,
    Encryption,
    Manifest,
    ManifestShard,
    ManifestStream,
    ObjectResult,
    Phase,
    ShardListing,
    VaultTarget,
)
from shardvault.errors import UploadIncomplete
from shardvault.wal.archive import wal_from


def finalize(context: BackupContext, svc: Services, now: float) -> dict[str, Any]:
    """Verifies the tail's objects signed at plan, builds the manifest from the listings and
    verified objects, stores it beside the objects, records the backup as complete and
    releases the cluster's lock. Finalize follows the tail's Upload map (or its plan, when it
    had nothing to upload): each backup's last."""
    results, _ = verified_results(context, Phase.TAIL, svc)
    manifest = build_manifest(context, svc, now, results)
    key = manifest_key(svc.store.prefix, context.cluster, context.backup_id)
    svc.store_bucket.put(
        key,
        manifest.model_dump_json(indent=1).encode(),
        ContentType="application/json",
        ChecksumAlgorithm="CRC64NVME",
    )
    summary = manifest_summary(manifest, key) | cost_estimate(manifest, context.vault)
    svc.catalog.update(context.cluster, context.backup_id, BackupItem.changes(**summary))
    svc.catalog.unlock(context.cluster, context.backup_id)
    svc.notify(f"ShardVault backup {context.backup_id} complete", summary)
    return summary


def build_manifest(
    context: BackupContext, svc: Services, now: float, results: list[ObjectResult]
) -> Manifest:
    listings = [
        ShardListing.model_validate(value)
        for value in svc.get_works(svc.list_work(svc.work_key(context.backup_id, "listings") + "/"))
    ]
    by_stream: dict[tuple[str, Phase], list[ObjectResult]] = defaultdict(list)
    for result in results:
        by_stream[(result.shard_id, result.phase)].append(result)
    shards: dict[str, ManifestShard] = {}
    maps = {r.shard_id: r for r in results if r.phase == Phase.BLOCKMAP}
    engine_of = {source.node_id: source.engine for source in context.sources}
    # The shards' data and tails: what a restore places (block maps are the backup's index).
    streamed_results = [r for r in results if r.phase != Phase.BLOCKMAP]
    # Objects copied inside the store: an archived tail's batches (backup.archived).
    copies: list[ObjectResult] = []
    # A synthesized full's copies of its chain, by shard (backup.synthesis).
    base = read_base(svc, context.backup_id) if context.synthesized else {}
    streamed = [listing for listing in listings if listing.phase != Phase.BLOCKMAP]
    for listing in sorted(streamed, key=lambda item: (item.shard_id, item.phase != Phase.DATA)):
        objects = sorted(by_stream[(listing.shard_id, listing.phase)], key=lambda r: r.index)
        check_stream_complete(listing, objects)
        stream = ManifestStream(
            phase=listing.phase, files=listing.files, objects=objects, extents=listing.extents
        )
        stream = with_archived_wal(svc, context.cluster, context.backup_id, listing, stream)
        copies += stream.objects[len(objects) :]  # an archived tail's WAL
        if listing.phase == Phase.DATA and listing.shard_id in base:
            layers, chain_copies = base[listing.shard_id]
            stream = stream.model_copy(
                update={"layers": layers, "objects": [*stream.objects, *chain_copies]}
            )
            copies += chain_copies
        if listing.shard_id in shards:
            shard = shards[listing.shard_id]
            marker = {**shard.marker, **listing.marker}
            shards[listing.shard_id] = shard.model_copy(
                update={"streams": [*shard.streams, stream], "marker": marker}
            )
        else:
            shards[listing.shard_id] = ManifestShard(
                shard_id=listing.shard_id,
                node_id=listing.node_id,
                marker=listing.marker,
                checkpoint_at=listing.checkpoint_at,
                streams=[stream],
                blockmap=maps.get(listing.shard_id),
                engine=engine_of.get(listing.node_id) or context.engine,
            )
    data_listings = [listing for listing in listings if listing.phase == Phase.DATA]
    tails = [listing for listing in listings if listing.phase == Phase.TAIL]
    cut = cut_summary(tails, context.backup_id)
    return Manifest(
        backup_id=context.backup_id,
        cluster=context.cluster,
        engine=context.engine,
        started_at=context.started_at,
        completed_at=now,
        checkpoint_skew_seconds=skew_seconds(data_listings),
        cut_name=cut.get("cut_name"),
        cut_skew_seconds=cut.get("cut_skew_seconds"),
        cut_late_seconds=cut.get("cut_late_seconds"),
        cut_paused=cut.get("cut_paused"),
        cut_pause_seconds=cut.get("cut_pause_seconds"),
        part_size=results[0].part_size if results else 0,
        shards=list(shards.values()),
        bytes=sum(r.length for r in [*streamed_results, *copies]),
        objects=len(streamed_results) + len(copies),
        parts=sum(r.part_count for r in [*streamed_results, *copies]),
        verification=verification_summary([*results, *copies]),
        stored_bytes=sum(r.stored_bytes for r in [*results, *copies]),
        encryption=sealed_with(context, results),
        kind=context.kind,
        chain=None if context.synthesized else context.chain,
        synthesized_from=context.chain.parent_id if context.synthesized and context.chain else None,
        **packing_cost(results),
    )


def packing_cost(results: list[ObjectResult]) -> dict[str, Any]:
    """The agents' packing CPU-seconds and frames per zstd level over the objects they
    packed and reported them for (copies and older agents report none)."""
    packed = [r for r in results if r.pack_cpu_seconds is not None]
    if not packed:
        return {}
    levels: Counter[int] = Counter()
    for result in packed:
        levels.update(result.frame_levels or {})
    return {
        "pack_cpu_seconds": round(sum(r.pack_cpu_seconds or 0.0 for r in packed), 3),
        "frame_levels": dict(sorted(levels.items())),
    }


def sealed_with(context: BackupContext, results: list[ObjectResult]) -> Encryption | None:
    """The backup's wrapped data key, with the check value its agents reported: every object
    of an encrypted backup must have been sealed, and with the same key."""
    if context.encryption is None:
        return None
    checks = {r.key_check for r in results}
    if None in checks or len(checks) > 1:
        raise UploadIncomplete(
            f"backup {context.backup_id} is to be encrypted, but its objects report key checks "
            f"{sorted(str(c) for c in checks)}: some were stored unsealed or under another key.",
            fix="upgrade every agent of the cluster (a version that seals frames), then start "
            "the backup again.",
        )
    return context.encryption.model_copy(update={"key_check": checks.pop() if checks else None})


def check_stream_complete(listing: ShardListing, objects: list[ObjectResult]) -> None:
    """A manifest must never point at a stream with a gap: every byte is in some object."""
    offset = 0
    for obj in objects:
        if obj.stream_offset != offset:
            raise UploadIncomplete(
                f"stream {listing.shard_id}/{listing.phase} has a gap at byte {offset}."
            )
        offset += obj.length
    if offset != listing.sent_bytes:
        raise UploadIncomplete(
            f"stream {listing.shard_id}/{listing.phase} covers {offset} of {listing.sent_bytes} "
            "bytes."
        )


def verification_summary(results: list[ObjectResult]) -> str:
    by = defaultdict(int)
    for result in results:
        by[result.verified_by] += 1
    detail = ", ".join(f"{n} by {how}" for how, n in sorted(by.items()))
    return f"all {len(results)} objects verified (CRC64NVME{': ' + detail if detail else ''})"


def cost_estimate(manifest: Manifest, vault: VaultTarget | None) -> dict[str, Any]:
    """What the backup costs to make and, a month, to keep (``shardvault.lifecycle.costs``)."""
    from shardvault.lifecycle.costs import price_backup
    from shardvault.pricing.prices import StorageClass

    # A class the price table lacks (a non-AWS store's own) is priced as STANDARD.
    known = {c.value for c in StorageClass}
    name = vault.storage_class if vault and vault.storage_class in known else "STANDARD"
    storage_class = StorageClass(name)
    stored = manifest.bytes if manifest.stored_bytes is None else manifest.stored_bytes
    cost = price_backup(stored, storage_class, part_size=manifest.part_size)
    return {
        "estimated_storage_usd_per_month": round(cost.storage_usd_per_month, 6),
        "estimated_overhead_usd": round(cost.overhead_usd, 6),
    }


def manifest_summary(manifest: Manifest, manifest_key: str) -> dict[str, Any]:
    duration = manifest.completed_at - manifest.started_at
    return {
        "status": BackupStatus.COMPLETE.value,
        "completed_at": manifest.completed_at,
        "duration_seconds": round(duration, 3),
        "bytes": manifest.bytes,
        "stored_bytes": manifest.stored_bytes,
        "pack_cpu_seconds": manifest.pack_cpu_seconds,
        "frame_levels": manifest.frame_levels,
        "format": manifest.format,
        "objects": manifest.objects,  # the data's (what a restore downloads)
        # Beside them in the store: each shard's block map (counted in stored_bytes) and the
        # manifest. ``shardvault show`` prints all three.
        "blockmap_objects": sum(1 for s in manifest.shards if s.blockmap),
        "parts": manifest.parts,
        "nodes": sorted({s.node_id for s in manifest.shards}),
        "shards": [s.shard_id for s in manifest.shards],
        "checkpoint_skew_seconds": manifest.checkpoint_skew_seconds,
        "cut_name": manifest.cut_name,
        "cut_skew_seconds": manifest.cut_skew_seconds,
        "cut_late_seconds": manifest.cut_late_seconds,
        "cut_paused": manifest.cut_paused,
        "cut_pause_seconds": manifest.cut_pause_seconds,
        # Per shard, the WAL segment its own WAL ends in: the archive keeps what follows.
        "wal_from": {
            s.shard_id: first for s in manifest.shards if (first := wal_from(manifest, s.shard_id))
        },
        "verification": manifest.verification,
        "manifest_key": manifest_key,
        "throughput_mib_s": round(manifest.bytes / max(duration, 1e-9) / 2**20, 2),
    }
