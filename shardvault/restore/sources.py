"""What a restore reads: the store its source backup is in (staging or the vault), the
backups an incremental builds on, and their manifests read side by side.

Terms:
- *source*: where a backup's objects are read: ``store``, ``vault`` (the stack's vault), or
  ``copy:NAME``, a copy target of the policy (``vault.copies``), chosen by ``restore
  --from-vault NAME``.
- *outliving the stack*: retention expires a backup from the store and the stack vault only
  (``shardvault.lifecycle.expire``); a copy target keeps its copy for its own retention, so
  an ``EXPIRED`` backup (and an incremental's ``EXPIRED`` ancestors) is still restored from
  a copy that holds it (``held_in_copy``).
- *staging* (of a copy): the agents hold no credentials of another provider or account, so
  the thaw step copies a copy target's objects into the store first (an archived object in
  account B thawed there before), under ``<prefix>/_staged/<restore id>/``; the agents
  read them there through presigned URLs as always. The restore's end removes them, and the
  sweep removes what a crash leaves (a prefix without a manifest, ``shardvault.lifecycle.sweep``).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from shardvault.aws.readback import load_manifest, manifest_place, parse_manifest
from shardvault.aws.services import Services
from shardvault.aws.store import Bucket
from shardvault.config.targets import STACK_TARGET, VaultCopy
from shardvault.contracts.catalog import BackupItem
from shardvault.contracts.layout import STAGED_DIR
from shardvault.contracts.models import (
    BackupStatus,
    ChainSource,
    Manifest,
    ManifestShard,
    RestoreContext,
)
from shardvault.errors import BackupNotRestorable, InvalidRequest, ParentUnavailable
from shardvault.lifecycle.targets import TargetBucket, bucket_of

COPY_SOURCE = "copy:"


def source_of(svc: Services, source: str) -> Bucket:
    """The bucket a backup is read from: the vault once promoted, else the store (where a
    copy target's objects are staged)."""
    if source == "vault" and svc.vault_bucket is not None:
        return svc.vault_bucket
    return svc.store_bucket


def copy_name(source: str) -> str | None:
    """The copy target a source names (None: the store or the stack vault)."""
    return source.removeprefix(COPY_SOURCE) if source.startswith(COPY_SOURCE) else None


def copy_target(svc: Services, cluster: str, name: str) -> VaultCopy:
    """The cluster's copy target ``name`` in the deployed policy, or refused by name."""
    policy = svc.policy()
    copies = policy.cluster(cluster).vault.copies if policy and cluster in policy.clusters else []
    for target in copies:
        if target.name == name:
            return target
    known = [policy.cluster(cluster).vault.name] if policy and cluster in policy.clusters else []
    raise InvalidRequest(
        f"cluster {cluster} has no vault target named {name!r}.",
        fix=f"use one of {', '.join(known + [t.name for t in copies])} (the policy's vault.name "
        "and vault.copies), or leave --from-vault out to read the stack vault.",
    )


def copy_bucket(
    svc: Services, cluster: str, name: str, bucket: str | None = None, session: str = "read"
) -> TargetBucket:
    """Copy target ``name``'s bucket: ``bucket``, the one a copy's record names, when given
    (the policy may name another since); ``session``: what an aws target's role session is
    for."""
    target = copy_target(svc, cluster, name)
    if bucket is not None:
        target = target.model_copy(update={"bucket": bucket})
    return bucket_of(target, svc, session)


def held_in_copy(record: BackupItem, name: str) -> bool:
    """Whether copy target ``name`` holds the backup, complete or expired from the stack."""
    held = record.vault_copies.get(name)
    readable = record.status in (BackupStatus.COMPLETE, BackupStatus.EXPIRED)
    return readable and held is not None and held.state == "COPIED"


def copy_place(record: BackupItem, name: str) -> tuple[str, str | None]:
    """A backup's manifest key and generation in copy target ``name``, or refused by name
    when the target holds no copy of it."""
    held = record.vault_copies.get(name)
    if held is None or held.state != "COPIED" or held.manifest_key is None:
        state = f"{held.state}: {held.reason}" if held else "never copied there"
        raise BackupNotRestorable(
            f"backup {record.backup_id} has no copy in vault target {name!r} ({state}).",
            fix="restore it from the stack vault (leave --from-vault out), or pick a backup "
            f"that target holds ('shardvault show {record.cluster} BACKUP' lists its copies).",
        )
    return held.manifest_key, held.manifest_generation


def read_manifest(
    svc: Services, cluster: str, source: str, key: str, version: str | None
) -> Manifest:
    """A manifest where its source keeps it: a copy target's is read from the provider."""
    if (name := copy_name(source)) is None:
        return load_manifest(source_of(svc, source), key, version)
    bucket = copy_bucket(svc, cluster, name)
    body = bucket.read_all(key, version)
    return parse_manifest(body, f"{bucket.where}/{key}")


def staged_key(svc: Services, restore_id: str, key: str) -> str:
    """Where a copy target's object is staged in the store for a restore."""
    return f"{svc.store.prefix.strip('/')}/{STAGED_DIR}/{restore_id}/{key}"


def readable_place(
    svc: Services, source: str, key: str, version: str | None, restore_id: str
) -> tuple[Bucket, str, str | None]:
    """Where an agent reads an object of a restore (bucket, key, version): a copy target's
    from its staged copy in the store."""
    if copy_name(source) is not None:
        return svc.store_bucket, staged_key(svc, restore_id, key), None
    return source_of(svc, source), key, version


PARALLEL_READS = 8


def stack_vault_name(svc: Services, cluster: str) -> str:
    """The name ``--from-vault`` gives the stack's own vault: the policy's ``vault.name``."""
    policy = svc.policy()
    entry = policy.clusters.get(cluster) if policy else None
    return entry.vault.name if entry else STACK_TARGET


def read_from(record: BackupItem, svc: Services) -> str:
    """Where a backup is read unless a restore names a copy: the vault once promoted."""
    return "vault" if record.location == "vault" and svc.vault else "store"


def chain_sources(manifest: Manifest, svc: Services, copy: str | None = None) -> list[ChainSource]:
    """Where each ancestor of an incremental is read, root first (from copy target ``copy``
    when the restore reads one); each manifest is read now (side by side), so a missing or
    damaged ancestor refuses the restore before anything is placed."""
    if manifest.chain is None:
        return []
    sources = []
    for backup_id in manifest.chain.ancestors:  # the catalog's table is not shared by threads
        record = svc.catalog.get(manifest.cluster, backup_id)
        held = record is not None and copy is not None and held_in_copy(record, copy)
        if record is None or (record.status != BackupStatus.COMPLETE and not held):
            raise ParentUnavailable(
                f"backup {manifest.backup_id} is an incremental whose ancestor {backup_id} is "
                f"{record.status.lower() if record else 'gone'}: its chain cannot be restored.",
                fix="restore another backup ('shardvault list'), e.g. the newest full.",
            )
        if copy:
            source, (key, version) = COPY_SOURCE + copy, copy_place(record, copy)
        else:
            source = read_from(record, svc)
            key, version = manifest_place(record, source)
        sources.append(
            ChainSource(
                backup_id=backup_id, manifest_key=key, source=source, manifest_version=version
            )
        )
    with ThreadPoolExecutor(PARALLEL_READS) as pool:  # boto3 clients may be shared by threads
        reads = [
            pool.submit(
                read_manifest, svc, manifest.cluster, s.source, s.manifest_key, s.manifest_version
            )
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
        found = list(pool.map(lambda p: read_manifest(svc, context.cluster, *p), places))
    return [(manifest, source) for manifest, (source, *_) in zip(found, places, strict=True)]


def shard_size(shard: ManifestShard) -> int:
    return sum(f.size for s in shard.streams for f in s.files)
