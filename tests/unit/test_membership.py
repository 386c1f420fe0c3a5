"""Who takes part in a backup: the policy, not an agent's own claim, decides which nodes
belong to a cluster; and the shards a backup would read must have their data and an engine
ready for it."""

from __future__ import annotations

import pytest

from shardvault.backup.admission import check_sources_readable
from shardvault.config.policy import PolicyError, parse_policy
from shardvault.contracts.models import AGENT_PROTOCOL, NodeRecord, ShardInfo, Source
from shardvault.errors import NotAMember, ShardDataMissing, ShardNotReady
from shardvault.workflow.membership import check_members

CLUSTER = """
  {name}:
    engine: sqlite
    schedule: {{full: '0 2 * * *'}}
    vault: {{storage_class: GLACIER_IR, object_lock: {{mode: GOVERNANCE, days: 1}}}}
    retention: {{keep_daily: 1}}
    {nodes}
"""


def policy(**clusters: str):
    text = "clusters:\n" + "".join(
        CLUSTER.format(name=name, nodes=f"nodes: {nodes}" if nodes else "")
        for name, nodes in clusters.items()
    )
    return parse_policy(text)


def node(node_id: str, cluster: str) -> NodeRecord:
    return NodeRecord(
        node_id=node_id,
        cluster=cluster,
        engine="sqlite",
        shards=[],
        free_bytes=0,
        version="test",
        protocol=AGENT_PROTOCOL,
        heartbeat_at=0,
    )


def test_listed_members_pass_and_an_unlisted_policy_trusts_registration() -> None:
    check_members("a", [node("n1", "a"), node("n2", "a")], policy(a="[n1, n2]"))
    check_members("a", [node("n9", "a")], policy(a=""))
    check_members("a", [node("n9", "a")], None)


def test_a_claim_outside_the_list_is_refused_by_name() -> None:
    with pytest.raises(NotAMember, match="n3 claims it, but is not in its policy's nodes"):
        check_members("a", [node("n1", "a"), node("n3", "a")], policy(a="[n1]"))


def test_a_node_listed_elsewhere_joins_no_other_cluster() -> None:
    """Not even a restore target the policy does not declare."""
    with pytest.raises(NotAMember, match="n1 claims it, but the policy lists it under 'a'"):
        check_members("restored", [node("n1", "restored")], policy(a="[n1]"))
    with pytest.raises(NotAMember, match="lists it under 'a'"):
        check_members("b", [node("n1", "b")], policy(a="[n1]", b="[n2]"))


def test_a_listed_node_that_has_not_registered_is_named() -> None:
    with pytest.raises(NotAMember, match=r"n2 \(a member by the policy\) has not registered"):
        check_members("a", [node("n1", "a")], policy(a="[n1, n2]"))


@pytest.mark.parametrize(
    ("clusters", "problem"),
    [
        ({"a": "[n1]", "b": "[n1]"}, "node 'n1' is listed under clusters a, b"),
        ({"a": "[n1, n1]"}, "n1 listed twice"),
        ({"a": "['Bad Node']"}, "node 'Bad Node' is not a valid name"),
        ({"a": "[]"}, "at least 1 item"),
    ],
)
def test_bad_node_lists_are_refused(clusters: dict[str, str], problem: str) -> None:
    with pytest.raises(PolicyError, match=problem):
        policy(**clusters)


# --- the shards a backup would read: their data, and their engine's readiness ---------------
def leader_with(problem: str | None, error: str | None) -> NodeRecord:
    return node("n1", "a").model_copy(
        update={
            "shards": [
                ShardInfo(shard_id="s1", role="leader", problem=problem, problem_error=error)
            ]
        }
    )


def test_an_engine_that_cannot_back_up_is_refused_as_not_ready() -> None:
    sources = [Source(node_id="n1", shard_ids=["s1"])]
    check_sources_readable([leader_with(None, None)], sources)
    with pytest.raises(ShardNotReady, match="n1/s1: no replication slot is free"):
        check_sources_readable([leader_with("no replication slot is free", "EngineError")], sources)
    # Missing data keeps its own name, as does a problem from an agent too old to say which.
    for error in ("ShardDataMissing", None):
        with pytest.raises(ShardDataMissing, match="cannot read: n1/s1: gone"):
            check_sources_readable([leader_with("gone", error)], sources)
