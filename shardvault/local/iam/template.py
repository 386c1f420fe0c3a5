"""The grants of a synthesized template, as the local stack enforces them.

``grants_document`` keeps of the template only what IAM decides with: each function's role
statements (inline, attached and managed policies), the agents' managed policy, the bucket
policies, and for each resource those statements reference its type and what names it (a
table's partition key, a topic's KMS key). References stay as the template writes them; the
local stack resolves them to its own names when it starts (:mod:`.resolve`).

``python -m shardvault.local.iam.template`` synthesizes the stack and writes ``grants.json``
beside this module (``make grants``); ``tests/infra`` fails when the file and a fresh synth
differ, so the local stack always enforces what ``cdk deploy`` would deploy.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

GRANTS_FILE = Path(__file__).with_name("grants.json")
AGENT = "agent"
OPERATOR = "operator"  # the CLI's (infra/components/operator_access.py)
READ_ONLY_OPERATOR = "operator-read-only"
FUNCTION = "function:"
# Statements every function's role carries for the Lambda runtime itself, which makes the calls
# (its log stream, its traces): no handler calls them, and the local stack runs neither.
RUNTIME_ACTIONS = ("logs:", "xray:")


def as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]


def referenced_ids(value: Any) -> set[str]:
    """The logical ids that ``value`` references (``Ref``, ``Fn::GetAtt``), at any depth."""
    if isinstance(value, list):
        return set().union(*(referenced_ids(v) for v in value)) if value else set()
    if not isinstance(value, dict):
        return set()
    if "Ref" in value:
        return {value["Ref"]}
    if "Fn::GetAtt" in value:
        return {as_list(value["Fn::GetAtt"])[0]}
    return set().union(*(referenced_ids(v) for v in value.values())) if value else set()


def role_statements(template: dict[str, Any], role_id: str) -> list[dict[str, Any]]:
    """Every statement granted to the role: inline, attached or in a managed policy."""
    resources = template["Resources"]
    role = resources[role_id]["Properties"]
    statements = [s for p in role.get("Policies", []) for s in p["PolicyDocument"]["Statement"]]
    for resource_id in sorted(referenced_ids(role.get("ManagedPolicyArns", []))):
        document = resources[resource_id]["Properties"]["PolicyDocument"]
        statements += document["Statement"]
    for resource in resources.values():
        attached_to = resource.get("Properties", {}).get("Roles", [])
        if resource["Type"] == "AWS::IAM::Policy" and role_id in referenced_ids(attached_to):
            statements += resource["Properties"]["PolicyDocument"]["Statement"]
    return statements


def function_modules(template: dict[str, Any]) -> dict[str, str]:
    """Role logical id -> the module of the handler that runs with it."""
    modules = {}
    for resource in template["Resources"].values():
        if resource["Type"] == "AWS::Lambda::Function":
            properties = resource["Properties"]
            handler = properties["Handler"]  # functions/<module>.lambda_handler
            modules[as_list(properties["Role"]["Fn::GetAtt"])[0]] = handler.split("/")[-1].split(
                "."
            )[0]
    return modules


def managed_policy(template: dict[str, Any], described_as: str) -> list[dict[str, Any]]:
    """The statements of the managed policy whose description starts with ``described_as``
    (CloudFormation names them)."""
    (document,) = [
        resource["Properties"]["PolicyDocument"]
        for resource in template["Resources"].values()
        if resource["Type"] == "AWS::IAM::ManagedPolicy"
        and resource["Properties"].get("Description", "").startswith(described_as)
    ]
    return document["Statement"]


def bucket_policies(template: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Bucket logical id -> its bucket policy's statements."""
    return {
        as_list(resource["Properties"]["Bucket"]["Ref"])[0]: resource["Properties"][
            "PolicyDocument"
        ]["Statement"]
        for resource in template["Resources"].values()
        if resource["Type"] == "AWS::S3::BucketPolicy"
    }


def described(template: dict[str, Any], logical_ids: set[str]) -> dict[str, dict[str, Any]]:
    """What the local stack needs to know of each referenced resource."""
    resources, modules = template["Resources"], function_modules(template)
    out = {}
    for logical_id in sorted(logical_ids & set(resources)):
        resource, entry = resources[logical_id], {}
        entry["type"] = resource["Type"]
        properties = resource.get("Properties", {})
        if resource["Type"] == "AWS::DynamoDB::Table":
            (hash_key,) = [
                k["AttributeName"] for k in properties["KeySchema"] if k["KeyType"] == "HASH"
            ]
            entry["partition_key"] = hash_key
        if resource["Type"] == "AWS::SNS::Topic" and "KmsMasterKeyId" in properties:
            entry["kms_key"] = sorted(referenced_ids(properties["KmsMasterKeyId"]))[0]
        if resource["Type"] == "AWS::Lambda::Function":
            entry["module"] = properties["Handler"].split("/")[-1].split(".")[0]
        if logical_id in modules:  # a function's role (a bucket policy names it)
            entry["module"] = modules[logical_id]
        out[logical_id] = entry
    return out


def grants_document(template: dict[str, Any]) -> dict[str, Any]:
    principals = {
        f"{FUNCTION}{module}": role_statements(template, role_id)
        for role_id, module in sorted(function_modules(template).items(), key=lambda kv: kv[1])
    }
    principals[AGENT] = managed_policy(template, "ShardVault agent:")
    principals[OPERATOR] = managed_policy(template, "ShardVault operator:")
    principals[READ_ONLY_OPERATOR] = managed_policy(template, "ShardVault operator, read-only:")
    buckets = bucket_policies(template)
    referenced = referenced_ids([principals, buckets])
    topics = {
        logical_id
        for logical_id, resource in template["Resources"].items()
        if resource["Type"] == "AWS::SNS::Topic"
    }
    described_ids = referenced | set(buckets) | topics
    described_ids |= referenced_ids([template["Resources"][t]["Properties"] for t in topics])
    return {
        "principals": principals,
        "bucket_policies": buckets,
        "resources": described(template, described_ids),
    }


def synthesized_template(context: dict[str, Any] | None = None) -> dict[str, Any]:
    """The stack's template as ``cdk synth`` writes it (needs the CDK packages: a checkout)."""
    import tempfile

    root = Path(__file__).resolve().parents[3]
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    from aws_cdk.assertions import Template

    from infra.app import build_app

    with tempfile.TemporaryDirectory() as outdir:
        _, stack = build_app(outdir=outdir, context=context or {})
        return Template.from_stack(stack).to_json()


def render(document: dict[str, Any]) -> str:
    return json.dumps(document, indent=1, sort_keys=True) + "\n"


def main() -> None:
    GRANTS_FILE.write_text(render(grants_document(synthesized_template())))
    print(f"wrote {GRANTS_FILE}")


if __name__ == "__main__":
    main()
