"""The retention workflow's steps (``statemachines/retention.asl.json``): decide, then expire.

Terms:
- *decision*: ``shardvault.lifecycle.retention.decide`` over a cluster's complete backups and its
keep
  counts from the policy file: what is kept and why, what expires, what is held until its
  class's paid minimum, what is still locked, the monthly saving and any early-deletion
  charge (reported, never hidden).
- *hold*: a real run records each held backup's end in its catalog item (``held_until``,
  ``held_for``: "paid minimum of DEEP_ARCHIVE"), so ``list`` and ``show`` say why a backup
  retention expired is still there; the item stays ``COMPLETE``, and restorable.
- *expire*: mark the catalog record ``EXPIRING`` (no longer restorable), delete every version
  of the backup's objects and manifest (the vault is versioned: a delete without a version id
  only adds a marker and the bytes stay billed), in batches of at most 1,000 keys, the
  manifest last; then mark it ``EXPIRED``. A backup is expired only after its Object Lock
  date, so S3 never has to refuse a deletion. A run that stops between the mark and the last
  deletion leaves an ``EXPIRING`` record: every later decision expires it again, whatever
  retention or holds would say of a complete backup, so what is left is always removed.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from typing import Any

from shardvault.aws.services import Services
from shardvault.aws.tables import completion_order
from shardvault.contracts.catalog import EXPIRED, EXPIRING, BackupItem
from shardvault.contracts.layout import backup_prefix
from shardvault.errors import ExpiryFailed, InvalidRequest
from shardvault.lifecycle import costs
from shardvault.lifecycle.retention import (
    BackupRecord,
    RetentionDecision,
    decide,
    deletion_batches,
    from_catalog,
)

log = logging.getLogger("shardvault.lifecycle.expire")


def clusters_to_check(requested: str | None, svc: Services) -> list[str]:
    policy = svc.policy()
    if policy is None:
        raise InvalidRequest(
            "this deployment has no policy file, so no keep counts.",
            fix="deploy with a policy file (shardvault.yaml) that declares each cluster's "
            "retention.",
        )
    if requested:
        policy.cluster(requested)  # a named error when the policy lacks it
        return [requested]
    return sorted(policy.clusters)


def records(cluster: str, svc: Services) -> list[BackupRecord]:
    """The cluster's complete backups, as retention sees them."""
    return from_catalog(cluster, svc.catalog.backups(cluster))


def decide_cluster(cluster: str, svc: Services, now: float) -> RetentionDecision:
    policy = svc.policy().cluster(cluster)
    at = datetime.fromtimestamp(now, UTC)
    return decide(
        records(cluster, svc),
        policy.retention,
        at,
        policy.schedule.zone,
        delete_before_paid_minimum=policy.vault.delete_before_paid_minimum,
    )


def unfinished(cluster: str, svc: Services) -> list[str]:
    """Backups whose expiry started and did not finish (newest first)."""
    items = [r for r in svc.catalog.backups(cluster) if r.status == EXPIRING]
    items.sort(key=completion_order, reverse=True)
    return [r.backup_id for r in items]


def record_holds(cluster: str, decision: RetentionDecision, svc: Services) -> None:
    """Writes each held backup's end into its catalog item, for ``list`` and ``show``."""
    for held in decision.held:
        until = BackupItem.changes(held_until=held.until.isoformat(), held_for=held.reason)
        svc.catalog.update(cluster, held.backup_id, until)


def decision_summary(
    cluster: str, decision: RetentionDecision, unfinished_ids: list[str] | None = None
) -> dict[str, Any]:
    """The decision as the workflow passes it on; ``expire`` also names the backups whose
    expiry an earlier run left unfinished (``unfinished``), which come first."""
    unfinished_ids = unfinished_ids or []
    return {
        "cluster": cluster,
        "keep": [
            {"backup_id": k.backup_id, "why": [f"{r.rule}:{r.detail}" for r in k.reasons]}
            for k in decision.keep
        ],
        "expire": [*unfinished_ids, *decision.expire],
        "unfinished": unfinished_ids,
        "locked": [
            {"backup_id": lk.backup_id, "until": lk.retain_until.isoformat()}
            for lk in decision.locked
        ],
        "held": [
            {"backup_id": h.backup_id, "until": h.until.isoformat(), "why": h.describe()}
            for h in decision.held
        ],
        "held_monthly_usd": round(decision.held_monthly_usd, 4),
        "unrestorable": decision.unrestorable,
        "monthly_saving_usd": round(decision.monthly_saving_usd, 4),
        "early_deletion_charge_usd": round(decision.early_deletion_charge_usd, 4),
        "early_deletions": [e.model_dump(mode="json") for e in decision.early_deletions],
    }


