"""Scheduled cuts: the cluster's cut (``shardvault.contracts.cut``) taken on its own, with no
backup, every few minutes, so that a restore can stop every node at one consistent moment
between backups.

Terms:
- *scheduled cut*: the policy's ``cut.every_minutes`` starts the cut state machine
  (``statemachines/cut.asl.json``) at the clock's multiples of that period; ``shardvault cut``
  starts it by hand. ``plan`` picks the shards' leaders and names the cut; each node's agent
  creates the restore point of that name on its shards at the cut instant (the Aim state's
  entry, just before the Cut map, plus the margin, as a backup's Stop counts it), inside the
  commit pause when the policy asks for one, and answers once the point is on disk;
  ``record`` writes the cut's catalog item (``CutItem``): complete when every node answered,
  failed (with the node and its cause) otherwise.
- *cut id*: the restore point's name, ``cut-<UTC second>-<random>`` (``contracts.models``):
  the plan's second, so cut items sort by time (``Catalog.cuts_before``).
- *restorable*: a cut can be restored to once every shard's WAL archive holds the segment its
  point lies in (``cut_wal``): PostgreSQL closes a segment at ``archive_timeout`` at the
  latest, so a cut becomes restorable within that and the archive's ``max_delay_seconds``.
  A cut needs a base: a complete backup that completed before its instant.
- *best-effort*: a cut asked to pause the commits (``cut.commit_lock``) that did not hold the
  pause on every node at one moment; its restore is allowed, and warned about.

A cut item lives as long as the WAL archive can reach it: the daily sweep deletes the items
of cuts older than the base the kept archive starts from (``lifecycle.sweep.forget_cuts``).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from shardvault.aws.services import Services
from shardvault.aws.tables import Catalog, completion_order
from shardvault.backup.admission import (
    check_nodes_available,
    check_sources_readable,
    choose_sources,
    cluster_policy,
)
from shardvault.contracts import cut as contract
from shardvault.contracts.catalog import BackupItem, CutItem, CutShardPoint, cut_key
from shardvault.contracts.commands import CutAnswer, parse_result
from shardvault.contracts.engines import traits
from shardvault.contracts.models import (
    BackupStatus,
    ClusterName,
    Frozen,
    Manifest,
    NodeRecord,
    RestoreRequest,
    RestoreTarget,
    is_cut_id,
    new_cut_id,
)
from shardvault.errors import (
    AgentOutdated,
    InvalidRequest,
    TargetOutOfRange,
    TargetUnsupported,
    UnknownCluster,
)
from shardvault.wal.archive import ShardArchive
from shardvault.wal.pitr import refuse_target_kind, when
from shardvault.workflow import fanout
from shardvault.workflow.causes import failure_cause
from shardvault.workflow.membership import check_members

# The agent protocol that knows the ``cut`` command (shardvault_agent.PROTOCOL). Only a cut
# needs it: backups and restores still accept agents of the protocol before.
CUT_PROTOCOL = 7


class CutClusterRequest(Frozen):
    """The cut state machine's input: from the schedule, ``shardvault cut`` or a test."""

    cluster: ClusterName
    requested_by: str = "cli"


class CutStep(Frozen):
    """The cut function's input: ``plan`` from the request, ``record`` with the nodes'
    answers."""

    phase: Literal["plan", "record"]
    request: dict[str, Any] = {}
    execution_id: str = ""
    plan: dict[str, Any] = {}
    results: list[dict[str, Any]] = []


# --- plan --------------------------------------------------------------------------------------
def plan(request: CutClusterRequest, svc: Services, now: float) -> dict[str, Any]:
    """The cut's id, its nodes (each shard's leader) and how they cut; refuses by name, before
    any side effect, a cluster whose shards cannot make a restore point a restore reaches."""
    nodes = svc.nodes.in_cluster(request.cluster)
    if not nodes:
        raise UnknownCluster(
            f"no agent has registered for cluster {request.cluster!r}.",
            fix="check the cluster name, or start the cluster's agents.",
        )
    check_members(request.cluster, nodes, svc.policy())
    check_nodes_available(nodes, now, svc.settings.heartbeat_max_age_seconds)
    sources = choose_sources(nodes)
    check_sources_readable(nodes, sources)
    check_cuttable(request.cluster, nodes, sources)
    policy = cluster_policy(request.cluster, svc)
    cut_id = new_cut_id(now)
    return {
        "cut_id": cut_id,
        "nodes": [{"node_id": s.node_id, "shard_ids": s.shard_ids} for s in sources],
        "margin_seconds": contract.cut_margin_seconds(len(sources)),
        "commit_lock": policy.cut.commit_lock if policy else None,
        "database": policy.cut.database if policy else None,
    }


