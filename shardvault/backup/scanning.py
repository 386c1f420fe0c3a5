"""Scan: what each node's agent compares its shards with before an incremental is planned.

``prepare_scan`` writes, per source node, the parent block map of each of its shards (the
parent manifest's ``blockmap`` object, where it lives, its frame table and key check, the
chain's wrapped key, and a presigned GET) to the work bucket. A full has no parent: its
agents scan all the same (this backup's block maps are what the next incremental compares
with) and every block counts as changed.

Each node scans in its Checkpoint command (``scan_args``: the dispatcher adds the parents), one
round trip instead of two. A per-node Map runs at most ``NODE_MAP_CONCURRENCY`` nodes at once
(``shardvault.workflow.fanout``), though: in a cluster of more nodes, the later nodes' checkpoints
would wait for earlier nodes' scans, and the cut would spread over a scan's length. Such a backup is
``separate``: its Checkpoint commands name no parents, and a Scan map sends each node ``scan``
with them once every checkpoint is taken.

*Packed at the scan*: an incremental's changed blocks must be read before the stop, and are
few; so each node packs its incremental's objects (its data and its block map, cut by the
shared ``planning.plan_objects``) right after its scan, where the Upload map would have asked
for each in a round of its own, and the data uploads after the stop with the tail: one round
of the Upload map fewer (``shardvault.backup.planner``). A lone source node also stops right
after packing (``stop_args``), in the same command: no Stop map. For the node's plan to be the
control plane's, the part size is fixed here, before any node scans: chosen from the chain's
full (an incremental is at most its cluster's size, give or take its growth), unless the
request or policy sets it. A node packs only what the Upload map would hold at once on its
disk (``planning.OBJECTS_IN_FLIGHT_PER_NODE`` objects); a larger change is packed in the map.
"""

from __future__ import annotations

from typing import Any

from shardvault.aws.readback import load_manifest, manifest_place
from shardvault.aws.services import Services
from shardvault.backup.planner import pack_arguments
from shardvault.contracts import deployment
from shardvault.contracts.catalog import BackupItem
from shardvault.contracts.commands import ParentMap
from shardvault.contracts.models import BackupContext, Manifest, object_place
from shardvault.data.planning import choose_part_size
from shardvault.errors import ParentUnavailable


def prepare_scan(context: BackupContext, svc: Services) -> dict[str, Any]:
    """Writes each source node's scan arguments where the dispatcher finds them by the node
    (``Services.scan_args_key``: the state carries no key per node); says whether the nodes
    scan in their Checkpoint command (``with_checkpoint``) or in a Scan step apart, and
    whether a lone node flushes in its Checkpoint command (``flush_with_checkpoint``: the
    Flush map exists to bring several nodes' checkpoints close together)."""
    parent = parent_record(context, svc)
    parents = parent_maps(context, parent, svc)
    separate = len(context.sources) > deployment.NODE_MAP_CONCURRENCY
    pack = pack_args(context, parent, svc) | stop_args(context)
    for source in context.sources:
        mine = {s: parents[s].model_dump(mode="json") for s in source.shard_ids if s in parents}
        args = {"parents": mine}
        svc.put_work(svc.scan_args_key(context.backup_id, source.node_id), args | pack)
    return {
        "separate": separate,
        "with_checkpoint": not separate,
        "flush_with_checkpoint": len(context.sources) == 1,
    }


def parent_record(context: BackupContext, svc: Services) -> BackupItem | None:
    """An incremental's parent's catalog record (None for a full, or a parent not on record)."""
    if context.chain is None:
        return None
    return svc.catalog.get(context.cluster, context.chain.parent_id)


def pack_args(context: BackupContext, parent: BackupItem | None, svc: Services) -> dict[str, Any]:
    """An incremental's ``pack`` arguments (see the module docstring), its part size fixed in
    the catalog for the plan; nothing for a full, whose objects are packed in the Upload map,
    several at a time. ``parent`` is the parent's record: the chain's full, at depth 1."""
    if context.chain is None:
        return {}
    # Not read back from this backup's record: a retried step chooses the same size from the
    # same full.
    part_size = context.part_size
    if not part_size:
        chain = context.chain
        root = parent
        if chain.root_id != chain.parent_id:
            root = svc.catalog.get(context.cluster, chain.root_id)
        vault_class = context.vault.storage_class if context.vault else None
        part_size = choose_part_size((root and root.bytes_total) or 0, vault_class)
        svc.catalog.update(
            context.cluster, context.backup_id, BackupItem.changes(part_size=part_size)
        )
    return {"pack": pack_arguments(context, svc.store.prefix, part_size)}


def stop_args(context: BackupContext) -> dict[str, Any]:
    """An incremental of one source node ends in its Checkpoint command (``stop``) once the
    node has packed every change at its scan: the Stop map's round trip, and the tail's own
    plan step, fewer. Its cut needs no margin (``cut.cut_margin_seconds``): the node cuts as
    it stops. Several nodes stop in the Stop map, where they cut at one instant."""
    if context.chain is None or len(context.sources) != 1:
        return {}
    cut = {"name": context.backup_id, "margin_seconds": 0.0}
    lock = {"commit_lock": context.cut_commit_lock, "database": context.cut_commit_database}
    return {"stop": {"cut": cut | lock}}


def parent_maps(
    context: BackupContext, record: BackupItem | None, svc: Services
) -> dict[str, ParentMap]:
    """Per shard, the parent's block map as an agent fetches it (URL included); ``record`` is
    the parent's catalog record."""
    if context.chain is None:
        return {}
    parent_id = context.chain.parent_id
    bucket, location = svc.store_bucket, "store"
    if record is not None and record.location == "vault" and svc.vault_bucket is not None:
        bucket, location = svc.vault_bucket, "vault"
    key, version = manifest_place(record, location) if record else ("", None)
    if not key:
        raise ParentUnavailable(
            f"the parent {parent_id} of this incremental has no manifest on record.",
            fix="run a full backup (omit --incremental).",
        )
    manifest: Manifest = load_manifest(bucket, key, version)
    maps = {}
    for shard in manifest.shards:
        if shard.blockmap is None:
            continue
        obj = shard.blockmap
        url = bucket.presign_get(obj.key, svc.settings.url_ttl_seconds, obj.version_id)
        maps[shard.shard_id] = ParentMap(
            backup_id=parent_id,
            object=obj,
            place=object_place(manifest.cluster, parent_id, obj.shard_id, obj.phase, obj.index),
            encryption=manifest.encryption,
            # Where the parent began (PostgreSQL: its start LSN) and on which node: an
            # engine's block screen proves blocks unchanged against it, on that node only
            # (``shardvault_agent.engines.postgres.pages``).
            marker=shard.marker,
            node_id=shard.node_id,
            url=url,
        )
    return maps
