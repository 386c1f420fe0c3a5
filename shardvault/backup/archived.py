"""Archived tails: a backup whose WAL the continuous archive already holds copies the
archive's batches into itself instead of having the agent copy the WAL again.

Terms:
- *archived tail*: a shard's tail whose marker names ``archived_from`` and
  ``archived_through`` (PostgreSQL with a ``wal_spool_dir``:
  ``shardvault_agent.engines.postgres.adapter``). The tail holds the backup label alone; the
  WAL from the backup's first segment through the last it needs is in the shard's archive, recorded
  before the agent answered Stop.
- *copies*: Finalize copies each batch that holds some of that WAL into the backup's prefix
  (``<shard>/wal-<n>``), inside the store (no byte through the database host), and checks
  each copy's checksum and size as the store reports them. They extend the shard's tail
  stream, after the label's bytes: each batch's files under ``pg_wal/`` (the segments the
  restore's recovery reads, as it reads a copied tail's), or under ``.shardvault-wal/tail/``
  (what a batch holds from before the backup's first segment, and a second copy of a file,
  which a restore removes). A copy keeps its batch's frames, so its manifest entry keeps the
  batch's place and data key.

The backup then stands alone like any other: promoted, verified, expired and restored by its
manifest, whatever the archive's own retention later removes.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

from shardvault.aws.services import Services
from shardvault.backup.upload import verify_object
from shardvault.contracts.layout import backup_prefix, batch_place
from shardvault.contracts.models import (
    Encryption,
    FileEntry,
    ManifestStream,
    ObjectResult,
    Phase,
    ShardListing,
)
from shardvault.contracts.pgwal import SEGMENT_NAME
from shardvault.contracts.wal_archive import WAL_DIR
from shardvault.errors import WalNotArchived
from shardvault.wal.archive import archived_batches, batch_files, shard_archive

PARALLEL_COPIES = 8
TAIL_EXTRAS = f"{WAL_DIR}/tail"  # a restore removes WAL_DIR once recovered


def wal_range(listing: ShardListing) -> tuple[str, str] | None:
    """The first and last WAL segment an archived tail refers to; None for any other tail."""
    first, through = listing.marker.get("archived_from"), listing.marker.get("archived_through")
    if listing.phase != Phase.TAIL or not first or not through:
        return None
    return first, through


def with_archived_wal(
    svc: Services, cluster: str, backup_id: str, listing: ShardListing, tail: ManifestStream
) -> ManifestStream:
    """``tail`` (the shard's tail stream, complete), extended by the archive's batches that
    hold its WAL, copied into the backup (module docstring); ``tail`` itself when the tail is
    not archived. Raises ``WalNotArchived`` when the archive lacks a segment of the range."""
    wal = wal_range(listing)
    if wal is None:
        return tail
    first, last = wal
    batches = covering(svc, cluster, listing.shard_id, first, last)
    prefix = backup_prefix(svc.store.prefix, cluster, backup_id)
    keys = [f"{prefix}{listing.shard_id}/wal-{i:05d}" for i in range(len(batches))]
    with ThreadPoolExecutor(PARALLEL_COPIES) as pool:  # each copy waits on the store
        verified = list(pool.map(lambda pair: copied(svc, *pair), zip(batches, keys, strict=True)))
    files, offsets = stream_files(batches, first)
    start, after = listing.sent_bytes, len(tail.objects)
    objects = [
        copy_result(index, key, listing, after + i, start + offset, how)
        for i, (index, key, offset, how) in enumerate(
            zip(batches, keys, offsets, verified, strict=True)
        )
    ]
    return tail.model_copy(
        update={"files": [*tail.files, *files], "objects": [*tail.objects, *objects]}
    )


def covering(
    svc: Services, cluster: str, shard_id: str, first: str, last: str
) -> list[dict[str, Any]]:
    """The indexes of the archive's batches that hold segments ``first`` to ``last`` (and the
    run's timeline history files), in WAL order."""
    indexes = archived_batches(svc, cluster, shard_id, since=first)
    run = shard_archive(shard_id, first, indexes)
    if not run.holds(last):
        reach = f"runs to {run.last}" if run.last else f"does not hold {first}"
        raise WalNotArchived(
            f"shard {shard_id}'s tail refers to the WAL archive from {first} to {last}, but "
            f"the archive {reach}.",
            fix="the backup is failed and removed; check the shard's spool and the archive "
            "function's errors in the agent's log, then start the backup again.",
        )
    return [b for b in run.batches if min(f["name"][:24] for f in b["files"]) <= last]


def copied(svc: Services, index: dict[str, Any], key: str) -> str:
    """Copies a batch's object to ``key`` inside the store; how the copy was verified (its
    checksum and size as the store reports them, against the batch's index)."""
    svc.store_bucket.copy_within(index["key"], key)
    return verify_object(svc, key, index["crc64nvme"], index["stored_length"])


def stream_files(batches: list[dict[str, Any]], first: str) -> tuple[list[FileEntry], list[int]]:
    """The copies' files, which follow the label's in the tail stream (module docstring:
    where each goes), and each batch's offset among them."""

    def path_of(name: str, batch_id: str, again: bool) -> str:
        early = SEGMENT_NAME.fullmatch(name[:24]) and name[:24] < first
        return f"{TAIL_EXTRAS}/{batch_id}/{name}" if again or early else f"pg_wal/{name}"

    return batch_files(batches, path_of)


def copy_result(
    index: dict[str, Any], key: str, listing: ShardListing, i: int, offset: int, how: str
) -> ObjectResult:
    encryption = index.get("encryption")
    sealed = Encryption.model_validate(encryption) if encryption else None
    return ObjectResult(
        key=key,
        node_id=listing.node_id,
        shard_id=listing.shard_id,
        phase=Phase.TAIL,
        index=i,
        stream_offset=offset,
        length=sum(f["size"] for f in index["files"]),
        part_size=max(1, index["stored_length"]),
        part_count=1,  # a batch is one PUT
        crc64nvme=index["crc64nvme"],
        part_crc64nvme=[index["crc64nvme"]],
        verified_by=how,
        stored_length=index["stored_length"],
        frame_size=index["frame_size"],
        frames=index["frames"],
        key_check=sealed.key_check if sealed else None,
        place=batch_place(index["cluster"], index["shard_id"], index["batch_id"]),
        encryption=sealed,
    )
