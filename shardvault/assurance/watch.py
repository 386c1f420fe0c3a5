"""The watch: what no backup run can say about itself, measured on a timer.

A failed night publishes its failure, but a night that never ran (its agents gone, its
schedule broken, every run refused) publishes nothing, and an agent that dies between backups
is noticed only by the next one. The watch (``functions/watch_clusters.py``, run every
``WATCH_MINUTES`` by an EventBridge rule) reads the catalog and the agents' registry and
publishes CloudWatch metrics (namespace ``ShardVault``), which the stack alarms on:

Terms:
- *backup age* (``NewestBackupAgeHours``, dimension ``Cluster``, each cluster of the policy):
  hours since the cluster's newest complete backup completed. A cluster without one is measured
  from its first recorded attempt (failed and refused runs are recorded); a cluster never
  attempted publishes nothing yet. Its alarm fires past the cluster's RPO
  (``Policy.rpo_hours``).
- *silent agents* (``SilentAgents``, the whole deployment): registered agents that stopped, or
  that missed their heartbeats (``NodeRecord.is_silent``, the rule validation refuses a
  backup by). One metric, not one per cluster or node: custom metrics are billed each, and
  ``shardvault nodes`` names them.
- *stalled WAL spools* (``StalledWalSpools``, the whole deployment): shards whose WAL spool's
  oldest file has waited more than ``SPOOL_STALL_SECONDS`` (by its agent's last heartbeat):
  the archive is not keeping up, or not running, and PostgreSQL keeps the WAL the spool
  refuses in ``pg_wal`` until the disk fills. The alarm fires long before that.
- *outdated agents* (``OutdatedAgents``, the whole deployment): registered agents that speak
  an older agent protocol than this control plane needs (``NodeRecord.is_outdated``): every
  backup and restore of their clusters is refused (``AgentOutdated``) until they are upgraded.
  Counted after a control-plane upgrade, the alarm fires the same quarter hour, not at the
  next night's refusal.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from shardvault.aws.services import Services
from shardvault.contracts.models import BackupStatus, Frozen

NAMESPACE = "ShardVault"
BACKUP_AGE_METRIC = "NewestBackupAgeHours"
SILENT_AGENTS_METRIC = "SilentAgents"
STALLED_SPOOLS_METRIC = "StalledWalSpools"
OUTDATED_AGENTS_METRIC = "OutdatedAgents"
SPOOL_STALL_SECONDS = 900.0  # 15 times the default archive delay: stalled, not batching
CLUSTER_DIMENSION = "Cluster"


class Observation(Frozen):
    """What one run of the watch saw."""

    backup_age_hours: dict[str, float]  # by cluster; a cluster never attempted is absent
    silent_nodes: list[str]  # "cluster/node"
    stalled_spools: list[str] = []  # "cluster/node/shard"
    outdated_nodes: list[str] = []  # "cluster/node (protocol n)"


def observe(svc: Services, now: float) -> Observation:
    policy = svc.policy()
    clusters = sorted(policy.clusters) if policy else []
    ages = {name: age for name in clusters if (age := backup_age_hours(svc, name, now)) is not None}
    max_age = svc.settings.heartbeat_max_age_seconds
    nodes = svc.nodes.everyone()
    silent = [f"{n.cluster}/{n.node_id}" for n in nodes if n.is_unavailable(now, max_age)]
    stalled = [
        f"{n.cluster}/{n.node_id}/{s.shard_id}"
        for n in nodes
        for s in n.shards
        if s.spool_stalled_for(now, n.heartbeat_at) > SPOOL_STALL_SECONDS
    ]
    outdated = [f"{n.cluster}/{n.node_id} (protocol {n.protocol})" for n in nodes if n.is_outdated]
    return Observation(
        backup_age_hours=ages,
        silent_nodes=silent,
        stalled_spools=stalled,
        outdated_nodes=outdated,
    )


def backup_age_hours(svc: Services, cluster: str, now: float) -> float | None:
    """Hours since the cluster's newest complete backup (or, without one, since its first
    recorded attempt); None when it has no record at all."""
    records = svc.catalog.backups(cluster)
    complete = [r for r in records if r.status == BackupStatus.COMPLETE]
    if complete:
        since = max(r.completed_at or r.started_at for r in complete)
    elif records:
        since = min(r.started_at for r in records)
    else:
        return None
    return max(0.0, (now - since) / 3600)


def publish(observation: Observation, svc: Services, now: float) -> None:
    """One PutMetricData call (up to 1,000 values fit: a cluster each, and one)."""
    at = datetime.fromtimestamp(now, UTC)
    data: list[dict[str, Any]] = [
        {
            "MetricName": SILENT_AGENTS_METRIC,
            "Timestamp": at,
            "Value": len(observation.silent_nodes),
            "Unit": "Count",
        },
        {
            "MetricName": STALLED_SPOOLS_METRIC,
            "Timestamp": at,
            "Value": len(observation.stalled_spools),
            "Unit": "Count",
        },
        {
            "MetricName": OUTDATED_AGENTS_METRIC,
            "Timestamp": at,
            "Value": len(observation.outdated_nodes),
            "Unit": "Count",
        },
    ]
    data += [
        {
            "MetricName": BACKUP_AGE_METRIC,
            "Dimensions": [{"Name": CLUSTER_DIMENSION, "Value": cluster}],
            "Timestamp": at,
            "Value": round(age, 3),
            "Unit": "None",
        }
        for cluster, age in observation.backup_age_hours.items()
    ]
    svc.cloudwatch.put_metric_data(Namespace=NAMESPACE, MetricData=data)


def watch(svc: Services, now: float) -> dict[str, Any]:
    observation = observe(svc, now)
    publish(observation, svc, now)
    return observation.model_dump(mode="json")
