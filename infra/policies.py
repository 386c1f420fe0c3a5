"""IAM statement builders: each names its actions and its resources, nothing implied.

*Object ARNs* confine S3 actions to a key prefix (``backups/*`` or ``_work/*``); *table
statements* confine DynamoDB actions to one table and, when asked, to named indexes; *queue
statements* confine SQS actions to queues of one name (or name pattern) in the stack's account
and region. Written
out rather than taken from ``grant_*`` helpers so that each function's access reads in one
place and never grows by a library's choice.
"""

from __future__ import annotations

from aws_cdk import ArnFormat, Stack
from aws_cdk import aws_dynamodb as dynamodb
from aws_cdk import aws_iam as iam
from aws_cdk import aws_s3 as s3

# What shardvault/aws/tables.py calls (no batch or transaction call exists there: granting them
# would only widen what a stolen role could do).
TABLE_READ = ("dynamodb:GetItem", "dynamodb:Query", "dynamodb:Scan")
# Posting a command to a node's inbox: the item put, the inbox's ring counter raised
# (shardvault/aws/tables.py: Inbox.post). Only agents delete their own items.
POST = ("dynamodb:PutItem", "dynamodb:UpdateItem")


def objects(bucket: s3.IBucket, prefix: str, *actions: str) -> iam.PolicyStatement:
    """``actions`` on the objects under ``prefix`` (which ends with ``/``)."""
    return iam.PolicyStatement(
        actions=list(actions), resources=[bucket.arn_for_objects(f"{prefix}*")]
    )


def list_prefix(bucket: s3.IBucket, prefix: str) -> iam.PolicyStatement:
    """ListBucket, but only for listings under ``prefix``."""
    return iam.PolicyStatement(
        actions=["s3:ListBucket"],
        resources=[bucket.bucket_arn],
        conditions={"StringLike": {"s3:prefix": [f"{prefix}*"]}},
    )


def table(
    table_: dynamodb.ITable, actions: tuple[str, ...], indexes: tuple[str, ...] = ()
) -> iam.PolicyStatement:
    resources = [table_.table_arn] + [f"{table_.table_arn}/index/{name}" for name in indexes]
    return iam.PolicyStatement(actions=list(actions), resources=resources)


def index(table_: dynamodb.ITable, name: str, *actions: str) -> iam.PolicyStatement:
    """``actions`` (a Query) on one index of the table only, not on the table itself."""
    return iam.PolicyStatement(
        actions=list(actions), resources=[f"{table_.table_arn}/index/{name}"]
    )


def queues(scope: Stack, name: str, *actions: str) -> iam.PolicyStatement:
    """``actions`` on the queues named ``name`` (which may end in ``*`` or hold a policy
    variable) in the stack's account and region."""
    arn = scope.format_arn(service="sqs", resource=name, arn_format=ArnFormat.NO_RESOURCE_NAME)
    return iam.PolicyStatement(actions=list(actions), resources=[arn])


def state_machine_arn(scope: Stack, name: str) -> str:
    return scope.format_arn(
        service="states",
        resource="stateMachine",
        resource_name=name,
        arn_format=ArnFormat.COLON_RESOURCE_NAME,
    )


def execution_arns(scope: Stack, name: str) -> list[str]:
    """The state machine's executions (``name:<id>``) and its Map Run child executions
    (``name/<map run>:<id>``)."""
    return [
        scope.format_arn(
            service="states",
            resource="execution",
            resource_name=f"{name}{separator}*",
            arn_format=ArnFormat.COLON_RESOURCE_NAME,
        )
        for separator in (":", "/")
    ]
