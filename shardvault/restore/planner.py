"""Plan: what each target node prepares and downloads, for the shards Validate placed on it
(``shardvault.restore.placement``).

Terms:
- *download item*: one object for one node; the node fetches its parts with a presigned GET
  URL (agents hold no store credentials) and checks each part and the object as it writes.
- *prefetch*: the items and URLs a node's prepare may start on before the Download map
  reaches it.
- *WAL feed*: a point-in-time restore's archive batches, per node (``wal_key``), signed as its
  finish starts and fetched by the node while recovery replays
  (``shardvault_agent.restore.walfeed``): only what recovery reaches, and a few batches ahead.
"""

from __future__ import annotations

from typing import Any

from shardvault.aws.keys import Rewrapper
from shardvault.aws.services import Services
from shardvault.contracts import engines
from shardvault.contracts.catalog import RestoreItem, restore_key
from shardvault.contracts.commands import Prepared, parse_result
from shardvault.contracts.models import (
    BackupKind,
    BackupStatus,
    DownloadItem,
    Encryption,
    FileEntry,
    Manifest,
    ManifestShard,
    ObjectResult,
    Phase,
    RestoreContext,
    RestoreTarget,
    object_place,
    pack_files,
)
from shardvault.data.chains import ShardLayer, chain_args, chain_layers, is_layered
from shardvault.data.planning import interleave_by_node, transfer_concurrency
from shardvault.errors import UnknownCommand
from shardvault.restore.sources import chain_manifests, read_manifest, readable_place
from shardvault.wal import pitr
from shardvault.workflow.fanout import raise_first_failure


