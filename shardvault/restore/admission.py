"""Validate: the restore workflow's first step, before any side effect.

Terms:
- *source*: the backup, read from its manifest; *target*: the cluster restored into, whose
  agents registered with a ``restore_dir`` (and report its room and the shards it holds).

Validation reads only (catalog, registry, manifest): a bad request changes nothing.
"""

from __future__ import annotations

import time
from functools import partial
from typing import Any

from shardvault.aws.readback import manifest_place
from shardvault.aws.services import Services
from shardvault.aws.tables import Catalog
from shardvault.backup import (
    check_agents_current,
    check_nodes_available,
    cuts,
)
from shardvault.contracts import engines
from shardvault.contracts.catalog import BackupItem
from shardvault.contracts.engines import traits
from shardvault.contracts.links import linked_dirs, remaps
from shardvault.contracts.models import (
    BackupStatus,
    Manifest,
    NodeRecord,
    RestoreContext,
    RestoreRequest,
    RestoreTarget,
    RetrievalTier,
)
from shardvault.contracts.sqlcheck import DIALECTS, check_validation_queries
from shardvault.errors import (
    BackupDamaged,
    BackupNotFound,
    BackupNotRestorable,
    EngineMismatch,
    InvalidRequest,
    TargetNotEmpty,
    TargetNotReady,
    UnknownCluster,
)
from shardvault.pricing.prices import RestoreTier, StorageClass, thaw_tiers
from shardvault.restore.placement import assignments, place_by_engine
from shardvault.restore.record import new_restore_id
from shardvault.restore.sources import (
    COPY_SOURCE,
    chain_sources,
    copy_name,
    copy_place,
    copy_target,
    held_in_copy,
    read_from,
    read_manifest,
    shard_size,
    stack_vault_name,
)
from shardvault.wal import pitr
from shardvault.workflow.membership import check_members


def validate(request: RestoreRequest, svc: Services, now: float) -> RestoreContext:
    """Resolves the backup, checks the target and places the shards, or raises a named error.
    Nothing is written."""
    cut = cuts.resolve(svc.catalog, request.cluster, request.target) if request.target else None
    if cut is not None:
        # A scheduled cut: every node to its restore point, from a base completed before it.
        request = request.model_copy(update={"target": RestoreTarget(name=cut.cut_id)})
        backups = svc.catalog.backups(request.cluster)
        record = cuts.base_for(cut, request, backups)
    elif request.target is not None:
        backups = svc.catalog.backups(request.cluster)
        record = pitr.base_backup(request, backups)
    else:
        record = resolve_backup(request, svc.catalog)
    check_not_damaged(record, request.accept_damaged)
    source, manifest_key, manifest_version = source_for(request, record, svc)
    if source == "vault":
        check_tier(record, request.tier)
    elif (name := copy_name(source)) and record.vault_copies[name].kind == "aws":
        check_tier(record, request.tier, record.vault_copies[name].storage_class)
    manifest = read_manifest(svc, request.cluster, source, manifest_key, manifest_version)
    links = remaps(
        request.tablespaces, {s.shard_id: linked_dirs(s.marker) for s in manifest.shards}
    )
    # Every ancestor readable (from the same copy target), or refused by name.
    chain = chain_sources(manifest, svc, copy_name(source))
    wal_batches, wal_bytes = 0, 0
    if request.target is not None:  # the archive reaches the target, or refused by name
        complete = [b for b in backups if b.status == BackupStatus.COMPLETE]
        oldest = min(b.completed_at or 0 for b in complete)
        reaches = partial(cuts.check_reached, cut, manifest) if cut is not None else None
        found = pitr.archives(svc, request, manifest, oldest, reaches)
        wal_batches, wal_bytes = pitr.replayed(found)
    # Each engine's own lexing: a text one reads as one statement another may split.
    check_validation_queries(
        request.validation_queries,
        [DIALECTS[e.value] for e in manifest.engines if e.value in DIALECTS],
    )
    nodes = target_nodes(request, svc, now)
    check_target_engines(manifest, nodes)
    if request.validation_queries and (
        silent := [e for e in manifest.engines if not traits(e).runs_queries]
    ):
        raise InvalidRequest(
            f"backup {manifest.backup_id} holds {engines.label(silent)} shards, which run no "
            "validation queries.",
            fix="restore without validation queries; the agents' finish hook checks the copy.",
        )
    shard_bytes = {s.shard_id: shard_size(s) for s in manifest.shards}
    room = {n.node_id: n.restore_free_bytes or 0 for n in nodes}
    placements = place_by_engine(
        shard_bytes,
        room,
        request.placement,
        shard_engine={s.shard_id: manifest.engine_of(s).value for s in manifest.shards},
        node_engine={n.node_id: n.engine.value for n in nodes},
    )
    if not request.replace:
        held = {n.node_id: set(n.restore_occupied) for n in nodes}
        if busy := [p for p in placements if p.shard_id in held[p.node_id]]:
            raise TargetNotEmpty(
                "target node(s) already hold data for "
                + ", ".join(f"shard {p.shard_id} on {p.node_id}" for p in busy)
                + ".",
                fix='set "replace": true to restore over it (the old data is deleted), or clear '
                "those directories in the nodes' restore_dir.",
            )
    return RestoreContext(
        restore_id=new_restore_id(now),
        cluster=request.cluster,
        backup_id=manifest.backup_id,
        manifest_key=manifest_key,
        manifest_version=manifest_version,
        target_cluster=request.target_cluster,
        placements=placements,
        assignments=assignments(placements),
        bytes=sum(shard_bytes.values()),  # what it writes (an incremental's chain included)
        objects=manifest.objects,  # the newest backup's; Plan counts a chain's objects
        tier=request.tier,
        replace=request.replace,
        plan_only=request.plan_only,
        validation_queries=request.validation_queries,
        heapallindexed=request.heapallindexed,
        started_at=now,
        execution_id=request.execution_id,
        source=source,
        chain=chain,
        target=request.target,
        wal_batches=wal_batches,
        wal_bytes=wal_bytes,
        links=links,
    )


