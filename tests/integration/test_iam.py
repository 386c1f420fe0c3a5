"""IAM on the local stack, from outside: the synthesized template's grants decide what a
function or an agent may do, so enforcement cannot silently be off (shardvault/local/iam)."""

from __future__ import annotations

import json
import subprocess
import sys

import boto3
import pytest
from botocore.exceptions import ClientError

from shardvault.assurance.watch import BACKUP_AGE_METRIC
from shardvault.assurance.watch import NAMESPACE as WATCH_NAMESPACE
from shardvault.aws.tables import NodeRegistry, table
from shardvault.client.operations import STACK_OUTPUTS
from shardvault.local.iam.template import READ_ONLY_OPERATOR
from shardvault.local.stack import DEPLOYED_NAME, REGION, WATCH_FUNCTION


def test_a_backup_whose_planner_lost_its_grant_fails_by_name_and_leaves_nothing(
    make_cluster, stack
):
    cluster = make_cluster(nodes=1, size_mb=1)

    with stack.gate.withdrawn("function:plan_backup", "s3:PutObject"):
        refused = cluster.backup()

    assert refused.status == "FAILED"
    assert "AccessDenied" in refused.cause
    assert "s3:PutObject" in refused.cause
    assert cluster.open_uploads() == []  # the failure path cleaned up, as on AWS
    assert cluster.held_checkpoints() == []
    (record,) = cluster.records()
    assert record["status"] == "FAILED"
    # The grant back, the same cluster backs up: the refusal was the missing grant's.
    assert cluster.backup().status == "SUCCEEDED"


def agent_client(stack, service: str, key: str):
    """A client as an agent's, over HTTP to moto's server (a new session: the default one
    answers this process's calls in-process, where no agent's call is made)."""
    return boto3.session.Session().client(
        service,
        endpoint_url=stack.endpoint,
        region_name=REGION,
        aws_access_key_id=key,
        aws_secret_access_key="unused",  # the local stack checks who, not the signature
    )


def test_an_agent_reaches_its_own_inbox_items_and_no_others(make_cluster, stack):
    cluster = make_cluster(nodes=2, size_mb=1)
    own, other = (c["node_id"] for c in cluster.configs)
    key = stack.gate.agent_key(own, cluster.name)
    dynamodb = agent_client(stack, "dynamodb", key)

    def read(node_id: str) -> None:
        dynamodb.get_item(
            TableName=stack.settings.inbox_table,
            Key={"node_id": {"S": node_id}, "command_id": {"S": "none"}},
        )

    read(own)
    with stack.gate.expecting_refusals():
        with pytest.raises(ClientError) as refused:
            read(other)
        assert refused.value.response["Error"]["Code"] == "AccessDeniedException"
        assert "dynamodb:GetItem" in str(refused.value)
        with pytest.raises(ClientError, match="AccessDenied"):  # agents may not list a table
            dynamodb.scan(TableName=stack.settings.inbox_table)
        with pytest.raises(ClientError, match="AccessDenied"):  # nor read a record whole
            dynamodb.get_item(
                TableName=stack.settings.catalog_table,
                Key={"cluster": {"S": cluster.name}, "backup_id": {"S": "x"}},
            )


def env_of(stack, **changes: str) -> dict[str, str]:
    """The environment ``stack.env`` gives the CLI, with ``changes`` (a variable set to "" is
    left out)."""
    lines = (stack.root / "stack.env").read_text().splitlines()
    env = dict(line.split("=", 1) for line in lines) | changes
    return {"PATH": "/usr/bin:/bin", "COLUMNS": "200"} | {k: v for k, v in env.items() if v}


def shardvault(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "shardvault.client.cli", *args],
        capture_output=True, text=True, timeout=300, check=False, env=env,
    )  # fmt: skip


def test_the_cli_and_an_agent_find_the_stack_by_its_name(make_cluster, stack, tmp_path):
    cluster = make_cluster(nodes=1, size_mb=1)
    assert cluster.backup().status == "SUCCEEDED"
    # Only what a deployed stack's operator has: credentials, a region, the endpoint.
    outputs = dict.fromkeys(STACK_OUTPUTS.values(), "")
    env = env_of(stack, **outputs)

    listed = shardvault(env, "list", cluster.name, "--stack", DEPLOYED_NAME, "--json")
    assert listed.returncode == 0, listed.stderr
    assert [r["status"] for r in json.loads(listed.stdout)] == ["COMPLETE"]

    agent_env = env | {"AWS_ACCESS_KEY_ID": stack.gate.agent_key("any-node", cluster.name)}
    written = tmp_path / "agent.env"
    init = subprocess.run(
        [sys.executable, "-m", "shardvault_agent.cli", "init", "--stack", DEPLOYED_NAME,
         "--out", str(written)],
        capture_output=True, text=True, timeout=120, check=False, env=agent_env,
    )  # fmt: skip
    assert init.returncode == 0, init.stderr
    assert f"SHARDVAULT_INBOX_TABLE={stack.settings.inbox_table}" in written.read_text()


