"""The local stack's IAM: requests as AWS authorizes them, evaluated by IAM's rules, and S3's
answers to a caller that may not list (shardvault/local/iam)."""

from __future__ import annotations

import json
from typing import Any

import boto3
import pytest
from botocore.exceptions import ClientError
from moto import mock_aws

from shardvault.local.iam.evaluate import UnsupportedCondition, evaluate
from shardvault.local.iam.gate import Gate, load_gate
from shardvault.local.iam.requests import Request, UnmappedCall, Where, requests_of
from shardvault.local.iam.resolve import LocalNames

WHERE = Where(
    region="us-east-1",
    account="123456789012",
    versioned_buckets=frozenset({"vault"}),
    partition_keys={"inbox": "node_id"},
    topic_keys={"arn:aws:sns:us-east-1:123456789012:topic": "arn:aws:kms:us-east-1:1:key/k"},
)
ROLE = "arn:aws:iam::123456789012:role/function-x"


def allow(action: str, resource: str, **condition: Any) -> dict[str, Any]:
    statement = {"Effect": "Allow", "Action": action, "Resource": resource}
    if condition:
        statement["Condition"] = condition
    return statement


def allowed(statements: list[dict], request: Request, resource_policy: list | None = None) -> bool:
    return evaluate(statements, resource_policy or [], request, ROLE).allowed


# --- requests --------------------------------------------------------------------------------
def test_attributes_of_a_versioned_object_need_the_version_actions():
    on_vault = requests_of("s3", "GetObjectAttributes", {"Bucket": "vault", "Key": "k"}, WHERE)
    on_store = requests_of("s3", "GetObjectAttributes", {"Bucket": "store", "Key": "k"}, WHERE)
    assert {r.action for r in on_vault} == {
        "s3:GetObjectVersion",
        "s3:GetObjectVersionAttributes",
    }
    assert {r.action for r in on_store} == {"s3:GetObject", "s3:GetObjectAttributes"}


def test_a_locked_copy_reads_its_source_and_writes_its_target_with_a_retention():
    params = {
        "Bucket": "vault",
        "Key": "b/k",
        "CopySource": {"Bucket": "store", "Key": "a/k"},
        "ObjectLockMode": "COMPLIANCE",
    }
    requests = requests_of("s3", "CopyObject", params, WHERE)
    assert {(r.action, r.resource) for r in requests} == {
        ("s3:PutObject", "arn:aws:s3:::vault/b/k"),
        ("s3:PutObjectRetention", "arn:aws:s3:::vault/b/k"),
        ("s3:GetObject", "arn:aws:s3:::store/a/k"),
    }


def test_publishing_to_an_encrypted_topic_needs_its_key():
    topic = "arn:aws:sns:us-east-1:123456789012:topic"
    actions = {r.action for r in requests_of("sns", "Publish", {"TopicArn": topic}, WHERE)}
    assert actions == {"sns:Publish", "kms:GenerateDataKey", "kms:Decrypt"}


def test_a_query_names_its_partition_key_as_the_leading_key():
    params = {
        "TableName": "inbox",
        "KeyConditionExpression": "#n0 = :v0",
        "ExpressionAttributeNames": {"#n0": "node_id"},
        "ExpressionAttributeValues": {":v0": {"S": "node-1"}},
    }
    (request,) = requests_of("dynamodb", "Query", params, WHERE)
    assert request.context["dynamodb:LeadingKeys"] == ["node-1"]


def test_sqs_batches_are_authorized_as_the_call_they_batch():
    params = {"QueueUrl": "http://x/123456789012/q", "Entries": []}
    (request,) = requests_of("sqs", "DeleteMessageBatch", params, WHERE)
    assert request.action == "sqs:DeleteMessage"


def test_a_call_nobody_mapped_is_refused_loudly():
    with pytest.raises(UnmappedCall):
        requests_of("s3", "PutBucketPolicy", {"Bucket": "b"}, WHERE)
    with pytest.raises(UnmappedCall):
        requests_of("ec2", "RunInstances", {}, WHERE)


# --- evaluation ------------------------------------------------------------------------------
def test_leading_keys_confine_an_agent_to_its_own_items():
    own = allow(
        "dynamodb:GetItem",
        "arn:aws:dynamodb:*:*:table/inbox",
        **{"ForAllValues:StringEquals": {"dynamodb:LeadingKeys": ["node-1"]}},
    )
    mine = Request(
        "dynamodb:GetItem",
        "arn:aws:dynamodb:us-east-1:1:table/inbox",
        {"dynamodb:LeadingKeys": ["node-1"]},
    )
    theirs = Request(mine.action, mine.resource, {"dynamodb:LeadingKeys": ["node-2"]})
    assert allowed([own], mine)
    assert not allowed([own], theirs)


