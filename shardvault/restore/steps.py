"""The restore workflow's steps (the Lambdas of ``statemachines/restore.asl.json``).

Terms:
- *source*: the backup, read from its manifest; *target*: the cluster restored into, whose
  agents registered with a ``restore_dir`` (and report its room and the shards it holds).
- *placement*: which target node restores which shard (``shardvault.restore.placement``).
- *thaw*: objects in an archive storage class are restored (RestoreObject) at the requested
  tier before they can be read; the state machine polls with growing waits.
- *download item*: one object for one node; the node fetches its parts with a presigned GET
  URL (agents hold no store credentials) and checks each part and the object as it writes.

Validation reads only (catalog, registry, manifest): a bad request changes nothing.
"""

from __future__ import annotations

import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from shardvault.aws.keys import Rewrapper
from shardvault.aws.readback import load_manifest, manifest_place
from shardvault.aws.services import Services
from shardvault.aws.store import presign_get, readable_now, versioned
from shardvault.aws.tables import RESTORE_PREFIX, Catalog
from shardvault.backup import (
    REAPED_STATUSES,
    check_agents_current,
    check_nodes_available,
    reaped_error,
)
from shardvault.contracts import engines
from shardvault.contracts.engines import traits
from shardvault.contracts.models import (
    THAW_DAYS,
    BackupKind,
    BackupStatus,
    ChainSource,
    DownloadItem,
    Encryption,
    FileEntry,
    Manifest,
    ManifestShard,
    NodeRecord,
    ObjectResult,
    Phase,
    RestoreContext,
    RestoreRequest,
    RestoreTarget,
    RetrievalTier,
    object_place,
    pack_files,
)
from shardvault.contracts.sqlcheck import DIALECTS, check_validation_queries
from shardvault.data.chains import chain_args, data_stream
from shardvault.data.planning import interleave_by_node, transfer_concurrency
from shardvault.errors import (
    BackupDamaged,
    BackupNotFound,
    BackupNotRestorable,
    DownloadIncomplete,
    EngineMismatch,
    InvalidRequest,
    ParentUnavailable,
    TargetNotEmpty,
    TargetNotReady,
    UnknownCluster,
    UnknownCommand,
)
from shardvault.pricing.prices import RestoreTier, StorageClass, thaw_tiers
from shardvault.restore.placement import assignments, place_by_engine
from shardvault.wal import pitr
from shardvault.workflow.causes import failure_cause, transfer_failure
from shardvault.workflow.dispatch import post_untracked
from shardvault.workflow.fanout import raise_first_failure
from shardvault.workflow.membership import check_members

THAW_MAX_WAIT = 3600


def new_restore_id(now: float) -> str:
    return "r" + time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now)) + "-" + secrets.token_hex(3)


def catalog_key(restore_id: str) -> str:
    return f"{RESTORE_PREFIX}{restore_id}"


# --- validate ----------------------------------------------------------------------------------
def validate(request: RestoreRequest, svc: Services, now: float) -> RestoreContext:
    """Resolves the backup, checks the target and places the shards, or raises a named error.
    Nothing is written."""
    if request.target is not None:
        backups = svc.catalog.backups(request.cluster)
        record = pitr.base_backup(request, backups)
    else:
        record = resolve_backup(request, svc.catalog)
    check_not_damaged(record, request.accept_damaged)
    source = "vault" if record.get("location") == "vault" and svc.vault else "store"
    if source == "vault":
        check_tier(record, request.tier)
    manifest_key, manifest_version = manifest_place(record, source)
    s3, bucket = source_of(svc, source)
    manifest = load_manifest(s3, bucket, manifest_key, manifest_version)
    chain = chain_sources(manifest, svc)  # every ancestor readable, or refused by name
    wal_batches, wal_bytes = 0, 0
    if request.target is not None:  # the archive reaches the target, or refused by name
        complete = [b for b in backups if b.get("status") == BackupStatus.COMPLETE]
        oldest = min(float(b["completed_at"]) for b in complete)
        found = pitr.archives(svc, request, manifest, oldest)
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
    )