def check_cuttable(cluster: str, nodes: list[NodeRecord], sources: list[Any]) -> None:
    """Every source runs an engine with restore points, archives its WAL (a cut the archive
    never holds can never be restored to) and knows the ``cut`` command."""
    if not sources:
        raise InvalidRequest(
            f"the agents of cluster {cluster!r} hold no shards: there is nothing to cut.",
            fix="list the node's databases under 'shards' in each agent's configuration.",
        )
    by_id = {n.node_id: n for n in nodes}
    chosen = [by_id[s.node_id] for s in sources]
    if pointless := [n for n in chosen if "name" not in traits(n.engine).targets]:
        raise TargetUnsupported(
            f"node(s) {', '.join(f'{n.node_id} ({n.engine})' for n in pointless)} of cluster "
            f"{cluster!r} run an engine that makes no restore point: a cut cannot name a "
            "moment of theirs.",
            fix="remove cut.every_minutes for this cluster; restore its backups, or a time.",
        )
    unarchived = [
        f"{n.node_id}/{shard.shard_id}"
        for n, source in zip(chosen, sources, strict=True)
        for shard in n.shards
        if shard.shard_id in source.shard_ids and shard.wal_spool_bytes is None
    ]
    if unarchived:
        raise TargetUnsupported(
            f"shard(s) {', '.join(unarchived)} of cluster {cluster!r} archive no WAL: a cut "
            "there could never be restored to.",
            fix="set up continuous archiving on those shards (docs/guide/wal-archiving.md), "
            "then cut again.",
        )
    if old := [n for n in chosen if n.protocol < CUT_PROTOCOL]:
        raise AgentOutdated(
            "agents too old to take a scheduled cut: "
            + ", ".join(f"{n.node_id} (agent {n.version}, protocol {n.protocol})" for n in old)
            + f"; a cut needs agent protocol {CUT_PROTOCOL}.",
            fix="upgrade shardvault-agent on each node listed (docs/guide/upgrading.md), then "
            "cut again. Backups and restores still run on them meanwhile.",
        )


# --- record ------------------------------------------------------------------------------------
def record(step: CutStep, svc: Services, now: float) -> dict[str, Any]:
    """Writes the cut's catalog item from the nodes' answers and returns it as a row; a node's
    failure is recorded (the item says which node, and why), then raised: the execution fails,
    and its alarm says so."""
    request = CutClusterRequest.model_validate(step.request)
    cut_id = str(step.plan["cut_id"])
    failed = [r for r in step.results if r.get("error")]
    base = {
        "cluster": request.cluster,
        "backup_id": cut_key(cut_id),
        "cut_id": cut_id,
        "requested_by": request.requested_by,
        "execution_id": step.execution_id,
        "instant": instant_of(step.plan),
        "commit_lock": step.plan.get("commit_lock"),
        "database": step.plan.get("database"),
        "nodes": [str(r.get("node_id")) for r in step.results],
        "completed_at": now,
    }
    if failed:
        node_id, error = str(failed[0].get("node_id")), failed[0]["error"]
        cause = failure_cause(error, svc, cut_id, [node_id])
        svc.catalog.put(
            CutItem(**base, status="failed", error=f"{node_id}: {error.get('Error')}", cause=cause)
        )
        fanout.raise_first_failure(step.results)
    answers = [parse_result(CutAnswer, str(r.get("node_id")), r) for r in step.results]
    markers = [(s.shard_id, s.marker) for a in answers for s in a.shards]
    points = {
        s.shard_id: point_of(a.node_id, s.shard_id, s.marker) for a in answers for s in a.shards
    }
    summary = contract.summary(markers, cut_id)  # its name is the item's; its shards, listed
    kept = {k: v for k, v in summary.items() if k not in ("cut_name", "cut_shards")}
    item = CutItem(**base, status="complete", shards=points, **kept)
    svc.catalog.put(item)
    return item.model_dump(mode="json", exclude_none=True)


def instant_of(plan: dict[str, Any]) -> float:
    """The cut's instant: the Aim state's entry (``entered``) plus the plan's margin."""
    request = contract.CutRequest(
        name=str(plan["cut_id"]),
        entered=str(plan["entered"]),
        margin_seconds=float(plan.get("margin_seconds") or 0.0),
    )
    return round(request.at, 6)


def point_of(node_id: str, shard_id: str, marker: dict[str, str]) -> CutShardPoint:
    """A shard's restore point from its agent's marker; one without the fields an agent of
    this version sends is refused by name."""
    try:
        return CutShardPoint(
            node_id=node_id,
            lsn=marker["cut_lsn"],
            wal=marker["cut_wal"],
            at=float(marker["cut_at"]),
            late_seconds=float(marker.get("cut_late_seconds", 0)),
        )
    except (KeyError, ValueError) as error:
        raise InvalidRequest(
            f"node {node_id} answered the cut for shard {shard_id} without {error}.",
            fix="run one ShardVault version on the agents and the control plane.",
        ) from None


