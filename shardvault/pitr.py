"""Point-in-time restores: a backup, then the WAL archive's batches after it, replayed to a
target (PostgreSQL; issue 11).

Terms:
- *target*: ``RestoreTarget``: a time (every shard replays its WAL to that instant, so the
  restored cluster is cut at one moment), or ``latest`` (each shard to the end of its archive).
- *base*: the backup a point-in-time restore starts from: the newest complete one that
  completed before the target (or the one the request names, if it did).
- *first segment*: per shard, the WAL segment the base's own WAL ends in (its cut's, or its
  stop's); the restore needs the archive from there on, without a gap.
- *restorable range*: from the oldest complete backup's completion to the time the archive
  of every shard reaches (its newest contiguous file's push): a target outside it is refused
  with ``TargetOutOfRange`` naming the range, before anything is written.

The archive's WAL goes to the restoring node like any other object (``Phase.WAL`` download
items, checked frame by frame), into ``.shardvault-wal/`` beside the restored data, where the
recovery's ``restore_command`` reads it. PostgreSQL stops at a time target only once it meets a
transaction after it: WAL that holds none (the archive ends too early, or nothing committed
since) makes the restored server stop, which the node reports as ``TargetOutOfRange``.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from shardvault.archive import ShardArchive, after_backup, batch_place, wal_from, wal_stream
from shardvault.errors import TargetOutOfRange, TargetUnsupported
from shardvault.models import (
    BackupStatus,
    DownloadItem,
    Encryption,
    Engine,
    FileEntry,
    Manifest,
    Phase,
    RestoreContext,
    RestoreRequest,
    RestoreTarget,
)
from shardvault.services import Services


def when(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, UTC).isoformat(timespec="seconds")


def base_backup(request: RestoreRequest, backups: list[dict[str, Any]]) -> dict[str, Any]:
    """The newest complete backup that completed before the target (or the named one, if it
    did)."""
    target = request.target
    assert target is not None
    complete = [b for b in backups if b.get("status") == BackupStatus.COMPLETE]
    before = [
        b for b in complete if target.latest or float(b.get("completed_at", 0)) <= target.epoch
    ]
    if request.backup_id != "latest":
        before = [b for b in before if b["backup_id"] == request.backup_id]
    if not before:
        oldest = min((float(b.get("completed_at", 0)) for b in complete), default=None)
        named = "" if request.backup_id == "latest" else f" {request.backup_id}"
        raise TargetOutOfRange(
            f"cluster {request.cluster!r} has no complete backup{named} that completed before "
            f"{target.describe()}"
            + (f": the oldest completed at {when(oldest)}." if oldest else "."),
            fix="choose a later target (shardvault list shows each backup's completion), or "
            "restore a backup without a target.",
        )
    return max(before, key=lambda b: b["backup_id"])


def shard_after(svc: Services, manifest: Manifest, shard_id: str) -> ShardArchive:
    """The shard's archive from the base on (``archive.after_backup``), which a target needs."""
    archive = after_backup(svc, manifest, shard_id)
    if archive is None:
        first_segment(manifest, shard_id)  # says why, by name
    assert archive is not None
    return archive


def first_segment(manifest: Manifest, shard_id: str) -> str:
    """The segment the backup's own WAL of the shard ends in: the archive's must start there."""
    first = wal_from(manifest, shard_id)
    if first is None:
        raise TargetUnsupported(
            f"backup {manifest.backup_id} records no WAL position for shard {shard_id}: it was "
            "taken by an agent older than point-in-time restores.",
            fix="restore it without a target, or take a new backup and restore from that one.",
        )
    return first


def archives(
    svc: Services, request: RestoreRequest, manifest: Manifest, oldest_backup: float
) -> list[ShardArchive]:
    """Every shard's archive from the base on; refuses a target it does not reach, by name."""
    target = request.target
    assert target is not None
    if manifest.engine != Engine.POSTGRES:
        raise TargetUnsupported(
            f"cluster {request.cluster!r} runs {manifest.engine}, which keeps no WAL archive: "
            "it restores to its backups only.",
            fix="restore a backup without a target (--target-time, --target-latest).",
        )
    found = []
    for shard in manifest.shards:
        found.append(shard_after(svc, manifest, shard.shard_id))
    reach = min((a.reaches for a in found), default=0.0)
    restorable = f"from {when(oldest_backup)} to {when(reach)}" if reach else "nothing"
    empty = [a for a in found if a.last is None]
    if empty:
        raise TargetOutOfRange(
            f"the WAL archive of shard(s) {', '.join(a.shard_id for a in empty)} holds nothing "
            f"from backup {manifest.backup_id}'s end on (segment {empty[0].first}): cluster "
            f"{request.cluster!r} can be restored to its backups only.",
            fix="set up continuous archiving on those shards (README: 'Continuous WAL "
            "archiving'), then take a backup; restore without a target meanwhile.",
        )
    if target.epoch is not None and target.epoch > reach:
        short = min(found, key=lambda a: a.reaches)
        raise TargetOutOfRange(
            f"{target.describe()} is past the WAL archive: shard {short.shard_id}'s archived "
            f"WAL runs without a gap to {short.last}, pushed at {when(short.reaches)}; the "
            f"restorable range is {restorable}.",
            fix="choose a target inside the range, or wait until the archive holds WAL past "
            "the target (PostgreSQL closes a segment every archive_timeout).",
        )
    return found


def wal_items(
    context: RestoreContext, archive: ShardArchive, node_id: str
) -> tuple[list[FileEntry], list[DownloadItem]]:
    """The shard's WAL stream and a download item per batch (each batch's own data key)."""
    files, offsets = wal_stream(archive.batches)
    items = []
    for index, offset in zip(archive.batches, offsets, strict=True):
        encryption = index.get("encryption")
        sealed = Encryption.model_validate(encryption) if encryption else None
        items.append(
            DownloadItem(
                restore_id=context.restore_id,
                target_cluster=context.target_cluster,
                node_id=node_id,
                shard_id=archive.shard_id,
                phase=Phase.WAL,
                key=index["key"],
                stream_offset=offset,
                length=sum(f["size"] for f in index["files"]),
                part_size=max(1, index["stored_length"]),
                part_count=1,  # one PUT
                crc64nvme=index["crc64nvme"],
                part_crc64nvme=[index["crc64nvme"]],
                source="store",  # the archive is never promoted
                stored_length=index["stored_length"],
                frame_size=index["frame_size"],
                frames=index["frames"],
                place=batch_place(index["cluster"], index["shard_id"], index["batch_id"]),
                key_check=sealed.key_check if sealed else None,
                encryption=sealed,
            )
        )
    return files, items


def recovery(target: RestoreTarget) -> dict[str, Any]:
    """What the restoring node's recovery is told (``finish_postgres``)."""
    return {"target_time": target.time.isoformat() if target.time else None, "wal_dir": True}


def plan_wal(
    svc: Services, context: RestoreContext, manifest: Manifest, node_of: dict[str, str]
) -> dict[str, tuple[list[FileEntry], list[DownloadItem]]]:
    """Per shard, its WAL stream and download items, from the archive as it is now (it may
    have grown since validation: more WAL, never less)."""
    planned = {}
    for shard in manifest.shards:
        archive = shard_after(svc, manifest, shard.shard_id)
        planned[shard.shard_id] = wal_items(context, archive, node_of[shard.shard_id])
    return planned
