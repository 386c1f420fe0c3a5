"""Validate: the backup workflow's first step, before any side effect.

It checks a request against the registry of agents (every node up, one engine, one leader per
shard, each shard's data readable) and against the policy file (vault, part size, upload
limits), then takes the cluster's lock and records the backup as RUNNING with the context each
later step receives. Bad input is refused with a named error before the lock is taken.

Terms:
- *source*: a node and the shards a backup reads from it (each shard's leader).
- *lock*: the catalog's per-cluster lock: one backup of a cluster runs at a time. A lock whose
  execution has ended is taken over once what it left is cleaned up
  (``cleanup.clean_up_abandoned``).
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from shardvault.aws.keys import new_data_key
from shardvault.aws.services import Services
from shardvault.aws.tables import NodeRegistry
from shardvault.backup.failure import TAKEN_OVER, clean_up_abandoned, recorded_context
from shardvault.config.policy import ClusterPolicy, Incremental, Upload
from shardvault.contracts import engines
from shardvault.contracts.catalog import BackupItem
from shardvault.contracts.cut import cut_margin_seconds
from shardvault.contracts.models import (
    AGENT_PROTOCOL,
    BackupContext,
    BackupKind,
    BackupRequest,
    BackupStatus,
    ChainLink,
    Compression,
    Encryption,
    Engine,
    NodeRecord,
    Role,
    Source,
    UploadLimits,
    VaultRequest,
    VaultTarget,
    lock_strength,
    new_backup_id,
)
from shardvault.data.planning import MiB, check_part_size
from shardvault.errors import (
    AgentOutdated,
    AgentUnavailable,
    BackupAlreadyRunning,
    EngineMismatch,
    InvalidRequest,
    MixedEngines,
    NoShards,
    ParentUnavailable,
    ShardDataMissing,
    ShardNotReady,
    ShardWithManyLeaders,
    ShardWithoutLeader,
    UnknownCluster,
)
from shardvault.lifecycle import costs
from shardvault.lifecycle.lifetimes import backup_class
from shardvault.workflow.membership import check_members

RUNNING_EXECUTION = "RUNNING"


def registered_nodes(registry: NodeRegistry, cluster: str) -> list[NodeRecord]:
    """The cluster's registered nodes; none is ``UnknownCluster``, naming those there are."""
    nodes = registry.in_cluster(cluster)
    if not nodes:
        known = ", ".join(registry.clusters()) or "none"
        raise UnknownCluster(
            f"no agent has registered for cluster {cluster!r} (registered clusters: {known}).",
            fix=f"check the cluster name, or start the agents with 'cluster: {cluster}' in "
            "their configuration.",
        )
    return nodes


