"""Requests: what AWS authorizes for one API call.

``requests_of(service, operation, params, where)`` turns a call, with the low-level parameters
botocore sends (DynamoDB values typed, as on the wire), into the *requests* AWS evaluates: an
IAM action on a resource ARN with the condition keys the call sets. The service
authorization reference decides each entry; a few calls need more than one action:

- a copy reads its source (``s3:GetObject``) and writes its target (``s3:PutObject``);
- ``GetObjectAttributes`` needs ``s3:GetObject`` and ``s3:GetObjectAttributes`` on an
  unversioned bucket, ``s3:GetObjectVersion`` and ``s3:GetObjectVersionAttributes`` on a
  versioned one (the vault, which Object Lock keeps versioned);
- a write that sets an Object Lock also needs ``s3:PutObjectRetention``, and sets the lock's
  condition keys (``s3:object-lock-mode``, ``s3:object-lock-remaining-retention-days``), as
  ``PutObjectRetention`` does; a write encrypted under a KMS key (SSE-KMS) also needs
  ``kms:GenerateDataKey`` on it, as the caller (reads' ``kms:Decrypt`` is not modelled);
- ``sts:AssumeRole`` is on the role, with ``sts:ExternalId`` when the call gives one;
- ``sns:Publish`` to a topic encrypted with a customer key also needs ``kms:GenerateDataKey``
  and ``kms:Decrypt`` on that key, as the publisher.

A call this module does not know raises ``UnmappedCall``: the gate never lets a call through
because nobody said what it needs.
"""

from __future__ import annotations

import base64
import datetime
import math
import re
from dataclasses import dataclass, field
from typing import Any

Context = dict[str, list[str]]


class UnmappedCall(Exception):
    """A call the local stack's IAM model does not know: add it to ``requests.py``."""


@dataclass(frozen=True)
class Request:
    action: str
    resource: str
    context: Context = field(default_factory=dict)


@dataclass(frozen=True)
class Where:
    """What turning calls into ARNs needs to know of the local stack."""

    region: str
    account: str
    versioned_buckets: frozenset[str] = frozenset()
    partition_keys: dict[str, str] = field(default_factory=dict)  # table name -> its key
    key_aliases: dict[str, str] = field(default_factory=dict)  # alias/… -> key id
    topic_keys: dict[str, str] = field(default_factory=dict)  # topic ARN -> its key's ARN

    def arn(self, service: str, resource: str) -> str:
        return f"arn:aws:{service}:{self.region}:{self.account}:{resource}"


def requests_of(
    service: str, operation: str, params: dict[str, Any], where: Where
) -> list[Request]:
    mapper = MAPPERS.get(service)
    if mapper is None:
        raise UnmappedCall(f"{service}:{operation}")
    return mapper(operation, params, where)


# --- S3 ---------------------------------------------------------------------------------------
OBJECT_READS = {
    "GetObject": ("s3:GetObject", "s3:GetObjectVersion"),
    "HeadObject": ("s3:GetObject", "s3:GetObjectVersion"),
    "GetObjectRetention": ("s3:GetObjectRetention", "s3:GetObjectRetention"),
    "GetObjectLegalHold": ("s3:GetObjectLegalHold", "s3:GetObjectLegalHold"),
    "GetObjectTagging": ("s3:GetObjectTagging", "s3:GetObjectVersionTagging"),
    "PutObjectTagging": ("s3:PutObjectTagging", "s3:PutObjectVersionTagging"),
    "DeleteObjectTagging": ("s3:DeleteObjectTagging", "s3:DeleteObjectVersionTagging"),
    "DeleteObject": ("s3:DeleteObject", "s3:DeleteObjectVersion"),
    "RestoreObject": ("s3:RestoreObject", "s3:RestoreObject"),
    "PutObjectRetention": ("s3:PutObjectRetention", "s3:PutObjectRetention"),
    "PutObjectLegalHold": ("s3:PutObjectLegalHold", "s3:PutObjectLegalHold"),
    "AbortMultipartUpload": ("s3:AbortMultipartUpload", "s3:AbortMultipartUpload"),
    "ListParts": ("s3:ListMultipartUploadParts", "s3:ListMultipartUploadParts"),
    "UploadPart": ("s3:PutObject", "s3:PutObject"),
    "CompleteMultipartUpload": ("s3:PutObject", "s3:PutObject"),
}
WRITES = ("PutObject", "CreateMultipartUpload", "CopyObject", "UploadPartCopy")
BUCKET_CALLS = {
    "ListObjectsV2": "s3:ListBucket",
    "ListObjects": "s3:ListBucket",
    "HeadBucket": "s3:ListBucket",
    "ListObjectVersions": "s3:ListBucketVersions",
    "ListMultipartUploads": "s3:ListBucketMultipartUploads",
    "GetBucketVersioning": "s3:GetBucketVersioning",
    "GetObjectLockConfiguration": "s3:GetBucketObjectLockConfiguration",
    "GetBucketLocation": "s3:GetBucketLocation",
    "CreateBucket": "s3:CreateBucket",
}
BYPASS = "s3:BypassGovernanceRetention"