def plan(context: RestoreContext, svc: Services) -> dict[str, Any]:
    """Writes what each node prepares and the download items, and records the restore as
    running in the catalog (the first side effect). A chain's newer members' objects are
    *prefetched*: each node fetches its own from its prepare on (``prefetch_key``: the items,
    signed by ``sign_prefetch``), so that the root's objects, downloaded by the Download map
    with the restored backup's WAL, are written with the newer members' changed blocks laid
    in (``shardvault_agent.restore.chain_placement``, layered) and no download wave waits for
    another."""
    manifest = read_manifest(
        svc, context.cluster, context.source, context.manifest_key, context.manifest_version
    )
    node_of = {p.shard_id: p.node_id for p in context.placements}
    planned = download_items(context, manifest, node_of)
    chain = restored_chain(context, manifest, svc)
    source_of = {m.backup_id: source for m, source in chain}
    prefetch: dict[str, list[DownloadItem]] = {}
    for shard in manifest.shards if chain else []:
        node_id = node_of[shard.shard_id]
        layers = chain_layers([m for m, _ in chain], shard.shard_id)
        prefetch.setdefault(node_id, []).extend(
            chain_items(context, layers[1:], source_of, shard.shard_id, node_id)
        )
        planned += chain_items(context, layers[:1], source_of, shard.shard_id, node_id)
    wal, created = pitr.plan_wal(svc, context, manifest, node_of) if context.target else ({}, {})
    # Every data key as the target cluster's agents may unwrap it (keys.Rewrapper).
    rewrap = Rewrapper(svc, context.target_cluster)
    planned = rewrapped(planned, rewrap)
    prefetch = {node_id: rewrapped(items, rewrap) for node_id, items in prefetch.items()}
    wal = {shard: (files, rewrapped(items, rewrap)) for shard, (files, items) in wal.items()}
    fed: dict[str, list[DownloadItem]] = {}
    for _, items in wal.values():
        for item in items:
            fed.setdefault(item.node_id, []).append(item)
    # Each node's objects in turn: the Download map starts items in plan order.
    plan_key = put_items(svc, context, "downloads.json", interleave_by_node(planned))
    for assignment in context.assignments:
        shards = [s for s in manifest.shards if s.shard_id in assignment.shard_ids]
        svc.put_work(
            prepare_key(svc, context, assignment.node_id),
            prepare_args(
                shards,
                rewrap(manifest.encryption),
                chain,
                wal,
                context.target,
                context.links,
                created,
            ),
        )
    prefetched = sum(len(items) for items in prefetch.values())
    svc.catalog.put(
        RestoreItem(
            cluster=context.target_cluster,
            backup_id=restore_key(context.restore_id),
            restore_id=context.restore_id,
            status=BackupStatus.RUNNING,
            source_cluster=context.cluster,
            source_backup_id=context.backup_id,
            source=context.source,
            engine=engines.label(manifest.engines),
            started_at=context.started_at,
            execution_id=context.execution_id,
            placement={p.shard_id: p.node_id for p in context.placements},
            # Every byte of the restored streams, once; the WAL recovery reaches is counted
            # as it is fed (finalize), and the batches the archive holds for it here.
            bytes_total=context.bytes,
            objects_total=len(planned) + prefetched,
            wal_batches=sum(len(items) for _, items in wal.values()) if wal else None,
        )
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
            "wal_key": (
                put_items(svc, context, f"wal/{a.node_id}.json", fed[a.node_id])
                if fed.get(a.node_id)
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
    """Presigned GET URLs of the objects a node prefetches from its prepare on (``plan``), or
    of its WAL feed's batches, with their items, written to the work bucket for the
    dispatcher (``prefetch_urls_key``, ``wal_urls_key``): like ``sign_download``'s, no URL
    enters the execution's history. Signed as the node's prepare (or finish) starts: a URL
    signed at plan could expire while objects thaw and download."""
    downloads = []
    for entry in svc.get_work(prefetch_key):
        item = DownloadItem.model_validate(entry["object"])
        bucket, key, version = readable_place(
            svc, item.source, item.key, item.version_id, item.restore_id
        )
        url = bucket.presign_get(key, svc.settings.url_ttl_seconds, version)
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
    answers = {
        answer.node_id: answer
        for answer in (parse_result(Prepared, str(r.get("node_id", "?")), r) for r in results)
    }
    for node in nodes:
        answer = answers.get(node["node_id"])
        if node.get("prefetch_key") and (answer is None or answer.prefetched is None):
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
    links: dict[str, dict[str, str]] | None = None,
    created: dict[str, dict[str, str]] | None = None,
) -> dict[str, Any]:
    """What a node needs to lay out its shards before any byte arrives: every stream's files
    (packed) and the byte ranges of its objects; for an incremental, its chain; for a
    point-in-time restore, the archive's WAL, where recovery stops and the linked directories
    created after the base (``created``, by shard); the request's remapped linked
    directories (``links``, by shard)."""
    wal, links, created = wal or {}, links or {}, created or {}
    return {
        "shards": [
            {
                "shard_id": shard.shard_id,
                # The newer members' objects download before the root's (two waves): the
                # node lays the root down whole, their changed blocks laid into its frames.
                **({"chain": chain_args([m for m, _ in chain], shard.shard_id)} if chain else {}),
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
                **(
                    {"recovery": pitr.recovery(target, created.get(shard.shard_id))}
                    if target
                    else {}
                ),
                **({"links": links[shard.shard_id]} if shard.shard_id in links else {}),
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
        # A layered backup's data comes from its chain's layers (chain_items).
        if not (is_layered(manifest) and stream.phase == Phase.DATA)
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


def restored_chain(
    context: RestoreContext, manifest: Manifest, svc: Services
) -> list[tuple[Manifest, str]]:
    """The backups whose layers a restore reads (``data.chains``), root first, each with where
    it is read: an incremental's chain, a synthesized full alone, nothing for a read full."""
    if manifest.kind == BackupKind.INCREMENTAL:
        return chain_manifests(context, svc)
    return [(manifest, context.source)] if is_layered(manifest) else []


def chain_items(
    context: RestoreContext,
    layers: list[ShardLayer],
    source_of: dict[str, str],
    shard_id: str,
    node_id: str,
) -> list[DownloadItem]:
    """Every data object of a shard's chain layers; the node fetches of each only the frames
    it contributes, as it placed them at prepare."""
    return [
        download_item(
            context,
            layer.manifest,
            shard_id,
            node_id,
            Phase.DATA,
            obj,
            source_of[layer.manifest.backup_id],
            from_chain=True,
        )
        for layer in layers
        for obj in layer.objects
    ]
