"""The CLI's exit status is what the README's table says: a refusal is 3 whether the CLI
makes it or the workflow's validation does (issue 44, also seen)."""

from __future__ import annotations

import subprocess
import sys


def cli(stack, *args: str) -> subprocess.CompletedProcess:
    env_file = str(stack.root / "stack.env")
    return subprocess.run(
        [sys.executable, "-m", "shardvault.client.cli", *args, "--stack-env", env_file],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip


def test_a_restore_of_a_backup_that_does_not_exist_is_refused_at_once(make_cluster, stack):
    cluster = make_cluster(nodes=1, size_mb=1)
    assert cluster.backup().status == "SUCCEEDED"
    for wait in ([], ["--wait"]):
        done = cli(stack, "restore", cluster.name, "--into", "x", "--backup-id", "nope", *wait)
        assert done.returncode == 3, done.stderr
        assert "BackupNotFound" in done.stderr
        assert "Traceback" not in done.stderr
    assert [r for r in cluster.records() if r["backup_id"].startswith("restore#")] == []


def test_a_refusal_made_by_the_workflow_exits_3_under_wait(make_cluster, stack):
    cluster = make_cluster(nodes=1, size_mb=1)
    assert cluster.backup().status == "SUCCEEDED"
    # The target has no agents: the restore's Validate refuses it (UnknownCluster).
    done = cli(stack, "restore", cluster.name, "--into", "nobody-here", "--wait")
    assert done.returncode == 3, (done.stdout, done.stderr)


def test_a_drill_that_cannot_run_is_refused_before_an_execution_starts(make_cluster, stack):
    cluster = make_cluster(nodes=1, size_mb=1)
    assert cluster.backup().status == "SUCCEEDED"
    other = make_cluster(nodes=1, size_mb=1)
    assert other.backup().status == "SUCCEEDED"
    started = drill_executions()

    nothing = cli(stack, "drill", "nosuch-cluster", "--into", "nosuch-drill")  # no --wait
    assert nothing.returncode == 3, (nothing.stdout, nothing.stderr)
    assert "BackupNotFound" in nothing.stderr
    backed_up = cli(stack, "drill", cluster.name, "--into", other.name)
    assert backed_up.returncode == 3, (backed_up.stdout, backed_up.stderr)
    assert "is backed up" in backed_up.stderr

    assert drill_executions() == started  # nothing started, nothing to fail later


def drill_executions() -> int:
    import boto3

    sfn = boto3.client("stepfunctions")
    (machine,) = [
        m["stateMachineArn"]
        for m in sfn.list_state_machines()["stateMachines"]
        if m["name"].endswith("-drill")
    ]
    return len(sfn.list_executions(stateMachineArn=machine)["executions"])