def validate(request: BackupRequest, svc: Services, now: float) -> BackupContext:
    """Checks the request against the registry and takes the cluster's lock, or raises a named
    error before any side effect."""
    if request.part_size is not None:
        check_part_size(request.part_size)
    nodes = registered_nodes(svc.nodes, request.cluster)
    check_members(request.cluster, nodes, svc.policy())
    check_nodes_available(nodes, now, svc.settings.heartbeat_max_age_seconds)
    check_agents_current(nodes)
    policy = cluster_policy(request.cluster, svc)  # read once: it is parsed at each read
    engine = check_engines(request.cluster, nodes, policy)
    sources = choose_sources(nodes)
    check_sources_readable(nodes, sources)
    if not sources:
        raise NoShards(
            f"the agents of cluster {request.cluster!r} ("
            + ", ".join(n.node_id for n in nodes)
            + ") hold no shards: a backup would hold nothing.",
            fix="list the node's databases under 'shards' in each agent's configuration (a "
            "restore target holds the shards it restored once the restore has finished).",
        )
    vault = vault_target(request, svc, policy)
    kind, chain, parent = chain_for(request, svc, policy, vault)  # refused before the lock
    synthesis = synthesis_for(request, svc, policy, vault) if kind == BackupKind.FULL else None
    if isinstance(synthesis, Synthesis):
        chain, parent = synthesis.link, synthesis.parent
    vault = lifetime_vault(vault, request, svc, policy, kind, now)
    candidate = new_backup_id(now)
    encryption = chain_key(parent) if chain else data_key(policy, svc, request.cluster, candidate)
    backup_id = take_lock(svc, request, candidate)
    if encryption and not chain and backup_id != candidate:  # our earlier attempt's lock
        encryption = data_key(policy, svc, request.cluster, backup_id)
    context = BackupContext(
        backup_id=backup_id,
        cluster=request.cluster,
        engine=engine,
        sources=sources,
        store_url=svc.settings.store_url,
        started_at=now,
        part_size=request.part_size or policy_part_size(policy),
        execution_id=request.execution_id,
        vault=vault,
        upload=upload_limits(policy),
        compression=policy.compression if policy else Compression(),
        encryption=encryption,
        kind=kind,
        chain=chain,
        synthesized=isinstance(synthesis, Synthesis),
        cut_margin_seconds=cut_margin_seconds(len(sources)),
        cut_commit_lock=policy.cut.commit_lock if policy else None,
        cut_commit_database=policy.cut.database if policy else None,
    )
    svc.catalog.put(
        BackupItem(
            cluster=context.cluster,
            backup_id=backup_id,
            status=BackupStatus.RUNNING,
            engine=engines.label(s.engine for s in sources if s.engine),
            started_at=now,
            execution_id=request.execution_id,
            requested_by=request.requested_by,
            nodes=[s.node_id for s in sources],
            shards=sorted(sh for s in sources for sh in s.shard_ids),
            kind=kind,
            **(
                synthesis.fields(backup_id)
                if isinstance(synthesis, Synthesis)
                else chain_fields(chain, backup_id) | {"full_reason": synthesis}
            ),
            # What the reaper needs to clean up after an execution that never reached Cleanup.
            context=context.model_dump_json(),
        )
    )
    return context


# Block maps (what an incremental compares with) exist from this manifest format on.
INCREMENTAL_FORMAT = 3


def chain_for(
    request: BackupRequest,
    svc: Services,
    cluster: ClusterPolicy | None,
    vault: VaultTarget | None = None,
) -> tuple[BackupKind, ChainLink | None, BackupItem | None]:
    """Whether the backup is a full or an incremental, and of which parent (its record).

    An incremental continues the cluster's newest complete backup; one that goes to the vault
    continues it only once that backup is in the vault too (the vault copy of an incremental
    is restored with its ancestors' vault copies, whose locks its promotion extends). A full
    is made instead
    when the chain already holds ``incremental.max_chain`` incrementals, and, when the policy
    says ``when_parent_unavailable: full``, when there is no usable parent; otherwise that
    is ``ParentUnavailable``, before any side effect."""
    if not request.incremental:
        return BackupKind.FULL, None, None
    settings = cluster.incremental if cluster else Incremental()
    parent, problem = usable_parent(request.cluster, svc, to_vault=vault is not None)
    if parent is None or problem:
        if settings.when_parent_unavailable == "full":
            return BackupKind.FULL, None, None
        raise ParentUnavailable(
            f"an incremental of cluster {request.cluster!r} has no parent: {problem}.",
            fix="run a full backup first (omit --incremental), or set "
            "incremental.when_parent_unavailable: full in the policy file.",
        )
    depth = parent.depth + 1
    if depth > settings.max_chain:
        return BackupKind.FULL, None, None
    link = ChainLink(
        parent_id=parent.backup_id,
        root_id=parent.chain_root or parent.backup_id,
        depth=depth,
        ancestors=[*parent.ancestors, parent.backup_id],
    )
    return BackupKind.INCREMENTAL, link, parent


def usable_parent(
    cluster: str, svc: Services, *, to_vault: bool = False
) -> tuple[BackupItem | None, str]:
    """The cluster's newest complete backup and, if it cannot be continued, why."""
    parent = svc.catalog.newest_backup(cluster, BackupStatus.COMPLETE)
    if parent is None:
        return None, "the cluster has no complete backup (failed and expired ones do not count)"
    if (parent.format or 1) < INCREMENTAL_FORMAT:
        return parent, f"its newest backup {parent.backup_id} was made before block maps"
    if to_vault and parent.location != "vault":
        state = "failed" if parent.promotion == "FAILED" else "has not finished"
        return parent, (
            f"its newest backup {parent.backup_id} is not in the vault (its promotion "
            f"{state}), and an incremental's vault copy needs its whole chain there"
        )
    return parent, ""


