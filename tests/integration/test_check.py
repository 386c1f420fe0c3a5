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
    found = {c["check"]: c["detail"] for c in result["checks"]}
    assert cluster.configs[0]["node_id"] in found["one leader per shard"]
    # Each agent put a probe into the store and read it back; nothing of it is left there.
    for config in cluster.configs:
        assert found[f"store round trip ({config['node_id']})"].startswith("put ")
    assert probe_objects(cluster) == []

    stopped = cluster.configs[1]["node_id"]
    cluster.stack.stop_agent(stopped)
    code, result = check_cli(cluster.stack, cluster.name, policy)
    assert code == 1
    assert stopped in failed(result)["agents up"]
    assert failed(result)[f"store round trip ({stopped})"].startswith("AgentUnavailable: ")
    assert f"store round trip ({cluster.configs[0]['node_id']})" not in failed(result)
    assert probe_objects(cluster) == []

    # --no-probe: the registry's and the catalog's checks alone.
    done = run_cli(
        cluster.stack, "check", cluster.name, "--policy", str(policy), "--json", "--no-probe"
    )
    assert not any(
        c["check"].startswith("store round trip") for c in json.loads(done.stdout)["checks"]
    )


def probe_objects(cluster) -> list[str]:
    """The store's probe objects, listed from the store itself."""
    svc = cluster.stack.services()
    listed = svc.store_s3.list_objects_v2(Bucket=svc.store.bucket, Prefix="_work/probes/")
    return [o["Key"] for o in listed.get("Contents", [])]


def test_a_probe_that_died_is_cleaned_up_by_the_next(make_cluster, monkeypatch):
    """A probe whose execution died before its last step leaves its objects; the next probe
    deletes every probe object older than a probe lives (here: any)."""
    cluster = make_cluster(nodes=1, size_mb=1)
    svc = cluster.stack.services()
    leftover = "_work/probes/probe-20260101T000000Z-dead00/some-node"
    svc.store_s3.put_object(Bucket=svc.store.bucket, Key=leftover, Body=b"left by a crash")
    monkeypatch.setattr("shardvault.assurance.probe.STALE_PROBE_SECONDS", -1)
    done = run_cli(cluster.stack, "check", cluster.name, "--json")
    found = {c["check"]: c for c in json.loads(done.stdout)["checks"]}
    assert found[f"store round trip ({cluster.configs[0]['node_id']})"]["ok"]
    assert probe_objects(cluster) == []  # the leftover, and this probe's own
