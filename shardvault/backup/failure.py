"""Cleanup: what a failed or abandoned backup leaves behind is removed.

- ``cleanup``: the workflow's failure path: open uploads aborted, partial objects deleted, a
  release posted to each source node, the backup marked failed with its cause (``explain``),
  the lock released.
- ``clean_up_abandoned``: the same for a backup whose execution ended without running its
  failure path, called by the reaper and by validation taking over the lock (``TAKEN_OVER``).
- ``report_refusal``: a scheduled run that validation refused, recorded and notified.
- *reaping*: after an execution is aborted or times out (``REAPED_STATUSES``), ``reap`` finds
  its backup and cleans it up.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from shardvault.aws.services import Services
from shardvault.contracts.catalog import BackupItem
from shardvault.contracts.layout import backup_prefix
from shardvault.contracts.models import (
    BackupContext,
    BackupKind,
    BackupRequest,
    BackupStatus,
    new_backup_id,
)
from shardvault.errors import InvalidRequest, ShardVaultError, UploadIncomplete
from shardvault.workflow.causes import failure_cause, named_failure, transfer_failure
from shardvault.workflow.dispatch import post_untracked


def explain(context: BackupContext, error: dict[str, Any], svc: Services, now: float) -> str:
    """The failure's cause (``shardvault.workflow.causes``), plus the nodes whose agents went
    silent: a timeout or a missing object is most often a dead agent, and the operator needs to know
    where to look."""
    nodes = [source.node_id for source in context.sources]
    cause = failure_cause(error, svc, context.backup_id, nodes)
    silent = []
    for source in context.sources:
        node = svc.nodes.get(source.node_id)
        if node is None or node.status != "up":
            silent.append(f"{source.node_id} (agent stopped)")
        elif node.is_silent(now, svc.settings.heartbeat_max_age_seconds):
            silent.append(f"{source.node_id} (silent for {now - node.heartbeat_at:.0f} s)")
    if not silent:
        return cause
    return (
        f"{cause} The agent of {', '.join(silent)} stopped answering. Fix: restart the agent on "
        "that node (shardvault-agent run), then start the backup again."
    )


def cleanup(
    context: BackupContext, error: dict[str, Any], svc: Services, now: float
) -> dict[str, Any]:
    """The failure path: no open multipart upload, no partial object, every source node told
    to release, the backup marked failed with its cause, the lock released, and a
    notification sent."""
    nodes = [source.node_id for source in context.sources]
    error = transfer_failure(error, UploadIncomplete.__name__, svc, context.backup_id, nodes)
    prefix = backup_prefix(svc.store.prefix, context.cluster, context.backup_id)
    aborted = svc.store_bucket.abort_uploads(prefix)
    deleted = svc.store_bucket.delete_prefix(prefix)
    post_releases(context, svc)
    named = named_failure(svc, context.backup_id, nodes)
    outcome = {
        "status": BackupStatus.FAILED.value,
        "failed_at": now,
        "error": named.name if named else error.get("Error", "States.Runtime"),
        "cause": (named.message if named else explain(context, error, svc, now))[:2000],
        "aborted_uploads": aborted,
        "deleted_objects": deleted,
    }
    svc.catalog.update(context.cluster, context.backup_id, BackupItem.changes(**outcome))
    svc.catalog.unlock(context.cluster, context.backup_id)
    svc.notify(
        f"ShardVault backup of {context.cluster} FAILED ({context.backup_id})",
        {"cluster": context.cluster, "backup_id": context.backup_id, **outcome},
    )
    return outcome


def report_refusal(
    request: BackupRequest, error: ShardVaultError, svc: Services, now: float
) -> bool:
    """A scheduled run refused by validation (an agent down, a backup already running): no one
    watches a schedule, so the night that did not happen is recorded in the catalog (status
    REFUSED, with the cause: ``list`` shows it, and the cluster's newest complete backup keeps
    ageing) and sent to the notifications topic naming the cluster, the cause and the fix. A
    run a person asked for shows its refusal to that person only. Returns whether it was
    reported."""
    if not request.requested_by.startswith("schedule"):
        return False
    backup_id = new_backup_id(now)
    svc.catalog.put(
        BackupItem(
            cluster=request.cluster,
            backup_id=backup_id,
            status=BackupStatus.REFUSED,
            started_at=now,
            requested_by=request.requested_by,
            execution_id=request.execution_id,
            kind=BackupKind.INCREMENTAL if request.incremental else BackupKind.FULL,
            error=error.name,
            cause=f"{error.message} Fix: {error.fix}" if error.fix else error.message,
        )
    )
    return svc.notify(
        f"ShardVault: scheduled backup of {request.cluster} refused ({error.name})",
        {
            "cluster": request.cluster,
            "backup_id": backup_id,
            "requested_by": request.requested_by,
            "execution_id": request.execution_id,
            "error": error.name,
            "cause": error.message,
            "fix": error.fix,
        },
    )


def post_releases(context: BackupContext, svc: Services) -> None:
    """A ``release`` in every source node's inbox *without* a task token: the agent runs it
    whenever it next reads its inbox and answers nobody. The workflow's own release skips a
    silent node (its dispatch is refused), whose snapshot would otherwise outlive the backup
    once it comes back; an agent that already released finds nothing to do."""
    for source in context.sources:
        post_untracked(
            svc,
            source.node_id,
            f"release:{context.backup_id}:cleanup",
            "release",
            {"shard_ids": source.shard_ids, "backup_id": context.backup_id, "failed": True},
        )


TAKEN_OVER = {
    "Error": "ExecutionEnded",
    "Cause": "its execution ended without finishing or cleaning up (stopped, timed out or "
    "lost); the next backup of the cluster cleaned up after it. Fix: nothing to do; see the "
    "execution's history for why it ended.",
}


def clean_up_abandoned(
    cluster: str, backup_id: str, error: dict[str, str], svc: Services, now: float
) -> dict:
    """Cleans up after a backup whose execution ended without running its failure path."""
    record = svc.catalog.get(cluster, backup_id)
    if record and record.status == BackupStatus.RUNNING:
        context = recorded_context(record)
        if context is not None:
            return cleanup(context, error, svc, now)
        # An older version's record without a usable context: what needs none.
        prefix = backup_prefix(svc.store.prefix, cluster, backup_id)
        svc.store_bucket.abort_uploads(prefix)
        svc.store_bucket.delete_prefix(prefix)
        failed = BackupItem.changes(
            status=BackupStatus.FAILED, error=error["Error"], cause=error["Cause"]
        )
        svc.catalog.update(cluster, backup_id, failed)
    svc.catalog.unlock(cluster, backup_id)
    return {"status": BackupStatus.FAILED.value}


def recorded_context(record: BackupItem) -> BackupContext | None:
    """The context validation stored with a backup's record; None when there is none or it no
    longer parses (written by an older version): cleanup must not stop at it."""
    try:
        return BackupContext.model_validate_json(record.context or "")
    except (ValidationError, InvalidRequest):  # the models' own checks raise InvalidRequest
        return None


# --- reaping -------------------------------------------------------------------------------
REAPED_STATUSES = frozenset({"ABORTED", "TIMED_OUT"})


def reap(execution_arn: str, status: str, cluster: str, svc: Services, now: float) -> dict:
    """After an execution was aborted or timed out (it skipped the failure path): the same
    cleanup (which also posts the releases). A backup that already ended is left alone."""
    if status not in REAPED_STATUSES:
        return {"reaped": False, "why": f"status {status}"}
    record = next(
        (r for r in svc.catalog.backups(cluster) if r.execution_id == execution_arn), None
    )
    if record is None or record.status != BackupStatus.RUNNING:
        return {"reaped": False, "why": "no running backup of that execution"}
    error = reaped_error(status, "its backup was cleaned up by the reaper", "backup")
    return {"reaped": True, **clean_up_abandoned(cluster, record.backup_id, error, svc, now)}


def reaped_error(status: str, what_was_done: str, workflow: str) -> dict[str, str]:
    """The error a reaped execution is recorded with, as its failure path would have it."""
    return {
        "Error": f"States.{status.title().replace('_', '')}",
        "Cause": f"the execution was {status.lower().replace('_', ' ')}; {what_was_done}. Fix: "
        f"start the {workflow} again (and raise the state machine's timeout if it timed out).",
    }
