"""The local stack's moto writes a DynamoDB item atomically and reads it whole, as DynamoDB
does."""

from __future__ import annotations

import json
import threading
import time

import boto3
from moto import mock_aws

from shardvault.local import moto_fidelity

THREADS, ADDS = 8, 200
READERS, WRITES = 2, 80  # each of 4 writers; without the fix a query failed in 3 runs of 4


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


def queries_beside_writes() -> list[Exception]:
    """Threads querying a partition while others add and remove its items' attributes; what
    the queries raised."""
    table = boto3.resource("dynamodb", region_name="us-east-1").create_table(
        TableName="q",
        KeySchema=[
            {"AttributeName": "k", "KeyType": "HASH"},
            {"AttributeName": "s", "KeyType": "RANGE"},
        ],
        AttributeDefinitions=[
            {"AttributeName": "k", "AttributeType": "S"},
            {"AttributeName": "s", "AttributeType": "N"},
        ],
        BillingMode="PAY_PER_REQUEST",
    )
    for s in range(4):
        table.put_item(Item={"k": "p", "s": s, **{f"a{i}": i for i in range(50)}})
    stop, raised = threading.Event(), []

    def write(s: int) -> None:
        for i in range(WRITES):
            table.update_item(
                Key={"k": "p", "s": s},
                UpdateExpression=f"SET b{i} = :v REMOVE a{i % 50}",
                ExpressionAttributeValues={":v": i},
            )

    def query() -> None:
        while not stop.is_set():
            try:
                table.query(KeyConditionExpression="k = :p", ExpressionAttributeValues={":p": "p"})
            except Exception as error:  # what a reader of the stack would see
                raised.append(error)

    readers = [threading.Thread(target=query) for _ in range(READERS)]
    writers = [threading.Thread(target=write, args=(s,)) for s in range(4)]
    for thread in readers + writers:
        thread.start()
    for thread in writers:
        thread.join()
    stop.set()
    for thread in readers:
        thread.join()
    return raised


def test_a_query_never_meets_an_item_half_written(monkeypatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    moto_fidelity.install()
    with mock_aws():
        assert queries_beside_writes() == []


def map_machine(tolerated: dict) -> str:
    """A Distributed Map over [1, 2, 3] whose child for 2 fails; its Catch keeps the error."""
    child = {
        "StartAt": "Which",
        "States": {
            "Which": {
                "Type": "Choice",
                "Choices": [{"Variable": "$", "NumericEquals": 2, "Next": "Fail"}],
                "Default": "Done",
            },
            "Fail": {"Type": "Fail", "Error": "UploadIncomplete", "Cause": "part 3 of k"},
            "Done": {"Type": "Succeed"},
        },
        "ProcessorConfig": {"Mode": "DISTRIBUTED", "ExecutionType": "STANDARD"},
    }
    return json.dumps(
        {
            "StartAt": "Upload",
            "States": {
                "Upload": {
                    "Type": "Map",
                    "ItemsPath": "$.items",
                    "ItemProcessor": child,
                    **tolerated,
                    "Catch": [{"ErrorEquals": ["States.ALL"], "Next": "Caught"}],
                    "End": True,
                },
                "Caught": {"Type": "Pass", "End": True},
            },
        }
    )


def run_map(name: str, tolerated: dict) -> dict:
    sfn = boto3.client("stepfunctions", region_name="us-east-1")
    arn = sfn.create_state_machine(
        name=name, definition=map_machine(tolerated), roleArn="arn:aws:iam::123456789012:role/r"
    )["stateMachineArn"]
    execution = sfn.start_execution(
        stateMachineArn=arn, name=name, input=json.dumps({"items": [1, 2, 3]})
    )
    for _ in range(200):
        described = sfn.describe_execution(executionArn=execution["executionArn"])
        if described["status"] != "RUNNING":
            return json.loads(described.get("output") or "null")
        time.sleep(0.05)
    raise TimeoutError("the execution did not end")


def test_a_failed_child_fails_the_distributed_map_run_as_on_aws(monkeypatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    moto_fidelity.install()
    with mock_aws(config={"stepfunctions": {"execute_state_machine": True}}):
        caught = run_map("strict", {})
        tolerated = run_map("tolerant", {"ToleratedFailurePercentage": 50.0})
    assert caught["Error"] == "States.ExceedToleratedFailureThreshold"
    assert "part 3" not in caught["Cause"]  # as on AWS: the child's cause is not there
    assert isinstance(tolerated, list)  # one failure of three is within 50 %


def test_a_locked_version_keeps_its_lock_against_the_stores_own_credentials(monkeypatch):
    """Issue 44 (4): moto let anyone shorten a lock (GOVERNANCE without the bypass header,
    COMPLIANCE at all) and then delete the version; S3 refuses both."""
    import datetime as dt

    import pytest
    from botocore.exceptions import ClientError

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    moto_fidelity.install()
    later = dt.datetime.now(dt.UTC) + dt.timedelta(days=2)
    past = dt.datetime(2020, 1, 1, tzinfo=dt.UTC)
    with mock_aws():
        s3 = boto3.client("s3", region_name="us-east-1")
        s3.create_bucket(Bucket="vault", ObjectLockEnabledForBucket=True)

        def locked(key: str, mode: str) -> str:
            return s3.put_object(
                Bucket="vault", Key=key, Body=b"x", ObjectLockMode=mode,
                ObjectLockRetainUntilDate=later, ChecksumAlgorithm="CRC32",
            )["VersionId"]  # fmt: skip

        def shorten(key: str, version: str, mode: str, **bypass: bool) -> None:
            s3.put_object_retention(
                Bucket="vault", Key=key, VersionId=version,
                Retention={"Mode": mode, "RetainUntilDate": past}, **bypass,
            )  # fmt: skip

        governed, compliant = locked("g", "GOVERNANCE"), locked("c", "COMPLIANCE")
        with pytest.raises(ClientError, match="AccessDenied"):
            shorten("g", governed, "GOVERNANCE")
        with pytest.raises(ClientError, match="AccessDenied"):
            shorten("c", compliant, "COMPLIANCE", BypassGovernanceRetention=True)
        with pytest.raises(ClientError, match="AccessDenied"):
            shorten("c", compliant, "GOVERNANCE")
        with pytest.raises(ClientError, match="AccessDenied"):
            s3.delete_object(Bucket="vault", Key="c", VersionId=compliant)
        head = s3.head_object(Bucket="vault", Key="c", VersionId=compliant)
        assert head["ObjectLockRetainUntilDate"] > dt.datetime.now(dt.UTC)
        # Extending is allowed; so is shortening GOVERNANCE with the bypass (and its grant).
        s3.put_object_retention(
            Bucket="vault", Key="c", VersionId=compliant,
            Retention={"Mode": "COMPLIANCE", "RetainUntilDate": later + dt.timedelta(days=1)},
        )  # fmt: skip
        shorten("g", governed, "GOVERNANCE", BypassGovernanceRetention=True)