def check_not_damaged(record: BackupItem, accepted: bool) -> None:
    """A backup that verify found damaged fails its restore only when the damaged frame is
    reached (minutes or hours in): refuse it before anything, unless the request accepts it."""
    verdict = record.verify
    if verdict is None or verdict.result != "damaged" or accepted:
        return
    problems = verdict.problems or ["(no problem recorded)"]
    when = time.gmtime(verdict.verified_at)
    raise BackupDamaged(
        f"backup {record.backup_id} was found damaged by verify on "
        f"{time.strftime('%Y-%m-%d %H:%M:%SZ', when)}: {problems[0]}.",
        fix="restore another backup (shardvault list), or verify this one again if the store "
        'was repaired; to restore what is intact anyway, pass --accept-damaged ("accept_damaged":'
        " true).",
    )


def check_tier(record: BackupItem, tier: RetrievalTier, held_in: str | None = None) -> None:
    """S3 refuses a thaw in a tier its class lacks (DEEP_ARCHIVE has no Expedited) only once
    the restore has started thawing: refuse it here, before anything, with the tiers it has
    (``held_in``: the class of the copy read, an aws copy target's; else the vault's)."""
    try:
        storage_class = StorageClass(held_in or record.storage_class or "")
    except ValueError:
        return  # a class the price table does not know (a non-AWS store's own): no tiers known
    tiers = thaw_tiers(storage_class)
    if not tiers or RestoreTier(tier.value.upper()) in tiers:
        return
    possible = [RetrievalTier(t.value.capitalize()).value for t in tiers]
    raise InvalidRequest(
        f"backup {record.backup_id} is in {storage_class.value}, which has no "
        f"{tier.value} thaw tier; it has {' and '.join(possible)}.",
        fix=f'set "tier" to {" or ".join(repr(t) for t in possible)} (shardvault restore '
        f"--tier), or restore a backup kept in another class.",
    )


def check_target_engines(manifest: Manifest, nodes: list[NodeRecord]) -> None:
    """Every target node runs one of the backup's engines, and each of them has a node."""
    held = manifest.engines
    if wrong := [n for n in nodes if n.engine not in held]:
        raise EngineMismatch(
            f"backup {manifest.backup_id} is of a {engines.label(held)} cluster, but target "
            "node(s) "
            + ", ".join(f"{n.node_id} ({n.engine})" for n in wrong)
            + " run another engine.",
            fix="restore into a cluster whose agents have "
            + " or ".join(f"'engine: {e}'" for e in held)
            + ".",
        )
    running = {n.engine for n in nodes}
    if missing := [e for e in held if e not in running]:
        shards = [s.shard_id for s in manifest.shards if manifest.engine_of(s) in missing]
        raise EngineMismatch(
            f"backup {manifest.backup_id} holds {engines.label(missing)} shards "
            f"({', '.join(shards)}), but no target node runs {engines.label(missing)}.",
            fix="add a node of each of the backup's engines ("
            + ", ".join(e.value for e in held)
            + ") to the target cluster.",
        )


