"""The local scheduler: what EventBridge Scheduler does on AWS, for the local stack.

It reads the same policy file, asks each cluster's schedule which backups fell due since the
last tick (``Schedule.fires``: cron expressions in the schedule's time zone, a full winning a
minute both claim) and starts them on the stack's backup state machine, and the restore drills
that fell due (``Drill.fires``) on its drill state machine, and the scheduled cuts
(``Cut.fires``) on its cut state machine; once a day it runs retention. A
backup already running for a cluster makes the new one fail with ``BackupAlreadyRunning``, as
on AWS.

A backup due as incremental is requested as one (``incremental: true``); the cluster's
``incremental`` policy decides when it is made as a full instead (no usable parent, or the
chain is as long as ``max_chain``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

from shardvault.assurance.drills import DrillRequest
from shardvault.client import operations as ops
from shardvault.config.policy import BackupKind, Policy
from shardvault.contracts.models import BackupRequest

log = logging.getLogger("shardvault.local.scheduler")
RETENTION_EVERY = timedelta(days=1)


def due(policy: Policy, since: datetime, until: datetime) -> list[tuple[datetime, str, BackupKind]]:
    """Backups due in ``(since, until]`` across the policy's clusters, in time order."""
    fired = [
        (at, name, kind)
        for name, cluster in policy.clusters.items()
        for at, kind in cluster.schedule.fires(since, until)
    ]
    return sorted(fired)


def drills_due(policy: Policy, since: datetime, until: datetime) -> list[tuple[datetime, str]]:
    """Restore drills due in ``(since, until]`` across the policy's clusters, in time order."""
    fired = [
        (at, name)
        for name, cluster in policy.clusters.items()
        if cluster.drill is not None
        for at in cluster.drill.fires(since, until)
    ]
    return sorted(fired)


def cuts_due(policy: Policy, since: datetime, until: datetime) -> list[tuple[datetime, str]]:
    """Scheduled cuts due in ``(since, until]``, one per cluster (the newest: a cut marks the
    moment it is taken, so a tick that comes late takes one, not the ones it missed)."""
    newest = {
        name: times[-1]
        for name, cluster in policy.clusters.items()
        if (times := list(cluster.cut.fires(since, until)))
    }
    return sorted((at, name) for name, at in newest.items())


def tick(
    policy: Policy,
    config: ops.ClientConfig,
    since: datetime,
    until: datetime,
    start: Callable[[ops.ClientConfig, BackupRequest], str] = ops.start_backup,
    start_drill: Callable[[ops.ClientConfig, DrillRequest], str] = ops.start_drill,
    start_cut: Callable[[ops.ClientConfig, str, str], str] = ops.start_cut,
) -> list[dict[str, Any]]:
    """Starts what fell due; returns one line per started backup, drill or cut."""
    started = []
    for at, cluster, kind in due(policy, since, until):
        request = BackupRequest(
            cluster=cluster,
            incremental=kind == BackupKind.INCREMENTAL,
            requested_by=f"schedule:{kind}",
        )
        execution = start(config, request)
        log.info("%s backup of %s due at %s: %s", kind, cluster, at.isoformat(), execution)
        started.append({"cluster": cluster, "kind": str(kind), "due": at, "execution": execution})
    for at, cluster in drills_due(policy, since, until):
        request = DrillRequest(cluster=cluster, requested_by="schedule:drill")
        execution = start_drill(config, request)
        log.info("restore drill of %s due at %s: %s", cluster, at.isoformat(), execution)
        started.append({"cluster": cluster, "kind": "drill", "due": at, "execution": execution})
    for at, cluster in cuts_due(policy, since, until):
        if not config.cut_state_machine_arn:  # a stack.env from before scheduled cuts
            log.warning(
                "cut of %s due at %s not started: the stack has no cut state machine "
                "(restart it with this release)",
                cluster,
                at.isoformat(),
            )
            continue
        execution = start_cut(config, cluster, "schedule:cut")
        log.info("cut of %s due at %s: %s", cluster, at.isoformat(), execution)
        started.append({"cluster": cluster, "kind": "cut", "due": at, "execution": execution})
    return started


def run(policy: Policy, config: ops.ClientConfig, interval: float = 20.0) -> None:
    """Ticks until interrupted; retention once a day (dry runs are for people)."""
    last = datetime.now(UTC)
    last_retention = datetime.min.replace(tzinfo=UTC)
    while True:
        time.sleep(interval)
        now = datetime.now(UTC)
        tick(policy, config, last, now)
        last = now
        if now - last_retention >= RETENTION_EVERY and config.retention_state_machine_arn:
            outcome = ops.run_retention(config, None, dry_run=False)
            log.info("retention: %s %s", outcome.status, outcome.error)
            last_retention = now