def test_a_read_only_operator_reads_the_catalog_and_starts_nothing(make_cluster, stack):
    cluster = make_cluster(nodes=1, size_mb=1)
    assert cluster.backup().status == "SUCCEEDED"
    (record,) = cluster.records()
    reader = env_of(stack, AWS_ACCESS_KEY_ID=stack.gate.operator_key(READ_ONLY_OPERATOR))

    for args in (
        ["list"],
        ["list", cluster.name],
        ["show", cluster.name, record["backup_id"]],
        ["nodes"],
        ["nodes", cluster.name],
        ["list", cluster.name, "--stack", DEPLOYED_NAME],
    ):
        done = shardvault(reader, *args, "--json")
        assert done.returncode == 0, (args, done.stderr)
        assert cluster.name in done.stdout, args

    with stack.gate.expecting_refusals():
        refused = shardvault(reader, "backup", cluster.name)
    assert refused.returncode != 0
    assert "states:StartExecution" in refused.stderr + refused.stdout
    assert len(cluster.records()) == 1  # nothing was started


def test_an_operator_lists_every_cluster_and_removes_a_node(make_cluster, stack):
    cluster = make_cluster(nodes=2, size_mb=1)
    gone = cluster.configs[1]["node_id"]
    operator = env_of(stack)

    listed = shardvault(operator, "list", "--json")  # every cluster: a Scan of the catalog
    assert listed.returncode == 0, listed.stderr
    stack.stop_agent(gone)  # decommissioned (a running agent registers again at once)
    removed = shardvault(operator, "nodes", "--remove", gone, "--force")
    assert removed.returncode == 0, removed.stderr
    assert NodeRegistry(table(stack.settings.nodes_table)).get(gone) is None


def test_the_watch_publishes_each_clusters_backup_age(make_cluster, policy_for, stack):
    cluster = make_cluster(nodes=1, size_mb=1)
    policy_for(cluster.name)  # the watch reads the policy's clusters
    assert cluster.backup().status == "SUCCEEDED"

    answer = boto3.client("lambda", region_name=REGION).invoke(
        FunctionName=f"shardvault-{WATCH_FUNCTION}", Payload=b"{}"
    )
    assert "FunctionError" not in answer, answer["Payload"].read()
    metrics = boto3.client("cloudwatch", region_name=REGION).list_metrics(
        Namespace=WATCH_NAMESPACE, MetricName=BACKUP_AGE_METRIC
    )["Metrics"]
    clusters = {d["Value"] for m in metrics for d in m.get("Dimensions", [])}
    assert cluster.name in clusters


def test_the_clis_calls_in_the_stacks_process_are_judged_by_the_operators_policy(
    make_cluster, stack
):
    """The demo, and these tests, run the CLI's operations in the stack's own process: bound
    as the operator (``ops.act_as``, in the demo and in the ``stack`` fixture), each call is
    judged by the operator's policy, as a CLI's in another shell is. Without the grant to
    start executions, starting a backup is AccessDenied and nothing starts; listing works."""
    from shardvault.client import operations as ops
    from shardvault.contracts.models import BackupRequest

    cluster = make_cluster(nodes=1, size_mb=1)
    config = stack.client_config()
    assert ops.list_backups(config, cluster.name) == []
    request = BackupRequest(cluster=cluster.name, requested_by="test")
    with (
        stack.gate.withdrawn("operator", "states:StartExecution"),
        pytest.raises(ClientError, match="AccessDenied"),
    ):
        ops.start_backup(config, request)
    assert cluster.records() == []  # refused before the call was sent: no backup began


def test_a_promotion_without_listbucket_meets_403_where_a_copy_is_missing(
    make_cluster, policy_for, stack
):
    """S3 answers a missing key with 403, not 404, to a caller without s3:ListBucket (the
    local stack answers so too). Promotion asks whether the vault holds each copy yet, so its
    function holds ListBucket on the vault. Withdrawn, the promotion fails by name and the
    backup stays complete and restorable in the store; given back, the next one promotes."""
    cluster = make_cluster(nodes=1, size_mb=1)
    policy_for(cluster.name)  # a vault in GLACIER_IR

    with stack.gate.withdrawn("function:promote_backup", "s3:ListBucket"):
        backup = cluster.backup()

    assert backup.status == "FAILED"  # the execution says the promotion failed...
    (record,) = cluster.records()
    assert record["status"] == "COMPLETE"  # ...and the backup is whole, in the store
    assert record.get("location") != "vault"
    assert record["promotion"] == "FAILED"
    assert record["promotion_error"] == "AccessDenied", record
    promoted = cluster.backup()
    assert promoted.status == "SUCCEEDED", promoted.cause
    newest = next(r for r in cluster.records() if r["backup_id"] == promoted.record["backup_id"])
    assert newest["location"] == "vault"