def object_arn(bucket: str, key: str) -> str:
    return f"arn:aws:s3:::{bucket}/{key}"


def s3_requests(operation: str, params: dict[str, Any], where: Where) -> list[Request]:
    bucket = params.get("Bucket", "")
    if operation in BUCKET_CALLS:
        context = {"s3:prefix": [params.get("Prefix", "")]} if "Prefix" in params else {}
        return [Request(BUCKET_CALLS[operation], f"arn:aws:s3:::{bucket}", context)]
    if operation == "DeleteObjects":
        return [
            request
            for item in params.get("Delete", {}).get("Objects", [])
            for request in s3_requests("DeleteObject", {**params, **item}, where)
        ]
    target = object_arn(bucket, params.get("Key", ""))
    if operation == "GetObjectAttributes":
        if bucket in where.versioned_buckets:
            actions = ("s3:GetObjectVersion", "s3:GetObjectVersionAttributes")
        else:
            actions = ("s3:GetObject", "s3:GetObjectAttributes")
        return [Request(action, target) for action in actions]
    if operation in WRITES:
        return write_requests(operation, params, target)
    if operation == "PutObjectRetention":
        retention = params.get("Retention", {})
        context = lock_context(retention.get("Mode"), retention.get("RetainUntilDate"))
        requests = [Request("s3:PutObjectRetention", target, context)]
        if params.get("BypassGovernanceRetention"):
            requests.append(Request(BYPASS, target))
        return requests
    if operation in OBJECT_READS:
        plain, versioned = OBJECT_READS[operation]
        requests = [Request(versioned if params.get("VersionId") else plain, target)]
        if params.get("BypassGovernanceRetention"):
            requests.append(Request(BYPASS, target))
        return requests
    raise UnmappedCall(f"s3:{operation}")


def write_requests(operation: str, params: dict[str, Any], target: str) -> list[Request]:
    context = {
        **lock_context(params.get("ObjectLockMode"), params.get("ObjectLockRetainUntilDate")),
        **encryption_keys(params),
    }
    requests = [Request("s3:PutObject", target, context)]
    if params.get("ObjectLockMode") or params.get("ObjectLockRetainUntilDate"):
        requests.append(Request("s3:PutObjectRetention", target, context))
    if params.get("SSEKMSKeyId") and operation != "CopyObject":
        # S3 asks KMS for the object's data key as the caller: the caller needs the grant.
        requests.append(Request("kms:GenerateDataKey", str(params["SSEKMSKeyId"])))
    if params.get("ObjectLockLegalHoldStatus"):
        requests.append(Request("s3:PutObjectLegalHold", target))
    if params.get("Tagging"):
        requests.append(Request("s3:PutObjectTagging", target))
    source = params.get("CopySource")
    if source:
        requests.append(copy_source_request(source))
    return requests


