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
  (stopped, timed out, a crash during the keep window, a node that could not). The next drill
  of the cluster tears it down before it restores, so what a crash leaves, a later drill
  removes.
- *target lock*: one drill restores into a target at a time (``#drill`` under the target
  cluster, a conditional write, taken over from a drill whose execution ended).
"""

from __future__ import annotations

import json
import random
from typing import Any

from pydantic import Field

from shardvault.aws.services import Services
from shardvault.aws.tables import DRILL_LOCK_KEY, completion_order
from shardvault.backup.admission import execution_running
from shardvault.config.policy import Drill, Policy
from shardvault.contracts.catalog import BackupItem, DrillItem, RestoreItem, drill_key
from shardvault.contracts.models import (
    BackupStatus,
    ClusterName,
    Frozen,
    RestoreRequest,
    new_backup_id,
)
from shardvault.errors import BackupNotFound, DrillAlreadyRunning, InvalidRequest, ShardVaultError
from shardvault.restore import admission

PASSED, FAILED, SLOW, RUNNING, REFUSED = "passed", "failed", "slow", "running", "refused"
BEFORE = "before"  # the teardown of stale copies, before the restore (then "after": its own)
EVERY_COPY = "*"  # a Teardown map that failed as a whole: no copy is known to be gone
RESTORE_NAME_PREFIX = "drill-"  # the nested restore execution's name: drill-<drill_id>
DAY = 86400.0
LOCK_ATTEMPTS = 3


class DrillRequest(Frozen):
    """The input of the drill state machine: the policy's drill of ``cluster``, or a person's
    with some of it overridden (a cluster without a ``drill`` section needs ``target_cluster``)."""

    cluster: ClusterName
    target_cluster: ClusterName | None = None
    backup_id: str | None = None  # a backup id, "latest" or "random"; None: the policy's
    keep_minutes: int | None = Field(None, ge=0, le=7 * 24 * 60)
    # A vault target to drill from (its copy proven, not assumed); None: the policy's.
    from_vault: str | None = Field(None, pattern=r"^[a-z][a-z0-9-]{0,39}$")
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


def restore_name(drill_id: str) -> str:
    return f"{RESTORE_NAME_PREFIX}{drill_id}"


# --- start -------------------------------------------------------------------------------------
def start(
    request: DrillRequest,
    svc: Services,
    now: float,
    execution_id: str = "",
    rng: random.Random | None = None,
    restore_machine: str = "",
) -> dict[str, Any]:
    """Checks the drill, picks its backup, takes its target (one drill restores into a target
    at a time), finds stale copies to tear down first, and records the drill as running.
    Everything that can refuse it does so before the target is taken; a scheduled drill's
    refusal is recorded and sent (nobody watches a schedule). A retried start (the same
    execution) goes on with the drill it began. ``restore_machine``: the restore state
    machine's ARN, to tell whether an earlier drill's nested restore still runs."""
    earlier = svc.catalog.drills(request.cluster)
    mine = next((r for r in earlier if execution_id and r.execution_id == execution_id), None)
    drill_id = mine.drill_id if mine else new_backup_id(now)
    try:
        spec = drill_spec(svc.policy(), request, svc)
        backup = pick_backup(request, spec, svc, now, rng or random.Random())
        drill_id = take_target(spec.target_cluster, drill_id, execution_id, restore_machine, svc)
    except ShardVaultError as error:
        report_refusal(request, error, svc, now)
        raise
    others = [r for r in earlier if r.drill_id != drill_id]
    stale, teardown = stale_copies(others, restore_machine, svc)
    context = DrillContext(
        drill_id=drill_id,
        cluster=request.cluster,
        target_cluster=spec.target_cluster,
        backup_id=backup.backup_id,
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
        backup_id=backup.backup_id,
        from_vault=spec.from_vault,
        validation_queries=list(spec.validation_queries),
        requested_by=f"drill:{drill_id}",
    )
    svc.catalog.put(
        DrillItem(
            cluster=request.cluster,
            backup_id=drill_key(drill_id),
            drill_id=drill_id,
            status=RUNNING,
            started_at=now,
            requested_by=request.requested_by,
            execution_id=execution_id,
            target_cluster=spec.target_cluster,
            source_backup_id=backup.backup_id,
            source_kind=backup.kind,
            restore_execution=restore_name(drill_id),
            keep_seconds=context.keep_seconds,
            rto_target_seconds=context.rto_target_seconds if spec.rto_target_minutes else None,
        )
    )
    return {
        "drill": context.model_dump(mode="json"),
        "restore": restore_request.model_dump(mode="json", exclude={"execution_id"}),
        "restore_name": restore_name(drill_id),
        "teardown": teardown,
        "torn_down": [],
        "phase": BEFORE,
    }


def drill_spec(policy: Policy | None, request: DrillRequest, svc: Services) -> Drill:
    """The cluster's drill section, with what the request overrides; its target checked."""
    if policy is None:
        raise InvalidRequest(
            "this deployment has no policy: a drill cannot tell which clusters are backed up.",
            fix="deploy with a policy file (docs/guide/policy.md).",
        )
    cluster = policy.clusters.get(request.cluster)
    spec = cluster.drill if cluster else None
    if spec is None and request.target_cluster is None:
        raise InvalidRequest(
            f"cluster {request.cluster!r} has no drill in the policy, and the request names "
            "no target cluster.",
            fix="add a drill: section to the cluster's policy (docs/guide/drills.md"
            "), or pass --into with a cluster of drill nodes.",
        )
    overrides: dict[str, Any] = {}
    if request.target_cluster is not None:
        overrides["target_cluster"] = request.target_cluster
    if request.backup_id in ("latest", "random"):
        overrides["backup"] = request.backup_id
    if request.from_vault is not None:
        overrides["from_vault"] = request.from_vault
    if spec is None:
        spec = Drill(cron="0 9 * * 3", **overrides)  # a person's drill: the schedule is unused
    elif overrides:
        spec = spec.model_copy(update=overrides)
    check_target(policy, request.cluster, spec.target_cluster, svc)
    return spec


