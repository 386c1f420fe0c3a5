"""Point-in-time restores: a backup, then the log archive's batches after it, replayed to a
target (PostgreSQL's WAL; MariaDB's binary logs, replayed by its adapter's ``replay``).

Terms:
- *target*: ``RestoreTarget``: a time (every shard replays its log to that instant, so the
  restored cluster is cut at one moment; MariaDB's in whole seconds), an LSN or a binary log
  position (a cluster of one shard), a restore point (PostgreSQL: every shard replays to the
  point of that name), or ``latest`` (each shard to the end of its archive). An engine's
  targets are its traits (``contracts.engines``): another is refused by name.
- *base*: the backup a point-in-time restore starts from, the newest complete one that can
  reach the target, or the one the request names if it can: for a time, completed before
  it; for an LSN, its WAL ends in an earlier segment; for a position, its copy ends in the
  same binary log or an earlier one; for a restore point, the backup of
  that name (every backup's cut is a restore point named after it), else the newest (as
  pgBackRest does: PostgreSQL finds the point in the WAL after the base, and a point older
  than the newest backup needs the request to name an older base).
- *first segment*: per shard, the WAL segment the base's own WAL ends in (its cut's, or its
  stop's); the restore needs the archive from there on, without a gap.
- *restorable range*: from the oldest complete backup's completion to the time the archive
  of every shard reaches (its newest contiguous file's push): a target outside it is refused
  with ``TargetOutOfRange`` naming the range, before anything is written.

The archive's WAL is *fed* to the restoring node's recovery as it replays: the batches
(``Phase.WAL`` download items, checked frame by frame like any object) come with the node's
finish, which starts recovery once the base is in place and fetches the batches recovery asks
for, and a few ahead, into ``.shardvault-wal/`` beside the restored data, where the recovery's
``restore_command`` waits for each file (``shardvault_agent.restore.walfeed``). PostgreSQL
stops at a time target only once it meets a transaction after it: WAL that holds none (the
archive ends too early, or nothing committed since) makes the restored server stop, which the
node reports as ``TargetOutOfRange``.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from shardvault.aws.services import Services
from shardvault.aws.tables import completion_order
from shardvault.contracts.catalog import BackupItem
from shardvault.contracts.engines import EngineTraits, label, traits
from shardvault.contracts.layout import batch_place
from shardvault.contracts.links import linked_dirs
from shardvault.contracts.models import (
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
from shardvault.contracts.pgwal import DEFAULT_SEGMENT_SIZE, lsn_number, lsn_text, segment_number
from shardvault.contracts.wal_archive import BINLOG_FILE, log_order
from shardvault.errors import InvalidRequest, TargetOutOfRange, TargetUnsupported
from shardvault.wal.archive import ShardArchive, after_backup, wal_from, wal_stream


def when(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, UTC).isoformat(timespec="seconds")


def base_backup(request: RestoreRequest, backups: list[BackupItem]) -> BackupItem:
    """The backup a point-in-time restore starts from (see the module docstring, *base*), or
    the one the request names if it qualifies."""
    target = request.target
    assert target is not None
    complete = [b for b in backups if b.status == BackupStatus.COMPLETE]
    refuse_target_kind(request, complete)
    if target.kind == "lsn":
        before = before_lsn(request, complete)
    elif target.kind == "position":
        before = before_position(request, complete)
    elif target.kind == "time":
        before = [b for b in complete if (b.completed_at or 0) <= (target.epoch or 0)]
    else:  # latest, or a restore point: PostgreSQL finds it in the WAL after the base
        before = complete
    if target.kind == "name" and request.backup_id == "latest":
        named = [b for b in complete if b.backup_id == target.name]
        before = named or before  # a backup's own cut: restore from that backup
    if request.backup_id != "latest":
        before = [b for b in before if b.backup_id == request.backup_id]
    if not before:
        oldest = min((b.completed_at or 0 for b in complete), default=None)
        which = "" if request.backup_id == "latest" else f" {request.backup_id}"
        raise TargetOutOfRange(
            f"cluster {request.cluster!r} has no complete backup{which} "
            + ("that completed" if target.kind == "time" else "whose WAL ends")
            + f" before {target.describe()}"
            + (f": the oldest completed at {when(oldest)}." if oldest else "."),
            fix="choose a later target (shardvault list shows each backup's completion), or "
            "restore a backup without a target.",
        )
    return max(before, key=completion_order)


def refuse_target_kind(request: RestoreRequest, complete: list[BackupItem]) -> None:
    """A target the cluster's engines' logs cannot stop at is refused by name (an LSN for
    MariaDB, a position for PostgreSQL), and so is a fraction of a second where an engine
    stamps its log by the second. The newest backup says the engines."""
    target = request.target
    assert target is not None
    if not complete:
        return  # base_backup says there is none
    newest = max(complete, key=completion_order)
    engines = [Engine(e) for e in newest.engine.split("+") if e in set(Engine)]
    lacking = [
        e for e in engines if traits(e).point_in_time and target.kind not in traits(e).targets
    ]
    if lacking:
        kinds = sorted(set.intersection(*(set(traits(e).targets) for e in lacking)))
        raise TargetUnsupported(
            f"cluster {request.cluster!r} runs {label(lacking)}, whose log cannot stop at "
            f"{target.describe()}.",
            fix="give a target of "
            + ", ".join(kinds)
            + " (--target-time, "
            + ("--target-position, " if "position" in kinds else "--target-lsn, --target-name, ")
            + "--target-latest).",
        )
    if (
        target.time is not None
        and target.time.microsecond
        and any(traits(e).whole_seconds for e in engines)
    ):
        raise InvalidRequest(
            f"target time {target.describe()} has a fraction of a second, and "
            f"{label(engines)} stamps its log by the second: the restore could not tell "
            "the transactions of that second apart.",
            fix="give the time in whole seconds (the restore holds what was committed before it).",
        )


def before_position(request: RestoreRequest, complete: list[BackupItem]) -> list[BackupItem]:
    """The complete backups whose copy ends in a binary log no later than the target
    position's (in the same file, the replay checks the offset): one shard's log, so a
    cluster of one shard only."""
    target = request.target
    assert target is not None
    assert target.position is not None
    shards = max((len(b.wal_from) for b in complete), default=1)
    one_shard_for_lsn(request.cluster, shards)
    at = log_order(target.position.rpartition(":")[0])
    return [
        b
        for b in complete
        if (first := next(iter(b.wal_from.values()), None)) is not None
        and BINLOG_FILE.fullmatch(first)
        and log_order(first) <= at
    ]


def before_lsn(request: RestoreRequest, complete: list[BackupItem]) -> list[BackupItem]:
    """The complete backups whose own WAL ends in a segment before the target LSN's: a
    recovery can stop there (PostgreSQL refuses a target before its base's end). An LSN is a
    place in one shard's WAL: a cluster of several shards is refused by name."""
    target = request.target
    assert target is not None
    assert target.lsn is not None
    shards = max((len(b.wal_from) for b in complete), default=1)
    one_shard_for_lsn(request.cluster, shards)
    at = lsn_number(target.lsn) // DEFAULT_SEGMENT_SIZE
    return [
        b
        for b in complete
        if (first := next(iter(b.wal_from.values()), None)) is not None
        and segment_number(first) < at
    ]


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
    svc: Services,
    request: RestoreRequest,
    manifest: Manifest,
    oldest_backup: float,
    reaches: Callable[[list[ShardArchive]], None] | None = None,
) -> list[ShardArchive]:
    """Every shard's archive from the base on; refuses a target it does not reach, by name
    (``reaches``: the target's own check of the archives, first: a scheduled cut's)."""
    target = request.target
    assert target is not None
    if without := [e for e in manifest.engines if not traits(e).point_in_time]:
        raise TargetUnsupported(
            f"cluster {request.cluster!r} runs {label(without)}, which keeps no WAL archive: "
            "it restores to its backups only.",
            fix="restore a backup without a target (--target-time, --target-latest).",
        )
    if target.lsn is not None:
        one_shard_for_lsn(request.cluster, len(manifest.shards))
    found = []
    for shard in manifest.shards:
        found.append(shard_after(svc, manifest, shard.shard_id))
    if reaches is not None:
        reaches(found)
    reach = min((a.reaches for a in found), default=0.0)
    restorable = f"from {when(oldest_backup)} to {when(reach)}" if reach else "nothing"
    empty = [a for a in found if a.last is None]
    if empty:
        log = log_of(manifest, empty[0].shard_id)
        raise TargetOutOfRange(
            f"the {log.log} archive of shard(s) {', '.join(a.shard_id for a in empty)} holds "
            f"nothing from backup {manifest.backup_id}'s end on ({log.log_file} "
            f"{empty[0].first}): cluster {request.cluster!r} can be restored to its backups "
            "only.",
            fix="set up continuous archiving on those shards (docs/guide/wal-archiving.md"
            "), then take a backup; restore without a target meanwhile.",
        )
    if target.lsn is not None:
        past_lsn(target, found[0], manifest)
    if target.position is not None:
        outside_position(target.position, found[0], manifest.shards[0].marker)
    if target.epoch is not None and target.epoch > reach:
        short = min(found, key=lambda a: a.reaches)
        log = log_of(manifest, short.shard_id)
        raise TargetOutOfRange(
            f"{target.describe()} is past the {log.log} archive: shard {short.shard_id}'s "
            f"archived {log.log} runs without a gap to {short.last}, pushed at "
            f"{when(short.reaches)}; the restorable range is {restorable}.",
            fix=f"choose a target inside the range, or wait until the archive holds {log.log} "
            f"past the target ({log.closes}).",
        )
    return found