def lock_context(mode: Any, until: Any) -> Context:
    """The Object Lock condition keys a write or PutObjectRetention sets (S3 counts the
    remaining days in whole days, rounded up)."""
    context: Context = {}
    if mode:
        context["s3:object-lock-mode"] = [str(mode)]
    if isinstance(until, datetime.datetime):
        until = until if until.tzinfo else until.replace(tzinfo=datetime.UTC)
        left = (until - datetime.datetime.now(datetime.UTC)).total_seconds()
        context["s3:object-lock-remaining-retention-days"] = [str(math.ceil(left / 86400))]
    return context


def encryption_keys(params: dict[str, Any]) -> Context:
    context: Context = {}
    if params.get("ServerSideEncryption"):
        context["s3:x-amz-server-side-encryption"] = [str(params["ServerSideEncryption"])]
    if params.get("SSEKMSKeyId"):
        key = str(params["SSEKMSKeyId"])
        context["s3:x-amz-server-side-encryption-aws-kms-key-id"] = [key]
    return context


def copy_source(source: Any) -> tuple[str, str, str | None]:
    """A CopySource's bucket, key and version (None: the current one)."""
    if isinstance(source, dict):
        return source["Bucket"], source["Key"], source.get("VersionId")
    path, _, query = str(source).lstrip("/").partition("?versionId=")
    bucket, _, key = path.partition("/")
    return bucket, key, query or None


def copy_source_request(source: Any) -> Request:
    bucket, key, version = copy_source(source)
    action = "s3:GetObjectVersion" if version else "s3:GetObject"
    return Request(action, object_arn(bucket, key))


# --- DynamoDB ---------------------------------------------------------------------------------
ITEM_CALLS = ("GetItem", "PutItem", "UpdateItem", "DeleteItem", "ConditionCheckItem")
READ_CALLS = ("Query", "Scan")
KEY_COMPARISON = re.compile(r"([#\w.:-]+)\s*=\s*(:[\w-]+)")


def dynamodb_requests(operation: str, params: dict[str, Any], where: Where) -> list[Request]:
    if operation in ("TransactWriteItems", "TransactGetItems"):
        return [
            request
            for item in params.get("TransactItems", [])
            for kind, call in item.items()
            for request in dynamodb_requests(TRANSACT_KINDS[kind], call, where)
        ]
    if operation in ("BatchGetItem", "BatchWriteItem"):
        return batch_requests(operation, params, where)
    if operation in ("DescribeTable", "CreateTable", "ListTables"):
        name = params.get("TableName", "*")
        return [Request(f"dynamodb:{operation}", where.arn("dynamodb", f"table/{name}"))]
    if operation not in ITEM_CALLS + READ_CALLS:
        raise UnmappedCall(f"dynamodb:{operation}")
    table = params["TableName"]
    resource = where.arn("dynamodb", f"table/{table}")
    if params.get("IndexName"):
        resource += f"/index/{params['IndexName']}"
    context = leading_keys(operation, params, where.partition_keys.get(table))
    context |= attributes_context(operation, params)
    return [Request(f"dynamodb:{operation}", resource, context)]


TRANSACT_KINDS = {
    "Put": "PutItem",
    "Update": "UpdateItem",
    "Delete": "DeleteItem",
    "ConditionCheck": "ConditionCheckItem",
    "Get": "GetItem",
}


def batch_requests(operation: str, params: dict[str, Any], where: Where) -> list[Request]:
    requests = []
    for table, entry in params.get("RequestItems", {}).items():
        if operation == "BatchGetItem":
            for key in entry.get("Keys", []):
                requests += dynamodb_requests("GetItem", {"TableName": table, "Key": key}, where)
            continue
        for write in entry:
            for kind, body in write.items():  # PutRequest {Item} / DeleteRequest {Key}
                call = "PutItem" if kind == "PutRequest" else "DeleteItem"
                requests += dynamodb_requests(call, {"TableName": table, **body}, where)
    return requests


def scalar(value: Any) -> str:
    """A typed DynamoDB value (``{"S": "x"}``) as the string IAM compares."""
    if isinstance(value, dict) and len(value) == 1:
        return str(next(iter(value.values())))
    return str(value)