def check_target(policy: Policy, cluster: str, target: str, svc: Services) -> None:
    """A drill's target holds drill copies only: never a cluster the policy or anyone backs up
    (its catalog has backups), never another cluster's drill target. (A drill's teardown
    removes only the shards its own restore placed, never a configured shard; this keeps
    drill copies out of production nodes in the first place.)"""
    backed_up = target == cluster or target in policy.clusters or svc.catalog.backups(target)
    if backed_up:
        raise InvalidRequest(
            f"a drill of {cluster!r} cannot restore into {target!r}: that cluster is backed "
            "up, and a drill removes what it restored there.",
            fix="drill into a cluster of drill nodes only (e.g. '" + cluster + "-drill').",
        )
    owner = next(
        (n for n, c in policy.clusters.items() if c.drill and c.drill.target_cluster == target),
        cluster,
    )
    if owner != cluster:
        raise InvalidRequest(
            f"{target!r} is the drill target of cluster {owner!r}.",
            fix="drill into a target of this cluster's own: one drill's copy would be in the "
            "other's way.",
        )


def take_target(
    target: str, drill_id: str, execution_id: str, restore_machine: str, svc: Services
) -> str:
    """The target's drill lock (a conditional write): taken; kept by a retried start of the
    same execution (whose drill id it returns: the first attempt may have written no record);
    or taken over from a drill that has ended, its restore included. Else
    ``DrillAlreadyRunning``. Returns the drill's id."""
    for _ in range(LOCK_ATTEMPTS):  # a holder that released between the put and the read
        holder = svc.catalog.try_lock(target, drill_id, execution_id, key=DRILL_LOCK_KEY)
        if holder is None:
            return drill_id
        if holder.holder:
            break
    if execution_id and holder.execution_id == execution_id:
        return holder.holder or drill_id
    previous = holder.execution_id
    ended = not drill_running(svc, previous, restore_machine, holder.holder)
    if ended and svc.catalog.take_over_lock(
        target, DRILL_LOCK_KEY, previous, drill_id, execution_id
    ):
        return drill_id
    raise DrillAlreadyRunning(
        f"drill {holder.holder} is restoring into {target!r} or keeping its copy "
        f"there (execution {previous or 'unknown'}).",
        fix="wait for it to end ('shardvault drills CLUSTER'), or stop its execution: the "
        "next drill tears its copy down.",
    )