@dataclass(frozen=True)
class Synthesis:
    """A full synthesized from the chain of ``parent`` (``shardvault.backup.synthesis``): the
    node scans against ``link`` as an incremental would; ``in_row`` counts this full among
    the synthesized ones since the last read full."""

    link: ChainLink
    parent: BackupItem
    in_row: int

    def fields(self, backup_id: str) -> dict[str, Any]:
        """Its catalog record's chain fields: a full, its own root."""
        return {
            "depth": 0,
            "chain_root": backup_id,
            "ancestors": [],
            "synthesized_from": self.parent.backup_id,
            "synthesized_in_row": self.in_row,
        }


def synthesis_for(
    request: BackupRequest, svc: Services, cluster: ClusterPolicy | None, vault: VaultTarget | None
) -> Synthesis | str | None:
    """How a full is made: a ``Synthesis`` when the policy synthesizes fulls
    (``incremental.synthesized_fulls``) and the cluster's chain can be copied; otherwise None
    (the policy reads every full, or the request asked for a read full) or why the full is
    read after all, for its record."""
    settings = cluster.incremental if cluster else Incremental()
    if settings.synthesized_fulls == 0 or request.read_full:
        return None
    parent, problem = usable_parent(request.cluster, svc, to_vault=vault is not None)
    if parent is None or problem:
        return f"no chain to synthesize from: {problem}"
    root = parent
    if parent.chain_root and parent.chain_root != parent.backup_id:
        root = svc.catalog.get(request.cluster, parent.chain_root) or parent
    if root.synthesized_in_row >= settings.synthesized_fulls:
        return (
            f"{root.synthesized_in_row} full(s) in a row were synthesized "
            "(incremental.synthesized_fulls): this one is read"
        )
    for backup_id in [*parent.ancestors, parent.backup_id]:
        member = (
            parent if backup_id == parent.backup_id else svc.catalog.get(request.cluster, backup_id)
        )
        if member is None or (member.location == "vault" and not member.staging_kept):
            return f"backup {backup_id} of the chain has no staging copy in the store to copy"
    link = ChainLink(
        parent_id=parent.backup_id,
        root_id=root.backup_id,
        depth=parent.depth + 1,
        ancestors=[*parent.ancestors, parent.backup_id],
    )
    return Synthesis(link, parent, root.synthesized_in_row + 1)


def chain_fields(chain: ChainLink | None, backup_id: str) -> dict[str, Any]:
    """A backup's place in its chain, in its catalog record (what retention keeps together
    and what the next incremental continues)."""
    if chain is None:
        return {"depth": 0, "chain_root": backup_id, "ancestors": []}
    return {
        "parent_id": chain.parent_id,
        "depth": chain.depth,
        "chain_root": chain.root_id,
        "ancestors": chain.ancestors,
    }


def chain_key(parent: BackupItem | None) -> Encryption | None:
    """An incremental is sealed under its chain's data key: the parent's (wrapped)."""
    context = recorded_context(parent) if parent else None
    if context is None or context.encryption is None:
        return None  # an unencrypted chain stays so until its next full
    return context.encryption.model_copy(update={"key_check": None})


def data_key(
    cluster: ClusterPolicy | None, svc: Services, name: str, chain_id: str
) -> Encryption | None:
    """A new wrapped data key when the policy encrypts the cluster (every backup starts its
    own chain until incrementals continue one); None otherwise."""
    if cluster is None or cluster.encryption != "kms":
        return None
    return new_data_key(svc, name, chain_id)


