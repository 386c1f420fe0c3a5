"""Restore drills: a backup restored on a schedule into drill nodes, validated, timed and torn
down, so that a cluster's backups are known to restore rather than hoped to.

Terms:
- *drill*: one run of the drill state machine (``statemachines/drill.asl.json``), started by
  the cluster's ``drill`` schedule (policy) or by ``shardvault drill``: pick a backup, restore it
  into the drill's *target cluster* (agents of drill nodes) with the restore state machine as a
  nested execution (the same validation, placement, engine checks and validation queries as any
  restore), record the verdict and the RTO, keep the copy ``keep_minutes``, tear it down.
  Its catalog record is ``drill#<drill_id>`` under the drilled cluster.
- *RTO*: seconds from the drill's start to its restore's validated end (every shard placed,
  started, checked by its engine and answering the queries): what a person would have waited
  for the same restore. The restore's own duration (from its Validate) is kept beside it.
- *verdict*: ``passed``; ``failed`` (the restore failed, refused or did not validate: its
  error and cause); ``slow`` (restored and validated, but the RTO is over the policy's
  ``rto_target_minutes``). Every verdict is sent to the notifications topic; ``failed`` and
  ``slow`` also fail the execution, which the state machine's alarm reports.
- *stale copy*: a drill's restored copy whose drill execution ended without tearing it down
  (stopped, timed out, a crash during the keep window). The next drill of the cluster tears
  it down before it restores, so what a crash leaves, a later drill removes.
"""

from __future__ import annotations

import json
import random
import time
from typing import Any

from pydantic import Field

from shardvault import restore
from shardvault.backup.admission import execution_running
from shardvault.errors import BackupNotFound, DrillAlreadyRunning, InvalidRequest, ShardVaultError
from shardvault.models import (
    BackupStatus,
    ClusterName,
    Frozen,
    RestoreRequest,
    new_backup_id,
)
from shardvault.policy import Drill, Policy
from shardvault.services import Services
from shardvault.tables import DRILL_PREFIX

PASSED, FAILED, SLOW, RUNNING, REFUSED = "passed", "failed", "slow", "running", "refused"
RESTORE_NAME_PREFIX = "drill-"  # the nested restore execution's name: drill-<drill_id>
DAY = 86400.0


class DrillRequest(Frozen):
    """The input of the drill state machine: the policy's drill of ``cluster``, or a person's
    with some of it overridden (a cluster without a ``drill`` section needs ``target_cluster``)."""

    cluster: ClusterName
    target_cluster: ClusterName | None = None
    backup_id: str | None = None  # a backup id, "latest" or "random"; None: the policy's
    keep_minutes: int | None = Field(None, ge=0, le=7 * 24 * 60)
    requested_by: str = "cli"


class DrillContext(Frozen):
    """What the drill decided at its start; passed along the state machine as ``$.drill``."""

    drill_id: str
    cluster: str
    target_cluster: str
    backup_id: str
    started_at: float
    keep_seconds: int
    rto_target_seconds: float | None = None
    requested_by: str = "cli"
    execution_id: str = ""
    stale: list[str] = Field(default_factory=list)  # earlier drills whose copies go first


def catalog_key(drill_id: str) -> str:
    return f"{DRILL_PREFIX}{drill_id}"


def restore_name(drill_id: str) -> str:
    return f"{RESTORE_NAME_PREFIX}{drill_id}"