def test_a_listing_outside_the_granted_prefix_is_refused():
    listing = allow("s3:ListBucket", "arn:aws:s3:::store", StringLike={"s3:prefix": ["backups/*"]})
    inside = Request("s3:ListBucket", "arn:aws:s3:::store", {"s3:prefix": ["backups/c/"]})
    outside = Request("s3:ListBucket", "arn:aws:s3:::store", {"s3:prefix": ["_work/"]})
    unprefixed = Request("s3:ListBucket", "arn:aws:s3:::store")
    assert allowed([listing], inside)
    assert not allowed([listing], outside)
    assert not allowed([listing], unprefixed)


def test_an_allow_whose_condition_fails_leaves_others_to_allow():
    conditional = allow("kms:Decrypt", "*", StringEquals={"kms:EncryptionContext:c": "a"})
    plain = allow("kms:Decrypt", "*")
    assert allowed([conditional, plain], Request("kms:Decrypt", "arn:aws:kms:x"))


def test_an_explicit_deny_in_the_buckets_policy_wins():
    statements = [allow("s3:DeleteObject", "arn:aws:s3:::vault/*")]
    deny = {
        "Effect": "Deny",
        "Principal": {"AWS": "*"},
        "Action": ["s3:DeleteObject"],
        "Resource": "arn:aws:s3:::vault/*",
        "Condition": {"ArnNotEquals": {"aws:PrincipalArn": ["arn:aws:iam::1:role/expire"]}},
    }
    request = Request("s3:DeleteObject", "arn:aws:s3:::vault/k", {"aws:PrincipalArn": [ROLE]})
    assert not allowed(statements, request, [deny])


def test_another_accounts_principal_needs_the_resource_policys_allow_too():
    """A vault in another account (issue 46): the writer's own grant is not enough; the
    bucket's policy must allow it by name, and a bucket policy alone is not enough either."""
    writer = "arn:aws:iam::222233334444:role/vault-writer"
    put = Request("s3:PutObject", "arn:aws:s3:::vault-b/backups/k")
    own = [allow("s3:PutObject", "arn:aws:s3:::vault-b/*")]
    bucket_allows = {
        "Effect": "Allow",
        "Principal": {"AWS": writer},
        "Action": "s3:PutObject",
        "Resource": "arn:aws:s3:::vault-b/*",
    }

    refused = evaluate(own, [], put, writer, cross_account=True)
    assert not refused.allowed
    assert refused.no_resource_allow
    assert evaluate(own, [bucket_allows], put, writer, cross_account=True).allowed
    assert not evaluate([], [bucket_allows], put, writer, cross_account=True).allowed
    other = "arn:aws:iam::222233334444:role/someone-else"
    assert not evaluate(own, [bucket_allows], put, other, cross_account=True).allowed
    assert evaluate(own, [], put, writer).allowed  # the same account: its own grant suffices


def test_actions_match_regardless_of_case_and_resources_exactly():
    statement = allow("S3:getobject", "arn:aws:s3:::store/backups/*")
    assert allowed([statement], Request("s3:GetObject", "arn:aws:s3:::store/backups/x"))
    assert not allowed([statement], Request("s3:GetObject", "arn:aws:s3:::store/Backups/x"))
    assert not allowed([statement], Request("s3:GetObject", "arn:aws:s3:::storeXbackups/x"))


def test_a_condition_operator_it_cannot_evaluate_is_an_error_not_an_allow():
    statement = allow("s3:GetObject", "*", IpAddress={"aws:SourceIp": "10.0.0.0/8"})
    with pytest.raises(UnsupportedCondition):
        allowed([statement], Request("s3:GetObject", "arn:aws:s3:::b/k"))


# --- the gate, on clients ---------------------------------------------------------------------
def gate_of(statements: list[dict[str, Any]]) -> Gate:
    names = LocalNames(
        region="us-east-1",
        account="123456789012",
        store_bucket="store",
        work_bucket="work",
        vault_bucket="vault",
        tables={},
        topic_arn="arn:aws:sns:us-east-1:123456789012:t",
        topic_key_arn="arn:aws:kms:us-east-1:123456789012:key/t",
        data_key_arn="arn:aws:kms:us-east-1:123456789012:key/d",
        function_prefix="shardvault-",
    )
    document = {"principals": {"function:x": statements}, "bucket_policies": {}, "resources": {}}
    return load_gate(names, key_aliases={}, document=document)