# --- restore to a cut ----------------------------------------------------------------------------
def resolve(catalog: Catalog, cluster: str, target: RestoreTarget) -> CutItem | None:
    """The scheduled cut a restore target names: ``cut``, or the newest complete cut at or
    before ``cut_before`` that is not best-effort; a ``name`` target is a cut when the catalog
    holds a cut of that name (None: an operator's own restore point, or any other target).
    Refused by name: no such cut, a failed one, none before the time."""
    if target.name is not None:
        return catalog.cut(cluster, target.name) if is_cut_id(target.name) else None
    if target.cut is not None:
        return named(catalog, cluster, target.cut)
    if target.cut_before is not None:
        return newest_before(catalog, cluster, target.cut_before)
    return None


def named(catalog: Catalog, cluster: str, cut_id: str) -> CutItem:
    cut = catalog.cut(cluster, cut_id)
    if cut is None:
        raise TargetOutOfRange(
            f"cluster {cluster!r} has no scheduled cut {cut_id!r}.",
            fix=f"shardvault cuts {cluster} lists its cuts (a cut older than the WAL archive's "
            "oldest base is forgotten).",
        )
    if cut.status != "complete":
        raise TargetOutOfRange(
            f"cut {cut_id} of cluster {cluster!r} failed ({cut.error}): not every node made "
            "its restore point.",
            fix=f"choose another cut (shardvault cuts {cluster}).",
        )
    return cut


def newest_before(catalog: Catalog, cluster: str, limit: datetime) -> CutItem:
    """The newest complete cut whose instant is at or before ``limit`` and that is not
    best-effort (read from ``limit`` back, ``Catalog.cuts_before``)."""
    skipped = 0
    for cut in catalog.cuts_before(cluster, limit.timestamp()):
        if cut.status != "complete" or cut.instant > limit.timestamp():
            continue
        if not cut.best_effort:
            return cut
        skipped += 1
    paused = f" that paused its commits ({skipped} best-effort skipped)" if skipped else ""
    raise TargetOutOfRange(
        f"cluster {cluster!r} has no complete cut at or before {limit.isoformat()}{paused}.",
        fix=f"shardvault cuts {cluster} lists its cuts; name one with --target-cut, or choose "
        "a later time.",
    )


def base_for(cut: CutItem, request: RestoreRequest, backups: list[BackupItem]) -> BackupItem:
    """The backup a restore to ``cut`` (``request``'s target, by its name) starts from: the
    newest complete one that completed before the cut's instant (its own cut, and the end of
    its copy, lie before it), or the one the request names if it did."""
    backup_id = request.backup_id
    complete = [b for b in backups if b.status == BackupStatus.COMPLETE]
    refuse_target_kind(request, complete)  # a cluster whose engine has no restore points
    before = [b for b in complete if (b.completed_at or 0) <= cut.instant]
    if backup_id != "latest":
        before = [b for b in before if b.backup_id == backup_id]
    if not before:
        which = "" if backup_id == "latest" else f" {backup_id}"
        raise TargetOutOfRange(
            f"cluster {cut.cluster!r} has no complete backup{which} that completed before cut "
            f"{cut.cut_id} ({when(cut.instant)}).",
            fix="choose a later cut (shardvault cuts lists them), or restore a backup.",
        )
    return max(before, key=completion_order)


def check_reached(cut: CutItem, manifest: Manifest, found: list[ShardArchive]) -> None:
    """Every shard of the base has its restore point of the cut, and its WAL archive holds
    the segment that point lies in; refused by name otherwise (before anything is written)."""
    if missing := [s.shard_id for s in manifest.shards if s.shard_id not in cut.shards]:
        raise TargetOutOfRange(
            f"cut {cut.cut_id} has no restore point on shard(s) {', '.join(missing)} of "
            f"backup {manifest.backup_id} (shards added after the cut).",
            fix="choose a later cut (shardvault cuts lists them).",
        )
    for archive in found:
        refuse_unarchived(cut, archive, cut.shards[archive.shard_id])


def refuse_unarchived(cut: CutItem, archive: ShardArchive, point: CutShardPoint) -> None:
    """The shard's archive runs without a gap to the segment of its restore point, or the
    refusal says why: a gap before it (waiting will not help), or not yet (it will)."""
    if archive.holds(point.wal):
        return
    if archive.holds_past_a_gap(point.wal):
        raise TargetOutOfRange(
            f"cut {cut.cut_id} is past a gap in shard {archive.shard_id}'s WAL archive: it runs "
            f"without a gap only to {archive.last}, and the point is in {point.wal}.",
            fix="restore to an earlier cut; cuts after the next backup are reached from it.",
        )
    runs = f"runs to {archive.last}" if archive.last else f"holds nothing from {archive.first} on"
    raise TargetOutOfRange(
        f"cut {cut.cut_id} is not archived yet: shard {archive.shard_id}'s restore point is in "
        f"WAL segment {point.wal}, and its archive {runs}.",
        fix="wait: PostgreSQL closes that segment within its archive_timeout, and the agent "
        "archives it within the policy's archive.max_delay_seconds.",
    )