def check_engines(
    cluster: str, nodes: list[NodeRecord], policy: ClusterPolicy | None
) -> Engine | None:
    """The cluster's engine, or None for a cluster the policy lets mix engines. Refuses nodes
    whose engine the policy does not name (``EngineMismatch``), and nodes of several engines
    unless the policy lists them (``MixedEngines``)."""
    running = {n.engine for n in nodes}
    allowed = policy.engines if policy else None
    if allowed and (strays := [n for n in nodes if n.engine not in allowed]):
        raise EngineMismatch(
            f"the policy declares cluster {cluster!r} as {engines.label(allowed)}, but node(s) "
            + ", ".join(f"{n.node_id} ({n.engine})" for n in strays)
            + " run another engine.",
            fix="correct the engine in those agents' configuration, or the cluster's engine in "
            "the policy file (a list, e.g. [postgres, rocksdb], lets its nodes mix engines).",
        )
    if len(running) > 1 and not (allowed and len(allowed) > 1):
        raise MixedEngines(
            f"nodes of cluster {cluster!r} report different engines: "
            + ", ".join(f"{n.node_id}={n.engine}" for n in nodes)
            + ".",
            fix="give each engine its own cluster name in the agents' configuration, or list "
            f"the engines in the policy file (clusters.{cluster}.engine: "
            f"[{', '.join(sorted(e.value for e in running))}]) to back them up as one cluster.",
        )
    return next(iter(running)) if len(running) == 1 else None


def cluster_policy(cluster: str, svc: Services) -> ClusterPolicy | None:
    """The cluster's entry in the deployment's policy file (None: no file, or no entry)."""
    policy = svc.policy()
    return policy.clusters.get(cluster) if policy else None


def policy_part_size(cluster: ClusterPolicy | None) -> int | None:
    """The cluster's ``upload.part_size_mib`` from the policy file, in bytes (checked there)."""
    mib = cluster.upload.part_size_mib if cluster else None
    return mib * MiB if mib else None


def upload_limits(cluster: ClusterPolicy | None) -> UploadLimits:
    """The cluster's ``upload`` rate limit, parallelism and throttle, for its agents; a
    cluster the policy does not name gets the policy's defaults, its throttle's floor among
    them (an adaptive backup never falls below it)."""
    upload = cluster.upload if cluster is not None else Upload()
    rate = upload.rate_limit_mib_per_second
    return UploadLimits(
        rate_limit_bytes_per_second=max(1, round(rate * MiB)) if rate else None,
        parallelism=upload.parallelism,
        throttle=upload.throttle,
        throttle_window_seconds=upload.throttle_window_minutes * 60,
        throttle_floor_bytes_per_second=max(1, round(upload.throttle_floor_mib_per_second * MiB)),
        max_held_log_bytes=upload.max_held_wal_mib * MiB if upload.max_held_wal_mib else None,
        min_source_free_percent=upload.min_source_free_percent,
    )


def vault_target(
    request: BackupRequest, svc: Services, cluster: ClusterPolicy | None
) -> VaultTarget | None:
    """Where the backup is promoted once verified; None: it stays in the store.

    - The deployment has no vault bucket: None, and a request naming a vault is refused.
    - The policy names the cluster: its vault, which the request's ``vault`` may make stricter
      but never weaker: a lock mode at least as strict (COMPLIANCE over GOVERNANCE), at least
      as many days, and the same storage class. The class is not protection (every vault class
      keeps the same durability) but cost and restore time, which the cluster's budget and
      forecasts assume, so a request may only repeat it. A weaker field is refused by name,
      never silently raised to the policy's.
    - The policy does not name the cluster: a request may opt in with its own target (fields
      it leaves out take ``VaultTarget``'s defaults). It is still locked: ``VaultRequest``
      admits only GOVERNANCE or COMPLIANCE and at least one day.
    """
    if svc.vault is None:
        if request.vault is not None:
            raise InvalidRequest(
                "the request names a vault, but this deployment has none.",
                fix="remove 'vault' from the request, or deploy with a vault bucket.",
            )
        return None
    policy = policy_vault(cluster)
    if request.vault is None:
        return policy
    asked = request.vault.model_dump(exclude_none=True)
    if policy is None:
        return VaultTarget(**asked)
    check_not_weaker(request.vault, policy, request.cluster)
    return policy.model_copy(update=asked)