# --- start -------------------------------------------------------------------------------------
def start(
    request: DrillRequest,
    svc: Services,
    now: float,
    execution_id: str = "",
    rng: random.Random | None = None,
) -> dict[str, Any]:
    """Checks the drill, picks its backup, finds stale copies to tear down first, and records
    the drill as running. Everything that can refuse it does so before the record is written;
    a scheduled drill's refusal is recorded and sent (nobody watches a schedule)."""
    try:
        spec = drill_spec(svc.policy(), request)
        earlier = svc.catalog.drills(request.cluster)
        refuse_if_running(earlier, svc)
        backup = pick_backup(request, spec, svc, now, rng or random.Random())
    except ShardVaultError as error:
        report_refusal(request, error, svc, now)
        raise
    drill_id = new_backup_id(now)
    stale, teardown = stale_copies(earlier, spec.target_cluster, svc)
    context = DrillContext(
        drill_id=drill_id,
        cluster=request.cluster,
        target_cluster=spec.target_cluster,
        backup_id=backup["backup_id"],
        started_at=now,
        keep_seconds=60
        * (spec.keep_minutes if request.keep_minutes is None else request.keep_minutes),
        rto_target_seconds=spec.rto_target_minutes * 60 if spec.rto_target_minutes else None,
        requested_by=request.requested_by,
        execution_id=execution_id,
        stale=stale,
    )
    restore_request = RestoreRequest(
        cluster=request.cluster,
        target_cluster=spec.target_cluster,
        backup_id=backup["backup_id"],
        validation_queries=list(spec.validation_queries),
        requested_by=f"drill:{drill_id}",
    )
    svc.catalog.put(
        {
            "cluster": request.cluster,
            "backup_id": catalog_key(drill_id),
            "drill_id": drill_id,
            "status": RUNNING,
            "started_at": now,
            "requested_by": request.requested_by,
            "execution_id": execution_id,
            "target_cluster": spec.target_cluster,
            "source_backup_id": backup["backup_id"],
            "source_kind": backup.get("kind", "full"),
            "restore_execution": restore_name(drill_id),
            "keep_seconds": context.keep_seconds,
            **(
                {"rto_target_seconds": context.rto_target_seconds}
                if spec.rto_target_minutes
                else {}
            ),
        }
    )
    return {
        "drill": context.model_dump(mode="json"),
        "restore": restore_request.model_dump(mode="json", exclude={"execution_id"}),
        "restore_name": restore_name(drill_id),
        "teardown": teardown,
        "phase": "before",
    }


def drill_spec(policy: Policy | None, request: DrillRequest) -> Drill:
    """The cluster's drill section, with what the request overrides."""
    cluster = policy.clusters.get(request.cluster) if policy else None
    spec = cluster.drill if cluster else None
    if spec is None and request.target_cluster is None:
        raise InvalidRequest(
            f"cluster {request.cluster!r} has no drill in the policy, and the request names "
            "no target cluster.",
            fix="add a drill: section to the cluster's policy (see the README's restore "
            "drills), or pass --into with a cluster of drill nodes.",
        )
    overrides: dict[str, Any] = {}
    if request.target_cluster is not None:
        overrides["target_cluster"] = request.target_cluster
    if request.backup_id in ("latest", "random"):
        overrides["backup"] = request.backup_id
    if spec is None:
        spec = Drill(cron="0 9 * * 3", **overrides)  # a person's drill: the schedule is unused
    elif overrides:
        spec = spec.model_copy(update=overrides)
    target = spec.target_cluster
    if target == request.cluster or (policy and target in policy.clusters):
        raise InvalidRequest(
            f"a drill of {request.cluster!r} cannot restore into {target!r}: the policy backs "
            "that cluster up, and a drill removes what it restored there.",
            fix="drill into a cluster of drill nodes only (e.g. '" + request.cluster + "-drill').",
        )
    return spec


def refuse_if_running(earlier: list[dict[str, Any]], svc: Services) -> None:
    """One drill of a cluster at a time: a second would find the first's copy in its target."""
    for record in earlier:
        if record.get("torn_down_at") or record.get("status") == REFUSED:
            continue
        if execution_running(svc, record.get("execution_id", "")):
            raise DrillAlreadyRunning(
                f"drill {record['drill_id']} of cluster {record['cluster']!r} is still running "
                f"(it keeps its copy until {keep_until(record)}).",
                fix="wait for it to end ('shardvault drills CLUSTER'), or stop its execution: "
                "the next drill tears its copy down.",
            )


def keep_until(record: dict[str, Any]) -> str:
    ends = record.get("validated_at", record.get("started_at", 0)) + record.get("keep_seconds", 0)
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(ends))


