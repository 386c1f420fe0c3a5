"""Finalize and cleanup: a restore's record completed, or what a failed or abandoned one
left on its target nodes removed, and a stopped execution reaped."""

from __future__ import annotations

import logging
from typing import Any

from botocore.exceptions import ClientError

from shardvault.aws.services import Services
from shardvault.backup import (
    REAPED_STATUSES,
    reaped_error,
)
from shardvault.contracts.catalog import RestoreItem, restore_key
from shardvault.contracts.commands import Finished, RestoredShard, parse_result
from shardvault.contracts.models import (
    BackupStatus,
    RestoreContext,
)
from shardvault.errors import DownloadIncomplete
from shardvault.restore.sources import copy_name, staged_key
from shardvault.workflow.causes import failure_cause, transfer_failure
from shardvault.workflow.dispatch import post_untracked

log = logging.getLogger("shardvault.restore.failure")


def finalize(
    context: RestoreContext, results: list[dict[str, Any]], svc: Services, now: float
) -> dict[str, Any]:
    """Records the restored cluster: where each shard runs and what its checks found."""
    answers = [parse_result(Finished, str(r.get("node_id", "?")), r) for r in results]
    shards = sorted((s for a in answers for s in a.shards), key=lambda s: s.shard_id)
    duration = now - context.started_at
    # A chain's objects each node prefetched as it prepared: counted now, as the nodes say.
    prefetched = [a.prefetched for a in answers if a.prefetched is not None]
    if prefetched:
        svc.catalog.add_progress(
            context.target_cluster,
            restore_key(context.restore_id),
            bytes_done=sum(p.bytes or 0 for p in prefetched),
            objects_done=sum(p.objects for p in prefetched),
        )
    record = svc.catalog.restore(context.target_cluster, context.restore_id)
    planned = record.objects_total if record else None
    summary = {
        "status": BackupStatus.COMPLETE.value,
        "completed_at": now,
        "duration_seconds": round(duration, 3),
        "bytes": context.bytes,
        "objects": context.objects if planned is None else planned,  # a chain's, as planned
        "throughput_mib_s": round(context.bytes / max(duration, 1e-9) / 2**20, 2),
        "shards": [s.model_dump(mode="json", exclude_none=True) for s in shards],
        "validation": "passed" if all(s.checks_passed for s in shards) else "failed",
        **wal_fed(shards),
    }
    restored = RestoreItem.changes(**summary)
    svc.catalog.update(context.target_cluster, restore_key(context.restore_id), restored)
    remove_staged(context, svc)  # best effort: never fails a restore that is complete
    svc.notify(
        f"ShardVault restore {context.restore_id} complete",
        {"restore_id": context.restore_id, "target_cluster": context.target_cluster, **summary},
    )
    return {
        "restore_id": context.restore_id,
        "target_cluster": context.target_cluster,
        "source_cluster": context.cluster,
        "backup_id": context.backup_id,
        "source": context.source,
        **summary,
    }


def wal_fed(shards: list[RestoredShard]) -> dict[str, int]:
    """What the nodes' WAL feeds fetched, all shards' (none: no point-in-time restore)."""
    fed = [s.wal for s in shards if s.wal is not None]
    if not fed:
        return {}
    return {
        "wal_batches": sum(f.planned for f in fed),
        "wal_batches_fetched": sum(f.fetched for f in fed),
        "wal_bytes_fetched": sum(f.bytes for f in fed),
        "wal_stored_bytes_fetched": sum(f.stored_bytes for f in fed),
    }


def cleanup(
    context: RestoreContext, error: dict[str, Any], svc: Services, now: float
) -> dict[str, Any]:
    """The failure path, after the nodes removed what they had written: the restore marked
    failed with its cause, and a notification."""
    nodes = [a.node_id for a in context.assignments]
    outcome = mark_failed(context.target_cluster, context.restore_id, error, svc, now, nodes)
    remove_staged(context, svc)
    return outcome


def remove_staged(context: RestoreContext, svc: Services) -> None:
    """A copy target's objects staged for the restore (``shardvault.restore.sources``): gone
    once it ends; the sweep removes what a crash leaves (a prefix without a manifest)."""
    if copy_name(context.source) is None:
        return
    try:
        svc.store_bucket.delete_prefix(staged_key(svc, context.restore_id, ""))
    except ClientError as error:  # the sweep removes them after the restores' longest run
        log.warning("staged objects of %s not removed: %s", context.restore_id, error)


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
    svc.catalog.update(target_cluster, restore_key(restore_id), RestoreItem.changes(**outcome))
    svc.notify(
        f"ShardVault restore into {target_cluster} FAILED ({restore_id})",
        {"target_cluster": target_cluster, "restore_id": restore_id, **outcome},
    )
    return outcome


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
        (r for r in svc.catalog.restores(target_cluster) if r.execution_id == execution_arn),
        None,
    )
    if record is None or record.status != BackupStatus.RUNNING:
        return {"reaped": False, "why": "no running restore of that execution"}
    restore_id = record.restore_id
    nodes = sorted(set(record.placement.values()))
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