@pytest.mark.parametrize(("may_list", "code"), [(False, "AccessDenied"), (True, "NoSuchKey")])
def test_a_missing_key_is_403_to_a_caller_that_may_not_list(monkeypatch, may_list, code):
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    statements = [allow("s3:GetObject", "arn:aws:s3:::store/*")]
    if may_list:
        statements.append(allow("s3:ListBucket", "arn:aws:s3:::store"))
    with mock_aws():
        boto3.client("s3").create_bucket(Bucket="store")
        gate = gate_of(statements)
        s3 = gate.bind(boto3.client("s3"), gate.function("x"))
        with pytest.raises(ClientError) as refused:
            s3.get_object(Bucket="store", Key="nothing-here")
        assert refused.value.response["Error"]["Code"] == code


@pytest.fixture
def bound(monkeypatch):
    """``bound(statements)``: a gate with a function ``x`` granted ``statements``, and an S3
    client of x's on moto, where a bucket ``store`` exists."""
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    with mock_aws():
        boto3.client("s3").create_bucket(Bucket="store")

        def make(statements: list[dict[str, Any]]) -> tuple[Gate, Any]:
            gate = gate_of(statements)
            return gate, gate.bind(boto3.client("s3"), gate.function("x"))

        yield make


def test_a_bound_client_is_refused_before_the_call_and_so_is_a_url_it_signs(bound):
    _, s3 = bound([allow("s3:GetObject", "arn:aws:s3:::store/*")])
    with pytest.raises(ClientError, match="s3:PutObject"):
        s3.put_object(Bucket="store", Key="k", Body=b"x")
    with pytest.raises(ClientError, match="s3:PutObject"):
        s3.generate_presigned_url("put_object", Params={"Bucket": "store", "Key": "k"})
    assert s3.generate_presigned_url("get_object", Params={"Bucket": "store", "Key": "k"})
    assert boto3.client("s3").list_objects_v2(Bucket="store").get("KeyCount") == 0


def test_a_withdrawn_grant_refuses_clients_already_bound(bound):
    gate, s3 = bound([allow("s3:ListBucket", "arn:aws:s3:::store")])
    s3.list_objects_v2(Bucket="store")
    with (
        gate.withdrawn("function:x", "s3:ListBucket"),
        pytest.raises(ClientError, match="AccessDenied"),
    ):
        s3.list_objects_v2(Bucket="store")
    s3.list_objects_v2(Bucket="store")


# --- the record, against the grants -----------------------------------------------------------
def test_the_report_names_refusals_no_test_asked_for_and_grants_no_call_used(tmp_path):
    from shardvault.local.iam.report import merged, unused_grants

    gate = gate_of([allow("s3:GetObject", "arn:aws:s3:::store/*"), allow("s3:Put*", "*")])
    x = gate.function("x")
    gate.verdict(x, Request("s3:GetObject", "arn:aws:s3:::store/k"))
    gate.verdict(x, Request("s3:DeleteObject", "arn:aws:s3:::store/k"))  # refused
    with gate.expecting_refusals():
        gate.verdict(x, Request("s3:ListBucket", "arn:aws:s3:::store"))  # a test's refusal
    gate.recorder.dump(tmp_path / "one.json")
    records = merged(tmp_path)
    assert records["denied"] == [("function:x", "s3:DeleteObject", "arn:aws:s3:::store/k")]
    grants = json.loads(json.dumps(gate.grants))
    assert unused_grants(grants, records["used"]) == [("function:x", "s3:Put* on *")]


def test_the_report_fails_on_an_unused_grant_unless_its_reason_is_listed(
    tmp_path, monkeypatch, capsys
):
    from shardvault.local.iam import report

    gate = gate_of([allow("s3:GetObject", "arn:aws:s3:::store/*"), allow("s3:Put*", "*")])
    gate.verdict(gate.function("x"), Request("s3:GetObject", "arn:aws:s3:::store/k"))
    gate.recorder.dump(tmp_path / "calls" / "one.json")
    grants = tmp_path / "grants.json"
    grants.write_text(json.dumps({"principals": gate.grants}))
    monkeypatch.setattr(report, "GRANTS_FILE", grants)
    reasons = tmp_path / "unexercised.yaml"
    reasons.write_text("{}")

    assert report.main([str(tmp_path / "calls")], reasons) == 1
    assert "UNUSED   function:x: s3:Put* on *" in capsys.readouterr().out

    reasons.write_text('function:x:\n  "s3:Put* on *": a path the suite does not reach\n')
    assert report.main([str(tmp_path / "calls")], reasons) == 0
    # A listed grant a call did use only warns: a path reached on some runs stays listed.
    reasons.write_text(
        'function:x:\n  "s3:Put* on *": unreached\n  "s3:GetObject on arn:aws:s3:::store/*": x\n'
    )
    assert report.main([str(tmp_path / "calls")], reasons) == 0
    assert "note: unexercised.yaml lists function:x: s3:GetObject" in capsys.readouterr().out