def log_of(manifest: Manifest, shard_id: str) -> EngineTraits:
    """The traits that name the shard's archived log in messages (WAL, binary log)."""
    (shard,) = [s for s in manifest.shards if s.shard_id == shard_id]
    return traits(manifest.engine_of(shard))


def replayed(found: list[ShardArchive]) -> tuple[int, int]:
    """How many archive batches a restore downloads, and their WAL's bytes: every shard's run
    from its base on (PostgreSQL reads as far as its target needs; the rest is fetched too)."""
    batches = [b for archive in found for b in archive.batches]
    return len(batches), sum(f["size"] for b in batches for f in b["files"])


def one_shard_for_lsn(cluster: str, shards: int) -> None:
    if shards > 1:
        raise TargetUnsupported(
            f"an LSN is a position in one shard's WAL, and cluster {cluster!r} has {shards} "
            "shards, each with its own.",
            fix="restore every shard to a time (--target-time) or a restore point (--target-name).",
        )


def outside_position(position: str, archive: ShardArchive, marker: dict[str, str]) -> None:
    """Refuses a binary log position whose file is not in the shard's archived run, or that
    lies before where the base's copy ends (its ``marker``), naming the run (the replay checks
    the offset against the file's transaction boundaries)."""
    file, _, offset = position.rpartition(":")
    assert archive.last is not None
    before_base = file == archive.first and int(offset) < int(marker.get("binlog_pos", 0))
    if before_base or not log_order(archive.first) <= log_order(file) <= log_order(archive.last):
        raise TargetOutOfRange(
            f"position {position} is not in shard {archive.shard_id}'s archived binary logs "
            f"after the base: they run from {archive.first}:{marker.get('binlog_pos', 4)} to "
            f"the end of {archive.last}.",
            fix="give a position in those files, or restore from another backup (--backup-id).",
        )


