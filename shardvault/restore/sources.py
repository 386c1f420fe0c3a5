"""What a restore reads: the store its source backup is in (staging or the vault), the
backups an incremental builds on, and their manifests read side by side."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from shardvault.aws.readback import load_manifest, manifest_place
from shardvault.aws.services import Services
from shardvault.aws.store import Bucket
from shardvault.contracts.models import (
    BackupStatus,
    ChainSource,
    Manifest,
    ManifestShard,
    RestoreContext,
)
from shardvault.errors import ParentUnavailable


def source_of(svc: Services, source: str) -> Bucket:
    """The bucket a backup is read from: the vault once promoted, else the store."""
    if source == "vault" and svc.vault_bucket is not None:
        return svc.vault_bucket
    return svc.store_bucket


PARALLEL_READS = 8


def chain_sources(manifest: Manifest, svc: Services) -> list[ChainSource]:
    """Where each ancestor of an incremental is read, root first; each manifest is read now
    (side by side), so a missing or damaged ancestor refuses the restore before anything is
    placed."""
    if manifest.chain is None:
        return []
    sources = []
    for backup_id in manifest.chain.ancestors:  # the catalog's table is not shared by threads
        record = svc.catalog.get(manifest.cluster, backup_id)
        if record is None or record.status != BackupStatus.COMPLETE:
            raise ParentUnavailable(
                f"backup {manifest.backup_id} is an incremental whose ancestor {backup_id} is "
                f"{record.status.lower() if record else 'gone'}: its chain cannot be restored.",
                fix="restore another backup ('shardvault list'), e.g. the newest full.",
            )
        source = "vault" if record.location == "vault" and svc.vault else "store"
        key, version = manifest_place(record, source)
        sources.append(
            ChainSource(
                backup_id=backup_id, manifest_key=key, source=source, manifest_version=version
            )
        )
    with ThreadPoolExecutor(PARALLEL_READS) as pool:  # boto3 clients may be shared by threads
        reads = [
            pool.submit(load_manifest, source_of(svc, s.source), s.manifest_key, s.manifest_version)
            for s in sources
        ]
        for read in reads:  # root first: the oldest damaged manifest is the one named
            read.result()
    return sources


def chain_manifests(context: RestoreContext, svc: Services) -> list[tuple[Manifest, str]]:
    """The chain's manifests with where each is read, root first (the restored one last),
    read side by side."""
    places = [(c.source, c.manifest_key, c.manifest_version) for c in context.chain]
    places.append((context.source, context.manifest_key, context.manifest_version))
    with ThreadPoolExecutor(PARALLEL_READS) as pool:
        found = list(pool.map(lambda p: load_manifest(source_of(svc, p[0]), *p[1:]), places))
    return [(manifest, source) for manifest, (source, *_) in zip(found, places, strict=True)]


def shard_size(shard: ManifestShard) -> int:
    return sum(f.size for s in shard.streams for f in s.files)
