"""Readiness: what ``shardvault check CLUSTER`` says of a cluster before its next backup.

Each *finding* is one check, passed or not, with what it saw and, when not, the fix. The
checks are the rules Validate applies (``shardvault.backup.admission``,
``shardvault.workflow.membership``) run on what the agents' registry holds now, so a check that
passes is a refusal the next backup will not meet; then what only the catalog tells: the age of the
newest complete backup against the cluster's RPO, and what its last verification found.
The engine's own readiness (``wal_level``, a free replication slot, the role's privileges, a
server that answers) is in the registry: each leader's agent checks it with every heartbeat.
Then the cluster's restore drill (``shardvault.assurance.drills``): its drill nodes ready for a
restore, and its newest drill's verdict and age. Last, what only the agents can tell: each one's
round trip to the store (``shardvault.assurance.probe``), one finding per node.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from shardvault.aws.tables import completion_order
from shardvault.backup.admission import (
    check_agents_current,
    check_engines,
    check_nodes_available,
    check_sources_readable,
    choose_sources,
)
from shardvault.backup.cuts import check_cuttable
from shardvault.config.policy import ClusterPolicy, Policy
from shardvault.contracts import engines
from shardvault.contracts.catalog import BackupItem, DrillItem
from shardvault.contracts.models import BackupStatus, Frozen, NodeRecord, Source
from shardvault.errors import ShardVaultError, UnknownCluster
from shardvault.restore.admission import check_target_nodes
from shardvault.workflow.membership import check_members


class Finding(Frozen):
    check: str
    ok: bool
    detail: str
    fix: str = ""


def findings(
    cluster: str,
    nodes: list[NodeRecord],
    records: list[BackupItem],
    policy: Policy | None,
    now: float,
    max_age: float,
) -> list[Finding]:
    """Every check of the cluster, in the order a backup meets them."""
    if not nodes:
        error = UnknownCluster(
            f"no agent has registered for cluster {cluster!r}.",
            fix=f"start the agents with 'cluster: {cluster}' in their configuration.",
        )
        return [refused("agents registered", error)]
    out = [Finding(check="agents registered", ok=True, detail=", ".join(n.node_id for n in nodes))]
    membership = attempt("membership (policy nodes)", lambda: check_members(cluster, nodes, policy))
    listed = policy is not None and cluster in policy.clusters and policy.clusters[cluster].nodes
    if membership.ok and not listed:
        membership = membership.model_copy(
            update={"detail": "no nodes list: any agent registered under the name takes part"}
        )
    out.append(membership)
    out.append(attempt("agents up", lambda: check_nodes_available(nodes, now, max_age)))
    out.append(attempt("agents current", lambda: check_agents_current(nodes)))
    out.append(attempt("engines", lambda: engines_found(cluster, nodes, policy)))
    try:
        chosen = choose_sources(nodes)
    except ShardVaultError as error:  # without sources, what they hold is not checked
        out.append(refused("one leader per shard", error))
    else:
        leaders = "; ".join(f"{s.node_id}: {', '.join(s.shard_ids)}" for s in chosen) or "none"
        out.append(Finding(check="one leader per shard", ok=True, detail=leaders))
        out.append(
            attempt(
                "shards readable, engines ready",
                lambda: check_sources_readable(nodes, chosen),
            )
        )
        out += cut_findings(cluster, nodes, chosen, policy)
    out += backup_findings(cluster, records, policy, now)
    return out


def cut_findings(
    cluster: str, nodes: list[NodeRecord], chosen: list[Source], policy: Policy | None
) -> list[Finding]:
    """Whether the policy's scheduled cuts can be taken (``backup.cuts.check_cuttable``): each
    leader archives its WAL and its agent knows the ``cut`` command. A cluster without them
    says nothing; its refused cuts would show only as failed runs."""
    declared = policy.clusters.get(cluster) if policy else None
    minutes = declared.cut.every_minutes if declared else None
    if minutes is None:
        return []
    check = f"scheduled cuts (every {minutes} min)"
    return [attempt(check, lambda: check_cuttable(cluster, nodes, chosen))]


def engines_found(cluster: str, nodes: list[NodeRecord], policy: Policy | None) -> str:
    """The engines the nodes run, as the policy allows them (``check_engines``)."""
    declared = policy.clusters.get(cluster) if policy else None
    engine = check_engines(cluster, nodes, declared)
    return engine.value if engine else "mixed: " + engines.label(n.engine for n in nodes)


def backup_findings(
    cluster: str, records: list[BackupItem], policy: Policy | None, now: float
) -> list[Finding]:
    """The newest complete backup's age against the RPO, and its last verification."""
    complete = [r for r in records if r.status == BackupStatus.COMPLETE]
    newest = max(complete, key=completion_order, default=None)
    if policy is None or cluster not in policy.clusters:
        where = (
            "no policy file was given"
            if policy is None
            else f"the policy declares {', '.join(sorted(policy.clusters)) or 'no cluster'}, "
            f"not {cluster}"
        )
        out = [
            Finding(
                check="in the policy",
                ok=False,
                detail=f"{where}: the cluster's backups run only when asked (no schedule, so no "
                "RPO to check; no vault, retention or commit pause; default upload limits)",
                fix=f"declare {cluster} under 'clusters:' in the deployment's policy, or pass "
                "that policy with --policy if it does.",
            )
        ]
    else:
        out = pause_findings(policy.clusters[cluster])
        rpo = policy.rpo_hours(cluster)
        age = (now - (newest.completed_at or 0)) / 3600 if newest else None
        out += [
            Finding(
                check=f"newest complete backup within the RPO ({rpo:g} h)",
                ok=age is not None and age <= rpo,
                detail=f"{newest.backup_id}, {age:.1f} h old" if newest else "none",
                fix=""
                if age is not None and age <= rpo
                else "run 'shardvault backup "
                f"{cluster} --wait', and 'shardvault list {cluster}' for why runs failed.",
            )
        ]
    if newest is not None:
        verified = newest.verify
        out.append(
            Finding(
                check="newest backup's last verification",
                ok=not verified or verified.result == "ok",
                detail=verified.result if verified else "never verified",
                fix=""
                if not verified or verified.result == "ok"
                else "see "
                f"'shardvault show {cluster} {newest.backup_id}' and run a new full backup.",
            )
        )
    return out