def past_lsn(target: RestoreTarget, archive: ShardArchive, manifest: Manifest) -> None:
    """Refuses an LSN past the end of the shard's archived run, naming the range: from where
    the base's own WAL ends to the end of the run's last segment."""
    assert target.lsn is not None
    assert archive.last is not None
    end = (segment_number(archive.last) + 1) * DEFAULT_SEGMENT_SIZE
    if lsn_number(target.lsn) >= end:
        (shard,) = manifest.shards  # one shard: one_shard_for_lsn
        first = shard.marker.get("cut_lsn") or shard.marker.get("stop_lsn") or "?"
        raise TargetOutOfRange(
            f"{target.describe()} is past the WAL archive of shard {archive.shard_id}: it runs "
            f"without a gap to {archive.last}; the restorable range is LSN {first} "
            f"to {lsn_text(end)}.",
            fix="choose an LSN inside the range, or wait until the archive holds WAL past it.",
        )


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


def recovery(target: RestoreTarget, created: dict[str, str] | None = None) -> dict[str, Any]:
    """What the restoring node's recovery is told (``finish_postgres``); ``created``: the
    shard's linked directories created after the base (``created_after``)."""
    return {
        "target_time": target.time.isoformat() if target.time else None,
        "target_lsn": target.lsn,
        "target_name": target.name,
        "target_position": target.position,
        "wal_dir": True,
        "created_links": created or {},
    }


def plan_wal(
    svc: Services, context: RestoreContext, manifest: Manifest, node_of: dict[str, str]
) -> tuple[dict[str, tuple[list[FileEntry], list[DownloadItem]]], dict[str, dict[str, str]]]:
    """Per shard, its WAL stream and download items, from the archive as it is now (it may
    have grown since validation: more WAL, never less); and the linked directories created
    after the base (``created_after``)."""
    planned, created = {}, {}
    for shard in manifest.shards:
        archive = shard_after(svc, manifest, shard.shard_id)
        planned[shard.shard_id] = wal_items(context, archive, node_of[shard.shard_id])
        created[shard.shard_id] = created_after(archive, shard.marker)
    return planned, created


def created_after(archive: ShardArchive, base_marker: dict[str, str]) -> dict[str, str]:
    """The linked directories (PostgreSQL's tablespaces) the archive's batches saw that the
    base did not hold: path -> the location they were created in. Recovery may replay their
    creation, which writes into that location on the restoring node (on the source's host,
    the source's own tablespace): the node refuses to replay where the location exists
    (``engines.postgres.tablespaces.refuse_created``)."""
    held = {d.path for d in linked_dirs(base_marker)}
    created: dict[str, str] = {}
    for batch in archive.batches:
        for path, location in (batch.get("links") or {}).items():
            if path not in held:
                created.setdefault(path, location)
    return created