def drill_running(
    svc: Services, execution_id: str, restore_machine: str = "", drill_id: str = ""
) -> bool:
    """Whether a drill still runs: its execution, or its nested restore (which a stopped drill
    may leave running); an execution that names none (a direct call) does not."""
    if execution_id.startswith("arn:") and execution_running(svc, execution_id):
        return True
    if not (restore_machine.startswith("arn:") and drill_id):
        return False
    return execution_running(svc, restore_execution_arn(restore_machine, drill_id))


def restore_execution_arn(restore_machine: str, drill_id: str) -> str:
    """The ARN of a drill's nested restore execution (``drill-<drill_id>``)."""
    prefix = restore_machine.replace(":stateMachine:", ":execution:", 1)
    return f"{prefix}:{restore_name(drill_id)}"


def pick_backup(
    request: DrillRequest, spec: Drill, svc: Services, now: float, rng: random.Random
) -> BackupItem:
    """The backup the drill restores: the one the request names, the newest complete one, or
    (``random``) any complete one of the last ``within_days`` (the newest when none is); from
    a copy target, among those it holds."""
    named = request.backup_id not in (None, "latest", "random")
    choice = request.backup_id if named else "latest"
    if named or spec.backup == "latest":
        return admission.resolve_backup(
            RestoreRequest(
                cluster=request.cluster,
                target_cluster=spec.target_cluster,
                backup_id=choice,
                from_vault=spec.from_vault,
            ),
            svc.catalog,
        )
    complete = [
        b
        for b in svc.catalog.backups(request.cluster)
        if b.status == BackupStatus.COMPLETE
        and (spec.from_vault is None or admission.held_by(b, spec.from_vault))
    ]
    if not complete:
        raise BackupNotFound(
            f"cluster {request.cluster!r} has no complete backup to drill.",
            fix="run a backup first ('shardvault backup CLUSTER --wait').",
        )
    recent = [b for b in complete if completed_at(b) >= now - spec.within_days * DAY]
    if not recent:
        return max(complete, key=completion_order)
    return rng.choice(sorted(recent, key=lambda b: b.backup_id))


def completed_at(record: BackupItem) -> float:
    return record.completed_at if record.completed_at is not None else record.started_at


def stale_copies(
    earlier: list[DrillItem], restore_machine: str, svc: Services
) -> tuple[list[str], list[dict[str, str]]]:
    """Earlier drills whose copies were never recorded torn down and whose executions ended,
    and the nodes to tear each copy down on (from its restore's record, under the target that
    drill used). A drill whose restore has no record was refused before its Plan: it placed
    nothing, and is stale only to be marked torn down."""
    stale, teardown = [], []
    restores: dict[str, dict[str, RestoreItem]] = {}  # by target: one query each
    for record in earlier:
        if record.torn_down_at or record.status == REFUSED:
            continue
        if drill_running(svc, record.execution_id, restore_machine, record.drill_id):
            continue  # a drill into another target, or a stopped drill's restore: still running
        stale.append(record.drill_id)
        target = record.target_cluster or ""
        if target not in restores:
            restores[target] = restores_by_name(target, svc)
        placed = restores[target].get(record.restore_execution or "")
        for node_id in sorted(set(placed.placement.values()) if placed else ()):
            item = {"node_id": node_id, "restore_id": placed.restore_id}
            teardown.append(item | {"drill_id": record.drill_id})
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
        DrillItem(
            cluster=request.cluster,
            backup_id=drill_key(drill_id),
            drill_id=drill_id,
            status=REFUSED,
            started_at=now,
            requested_by=request.requested_by,
            error=error.name,
            cause=cause,
        )
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
    nodes = sorted(set(placed.placement.values()) if placed else ())
    # A failed restore removed what it placed (its own failure path), unless that failed too:
    # the undo is safe twice, so every node the restore placed on runs it.
    teardown = [
        {"node_id": n, "restore_id": placed.restore_id, "drill_id": drill.drill_id}
        for n in nodes
        if placed
    ]
    verdict = DrillItem.changes(
        **outcome, restore_id=placed.restore_id if placed else "", nodes=nodes
    )
    svc.catalog.update(drill.cluster, drill_key(drill.drill_id), verdict)
    # A Record retried after a Lambda fault sends this again: an alarm goes out at least once,
    # never lost between its record and its send; the message's drill_id tells a duplicate.
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
        "keep_seconds": drill.keep_seconds if teardown and outcome["status"] != FAILED else 0,
        "error": outcome.get("error", ""),
        "cause": outcome.get("cause", "")[:1000],
    }


