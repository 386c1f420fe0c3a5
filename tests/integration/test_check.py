"""``shardvault check CLUSTER`` says, from the registry and the catalog as they are now,
whether the next backup will run and whether the cluster is within its RPO: exit 0 when every
check passes, 1 (naming the check and its fix) when one fails."""

from __future__ import annotations

import json

from .conftest import run_cli


def check_cli(stack, cluster: str, policy) -> tuple[int, dict]:
    done = run_cli(stack, "check", cluster, "--policy", str(policy), "--json")
    assert done.returncode in (0, 1), done.stderr
    return done.returncode, json.loads(done.stdout)


def failed(result: dict) -> dict[str, str]:
    return {c["check"]: c["detail"] for c in result["checks"] if not c["ok"]}


def test_check_names_what_the_next_backup_would_meet(make_cluster, policy_for, tmp_path):
    cluster = make_cluster(nodes=2, size_mb=1)
    policy_for(cluster.name)
    policy = tmp_path / "policy.yaml"  # what policy_for wrote

    code, result = check_cli(cluster.stack, cluster.name, policy)
    assert code == 1
    assert not result["ok"]
    assert failed(result) == {"newest complete backup within the RPO (30 h)": "none"}

    assert cluster.backup().status == "SUCCEEDED"
    code, result = check_cli(cluster.stack, cluster.name, policy)
    assert (code, failed(result)) == (0, {})
    leaders = {c["check"]: c["detail"] for c in result["checks"]}["one leader per shard"]
    assert cluster.configs[0]["node_id"] in leaders

    stopped = cluster.configs[1]["node_id"]
    cluster.stack.stop_agent(stopped)
    code, result = check_cli(cluster.stack, cluster.name, policy)
    assert code == 1
    assert stopped in failed(result)["agents up"]
