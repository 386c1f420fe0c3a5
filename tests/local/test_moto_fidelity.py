"""The local stack's moto writes a DynamoDB item atomically, as DynamoDB does."""

from __future__ import annotations

import threading

import boto3
from moto import mock_aws

from shardvault.local import moto_fidelity

THREADS, ADDS = 8, 200


def concurrent_adds() -> int:
    """THREADS threads each ADD 1 to one counter ADDS times; the counter's final value."""
    table = boto3.resource("dynamodb", region_name="us-east-1").create_table(
        TableName="t",
        KeySchema=[{"AttributeName": "k", "KeyType": "HASH"}],
        AttributeDefinitions=[{"AttributeName": "k", "AttributeType": "S"}],
        BillingMode="PAY_PER_REQUEST",
    )

    def add() -> None:
        for _ in range(ADDS):
            table.update_item(
                Key={"k": "c"}, UpdateExpression="ADD n :one", ExpressionAttributeValues={":one": 1}
            )

    threads = [threading.Thread(target=add) for _ in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return int(table.get_item(Key={"k": "c"}, ConsistentRead=True)["Item"]["n"])


def test_concurrent_adds_to_one_item_are_all_counted(monkeypatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    moto_fidelity.install()
    moto_fidelity.install()  # a second stack in the process: nothing wrapped twice
    with mock_aws():
        assert concurrent_adds() == THREADS * ADDS