def lifetime_vault(
    vault: VaultTarget | None,
    request: BackupRequest,
    svc: Services,
    cluster: ClusterPolicy | None,
    kind: BackupKind,
    now: float,
) -> VaultTarget | None:
    """The vault target in the backup's lifetime class (``lifetimes.backup_class``): the class
    that costs least for how long the cluster's retention will keep a backup made now, at the
    size the catalog measured for this kind (the newest full; an incremental, the median
    share of its full). The policy's class stands when the policy forces it
    (``class_by_lifetime: false``), when the request names it, and while the cluster has no
    measured full to size the choice by."""
    if vault is None or cluster is None or not cluster.vault.class_by_lifetime:
        return vault
    if request.vault is not None and request.vault.storage_class is not None:
        return vault
    measured = costs.measured_sizes(svc.catalog.backups(request.cluster), request.cluster)
    if measured is None:
        return vault
    size = measured.full_bytes
    if kind == BackupKind.INCREMENTAL and measured.incremental_share is not None:
        size = round(size * measured.incremental_share)
    made = datetime.fromtimestamp(now, UTC)
    chosen = backup_class(cluster, made, max(size, 1), lock_days=vault.lock_days)
    return vault.model_copy(update={"storage_class": chosen})


def policy_vault(cluster: ClusterPolicy | None) -> VaultTarget | None:
    """The cluster's vault in the policy file (None: the policy does not name the cluster)."""
    if cluster is None:
        return None
    return VaultTarget(
        storage_class=cluster.vault.storage_class,
        lock_mode=cluster.vault.object_lock.mode,
        lock_days=cluster.vault.object_lock.days,
    )


def check_not_weaker(asked: VaultRequest, policy: VaultTarget, cluster: str) -> None:
    """Refuses, by field, a request that would weaken the policy's vault for ``cluster``."""
    where = f"the policy's vault for cluster {cluster!r}"
    if asked.storage_class is not None and asked.storage_class != policy.storage_class:
        raise InvalidRequest(
            f"vault.storage_class {asked.storage_class} differs from {where}, which "
            f"requires {policy.storage_class}.",
            fix=f"write {policy.storage_class} or leave storage_class out (a request cannot "
            "change the vault's class), or change the cluster's class in the policy file.",
        )
    if asked.lock_mode is not None and lock_strength(asked.lock_mode) < lock_strength(
        policy.lock_mode
    ):
        raise InvalidRequest(
            f"vault.lock_mode {asked.lock_mode} is weaker than {where}, which requires "
            f"{policy.lock_mode}.",
            fix=f"ask for {policy.lock_mode} or leave lock_mode out.",
        )
    if asked.lock_days is not None and asked.lock_days < policy.lock_days:
        raise InvalidRequest(
            f"vault.lock_days {asked.lock_days} is shorter than {where}, which requires "
            f"at least {policy.lock_days} days.",
            fix=f"ask for {policy.lock_days} days or more, or leave lock_days out.",
        )


def check_nodes_available(nodes: list[NodeRecord], now: float, max_age: float) -> None:
    """Every registered node must be up: a silent node's leadership claims may be stale."""
    problems = []
    for node in nodes:
        age = now - node.heartbeat_at
        if node.status != "up":
            problems.append(f"{node.node_id} (agent {node.status} {age:.0f} s ago)")
        elif node.is_silent(now, max_age):
            problems.append(f"{node.node_id} (silent for {age:.0f} s)")
    if problems:
        raise AgentUnavailable(
            "agents unavailable: " + ", ".join(problems) + ".",
            fix="start or restart the agent on each node listed (shardvault-agent run), or "
            "forget a decommissioned node with 'shardvault nodes --remove NODE_ID'.",
        )


def check_agents_current(nodes: list[NodeRecord]) -> None:
    """Every node's agent speaks the protocol this control plane needs: an older one would
    fail a command mid-backup (an object sent by one PUT, say) instead of being refused."""
    outdated = [
        f"{n.node_id} (agent {n.version}, protocol {n.protocol})" for n in nodes if n.is_outdated
    ]
    if outdated:
        raise AgentOutdated(
            "agents older than this control plane: " + ", ".join(outdated) + f"; it needs "
            f"agent protocol {AGENT_PROTOCOL}.",
            fix="upgrade shardvault-agent on each node listed to this release (from wheels, as "
            "docs/guide/agent.md shows) and restart it, then retry.",
        )