def leading_keys(operation: str, params: dict[str, Any], partition_key: str | None) -> Context:
    """``dynamodb:LeadingKeys``: the partition key values the call reaches (none for a Scan)."""
    if partition_key is None or operation == "Scan":
        return {}
    item = params.get("Key") or params.get("Item")
    if item is not None:
        return (
            {"dynamodb:LeadingKeys": [scalar(item[partition_key])]} if partition_key in item else {}
        )
    names = params.get("ExpressionAttributeNames", {})
    values = params.get("ExpressionAttributeValues", {})
    for name, placeholder in KEY_COMPARISON.findall(params.get("KeyConditionExpression", "")):
        if names.get(name, name) == partition_key and placeholder in values:
            return {"dynamodb:LeadingKeys": [scalar(values[placeholder])]}
    condition = params.get("KeyConditions", {}).get(partition_key)
    if condition:
        return {"dynamodb:LeadingKeys": [scalar(v) for v in condition["AttributeValueList"]]}
    return {}


def attributes_context(operation: str, params: dict[str, Any]) -> Context:
    """``dynamodb:Attributes`` and ``dynamodb:Select`` of a read: the projected attributes
    (``SPECIFIC_ATTRIBUTES``), else every attribute (``ALL_ATTRIBUTES``, DynamoDB's default)."""
    if operation not in ("GetItem", "Query", "Scan"):
        return {}
    projection = params.get("ProjectionExpression") or params.get("AttributesToGet")
    if not projection:
        return {"dynamodb:Select": [params.get("Select", "ALL_ATTRIBUTES")]}
    names = params.get("ExpressionAttributeNames", {})
    if isinstance(projection, list):
        attributes = projection
    else:
        attributes = [names.get(p.strip(), p.strip()) for p in projection.split(",")]
    return {
        "dynamodb:Attributes": attributes,
        "dynamodb:Select": [params.get("Select", "SPECIFIC_ATTRIBUTES")],
    }


# --- the other services -----------------------------------------------------------------------
STATE_MACHINE_CALLS = ("StartExecution", "ListExecutions", "DescribeStateMachine")
EXECUTION_CALLS = ("DescribeExecution", "StopExecution", "GetExecutionHistory", "ListMapRuns")
TASK_CALLS = ("SendTaskSuccess", "SendTaskFailure", "SendTaskHeartbeat")


def states_requests(operation: str, params: dict[str, Any], where: Where) -> list[Request]:
    if operation in STATE_MACHINE_CALLS:
        resource = params["stateMachineArn"]
    elif operation in EXECUTION_CALLS:
        resource = params["executionArn"]
    elif operation == "DescribeMapRun":
        resource = params["mapRunArn"]
    elif operation in TASK_CALLS or operation == "ListStateMachines":
        resource = "*"  # no resource-level permissions
    else:
        raise UnmappedCall(f"states:{operation}")
    return [Request(f"states:{operation}", resource)]


def sns_requests(operation: str, params: dict[str, Any], where: Where) -> list[Request]:
    if operation not in ("Publish", "GetTopicAttributes", "Subscribe"):
        raise UnmappedCall(f"sns:{operation}")
    topic = params["TopicArn"]
    requests = [Request(f"sns:{operation}", topic)]
    key = where.topic_keys.get(topic)
    if operation == "Publish" and key:
        requests += [Request("kms:GenerateDataKey", key), Request("kms:Decrypt", key)]
    return requests


def sqs_requests(operation: str, params: dict[str, Any], where: Where) -> list[Request]:
    # A batch is authorized as the single call it batches (SQS has no batch actions).
    operation = operation.removesuffix("Batch")
    if "QueueUrl" in params:
        name = params["QueueUrl"].rstrip("/").rsplit("/", 1)[-1]
    elif "QueueName" in params:
        name = params["QueueName"]
    else:
        raise UnmappedCall(f"sqs:{operation}")
    return [Request(f"sqs:{operation}", where.arn("sqs", name))]


