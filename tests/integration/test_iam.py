"""IAM on the local stack, from outside: the synthesized template's grants decide what a
function or an agent may do, so enforcement cannot silently be off (shardvault/local/iam)."""

from __future__ import annotations

import boto3
import pytest
from botocore.exceptions import ClientError

from shardvault.local.stack import REGION


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
