"""Membership: which nodes may take part in a cluster's backups and restores.

An agent registers under the cluster its own configuration names, and it writes its own node
item: a compromised node could claim another cluster, to be handed that cluster's restores or
to slip its data into that cluster's backups. The deployment's policy decides instead.

Terms:
- *claim*: the cluster (and the shards, and their roles) an agent registers for its node.
- *members*: the node ids a cluster's policy lists under ``nodes``; with such a list, only those
  nodes take part, and every one of them must have registered. A node listed under one cluster
  is refused by every other cluster, listed or not (a restore target that the policy does not
  declare takes no node that the policy gives to a cluster).
- *leadership*: which node of a cluster leads a shard is the agents' claim (each reads it from
  its own engine: a PostgreSQL primary is the leader of its shards). A member that lies about
  leadership can make a backup of its cluster read a shard from itself: validation refuses two
  claimants of one shard (``ShardWithManyLeaders``) and a shard without one, so a lying member
  can stop its cluster's backups (visibly, by name) or have them read its own copy of a shard
  it claims alone; it cannot take part in another cluster or change another node's claim (its
  agent role writes its own node item only).
"""

from __future__ import annotations

from shardvault.config.policy import Policy
from shardvault.contracts.models import NodeRecord
from shardvault.errors import NotAMember


def check_members(cluster: str, nodes: list[NodeRecord], policy: Policy | None) -> None:
    """Refuses, by name, registered agents of ``cluster`` that the policy gives elsewhere or
    does not list, and listed nodes that have not registered under it."""
    if policy is None:
        return
    problems = [claim_problem(cluster, n.node_id, policy) for n in nodes]
    members = policy.clusters[cluster].nodes if cluster in policy.clusters else None
    registered = {n.node_id for n in nodes}
    problems += [
        f"{node} (a member by the policy) has not registered under {cluster!r}"
        for node in members or ()
        if node not in registered
    ]
    problems = [p for p in problems if p]
    if problems:
        raise NotAMember(
            f"the agents of cluster {cluster!r} disagree with the policy's membership: "
            + "; ".join(problems)
            + ".",
            fix="set each agent's 'cluster' to the one whose 'nodes' list its node in the "
            "policy file, or correct those lists (the policy decides membership).",
        )


def claim_problem(cluster: str, node_id: str, policy: Policy) -> str:
    """Why the policy refuses ``node_id``'s claim of ``cluster`` ('' when it does not)."""
    owner = policy.cluster_of(node_id)
    if owner is not None and owner != cluster:
        return f"{node_id} claims it, but the policy lists it under {owner!r}"
    members = policy.clusters[cluster].nodes if cluster in policy.clusters else None
    if members is not None and node_id not in members:
        return f"{node_id} claims it, but is not in its policy's nodes"
    return ""