def pause_findings(cluster: ClusterPolicy) -> list[Finding]:
    """Where the cut's commit pause takes its lock (advisory locks are per database: only
    commits that take it in that database are paused), when the policy asks for one. The
    heartbeat checks the agents' grants in the database their conninfo names only; whether
    they reach this one is the probe's finding (``cut_database_findings``)."""
    if cluster.cut.commit_lock is None:
        return []
    detail = (
        f"lock {cluster.cut.commit_lock} taken in database {cluster.cut.database!r} on every "
        "PostgreSQL node at each cut, whatever database the agents' conninfo names: only "
        "commits that hold it in that database are paused; the agents' role needs CONNECT on "
        "it and EXECUTE on pg_create_restore_point(text) granted in it"
    )
    return [Finding(check="commit pause", ok=True, detail=detail)]


def attempt(check: str, run: Callable[[], Any]) -> Finding:
    """One of Validate's rules as a finding: passed, or refused with its message and fix."""
    try:
        result = run()
    except ShardVaultError as error:
        return refused(check, error)
    return Finding(check=check, ok=True, detail=str(result) if result else "ok")


def refused(check: str, error: ShardVaultError) -> Finding:
    return Finding(check=check, ok=False, detail=f"{error.name}: {error.message}", fix=error.fix)


DRILL_SLACK = 2.0  # a drill older than two of its schedule's gaps: the schedule is not running