def kms_key_arn(params: dict[str, Any], where: Where) -> str:
    key = params.get("KeyId")
    if key is None and "CiphertextBlob" in params:
        key = ciphertext_key(params["CiphertextBlob"])
    key = where.key_aliases.get(key, key) if key else "*"
    if key.startswith("arn:") or key == "*":
        return key
    return where.arn("kms", f"key/{key}")


def ciphertext_key(blob: Any) -> str | None:
    """The key id at the head of a ciphertext of moto's KMS (a UUID's 36 characters)."""
    raw = blob if isinstance(blob, bytes) else base64.b64decode(blob)
    head = raw[:36].decode("ascii", "replace")
    return head if re.fullmatch(r"[0-9a-f-]{36}", head) else None


def encryption_context(context: dict[str, str] | None) -> Context:
    return {f"kms:EncryptionContext:{k}": [v] for k, v in (context or {}).items()}


def kms_requests(operation: str, params: dict[str, Any], where: Where) -> list[Request]:
    if operation == "ReEncrypt":  # from the source key and context, to the destination's
        source = {**params, "KeyId": params.get("SourceKeyId")}
        destination = {"KeyId": params["DestinationKeyId"]}
        return [
            Request(
                "kms:ReEncryptFrom",
                kms_key_arn(source, where),
                encryption_context(params.get("SourceEncryptionContext")),
            ),
            Request(
                "kms:ReEncryptTo",
                kms_key_arn(destination, where),
                encryption_context(params.get("DestinationEncryptionContext")),
            ),
        ]
    if operation not in ("Encrypt", "Decrypt", "DescribeKey") and not operation.startswith(
        "GenerateDataKey"
    ):
        raise UnmappedCall(f"kms:{operation}")
    context = encryption_context(params.get("EncryptionContext"))
    return [Request(f"kms:{operation}", kms_key_arn(params, where), context)]


def lambda_requests(operation: str, params: dict[str, Any], where: Where) -> list[Request]:
    if operation != "Invoke":
        raise UnmappedCall(f"lambda:{operation}")
    name = params["FunctionName"]
    arn = name if name.startswith("arn:") else where.arn("lambda", f"function:{name}")
    return [Request("lambda:InvokeFunction", arn)]


def cloudformation_requests(operation: str, params: dict[str, Any], where: Where) -> list[Request]:
    if operation != "DescribeStacks":
        raise UnmappedCall(f"cloudformation:{operation}")
    name = params.get("StackName", "*")
    return [
        Request("cloudformation:DescribeStacks", where.arn("cloudformation", f"stack/{name}/local"))
    ]


def cloudwatch_requests(operation: str, params: dict[str, Any], where: Where) -> list[Request]:
    if operation != "PutMetricData":
        raise UnmappedCall(f"cloudwatch:{operation}")
    # PutMetricData names no resource: a grant binds it to a namespace by condition.
    namespace = {"cloudwatch:namespace": [params.get("Namespace", "")]}
    return [Request("cloudwatch:PutMetricData", "*", namespace)]


def sts_requests(operation: str, params: dict[str, Any], where: Where) -> list[Request]:
    if operation == "GetCallerIdentity":
        return []  # it needs no permission
    if operation != "AssumeRole":
        raise UnmappedCall(f"sts:{operation}")
    context: Context = {"sts:RoleSessionName": [str(params.get("RoleSessionName", ""))]}
    if params.get("ExternalId"):
        context["sts:ExternalId"] = [str(params["ExternalId"])]
    return [Request("sts:AssumeRole", str(params.get("RoleArn", "")), context)]


MAPPERS = {
    "s3": s3_requests,
    "dynamodb": dynamodb_requests,
    "stepfunctions": states_requests,
    "states": states_requests,
    "sns": sns_requests,
    "sqs": sqs_requests,
    "kms": kms_requests,
    "lambda": lambda_requests,
    "cloudformation": cloudformation_requests,
    "cloudwatch": cloudwatch_requests,
    "monitoring": cloudwatch_requests,
    "sts": sts_requests,
}