def check_not_damaged(record: dict[str, Any], accepted: bool) -> None:
    """A backup that verify found damaged fails its restore only when the damaged frame is
    reached (minutes or hours in): refuse it before anything, unless the request accepts it."""
    verdict = record.get("verify") or {}
    if verdict.get("result") != "damaged" or accepted:
        return
    problems = verdict.get("problems") or ["(no problem recorded)"]
    when = time.gmtime(float(verdict.get("verified_at") or record.get("verified_at") or 0))
    raise BackupDamaged(
        f"backup {record.get('backup_id')} was found damaged by verify on "
        f"{time.strftime('%Y-%m-%d %H:%M:%SZ', when)}: {problems[0]}.",
        fix="restore another backup (shardvault list), or verify this one again if the store "
        'was repaired; to restore what is intact anyway, pass --accept-damaged ("accept_damaged":'
        " true).",
    )


def check_tier(record: dict[str, Any], tier: RetrievalTier) -> None:
    """S3 refuses a thaw in a tier its class lacks (DEEP_ARCHIVE has no Expedited) only once
    the restore has started thawing: refuse it here, before anything, with the tiers it has."""
    try:
        storage_class = StorageClass(record.get("storage_class", ""))
    except ValueError:
        return  # a class the price table does not know (a non-AWS store's own): no tiers known
    tiers = thaw_tiers(storage_class)
    if not tiers or RestoreTier(tier.value.upper()) in tiers:
        return
    possible = [RetrievalTier(t.value.capitalize()).value for t in tiers]
    raise InvalidRequest(
        f"backup {record.get('backup_id')} is in {storage_class.value}, which has no "
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


def source_of(svc: Services, source: str) -> tuple[Any, str]:
    """The client and bucket a backup is read from: the vault once promoted, else the store."""
    if source == "vault":
        return svc.vault_s3, svc.vault.bucket
    return svc.store_s3, svc.store.bucket


def resolve_backup(request: RestoreRequest, catalog: Catalog) -> dict[str, Any]:
    """The catalog record of the requested backup (``latest``: the newest complete one); the
    CLI asks too, before it starts a restore."""
    if request.backup_id == "latest":
        newest = catalog.newest_backup(request.cluster, BackupStatus.COMPLETE)
        if newest is not None:
            return newest
        backups = catalog.backups(request.cluster)
        raise BackupNotFound(
            f"cluster {request.cluster!r} has no complete backup"
            + (f" ({len(backups)} failed or running)." if backups else "."),
            fix="check the cluster name ('shardvault list'), or run a backup first.",
        )
    backups = catalog.backups(request.cluster)
    record = next((b for b in backups if b["backup_id"] == request.backup_id), None)
    if record is None:
        known = ", ".join(sorted(b["backup_id"] for b in backups)[-3:]) or "none"
        raise BackupNotFound(
            f"cluster {request.cluster!r} has no backup {request.backup_id!r} (latest: {known}).",
            fix="pick a backup id from 'shardvault list CLUSTER', or use \"latest\".",
        )
    if record.get("status") != BackupStatus.COMPLETE or not record.get("manifest_key"):
        raise BackupNotRestorable(
            f"backup {request.backup_id} is {record.get('status', 'unknown')}, not COMPLETE"
            + (f": {record['cause']}" if record.get("cause") else "."),
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
PARALLEL_READS = 8


def chain_sources(manifest: Manifest, svc: Services) -> list[ChainSource]:
    """Where each ancestor of an incremental is read, root first; each manifest is read now
    (side by side), so a missing or damaged ancestor refuses the restore before anything is
    placed."""
    if manifest.chain is None:
        return []
    sources = []
    for backup_id in manifest.chain.ancestors:  # the catalog's table is not shared by threads
        record = svc.catalog.get(manifest.cluster, backup_id) or {}
        if record.get("status") != BackupStatus.COMPLETE:
            raise ParentUnavailable(
                f"backup {manifest.backup_id} is an incremental whose ancestor {backup_id} is "
                f"{record.get('status', 'gone').lower()}: its chain cannot be restored.",
                fix="restore another backup ('shardvault list'), e.g. the newest full.",
            )
        source = "vault" if record.get("location") == "vault" and svc.vault else "store"
        key, version = manifest_place(record, source)
        sources.append(
            ChainSource(
                backup_id=backup_id, manifest_key=key, source=source, manifest_version=version
            )
        )
    with ThreadPoolExecutor(PARALLEL_READS) as pool:  # boto3 clients may be shared by threads
        reads = [
            pool.submit(
                load_manifest, *source_of(svc, s.source), s.manifest_key, s.manifest_version
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
        found = list(pool.map(lambda p: load_manifest(*source_of(svc, p[0]), *p[1:]), places))
    return [(manifest, source) for manifest, (source, *_) in zip(found, places, strict=True)]


def chain_items(
    context: RestoreContext, chain: list[tuple[Manifest, str]], shard_id: str, node_id: str
) -> list[DownloadItem]:
    """Every data object of a shard's chain; the node fetches of each only the frames it
    contributes, as it placed them at prepare."""
    return [
        download_item(
            context, manifest, shard_id, node_id, Phase.DATA, obj, source, from_chain=True
        )
        for manifest, source in chain
        for obj in data_stream(manifest, shard_id).objects
    ]


def shard_size(shard: ManifestShard) -> int:
    return sum(f.size for s in shard.streams for f in s.files)


# --- plan --------------------------------------------------------------------------------------
def plan(context: RestoreContext, svc: Services) -> dict[str, Any]:
    """Writes what each node prepares and the download items, and records the restore as
    running in the catalog (the first side effect). A chain's newer members' objects are
    *prefetched*: each node fetches its own from its prepare on (``prefetch_key``: the items,
    signed by ``sign_prefetch``), so that the root's objects, downloaded by the Download map
    with the restored backup's WAL, are written with the newer members' changed blocks laid
    in (``shardvault_agent.chain_placement``, layered) and no download wave waits for another."""
    manifest = load_manifest(
        *source_of(svc, context.source), context.manifest_key, context.manifest_version
    )
    node_of = {p.shard_id: p.node_id for p in context.placements}
    planned = download_items(context, manifest, node_of)
    chain = chain_manifests(context, svc) if manifest.kind == BackupKind.INCREMENTAL else []
    prefetch: dict[str, list[DownloadItem]] = {}
    for shard in manifest.shards if chain else []:
        node_id = node_of[shard.shard_id]
        prefetch.setdefault(node_id, []).extend(
            chain_items(context, chain[1:], shard.shard_id, node_id)
        )
        planned += chain_items(context, chain[:1], shard.shard_id, node_id)
    wal = pitr.plan_wal(svc, context, manifest, node_of) if context.target else {}
    # Every data key as the target cluster's agents may unwrap it (keys.Rewrapper).
    rewrap = Rewrapper(svc, context.target_cluster)
    planned = rewrapped(planned, rewrap)
    prefetch = {node_id: rewrapped(items, rewrap) for node_id, items in prefetch.items()}
    wal = {shard: (files, rewrapped(items, rewrap)) for shard, (files, items) in wal.items()}
    for _, items in wal.values():
        planned += items
    # Each node's objects in turn: the Download map starts items in plan order.
    plan_key = put_items(svc, context, "downloads.json", interleave_by_node(planned))
    for assignment in context.assignments:
        shards = [s for s in manifest.shards if s.shard_id in assignment.shard_ids]
        svc.put_work(
            prepare_key(svc, context, assignment.node_id),
            prepare_args(shards, rewrap(manifest.encryption), chain, wal, context.target),
        )
    prefetched = sum(len(items) for items in prefetch.values())
    svc.catalog.put(
        {
            "cluster": context.target_cluster,
            "backup_id": catalog_key(context.restore_id),
            "restore_id": context.restore_id,
            "status": BackupStatus.RUNNING.value,
            "source_cluster": context.cluster,
            "source_backup_id": context.backup_id,
            "engine": engines.label(manifest.engines),
            "started_at": context.started_at,
            "execution_id": context.execution_id,
            "placement": {p.shard_id: p.node_id for p in context.placements},
            # Every byte of the restored streams, once, and the archive's WAL it replays.
            "bytes_total": context.bytes + sum(i.length for _, w in wal.values() for i in w),
            "objects_total": len(planned) + prefetched,
            "bytes_done": 0,
            "objects_done": 0,
        }
    )
    nodes = [
        {
            **a.model_dump(mode="json"),
            "args_key": prepare_key(svc, context, a.node_id),
            "prefetch_key": (
                put_items(svc, context, f"prefetch/{a.node_id}.json", prefetch[a.node_id])
                if prefetch.get(a.node_id)
                else None
            ),
        }
        for a in context.assignments
    ]
    return {
        "plan_key": plan_key,
        "objects": len(planned),
        "nodes": nodes,
        "download_concurrency": transfer_concurrency(context.assignments),
    }


def rewrapped(items: list[DownloadItem], rewrap: Rewrapper) -> list[DownloadItem]:
    """``items`` with their own data keys (an archived batch's) wrapped for the target."""
    return [
        item.model_copy(update={"encryption": rewrap(item.encryption)}) if item.encryption else item
        for item in items
    ]


def put_items(
    svc: Services, context: RestoreContext, name: str, planned: list[DownloadItem]
) -> str:
    """Writes a download wave's items where its map reads them; returns their key."""
    key = svc.work_key(context.restore_id, name)
    svc.put_work(key, [{"object": item.model_dump(mode="json")} for item in planned])
    return key


def prepare_key(svc: Services, context: RestoreContext, node_id: str) -> str:
    return svc.work_key(context.restore_id, "prepare", f"{node_id}.json")


def sign_prefetch(prefetch_key: str, svc: Services) -> dict[str, Any]:
    """Presigned GET URLs of the objects a node prefetches from its prepare on (``plan``), with
    their items, written to the work bucket for the dispatcher (``prefetch_urls_key``): like
    ``sign_download``'s, no URL enters the execution's history. Signed when the node's
    prepare starts, after thaw: a URL signed at plan could expire while objects thaw."""
    downloads = []
    for entry in svc.get_work(prefetch_key):
        item = DownloadItem.model_validate(entry["object"])
        s3, bucket = source_of(svc, item.source)
        url = presign_get(s3, bucket, item.key, svc.settings.url_ttl_seconds, item.version_id)
        downloads.append({"object": entry["object"], "url": url})
    if not downloads:
        return {"url_key": None}
    restore_id = downloads[0]["object"]["restore_id"]
    return {"url_key": svc.put_urls(restore_id, prefetch_key, {"downloads": downloads})}


def check_prepared(results: list[dict[str, Any]], nodes: list[dict[str, Any]]) -> dict[str, int]:
    """After the Prepare map: fails the restore with the first node's own error, and refuses
    a node that was given objects to prefetch and did not say it would (an agent from before
    prefetching, which would leave a chain without its newer blocks)."""
    counted = raise_first_failure(results)
    answers = {r.get("node_id"): r for r in results if isinstance(r, dict)}
    for node in nodes:
        if node.get("prefetch_key") and "prefetched" not in answers.get(node["node_id"], {}):
            raise UnknownCommand(
                f"the agent of node {node['node_id']} did not prefetch the newer backups of the "
                "chain it restores: it is older than this control plane.",
                fix="upgrade shardvault-agent on that node, then start the restore again.",
            )
    return counted


def prepare_args(
    shards: list[ManifestShard],
    encryption: Encryption | None,
    chain: list[tuple[Manifest, str]],
    wal: dict[str, tuple[list[FileEntry], list[DownloadItem]]] | None = None,
    target: RestoreTarget | None = None,
) -> dict[str, Any]:
    """What a node needs to lay out its shards before any byte arrives: every stream's files
    (packed) and the byte ranges of its objects; for an incremental, its chain; for a
    point-in-time restore, the archive's WAL and where recovery stops."""
    wal = wal or {}
    return {
        "shards": [
            {
                "shard_id": shard.shard_id,
                **(
                    {
                        "chain": chain_args([m for m, _ in chain], shard.shard_id),
                        # The newer members' objects download before the root's (two
                        # waves): the node lays the root down whole, their changed blocks
                        # laid into its frames (chains: layered).
                        "chain_layered": True,
                    }
                    if chain
                    else {}
                ),
                "marker": shard.marker,
                # The wrapped data key (never the key): the node unwraps it itself.
                "encryption": encryption.model_dump(mode="json") if encryption else None,
                "streams": [
                    {
                        "phase": stream.phase.value,
                        "files": pack_files(stream.files),
                        "objects": [
                            {"key": o.key, "stream_offset": o.stream_offset, "length": o.length}
                            for o in stream.objects
                        ],
                    }
                    for stream in shard.streams
                ]
                + ([wal_stream_args(*wal[shard.shard_id])] if shard.shard_id in wal else []),
                **({"recovery": pitr.recovery(target)} if target else {}),
            }
            for shard in shards
        ]
    }


def wal_stream_args(files: list[FileEntry], items: list[DownloadItem]) -> dict[str, Any]:
    return {
        "phase": Phase.WAL.value,
        "files": pack_files(files),
        "objects": [
            {"key": i.key, "stream_offset": i.stream_offset, "length": i.length} for i in items
        ],
    }


def download_items(
    context: RestoreContext, manifest: Manifest, node_of: dict[str, str]
) -> list[DownloadItem]:
    return [
        download_item(
            context,
            manifest,
            shard.shard_id,
            node_of[shard.shard_id],
            stream.phase,
            obj,
            context.source,
        )
        for shard in manifest.shards
        for stream in shard.streams
        # An incremental's data comes from its whole chain (chain_items).
        if not (manifest.kind == BackupKind.INCREMENTAL and stream.phase == Phase.DATA)
        for obj in stream.objects
    ]


def download_item(
    context: RestoreContext,
    manifest: Manifest,
    shard_id: str,
    node_id: str,
    phase: Phase,
    obj: ObjectResult,
    source: str,
    from_chain: bool = False,
) -> DownloadItem:
    """One object for one target node, as its backup's manifest records it. A chain
    member's object is placed as the node resolved the chain, not from its offset."""
    return DownloadItem(
        restore_id=context.restore_id,
        target_cluster=context.target_cluster,
        node_id=node_id,
        shard_id=shard_id,
        phase=phase,
        key=obj.key,
        version_id=obj.version_id,
        stream_offset=0 if from_chain else obj.stream_offset,
        length=obj.length,
        part_size=obj.part_size,
        part_count=obj.part_count,
        crc64nvme=obj.crc64nvme,
        part_crc64nvme=obj.part_crc64nvme,
        key_check=obj.key_check,
        source=source,
        stored_length=obj.stored_length,
        frame_size=obj.frame_size,
        frames=obj.frames,
        # A copy of an archive batch keeps the batch's place and data key (backup.archived).
        place=obj.place
        or object_place(manifest.cluster, manifest.backup_id, shard_id, phase, obj.index),
        encryption=obj.encryption,
        from_chain=from_chain,
    )


# --- thaw --------------------------------------------------------------------------------------
def thaw(context: RestoreContext, attempt: int, svc: Services) -> dict[str, Any]:
    """Requests a restore of every archived object not yet thawed; returns how many are still
    frozen and how long to wait before asking again (doubling, up to an hour)."""
    objects = [
        (*source_of(svc, source), obj.key, obj.version_id)
        for manifest, source in chain_manifests(context, svc)  # a full: itself alone
        for shard in manifest.shards
        for stream in shard.streams
        for obj in stream.objects
    ]
    with ThreadPoolExecutor(PARALLEL_READS) as pool:
        states = list(pool.map(lambda o: thaw_object(*o, tier=context.tier), objects))
    frozen = sum(state != "readable" for state in states)
    requested = states.count("requested")
    svc.catalog.update(context.target_cluster, catalog_key(context.restore_id), frozen=frozen)
    first = svc.settings.thaw_first_wait_seconds
    wait = min(first * 2**attempt, THAW_MAX_WAIT)
    return {"frozen": frozen, "requested": requested, "attempt": attempt + 1, "wait_seconds": wait}


def thaw_object(
    s3: Any, bucket: str, key: str, version_id: str | None, *, tier: RetrievalTier
) -> str:
    """``readable``, ``thawing`` or ``requested`` (a restore of it was asked for now)."""
    named = versioned(bucket, key, version_id)
    head = s3.head_object(**named)
    if readable_now(head):  # not archived, or thawed
        return "readable"
    if head.get("Restore"):
        return "thawing"
    s3.restore_object(
        **named,
        RestoreRequest={"Days": THAW_DAYS, "GlacierJobParameters": {"Tier": tier.value}},
    )
    return "requested"


# --- sign --------------------------------------------------------------------------------------
def sign_download(item: DownloadItem, svc: Services) -> dict[str, Any]:
    """A presigned GET URL of one object (the agent reads ranges of it), written to the work
    bucket for the dispatcher: a URL never enters the execution's history."""
    s3, bucket = source_of(svc, item.source)
    url = presign_get(s3, bucket, item.key, svc.settings.url_ttl_seconds, item.version_id)
    return {"url_key": svc.put_urls(item.restore_id, item.key, {"url": url})}


def record_download(item: DownloadItem, written: int | None, svc: Services) -> None:
    """Counts a downloaded object in the restore's progress (what the CLI shows): the bytes
    the node says it wrote (a chain member's object writes only its placements)."""
    svc.catalog.add_progress(
        item.target_cluster,
        catalog_key(item.restore_id),
        bytes_done=item.placed_bytes if written is None else written,
        objects_done=1,
    )


# --- finalize and cleanup ----------------------------------------------------------------------
def finalize(
    context: RestoreContext, results: list[dict[str, Any]], svc: Services, now: float
) -> dict[str, Any]:
    """Records the restored cluster: where each shard runs and what its checks found."""
    shards = sorted((s for r in results for s in r.get("shards", [])), key=lambda s: s["shard_id"])
    duration = now - context.started_at
    # A chain's objects each node prefetched as it prepared: counted now, as the nodes say.
    prefetched = [r["prefetched"] for r in results if isinstance(r.get("prefetched"), dict)]
    if prefetched:
        svc.catalog.add_progress(
            context.target_cluster,
            catalog_key(context.restore_id),
            bytes_done=sum(p.get("bytes", 0) for p in prefetched),
            objects_done=sum(p.get("objects", 0) for p in prefetched),
        )
    record = svc.catalog.get(context.target_cluster, catalog_key(context.restore_id)) or {}
    summary = {
        "status": BackupStatus.COMPLETE.value,
        "completed_at": now,
        "duration_seconds": round(duration, 3),
        "bytes": context.bytes,
        "objects": record.get("objects_total", context.objects),  # a chain's, as planned
        "throughput_mib_s": round(context.bytes / max(duration, 1e-9) / 2**20, 2),
        "shards": shards,
        "validation": "passed" if all(s.get("checks_passed") for s in shards) else "failed",
    }
    svc.catalog.update(context.target_cluster, catalog_key(context.restore_id), **summary)
    svc.notify(
        f"ShardVault restore {context.restore_id} complete",
        {"restore_id": context.restore_id, "target_cluster": context.target_cluster, **summary},
    )
    return {
        "restore_id": context.restore_id,
        "target_cluster": context.target_cluster,
        "source_cluster": context.cluster,
        "backup_id": context.backup_id,
        **summary,
    }


def cleanup(
    context: RestoreContext, error: dict[str, Any], svc: Services, now: float
) -> dict[str, Any]:
    """The failure path, after the nodes removed what they had written: the restore marked
    failed with its cause, and a notification."""
    nodes = [a.node_id for a in context.assignments]
    return mark_failed(context.target_cluster, context.restore_id, error, svc, now, nodes)


def mark_failed(
    target_cluster: str,
    restore_id: str,
    error: dict[str, Any],
    svc: Services,
    now: float,
    nodes: list[str],
) -> dict[str, Any]:
    error = transfer_failure(error, DownloadIncomplete.__name__, svc, restore_id, nodes)
    outcome = {
        "status": BackupStatus.FAILED.value,
        "failed_at": now,
        "error": error.get("Error", "States.Runtime"),
        "cause": failure_cause(error, svc, restore_id, nodes)[:2000],
    }
    svc.catalog.update(target_cluster, catalog_key(restore_id), **outcome)
    svc.notify(
        f"ShardVault restore into {target_cluster} FAILED ({restore_id})",
        {"target_cluster": target_cluster, "restore_id": restore_id, **outcome},
    )
    return outcome


# --- reaping -----------------------------------------------------------------------------------
def reap(
    execution_arn: str, status: str, target_cluster: str, svc: Services, now: float
) -> dict[str, Any]:
    """After a restore execution was aborted or timed out (it skipped AbortOnNodes and
    Cleanup): an abort posted to every target node's inbox without a task token (the agent
    stops what the restore started, removes what it placed and its staging, and answers
    nobody), and the restore marked failed. A restore that already ended is left alone, and
    so is one stopped before Plan: nothing was placed yet and no record names it."""
    if status not in REAPED_STATUSES:
        return {"reaped": False, "why": f"status {status}"}
    record = next(
        (r for r in svc.catalog.restores(target_cluster) if r.get("execution_id") == execution_arn),
        None,
    )
    if record is None or record.get("status") != BackupStatus.RUNNING:
        return {"reaped": False, "why": "no running restore of that execution"}
    restore_id = record["restore_id"]
    nodes = sorted(set(record.get("placement", {}).values()))
    for node_id in nodes:
        post_untracked(
            svc, node_id, f"abort_restore:{restore_id}:reaped", "abort_restore",
            {"backup_id": restore_id},
        )  # fmt: skip
    done = (
        f"the reaper told nodes {', '.join(nodes)} to stop what the restore started and remove "
        "what it placed"
    )
    error = reaped_error(status, done, "restore")
    return {
        "reaped": True,
        "nodes": nodes,
        **mark_failed(target_cluster, restore_id, error, svc, now, nodes),
    }
