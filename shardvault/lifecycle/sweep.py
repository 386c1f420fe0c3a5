"""The sweep: removes from the store what no running backup owns and no manifest names.

Every failure path cleans up after itself, but a crash of the control plane itself (a Lambda
killed mid-cleanup, an EventBridge event lost) can still leave open multipart uploads (billed
for their parts, invisible in a listing of objects) and partial objects. The daily retention
run sweeps them, so cleanup converges whatever happened:

- an *orphan upload* is an open multipart upload under ``<prefix>/<cluster>/<backup_id>/``
  whose backup is not RUNNING in the catalog;
- an *orphan prefix* is a backup prefix without ``manifest.json`` whose backup is not RUNNING
  (a prefix with a manifest is a backup, even if the catalog lost its record: never swept).

A restore's staged copy of a copy target (``_staged/<restore id>/``, ``shardvault.restore.
sources``) is removed once no restore can still be running (72 hours, plus the grace).

A cluster's WAL archive (``<cluster>/_wal/``, ``shardvault.wal.archive``) is no backup prefix: the
sweep deletes from it only the batches no kept backup needs (``archive.expired_keys``: WAL
before the oldest complete backup's own), and forgets the scheduled cuts taken before that
backup completed (``forget_cuts``: their catalog items; no kept base reaches them).

Both must be older than the settings' ``sweep_grace_seconds`` (6 hours): a backup writes its
catalog record before its first upload, but the sweep does not bet on clocks and listing
order.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from shardvault.aws.services import Services
from shardvault.aws.store import Bucket
from shardvault.contracts import layout
from shardvault.contracts.catalog import BackupItem
from shardvault.contracts.layout import backup_prefix, manifest_key, store_root
from shardvault.contracts.models import BackupStatus
from shardvault.wal import archive


def sweep(svc: Services, now: float, *, dry_run: bool = False) -> dict[str, Any]:
    """Aborts orphan uploads and deletes orphan prefixes (or, with ``dry_run``, lists them)."""
    bucket, root = svc.store_bucket, store_root(svc.store.prefix)
    grace_seconds = svc.settings.sweep_grace_seconds
    statuses: dict[str, dict[str, str]] = {}

    def running(cluster: str, backup_id: str) -> bool:
        if cluster not in statuses:
            statuses[cluster] = {r.backup_id: r.status for r in svc.catalog.backups(cluster)}
        return statuses[cluster].get(backup_id) == BackupStatus.RUNNING

    aborted = []
    for upload in bucket.open_uploads(root):
        owner = backup_of(upload["Key"], root)
        young = now - upload["Initiated"].timestamp() < grace_seconds
        if owner is None or young or running(*owner):
            continue
        aborted.append(upload["Key"])
        if not dry_run:
            bucket.abort_upload(upload["Key"], upload["UploadId"])
    deleted: dict[str, int] = {}
    prefixes, archives = store_listing(bucket, root)
    for (cluster, backup_id), newest in prefixes.items():
        prefix = backup_prefix(svc.store.prefix, cluster, backup_id)
        if cluster == layout.STAGED_DIR:  # a restore's staged copy: kept while it may run
            if now - newest >= layout.RESTORE_LONGEST_SECONDS + grace_seconds:
                deleted[prefix] = 0 if dry_run else bucket.delete_prefix(prefix)
            continue
        if now - newest < grace_seconds or running(cluster, backup_id):
            continue
        if bucket.holds_any(manifest_key(svc.store.prefix, cluster, backup_id)):
            continue
        deleted[prefix] = 0 if dry_run else bucket.delete_prefix(prefix)
    expired_wal, expired_cuts = {}, {}
    policy = svc.policy()
    for cluster, keys in archives.items():
        entry = policy.clusters.get(cluster) if policy else None
        window = entry.archive.window_days if entry else None
        base = archive.kept_base(svc.catalog.backups(cluster), window, now)
        expired = archive.expired_keys(keys, dict(base.wal_from) if base else {})
        if expired:
            expired_wal[cluster] = len(expired)
            if not dry_run:
                bucket.delete_keys(expired)
        if base is not None and (gone := forget_cuts(svc, cluster, base, dry_run)):
            expired_cuts[cluster] = gone
    return {
        "dry_run": dry_run,
        "aborted_uploads": aborted,
        "deleted_prefixes": deleted,
        "expired_wal": expired_wal,
        "expired_cuts": expired_cuts,
    }


def forget_cuts(svc: Services, cluster: str, base: BackupItem, dry_run: bool) -> int:
    """Deletes the catalog items of the cluster's scheduled cuts (``backup.cuts``) taken
    before the kept archive's base completed: no backup the archive still replays from
    reaches them. Returns how many (would) go."""
    gone = [c for c in svc.catalog.cuts(cluster) if c.instant < (base.completed_at or 0)]
    if not dry_run:
        for cut in gone:
            svc.catalog.delete_cut(cluster, cut.cut_id)
    return len(gone)


def backup_of(key: str, root: str) -> tuple[str, str] | None:
    """``(cluster, backup_id)`` of a key ``<root><cluster>/<backup_id>/...``; None for a key
    outside any backup (the WAL archive's included)."""
    if not key.startswith(root):
        return None
    parts = key.removeprefix(root).split("/")
    if len(parts) <= 2 or parts[1] == layout.ARCHIVE_DIR:
        return None
    return parts[0], parts[1]


def store_listing(
    bucket: Bucket, root: str
) -> tuple[dict[tuple[str, str], float], dict[str, list[str]]]:
    """One listing of the store: every backup prefix, with the time (epoch seconds) of its
    newest object; and every cluster's WAL archive keys."""
    newest: dict[tuple[str, str], float] = defaultdict(float)
    archives: dict[str, list[str]] = defaultdict(list)
    for obj in bucket.objects(root):
        parts = obj["Key"].removeprefix(root).split("/")
        if len(parts) > 3 and parts[1] == layout.ARCHIVE_DIR:
            archives[parts[0]].append(obj["Key"])
        owner = backup_of(obj["Key"], root)
        if owner is not None:
            newest[owner] = max(newest[owner], obj["LastModified"].timestamp())
    return dict(newest), dict(archives)