def pick_backup(
    request: DrillRequest, spec: Drill, svc: Services, now: float, rng: random.Random
) -> dict[str, Any]:
    """The backup the drill restores: the one the request names, the newest complete one, or
    (``random``) any complete one of the last ``within_days`` (the newest when none is)."""
    named = request.backup_id not in (None, "latest", "random")
    choice = request.backup_id if named else "latest"
    if named or spec.backup == "latest":
        return restore.resolve_backup(
            RestoreRequest(
                cluster=request.cluster, target_cluster=spec.target_cluster, backup_id=choice
            ),
            svc,
        )
    complete = [
        b for b in svc.catalog.backups(request.cluster) if b.get("status") == BackupStatus.COMPLETE
    ]
    if not complete:
        raise BackupNotFound(
            f"cluster {request.cluster!r} has no complete backup to drill.",
            fix="run a backup first ('shardvault backup CLUSTER --wait').",
        )
    recent = [b for b in complete if completed_at(b) >= now - spec.within_days * DAY]
    if not recent:
        return max(complete, key=lambda b: b["backup_id"])
    return rng.choice(sorted(recent, key=lambda b: b["backup_id"]))


def completed_at(record: dict[str, Any]) -> float:
    return float(record.get("completed_at", record.get("started_at", 0)))


def stale_copies(
    earlier: list[dict[str, Any]], target_cluster: str, svc: Services
) -> tuple[list[str], list[dict[str, str]]]:
    """Earlier drills whose copies were never torn down (their executions ended: the caller
    refused any that still run), and the nodes to tear each copy down on."""
    restores = {
        r.get("execution_id", "").rpartition(":")[2]: r
        for r in svc.catalog.restores(target_cluster)
    }
    stale, teardown = [], []
    for record in earlier:
        if record.get("torn_down_at") or record.get("status") == REFUSED:
            continue
        stale.append(record["drill_id"])
        placed = restores.get(record.get("restore_execution", ""))
        if placed is None:  # refused before its Plan: nothing was placed
            continue
        for node_id in sorted(set(placed.get("placement", {}).values())):
            teardown.append({"node_id": node_id, "restore_id": placed["restore_id"]})
    return stale, teardown


def report_refusal(
    request: DrillRequest, error: ShardVaultError, svc: Services, now: float
) -> None:
    """A scheduled drill that could not start is recorded (``drills`` shows it) and sent."""
    if not request.requested_by.startswith("schedule"):
        return
    drill_id = new_backup_id(now)
    cause = f"{error.message} Fix: {error.fix}" if error.fix else error.message
    svc.catalog.put(
        {
            "cluster": request.cluster,
            "backup_id": catalog_key(drill_id),
            "drill_id": drill_id,
            "status": REFUSED,
            "started_at": now,
            "requested_by": request.requested_by,
            "error": error.name,
            "cause": cause,
        }
    )
    svc.notify(
        f"ShardVault: scheduled drill of {request.cluster} refused ({error.name})",
        {"cluster": request.cluster, "drill_id": drill_id, "error": error.name, "cause": cause},
    )


# --- record ------------------------------------------------------------------------------------
def record(
    drill: DrillContext,
    restored: dict[str, Any] | None,
    error: dict[str, Any] | None,
    svc: Services,
    now: float,
) -> dict[str, Any]:
    """The drill's verdict from its restore's outcome (the nested execution's output, or its
    failure), recorded and sent; returns what the state machine needs next: the verdict, the
    copy's nodes to tear down after ``keep_seconds``."""
    placed = restore_record(drill, svc)
    if restored is not None and error is None:
        outcome = passed_outcome(drill, restored.get("output") or {}, now)
    else:
        outcome = failed_outcome(error or {}, placed, now)
    nodes = sorted(set((placed or {}).get("placement", {}).values()))
    teardown = (
        [{"node_id": n, "restore_id": placed["restore_id"]} for n in nodes]
        if placed and outcome["status"] != FAILED
        else []  # a failed restore removed what it placed (its own failure path)
    )
    svc.catalog.update(
        drill.cluster,
        catalog_key(drill.drill_id),
        **outcome,
        restore_id=(placed or {}).get("restore_id", ""),
        nodes=nodes,
    )
    svc.notify(
        subject(drill, outcome),
        {
            "drill_id": drill.drill_id,
            "cluster": drill.cluster,
            "target_cluster": drill.target_cluster,
            "backup_id": drill.backup_id,
            **outcome,
        },
    )
    return {
        "drill_id": drill.drill_id,
        "backup_id": drill.backup_id,
        "verdict": outcome["status"],
        "passed": outcome["status"] == PASSED,
        "rto_seconds": outcome.get("rto_seconds"),
        "teardown": teardown,
        "keep_seconds": drill.keep_seconds if teardown else 0,
        "error": outcome.get("error", ""),
        "cause": outcome.get("cause", "")[:1000],
    }


