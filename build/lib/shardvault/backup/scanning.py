"""Scan: what each node's agent compares its shards with before an incremental is planned.

``prepare_scan`` writes, per source node, the parent block map of each of its shards (the
parent manifest's ``blockmap`` object, where it lives, its frame table and key check, the
chain's wrapped key, and a presigned GET) to the work bucket. A full has no parent: its
agents scan all the same (this backup's block maps are what the next incremental compares
with) and every block counts as changed.

Each node scans in its Checkpoint command (``checkpoint_args_key`` names the parents), one
round trip instead of two. An inline Map runs at most :data:`INLINE_MAP_CONCURRENCY` items at
once, though: in a cluster of more nodes, the later nodes' checkpoints would wait for earlier
nodes' scans, and the cut would spread over a scan's length. Such a backup is ``separate``:
its Checkpoint commands name no parents, and a Scan map sends each node ``scan`` with its
``args_key`` once every checkpoint is taken.
"""

from __future__ import annotations

from typing import Any

from shardvault.errors import ParentUnavailable
from shardvault.models import BackupContext, Manifest, object_place
from shardvault.readback import load_manifest
from shardvault.services import Services

INLINE_MAP_CONCURRENCY = 40  # Step Functions' most iterations of an inline Map at once


def prepare_scan(context: BackupContext, svc: Services) -> dict[str, Any]:
    parents = parent_maps(context, svc)
    separate = len(context.sources) > INLINE_MAP_CONCURRENCY
    nodes = []
    for source in context.sources:
        args = {"parents": {s: parents[s] for s in source.shard_ids if s in parents}}
        key = svc.work_key(context.backup_id, "scan", f"{source.node_id}.json")
        svc.put_work(key, args)
        nodes.append(
            {
                "node_id": source.node_id,
                "shard_ids": source.shard_ids,
                # None: the Checkpoint command names no parents, it only checkpoints.
                "checkpoint_args_key": None if separate else key,
                "args_key": key,
            }
        )
    return {"nodes": nodes, "separate": separate}


def parent_maps(context: BackupContext, svc: Services) -> dict[str, dict[str, Any]]:
    """Per shard, the parent's block map as an agent fetches it (URL included)."""
    if context.chain is None:
        return {}
    parent_id = context.chain.parent_id
    record = svc.catalog.get(context.cluster, parent_id) or {}
    s3, bucket, key = svc.store_s3, svc.store.bucket, record.get("manifest_key", "")
    if record.get("location") == "vault" and svc.vault is not None:
        s3, bucket, key = svc.vault_s3, svc.vault.bucket, record.get("vault_manifest_key", "")
    if not key:
        raise ParentUnavailable(
            f"the parent {parent_id} of this incremental has no manifest on record.",
            fix="run a full backup (omit --incremental).",
        )
    manifest: Manifest = load_manifest(s3, bucket, key)
    encryption = manifest.encryption.model_dump(mode="json") if manifest.encryption else None
    maps = {}
    for shard in manifest.shards:
        if shard.blockmap is None:
            continue
        obj = shard.blockmap
        url = s3.generate_presigned_url(
            "get_object", Params={"Bucket": bucket, "Key": obj.key},
            ExpiresIn=svc.settings.url_ttl_seconds,
        )  # fmt: skip
        maps[shard.shard_id] = {
            "backup_id": parent_id,
            "object": obj.model_dump(mode="json"),
            "place": object_place(manifest.cluster, parent_id, obj.shard_id, obj.phase, obj.index),
            "encryption": encryption,
            "url": url,
        }
    return maps