def check_sources_readable(nodes: list[NodeRecord], sources: list[Source]) -> None:
    """Every shard a backup would read has its data where its agent's configuration says (a
    missing database must fail by name, never back up as an empty one), and an engine ready
    for the backup (``ShardNotReady``: settings, privileges, a server that answers)."""
    chosen = {(s.node_id, shard) for s in sources for shard in s.shard_ids}
    found = [
        (shard.problem_error, f"{node.node_id}/{shard.shard_id}: {shard.problem}")
        for node in nodes
        for shard in node.shards
        if shard.problem and (node.node_id, shard.shard_id) in chosen
    ]
    missing = [p for error, p in found if error in (None, ShardDataMissing.__name__)]
    if missing:
        raise ShardDataMissing(
            "the agents report shards whose data they cannot read: " + "; ".join(missing),
            fix="correct each shard's path or data_dir in its agent's configuration (or bring "
            "the data back), then start the backup again.",
        )
    if found:
        raise ShardNotReady(
            "the agents report shards their engine cannot back up now: "
            + "; ".join(p for _, p in found),
            fix="change what each names on its server; the agent checks again within 30 s "
            "(while a shard reports a problem, it heartbeats that often), then start the "
            "backup again.",
        )


def choose_sources(nodes: list[NodeRecord]) -> list[Source]:
    """One source per shard: its leader. Raises if a shard has no leader or several."""
    leaders: dict[str, list[str]] = defaultdict(list)
    holders: dict[str, list[str]] = defaultdict(list)
    for node in nodes:
        for shard in node.shards:
            holders[shard.shard_id].append(node.node_id)
            if shard.role == Role.LEADER:
                leaders[shard.shard_id].append(node.node_id)
    for shard_id in sorted(holders):
        if not leaders[shard_id]:
            raise ShardWithoutLeader(
                f"shard {shard_id!r} has replicas on {', '.join(holders[shard_id])} but no leader.",
                fix="wait for the shard to elect a leader (or promote one), then retry.",
            )
        if len(leaders[shard_id]) > 1:
            raise ShardWithManyLeaders(
                f"shard {shard_id!r} is claimed as leader by {', '.join(leaders[shard_id])}.",
                fix="resolve the split brain (demote all but one leader), then retry.",
            )
    by_node: dict[str, list[str]] = defaultdict(list)
    for shard_id, (node_id,) in sorted(leaders.items()):
        by_node[node_id].append(shard_id)
    engine = {node.node_id: node.engine for node in nodes}
    return [Source(node_id=n, shard_ids=s, engine=engine[n]) for n, s in sorted(by_node.items())]


def take_lock(svc: Services, request: BackupRequest, backup_id: str) -> str:
    """Takes the cluster's lock for ``backup_id``; returns the backup id that holds it for
    this execution (an earlier attempt's, when Validate itself was retried)."""
    holder = svc.catalog.try_lock(request.cluster, backup_id, request.execution_id)
    if holder is not None and not holder.holder:  # released between our try and our look
        holder = svc.catalog.try_lock(request.cluster, backup_id, request.execution_id)
    if holder is None:
        return backup_id
    if request.execution_id and holder.execution_id == request.execution_id:
        return holder.holder  # our own lock, taken by an attempt whose answer was lost
    if holder.holder and not execution_running(svc, holder.execution_id):
        # The holder's execution ended without its failure path (stopped by hand, timed out,
        # and this backup came before the reaper): clean up what it left, which releases the
        # lock, then take it over.
        clean_up_abandoned(request.cluster, holder.holder, TAKEN_OVER, svc, time.time())
        if svc.catalog.try_lock(request.cluster, backup_id, request.execution_id) is None:
            return backup_id
    raise BackupAlreadyRunning(
        f"backup {holder.holder or 'unknown'} of cluster {request.cluster!r} is still running "
        f"(execution {holder.execution_id or 'unknown'}).",
        fix="wait for it to finish ('shardvault show' follows it), or stop that execution.",
    )


def execution_running(svc: Services, execution_id: str) -> bool:
    if not execution_id.startswith("arn:"):
        return True  # cannot tell: assume it runs
    try:
        status = svc.sfn.describe_execution(executionArn=execution_id)["status"]
    except svc.sfn.exceptions.ExecutionDoesNotExist:
        return False
    return status == RUNNING_EXECUTION