def restore_record(drill: DrillContext, svc: Services) -> dict[str, Any] | None:
    """The nested restore's catalog record (None: it was refused before its Plan)."""
    name = restore_name(drill.drill_id)
    return next(
        (
            r
            for r in svc.catalog.restores(drill.target_cluster)
            if r.get("execution_id", "").rpartition(":")[2] == name
        ),
        None,
    )


def passed_outcome(drill: DrillContext, summary: dict[str, Any], now: float) -> dict[str, Any]:
    validated_at = float(summary.get("completed_at", now))
    rto = round(validated_at - drill.started_at, 3)
    slow = drill.rto_target_seconds is not None and rto > drill.rto_target_seconds
    shards = summary.get("shards", [])
    outcome: dict[str, Any] = {
        "status": SLOW if slow else PASSED,
        "validated_at": validated_at,
        "rto_seconds": rto,
        "restore_seconds": summary.get("duration_seconds", 0),
        "bytes": summary.get("bytes", 0),
        "shards": len(shards),
        "checks_passed": sum(len(s.get("checks") or {}) for s in shards),
    }
    if slow:
        outcome["error"] = "RtoOverTarget"
        outcome["cause"] = (
            f"the drill restored and validated in {rto:,.0f} s, over its RTO target of "
            f"{drill.rto_target_seconds:,.0f} s."
        )
    return outcome


def failed_outcome(
    error: dict[str, Any], placed: dict[str, Any] | None, now: float
) -> dict[str, Any]:
    """The restore's own error and cause: its catalog record's (the failure path wrote what the
    nodes said), else the nested execution's, else the drill's."""
    name, cause = error.get("Error", "States.Runtime"), str(error.get("Cause", ""))
    try:
        nested = json.loads(cause)
    except ValueError:
        nested = None
    if isinstance(nested, dict):  # States.TaskFailed: the restore execution's description
        name, cause = nested.get("Error", name), str(nested.get("Cause", ""))
    if placed and placed.get("status") == BackupStatus.FAILED:
        name, cause = placed.get("error", name), placed.get("cause", cause)
    return {"status": FAILED, "failed_at": now, "error": name, "cause": cause[:2000]}


def subject(drill: DrillContext, outcome: dict[str, Any]) -> str:
    verdict = outcome["status"]
    if verdict == FAILED:
        return f"ShardVault drill of {drill.cluster} FAILED ({outcome['error']})"
    rto = f"RTO {outcome['rto_seconds']:,.0f} s"
    if verdict == SLOW:
        return f"ShardVault drill of {drill.cluster} SLOW: {rto} over target"
    return f"ShardVault drill of {drill.cluster} passed: {rto}"


# --- end ---------------------------------------------------------------------------------------
def end(drill: DrillContext, svc: Services, now: float) -> dict[str, Any]:
    """After the teardown: nothing of this drill's copy is left (a failed restore removed its
    own), nor of the stale copies it tore down before restoring."""
    for drill_id in [*drill.stale, drill.drill_id]:
        svc.catalog.update(drill.cluster, catalog_key(drill_id), torn_down_at=now)
    return {"drill_id": drill.drill_id, "stale_removed": drill.stale}