def source_for(
    request: RestoreRequest, record: BackupItem, svc: Services
) -> tuple[str, str, str | None]:
    """Where the backup is read (source, manifest key, version): the vault target the request
    names, or refused by name; else the stack vault once promoted, else the store."""
    name = request.from_vault
    if name is None or name == stack_vault_name(svc, request.cluster):
        source = read_from(record, svc)
        if name is not None and source != "vault":
            raise BackupNotRestorable(
                f"backup {record.backup_id} is not in the stack vault {name!r} "
                f"({record.promotion or 'not promoted'}).",
                fix="leave --from-vault out to restore it from where it is.",
            )
        return source, *manifest_place(record, source)
    copy_target(svc, request.cluster, name)  # an unknown name refused before the backup's
    return COPY_SOURCE + name, *copy_place(record, name)


def newest_copied(catalog: Catalog, cluster: str, name: str) -> BackupItem | None:
    """The newest backup that copy target ``name`` holds, complete or expired from the stack
    (None: none, or ``name`` is the stack vault's)."""
    copied = [b for b in catalog.backups(cluster) if held_in_copy(b, name)]
    return max(copied, key=lambda b: b.completed_at or 0, default=None)


def held_by(record: BackupItem, name: str) -> bool:
    """Whether vault target ``name`` holds the backup: a copy target's copy, or (a name with
    no copy record) the stack vault's."""
    copy = record.vault_copies.get(name)
    return record.location == "vault" if copy is None else copy.state == "COPIED"


def resolve_backup(request: RestoreRequest, catalog: Catalog) -> BackupItem:
    """The catalog record of the requested backup (``latest``: the newest complete one); the
    CLI asks too, before it starts a restore."""
    if request.backup_id == "latest":
        newest = (
            newest_copied(catalog, request.cluster, request.from_vault)
            if request.from_vault
            else None
        ) or catalog.newest_backup(request.cluster, BackupStatus.COMPLETE)
        if newest is not None:
            return newest
        backups = catalog.backups(request.cluster)
        raise BackupNotFound(
            f"cluster {request.cluster!r} has no complete backup"
            + (f" ({len(backups)} failed or running)." if backups else "."),
            fix="check the cluster name ('shardvault list'), or run a backup first.",
        )
    backups = catalog.backups(request.cluster)
    record = next((b for b in backups if b.backup_id == request.backup_id), None)
    if record is None:
        known = ", ".join(sorted(b.backup_id for b in backups)[-3:]) or "none"
        raise BackupNotFound(
            f"cluster {request.cluster!r} has no backup {request.backup_id!r} (latest: {known}).",
            fix="pick a backup id from 'shardvault list CLUSTER', or use \"latest\".",
        )
    from_copy = request.from_vault is not None and held_in_copy(record, request.from_vault)
    if (record.status != BackupStatus.COMPLETE and not from_copy) or not record.manifest_key:
        raise BackupNotRestorable(
            f"backup {request.backup_id} is {record.status}, not COMPLETE"
            + (f": {record.cause}" if record.cause else "."),
            fix="restore a complete, verified backup ('shardvault list' shows their status).",
        )
    return record


def target_nodes(request: RestoreRequest, svc: Services, now: float) -> list[NodeRecord]:
    nodes = svc.nodes.in_cluster(request.target_cluster)
    max_age = svc.settings.heartbeat_max_age_seconds
    check_target_nodes(request.target_cluster, nodes, svc.policy(), now, max_age)
    return nodes


def check_target_nodes(
    target: str, nodes: list[NodeRecord], policy: Any, now: float, max_age: float
) -> str:
    """The target's agents can take a restore: registered, members, up, each with a
    ``restore_dir``. Returns what was found (``shardvault check`` shows it for a drill's)."""
    if not nodes:
        raise UnknownCluster(
            f"no agent has registered for target cluster {target!r}.",
            fix=f"start agents with 'cluster: {target}' and a restore_dir on the target nodes.",
        )
    check_members(target, nodes, policy)
    check_nodes_available(nodes, now, max_age)
    check_agents_current(nodes)
    unready = [n.node_id for n in nodes if n.restore_free_bytes is None]
    if unready:
        raise TargetNotReady(
            f"target node(s) {', '.join(unready)} accept no restores (no restore_dir).",
            fix="set restore_dir in those agents' configuration and restart them.",
        )
    return f"{', '.join(n.node_id for n in nodes)}: up, with a restore_dir"


# Requests a restore step makes side by side (a chain's manifests, the heads of its objects):
# each waits on the store, not on this process.