def restore_record(drill: DrillContext, svc: Services) -> RestoreItem | None:
    """The nested restore's catalog record (None: it was refused before its Plan)."""
    return restores_by_name(drill.target_cluster, svc).get(restore_name(drill.drill_id))


def restores_by_name(target: str, svc: Services) -> dict[str, RestoreItem]:
    """The restores into ``target`` by their execution's name (a drill's: ``drill-<id>``)."""
    return {r.execution_id.rpartition(":")[2]: r for r in svc.catalog.restores(target)}


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


def failed_outcome(error: dict[str, Any], placed: RestoreItem | None, now: float) -> dict[str, Any]:
    """The restore's own error and cause: its catalog record's (the failure path wrote what the
    nodes said), else the nested execution's, else the drill's."""
    name, cause = error.get("Error") or "States.Runtime", str(error.get("Cause") or "")
    try:
        nested = json.loads(cause)
    except ValueError:
        nested = None
    if isinstance(nested, dict):  # States.TaskFailed: the restore execution's description
        name, cause = nested.get("Error") or name, str(nested.get("Cause") or "")
    if placed and placed.status == BackupStatus.FAILED:
        name, cause = placed.error or name, placed.cause or cause
    return {"status": FAILED, "failed_at": now, "error": name, "cause": cause[:2000]}


def subject(drill: DrillContext, outcome: dict[str, Any]) -> str:
    verdict = outcome["status"]
    if verdict == FAILED:
        return f"ShardVault drill of {drill.cluster} FAILED ({outcome['error']})"
    rto = f"RTO {outcome['rto_seconds']:,.0f} s"
    if verdict == SLOW:
        return f"ShardVault drill of {drill.cluster} SLOW: {rto} over target"
    return f"ShardVault drill of {drill.cluster} passed: {rto}"


# --- teardown --------------------------------------------------------------------------------
def note_teardown(
    drill: DrillContext,
    phase: str,
    teardown: list[dict[str, str]],
    torn_down: list[dict[str, Any]],
    svc: Services,
    now: float,
) -> dict[str, Any]:
    """After a Teardown (or none): the drills whose copies are gone are marked torn down (the
    stale ones before the restore, this one after it); a copy a node could not tear down stays
    recorded as not torn down, for the next drill. After this drill's own, its target is free."""
    failed = {r.get("restore_id") for r in torn_down if r.get("torn_down") is False}
    asked: dict[str, set[str]] = {}
    for item in teardown:
        asked.setdefault(item["drill_id"], set()).add(item["restore_id"])
    removed, left = [], []
    for drill_id in drill.stale if phase == BEFORE else [drill.drill_id]:
        copies = asked.get(drill_id, set())
        if copies & failed or (copies and EVERY_COPY in failed):
            left.append(drill_id)
            continue
        torn = DrillItem.changes(torn_down_at=now)
        svc.catalog.update(drill.cluster, drill_key(drill_id), torn)
        removed.append(drill_id)
    if phase != BEFORE:
        svc.catalog.unlock(drill.target_cluster, drill.drill_id, key=DRILL_LOCK_KEY)
    return {"removed": removed, "left": left}
