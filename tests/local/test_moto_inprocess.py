"""The local stack's own calls to moto are answered in its process, as moto's server answers
them, and calls to other endpoints still go out over the network."""

from __future__ import annotations

import io

import boto3
import pytest
from botocore.exceptions import ClientError, EndpointConnectionError

from shardvault.local import moto_inprocess
from shardvault.local.ports import free_port

CREDENTIALS = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing"}


@pytest.fixture
def session(monkeypatch):
    """A default session of the test's own (a running stack's is put back afterwards)."""
    monkeypatch.setattr(boto3, "DEFAULT_SESSION", boto3.DEFAULT_SESSION)
    boto3.setup_default_session(region_name="us-east-1", **CREDENTIALS)
    return boto3.DEFAULT_SESSION


def test_calls_to_motos_port_are_answered_without_a_server(session) -> None:
    port = free_port()  # nothing listens there: a call that went out would be refused
    moto_inprocess.install(port)
    ddb = boto3.client("dynamodb", endpoint_url=f"http://127.0.0.1:{port}")
    s3 = boto3.client("s3", endpoint_url=f"http://localhost:{port}")  # moto's interpreter's

    ddb.create_table(
        TableName="inprocess-t",
        KeySchema=[{"AttributeName": "k", "KeyType": "HASH"}],
        AttributeDefinitions=[{"AttributeName": "k", "AttributeType": "S"}],
        BillingMode="PAY_PER_REQUEST",
    )
    ddb.put_item(TableName="inprocess-t", Item={"k": {"S": "a"}, "v": {"N": "7"}})
    item = ddb.get_item(TableName="inprocess-t", Key={"k": {"S": "a"}})["Item"]
    assert item == {"k": {"S": "a"}, "v": {"N": "7"}}
    with pytest.raises(ClientError) as missing:  # errors keep their code and status
        ddb.get_item(TableName="inprocess-none", Key={"k": {"S": "a"}})
    assert missing.value.response["Error"]["Code"] == "ResourceNotFoundException"
    assert missing.value.response["ResponseMetadata"]["HTTPStatusCode"] == 400

    s3.create_bucket(Bucket="inprocess-b")
    body = bytes(range(256)) * 4096
    s3.put_object(Bucket="inprocess-b", Key="w/x", Body=io.BytesIO(body))  # a file-like body
    assert s3.get_object(Bucket="inprocess-b", Key="w/x")["Body"].read() == body
    assert s3.head_object(Bucket="inprocess-b", Key="w/x")["ContentLength"] == len(body)
    listed = s3.list_objects_v2(Bucket="inprocess-b", Prefix="w/")["Contents"]
    assert [o["Key"] for o in listed] == ["w/x"]
    with pytest.raises(ClientError) as gone:
        s3.head_object(Bucket="inprocess-b", Key="w/none")
    assert gone.value.response["ResponseMetadata"]["HTTPStatusCode"] == 404


def test_calls_to_other_endpoints_go_out_over_the_network(session) -> None:
    port, other = free_port(), free_port()
    handler = moto_inprocess.install(port)
    s3 = boto3.client(
        "s3",
        endpoint_url=f"http://127.0.0.1:{other}",
        config=boto3.session.Config(retries={"max_attempts": 1}),
    )
    with pytest.raises(EndpointConnectionError):  # not answered here: refused out there
        s3.list_buckets()
    # Another port that merely starts with moto's digits is another endpoint.
    assert handler.base_of(f"http://127.0.0.1:{port}1/x") is None
    assert handler.base_of(f"http://localhost:{port}?a=1") == f"http://localhost:{port}"