def drill_findings(
    cluster: str,
    policy: Policy | None,
    drills: list[DrillItem],
    target: list[NodeRecord],
    now: float,
    max_age: float,
) -> list[Finding]:
    """The drill's nodes ready for its restore, and its newest drill: passed, recent enough."""
    spec = policy.clusters[cluster].drill if policy and cluster in policy.clusters else None
    if spec is None:
        return [
            Finding(
                check="restore drill",
                ok=True,
                detail="none scheduled: a drill: section restores a backup on a schedule",
            )
        ]
    nodes = f"drill nodes ready ({spec.target_cluster})"
    out = [
        attempt(
            nodes,
            lambda: check_target_nodes(spec.target_cluster, target, policy, now, max_age),
        )
    ]
    ended = [d for d in drills if d.status != "running"]
    newest = max(ended, key=lambda d: d.started_at, default=None)
    if newest is None:
        out.append(
            Finding(
                check="newest drill",
                ok=False,
                detail="never drilled",
                fix=f"run 'shardvault drill {cluster} --wait' (the schedule runs it next at its "
                "cron time).",
            )
        )
        return out
    age = (now - newest.started_at) / 3600
    status = newest.status
    rto = f", RTO {newest.rto_seconds:,.0f} s" if newest.rto_seconds is not None else ""
    detail = f"{newest.drill_id}: {status}{rto}, {age:.1f} h ago"
    if status != "passed":
        why = f"{newest.error or ''} {newest.cause or ''}".strip()
        fix = f"see 'shardvault drills {cluster}'" + (f": {why}" if why else "")
        out.append(Finding(check="newest drill", ok=False, detail=detail, fix=fix))
    elif age > DRILL_SLACK * spec.longest_gap_hours():
        fix = "check the drill's schedule (and its dead-letter alarm), then 'shardvault drill "
        out.append(
            Finding(check="newest drill", ok=False, detail=detail, fix=fix + f"{cluster} --wait'.")
        )
    else:
        out.append(Finding(check="newest drill", ok=True, detail=detail))
    return out


ROUND_TRIP = "store round trip"


def probe_findings(progress: Any) -> list[Finding]:
    """One finding per probed node, from the probe state machine's run (``progress``: an
    ``operations.Progress``); one failed finding when the probe itself could not run."""
    if progress.status != "SUCCEEDED":
        return [
            Finding(
                check=ROUND_TRIP,
                ok=False,
                detail=f"{progress.error or progress.status}: {progress.cause}",
                fix="see the error; 'shardvault check --no-probe' checks the rest meanwhile.",
            )
        ]
    out = [copy_finding(target) for target in (progress.record or {}).get("targets", [])]
    for node in (progress.record or {}).get("nodes", []):
        check = f"{ROUND_TRIP} ({node['node_id']})"
        if node["ok"]:
            detail = f"put {node['put_seconds']:.2f} s, read back {node['get_seconds']:.2f} s"
            out.append(Finding(check=check, ok=True, detail=detail))
            out += cut_database_findings(node)
            continue
        out.append(
            Finding(
                check=check,
                ok=False,
                detail=f"{node['error']}: {node['cause']}",
                fix="check the node's path to the store (DNS, proxy, firewall, TLS trust) and "
                "its agent's log, which names each failed try.",
            )
        )
    return out


COPY_TARGET = "vault copy target"


def copy_finding(target: dict[str, Any]) -> Finding:
    """A copy target as the probe found it: a probe object put and read back, or why not."""
    check = f"{COPY_TARGET} {target['name']}"
    if target["ok"]:
        return Finding(check=check, ok=True, detail=target["detail"])
    return Finding(
        check=check,
        ok=False,
        detail=target["detail"],
        fix="GCS: check the bucket (created with object retention), the workload identity "
        "provider and the custom role bound on it; account B: the bucket (Object Lock), the "
        "role's trust policy and external ID, and the policies shardvault copy-setup prints "
        "(docs/guide/vault-copies.md); until then each backup is promoted PARTIAL.",
    )


PAUSE_DATABASE = "commit pause database"


def cut_database_findings(node: dict[str, Any]) -> list[Finding]:
    """What a probed node found of the policy's ``cut.database`` (when the probe asked: a
    commit pause is set): whether each PostgreSQL shard it leads can run the paused cut
    there (connect to it on the shard's instance, create the restore point: function
    grants are per database). Each problem names the database and its fix."""
    found = node.get("cut_database")
    if not found:
        return []
    check = f"{PAUSE_DATABASE} ({node['node_id']})"
    database, problems = found.get("database"), found.get("problems") or []
    if not problems:
        detail = f"the cut can take its lock and create its restore point in {database!r}"
        return [Finding(check=check, ok=True, detail=detail)]
    return [
        Finding(
            check=check,
            ok=False,
            detail="; ".join(p["message"] for p in problems),
            fix=" ".join(p["fix"] for p in problems),
        )
    ]


def probe_not_run() -> Finding:
    return Finding(
        check=ROUND_TRIP,
        ok=False,
        detail="not tried: SHARDVAULT_PROBE_STATE_MACHINE_ARN is not set",
        fix="set it from the stack's ProbeStateMachineArn output (or pass --stack-env for the "
        "local stack), or pass --no-probe to check the rest.",
    )