def decide_all(
    requested: str | None, svc: Services, now: float, *, dry_run: bool = False
) -> dict[str, Any]:
    """Decisions for every cluster asked for, and the flat list of backups to expire. A real
    run (not ``dry_run``) records the holds in the catalog."""
    decisions = []
    for cluster in clusters_to_check(requested, svc):
        decision = decide_cluster(cluster, svc, now)
        if not dry_run:
            record_holds(cluster, decision, svc)
        decisions.append(decision_summary(cluster, decision, unfinished(cluster, svc)))
    expiring = [{"cluster": d["cluster"], "backup_id": b} for d in decisions for b in d["expire"]]
    alerts = [a for c in clusters_to_check(requested, svc) if (a := checked_budget(c, svc))]
    for alert in alerts:
        svc.notify("ShardVault: a cluster is over its budget", {"alert": alert})
    return {
        "decisions": decisions,
        "budget_alerts": alerts,
        "expire": expiring,
        "monthly_saving_usd": round(sum(d["monthly_saving_usd"] for d in decisions), 4),
        "early_deletion_charge_usd": round(
            sum(d["early_deletion_charge_usd"] for d in decisions), 4
        ),
    }


def checked_budget(cluster: str, svc: Services) -> str | None:
    """``budget_alert``, but a forecast that fails is logged and skipped: one cluster's
    forecast must never stop the daily run from expiring anything, in any cluster."""
    try:
        return budget_alert(cluster, svc)
    except Exception as error:
        log.warning(
            "budget of cluster %s not checked: %s: %s", cluster, type(error).__name__, error
        )
        return None


def budget_alert(cluster: str, svc: Services) -> str | None:
    """The alert when the cluster's monthly forecast, at its measured sizes (its newest full,
    its incrementals' median share of their full), exceeds the policy's budget. Checked once
    a day, with retention, not on each backup: a forecast simulates a year of the schedule."""
    cluster_policy = svc.policy().cluster(cluster)
    if cluster_policy.budget_usd_per_month is None:
        return None
    measured = costs.measured_sizes(svc.catalog.backups(cluster), cluster)
    if measured is None:
        return None
    forecast = costs.forecast_measured(cluster_policy, measured, costs.DEFAULT_DAILY_CHANGE)
    return costs.budget_alert(cluster, forecast)


def expire_backup(cluster: str, backup_id: str, svc: Services, now: float) -> dict[str, Any]:
    """Marks the backup ``EXPIRING``, deletes every version of its objects, wherever they are
    (vault and store), manifests last, then marks it expired. Idempotent: a retry, or the
    next run (see *expire*), deletes what is left."""
    svc.catalog.update(cluster, backup_id, BackupItem.changes(status=EXPIRING, expiring_at=now))
    deleted = 0
    places = [(svc.store_bucket, svc.store)]
    if svc.vault_bucket is not None and svc.vault is not None:
        places.append((svc.vault_bucket, svc.vault))
    for bucket, location in places:
        prefix = backup_prefix(location.prefix, cluster, backup_id)
        versions = sorted(
            bucket.versions(prefix),
            key=lambda kv: kv[0].endswith("manifest.json"),  # manifests last
        )
        for batch in deletion_batches(versions):
            if errors := bucket.delete_batch(batch):
                raise ExpiryFailed(
                    f"the store refused to delete {len(errors)} objects of backup {backup_id}, "
                    f"e.g. {errors[0].get('Key')}: {errors[0].get('Code')} "
                    f"{errors[0].get('Message', '')}",
                    fix="check the vault's Object Lock dates and the function's permissions; the "
                    "next retention run retries.",
                )
            deleted += len(batch)
    expired = BackupItem.changes(status=EXPIRED, expired_at=now, deleted_objects=deleted)
    svc.catalog.update(cluster, backup_id, expired)
    return {"cluster": cluster, "backup_id": backup_id, "deleted_objects": deleted}
