"""The store's key layout: where a backup's objects and manifest live, and the WAL archive
beside them. The control plane and the agents build these keys here alone (the work
bucket's keys, which no backup outlives, are ``Services``').

Under the store's prefix (``store_root``), each cluster has a directory per backup and one
WAL archive::

    <root><cluster>/<backup id>/<shard>/<phase>-<n>           a backup's objects
    <root><cluster>/<backup id>/manifest.json                 its manifest
    <root><cluster>/_wal/<shard>/<first>--<last>--<batch>.wal  a WAL archive batch
    <root><cluster>/_wal/<shard>/<first>--<last>--<batch>.json its index

A backup id starts with a digit, so it never collides with ``_wal``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shardvault.contracts.models import ShardListing
    from shardvault.contracts.wal_archive import Batch

ARCHIVE_DIR = "_wal"  # under a cluster's prefix; never a backup id (those start with a digit)
# Under the store's root, beside the clusters: a copy target's objects staged for a restore,
# one directory per restore id (shardvault.restore.sources); never a cluster name (those
# start with a letter). Kept at most as long as a restore can run (restore.asl.json's
# TimeoutSeconds), after which the sweep removes what is left.
STAGED_DIR = "_staged"
RESTORE_LONGEST_SECONDS = 72 * 3600


def store_root(prefix: str) -> str:
    """The key prefix every backup lives under ("" for a store without a prefix)."""
    return f"{prefix.strip('/')}/" if prefix.strip("/") else ""


def backup_prefix(prefix: str, cluster: str, backup_id: str) -> str:
    """Where a backup's objects and manifest live in the store."""
    return f"{store_root(prefix)}{cluster}/{backup_id}/"


def object_key(prefix: str, cluster: str, backup_id: str, listing: ShardListing, i: int) -> str:
    return f"{backup_prefix(prefix, cluster, backup_id)}{listing.shard_id}/{listing.phase}-{i:05d}"


def manifest_key(prefix: str, cluster: str, backup_id: str) -> str:
    return f"{backup_prefix(prefix, cluster, backup_id)}manifest.json"


def batch_place(cluster: str, shard_id: str, batch_id: str) -> str:
    """Where a batch's frames belong, for their seal's associated data (``pipeline.Sealer``):
    a frame moved to another batch, shard or cluster does not open."""
    return f"{cluster}/{ARCHIVE_DIR}/{shard_id}/{batch_id}"


def batch_key(prefix: str, cluster: str, batch: Batch) -> str:
    first, last = batch.files[0].name, batch.files[-1].name
    return (
        f"{store_root(prefix)}{cluster}/{ARCHIVE_DIR}/{batch.shard_id}/"
        f"{first}--{last}--{batch.batch_id}.wal"
    )


def index_key(object_key: str) -> str:
    return object_key.removesuffix(".wal") + ".json"


def archive_prefix(prefix: str, cluster: str, shard_id: str) -> str:
    return f"{store_root(prefix)}{cluster}/{ARCHIVE_DIR}/{shard_id}/"