@pytest.mark.parametrize("may_read_lock", [False, True])
def test_head_shows_the_lock_only_to_a_caller_that_may_read_it(monkeypatch, may_read_lock):
    import datetime as dt

    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    statements = [allow("s3:GetObject", "arn:aws:s3:::vault/*")]
    if may_read_lock:
        statements.append(allow("s3:GetObjectRetention", "arn:aws:s3:::vault/*"))
    with mock_aws():
        raw = boto3.client("s3")
        raw.create_bucket(Bucket="vault", ObjectLockEnabledForBucket=True)
        until = dt.datetime.now(dt.UTC) + dt.timedelta(days=1)
        raw.put_object(
            Bucket="vault", Key="k", Body=b"x", ObjectLockMode="GOVERNANCE",
            ObjectLockRetainUntilDate=until, ChecksumAlgorithm="CRC32",
        )  # fmt: skip
        gate = gate_of(statements)
        s3 = gate.bind(boto3.client("s3"), gate.function("x"))
        head = s3.head_object(Bucket="vault", Key="k")
        assert ("ObjectLockMode" in head) is may_read_lock
        assert "ObjectLockMode" in raw.head_object(Bucket="vault", Key="k")


def test_a_role_of_another_account_is_assumed_only_as_its_trust_policy_says(monkeypatch):
    """AssumeRole across accounts: the caller's own grant and the role's trust policy (its
    external ID) must both allow it; the session's calls are then judged by the role's
    permissions and the bucket's policy, an account root naming every principal of it."""
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    role = "arn:aws:iam::222233334444:role/vault-writer"
    trust = [
        {
            "Effect": "Allow",
            "Principal": {"AWS": "arn:aws:iam::123456789012:root"},
            "Action": "sts:AssumeRole",
            "Condition": {"StringEquals": {"sts:ExternalId": "the-id"}},
        }
    ]
    deny_governance = {
        "Effect": "Deny",
        "Principal": "*",
        "Action": "s3:PutObject",
        "Resource": "arn:aws:s3:::vault-b/*",
        "Condition": {
            "StringNotEquals": {"s3:object-lock-mode": "COMPLIANCE"},
            "Null": {"s3:object-lock-mode": "false"},
        },
    }
    with mock_aws():
        gate = gate_of([allow("sts:AssumeRole", role)])
        gate.add_account(
            {role: (trust, [allow("s3:PutObject", "arn:aws:s3:::vault-b/*")])},
            {"vault-b": [deny_governance]},
        )
        sts = gate.bind(boto3.client("sts"), gate.function("x"))
        with pytest.raises(ClientError, match="no resource-based policy allows"):
            sts.assume_role(RoleArn=role, RoleSessionName="s1", ExternalId="not-it")
        keys = sts.assume_role(RoleArn=role, RoleSessionName="s1", ExternalId="the-id")
        assert keys["Credentials"]["AccessKeyId"]
        s3 = gate.bind(boto3.client("s3"), gate.function("x"), role_arn=role)
        boto3.client("s3").create_bucket(Bucket="vault-b")
        s3.put_object(Bucket="vault-b", Key="k", Body=b"x")
        with pytest.raises(ClientError, match="explicit deny in a resource-based policy"):
            s3.put_object(Bucket="vault-b", Key="k", Body=b"x", ObjectLockMode="GOVERNANCE")
        # The function itself, not the role: another account's bucket allows it nothing.
        own = gate.bind(boto3.client("s3"), gate.function("x"))
        with pytest.raises(ClientError, match="s3:PutObject"):
            own.put_object(Bucket="vault-b", Key="k", Body=b"x")


def test_a_roles_trust_policy_decides_an_assume_role_in_one_account_too(monkeypatch):
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    role = "arn:aws:iam::123456789012:role/same-account"
    with mock_aws():
        gate = gate_of([allow("sts:AssumeRole", role)])
        gate.add_account({role: ([], [])}, {})  # a trust policy that trusts nobody
        sts = gate.bind(boto3.client("sts"), gate.function("x"))
        with pytest.raises(ClientError, match="no resource-based policy allows"):
            sts.assume_role(RoleArn=role, RoleSessionName="s1", ExternalId="the-id")
