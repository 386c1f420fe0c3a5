"""Infrastructure tests on the synthesized ShardVault stack (one synth per module), on the
ASL files it deploys, and on the template's validity (cfn-lint) and compliance (cdk-nag).

The stack is environment-agnostic: it synthesizes with no AWS account, region or credentials.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aws_cdk import App, Token
from aws_cdk.assertions import Annotations, Match, Template

from infra.app import build_app
from infra.components.schedules import scheduler_cron
from infra.components.workflow import (
    distributed_maps,
    item_readers,
    modules_called,
    placeholders_in,
)
from infra.constants import (
    AGENT_POLICY_DESCRIPTION,
    BACKUP_ASL,
    BACKUP_STATE_MACHINE_NAME,
    CLUSTER_TAG,
    CUT_ASL,
    CUT_STATE_MACHINE_NAME,
    DEFAULT_POLICY,
    DRILL_ASL,
    DRILL_STATE_MACHINE_NAME,
    FUNCTIONS,
    NODE_ID_TAG,
    PROBE_ASL,
    PROBE_STATE_MACHINE_NAME,
    PROMOTED_TAG,
    REPO_ROOT,
    RESTORE_ASL,
    RESTORE_MACHINE_PLACEHOLDER,
    RESTORE_STATE_MACHINE_NAME,
    RETENTION_ASL,
    RETENTION_STATE_MACHINE_NAME,
    STATE_MACHINES_DIR,
    SUBSTITUTION_KEYS,
    VERIFY_ASL,
    VERIFY_STATE_MACHINE_NAME,
    WORK_BUCKET_PLACEHOLDER,
)
from infra.stack import ShardVaultStack, agent_nodes, alert_emails
from shardvault.config.policy import load_policy
from shardvault.contracts.deployment import NODE_MAP_CONCURRENCY
from shardvault.contracts.models import DOORBELL_PREFIX
from shardvault.workflow.dispatch import ANSWER_URL_TTL_SECONDS, ANSWERED
from tests.infra.template_queries import (
    actions,
    as_list,
    iter_states,
    only,
    placeholders,
    referenced_ids,
    role_statements,
    tasks_without_retry,
)

ASL_FILES = sorted(STATE_MACHINES_DIR.glob("*.asl.json"))
needs_asl = pytest.mark.skipif(
    not ASL_FILES, reason=f"no statemachines/*.asl.json in {STATE_MACHINES_DIR} yet"
)
EXPECTED_ENVIRONMENT = {
    "CATALOG_TABLE",
    "NODES_TABLE",
    "INBOX_TABLE",
    "WORK_BUCKET",
    "WORK_PREFIX",
    "STORE_URL",
    "TOPIC_ARN",
    "VAULT_URL",
    "POLICY",
    "DATA_KEY_ID",
    "POWERTOOLS_SERVICE_NAME",
    "POWERTOOLS_METRICS_NAMESPACE",
    "POWERTOOLS_TRACER_CAPTURE_RESPONSE",
}
# cfn-lint warnings that CDK itself produces, each with why it is harmless.
ALLOWED_CFN_LINT_WARNINGS = {
    "W3005": "CDK writes an explicit DependsOn beside a GetAtt (role before function).",
}


AGENT_NODES = ["node-1=orders", "node-2"]
ALERT_EMAILS = "oncall@example.com,dba@example.org"


@dataclass
class Synthesized:
    stack: ShardVaultStack
    template: Template
    json: dict[str, Any]
    outdir: Path


@pytest.fixture(scope="module")
def synth(tmp_path_factory: pytest.TempPathFactory) -> Synthesized:
    outdir = tmp_path_factory.mktemp("cdk.out")
    context = {"agentNodes": AGENT_NODES, "alertEmail": ALERT_EMAILS}
    _, stack = build_app(outdir=str(outdir), context=context)
    template = Template.from_stack(stack)
    return Synthesized(stack, template, template.to_json(), outdir)


def resources_of(synth: Synthesized, kind: str) -> dict[str, Any]:
    return synth.template.find_resources(kind)


MACHINES = {
    BACKUP_STATE_MACHINE_NAME: BACKUP_ASL,
    RESTORE_STATE_MACHINE_NAME: RESTORE_ASL,
    RETENTION_STATE_MACHINE_NAME: RETENTION_ASL,
    VERIFY_STATE_MACHINE_NAME: VERIFY_ASL,
    PROBE_STATE_MACHINE_NAME: PROBE_ASL,
    DRILL_STATE_MACHINE_NAME: DRILL_ASL,
    CUT_STATE_MACHINE_NAME: CUT_ASL,
}


def machines(synth: Synthesized) -> dict[str, tuple[str, dict[str, Any]]]:
    """State machine name -> (logical id, resource)."""
    return {
        resource["Properties"]["StateMachineName"]: (logical_id, resource)
        for logical_id, resource in resources_of(synth, "AWS::StepFunctions::StateMachine").items()
    }


def buckets(synth: Synthesized) -> dict[str, tuple[str, dict[str, Any]]]:
    """ "staging" or "vault" -> (logical id, resource)."""
    out = {}
    for logical_id, bucket in resources_of(synth, "AWS::S3::Bucket").items():
        kind = "vault" if bucket["Properties"].get("ObjectLockEnabled") else "staging"
        assert kind not in out, f"two {kind} buckets"
        out[kind] = (logical_id, bucket)
    return out


def function_ids(synth: Synthesized) -> dict[str, str]:
    """Lambda logical id -> module of its handler."""
    return {
        logical_id: fn["Properties"]["Handler"].split("/")[1].split(".")[0]
        for logical_id, fn in resources_of(synth, "AWS::Lambda::Function").items()
    }


# --- the ASL files --------------------------------------------------------------------------
def test_retry_check_looks_inside_maps_and_parallels() -> None:
    definition = {
        "States": {
            "Top": {"Type": "Task", "Retry": [{"ErrorEquals": ["States.ALL"]}]},
            "Fan": {
                "Type": "Map",
                "ItemProcessor": {
                    "ProcessorConfig": {"Mode": "DISTRIBUTED"},
                    "States": {"InMap": {"Type": "Task"}},
                },
            },
            "Both": {"Type": "Parallel", "Branches": [{"States": {"InBranch": {"Type": "Task"}}}]},
            "Old": {"Type": "Map", "Iterator": {"States": {"InIterator": {"Type": "Task"}}}},
        }
    }
    assert sorted(tasks_without_retry(definition)) == ["InBranch", "InIterator", "InMap"]


@needs_asl
@pytest.mark.parametrize("path", ASL_FILES, ids=lambda p: p.name)
def test_every_placeholder_has_a_substitution(path: Path) -> None:
    unknown = placeholders(path.read_text()) - SUBSTITUTION_KEYS
    assert not unknown, f"{path.name} uses placeholders with no substitution: {sorted(unknown)}"


@needs_asl
@pytest.mark.parametrize("path", ASL_FILES, ids=lambda p: p.name)
def test_every_task_retries(path: Path) -> None:
    definition = json.loads(path.read_text())
    assert list(iter_states(definition["States"])), "the definition has no states"
    assert tasks_without_retry(definition) == []


@needs_asl
def test_every_substitution_is_used() -> None:
    """A function no definition invokes is dead code with permissions."""
    used = set().union(*(placeholders(path.read_text()) for path in ASL_FILES))
    assert sorted(SUBSTITUTION_KEYS - used) == []


@needs_asl
@pytest.mark.parametrize("name", sorted(MACHINES))
def test_state_machine_gets_exactly_the_substitutions(synth: Synthesized, name: str) -> None:
    _, machine = machines(synth)[name]
    properties = machine["Properties"]
    assert set(properties["DefinitionSubstitutions"]) == placeholders_in(MACHINES[name])
    assert properties["StateMachineType"] == "STANDARD"
    assert properties["TracingConfiguration"] == {"Enabled": True}
    assert properties["LoggingConfiguration"]["Level"] == "ALL"
    assert properties["LoggingConfiguration"]["IncludeExecutionData"] is False


# --- the state machine's role ----------------------------------------------------------------
@needs_asl
@pytest.mark.parametrize("name", sorted(MACHINES))
def test_state_machine_invokes_exactly_the_functions(synth: Synthesized, name: str) -> None:
    _, machine = machines(synth)[name]
    (role_id,) = referenced_ids(machine["Properties"]["RoleArn"])
    invoking = [
        statement
        for statement in role_statements(synth.json, role_id)
        if any(a in ("lambda:InvokeFunction", "lambda:*", "*") for a in actions(statement))
    ]
    resources = [r for s in invoking for r in as_list(s["Resource"])]
    assert all(isinstance(r, dict) for r in resources), f"literal ARNs/wildcards: {resources}"
    for resource in resources:  # a function ARN, or that ARN followed by ":*" (its versions)
        if "Fn::Join" in resource:
            assert resource["Fn::Join"][1][1:] == [":*"], resource
    functions = function_ids(synth)
    assert len(functions) == len(FUNCTIONS)
    assert sorted(functions.values()) == sorted(spec.module for spec in FUNCTIONS)
    assert "reap_execution" not in set(modules_called(MACHINES[name]))
    called = set(modules_called(MACHINES[name]))
    assert {functions[i] for i in referenced_ids(resources)} == called


@needs_asl
@pytest.mark.parametrize("name", sorted(MACHINES))
def test_state_machine_role_runs_its_map_runs_and_reads_plans_only(
    synth: Synthesized, name: str
) -> None:
    _, machine = machines(synth)[name]
    (role_id,) = referenced_ids(machine["Properties"]["RoleArn"])
    statements = role_statements(synth.json, role_id)
    by_action = {a: s for s in statements for a in actions(s)}
    if not distributed_maps(MACHINES[name]):  # an inline Map starts no executions
        assert not [a for a in by_action if a.startswith(("states:", "s3:"))], sorted(by_action)
        return
    starts = [
        json.dumps(s["Resource"]) for s in statements if "states:StartExecution" in actions(s)
    ]
    assert any(f":stateMachine:{name}" in start for start in starts)
    stops = [json.dumps(s["Resource"]) for s in statements if "states:StopExecution" in actions(s)]
    assert any(f":execution:{name}/*" in executions for executions in stops)
    s3 = [s for s in statements if any(a.startswith("s3:") for a in actions(s))]
    if not item_readers(MACHINES[name]):  # its Maps iterate over the input: no plan to read
        assert s3 == []
        return
    assert [actions(s) for s in s3] == [["s3:GetObject"]]
    assert json.dumps(s3[0]["Resource"]).endswith('"/_work/*"]]}')


def test_the_drill_starts_restores_and_watches_only_those(synth: Synthesized) -> None:
    _, machine = machines(synth)[DRILL_STATE_MACHINE_NAME]
    (role_id,) = referenced_ids(machine["Properties"]["RoleArn"])
    statements = role_statements(synth.json, role_id)
    starts = [
        json.dumps(s["Resource"]) for s in statements if "states:StartExecution" in actions(s)
    ]
    # Its own Map Runs' children, and restores: nothing else.
    mine = (DRILL_STATE_MACHINE_NAME, RESTORE_STATE_MACHINE_NAME)
    assert all(any(f":stateMachine:{n}" in start for n in mine) for start in starts), starts
    assert any(f":stateMachine:{RESTORE_STATE_MACHINE_NAME}" in start for start in starts)
    assert not any(f":stateMachine:{BACKUP_STATE_MACHINE_NAME}" in start for start in starts)
    described = [
        json.dumps(s["Resource"]) for s in statements if "states:DescribeExecution" in actions(s)
    ]
    assert any(f":execution:{RESTORE_STATE_MACHINE_NAME}:*" in d for d in described)
    (rule,) = [s for s in statements if "events:PutRule" in actions(s)]
    assert "StepFunctionsGetEventsForStepFunctionsExecutionRule" in json.dumps(rule["Resource"])
    restore_id, _ = machines(synth)[RESTORE_STATE_MACHINE_NAME]
    nested = machine["Properties"]["DefinitionSubstitutions"]["RestoreStateMachineArn"]
    assert referenced_ids(nested) == {restore_id}  # the restore state machine of this stack


# --- functions --------------------------------------------------------------------------------
def test_functions_share_one_locally_bundled_asset(synth: Synthesized) -> None:
    functions = resources_of(synth, "AWS::Lambda::Function").values()
    (key,) = {fn["Properties"]["Code"]["S3Key"] for fn in functions}
    asset = synth.outdir / f"asset.{key.removesuffix('.zip')}"
    for spec in FUNCTIONS:
        assert (asset / "functions" / f"{spec.module}.py").is_file()
    assert (asset / "shardvault").is_dir()
    assert (asset / "aws_xray_sdk").is_dir()  # Powertools' Tracer imports it
    native = list((asset / "pydantic_core").glob("*.so"))
    assert native, "no pydantic_core extension in the asset"
    assert all("cpython-312-aarch64" in so.name for so in native), native
    assert not list(asset.rglob("__pycache__")), "host bytecode leaked into the asset"


def test_function_shapes(synth: Synthesized) -> None:
    specs = {spec.module: spec for spec in FUNCTIONS}
    for logical_id, module in function_ids(synth).items():
        properties = resources_of(synth, "AWS::Lambda::Function")[logical_id]["Properties"]
        spec = specs[module]
        assert properties["Handler"] == f"functions/{module}.lambda_handler"
        assert properties["Runtime"] == "python3.12"
        assert properties["Architectures"] == ["arm64"]
        assert properties["TracingConfig"] == {"Mode": "Active"}
        assert properties["Timeout"] == spec.timeout_seconds
        assert properties["MemorySize"] == spec.memory_mb
        (log_group,) = referenced_ids(properties["LoggingConfig"])
        assert synth.json["Resources"][log_group]["Properties"]["RetentionInDays"] == 30
    assert specs["complete_upload"].timeout_seconds == specs["finalize_backup"].timeout_seconds
    assert specs["complete_upload"].memory_mb == 1024


def test_functions_get_every_setting_they_read(synth: Synthesized) -> None:
    from shardvault.config.settings import Settings  # the runtime's own list of settings

    known = {name.upper() for name in Settings.model_fields}
    required = {name.upper() for name, f in Settings.model_fields.items() if f.is_required()}
    for fn in resources_of(synth, "AWS::Lambda::Function").values():
        variables = fn["Properties"]["Environment"]["Variables"]
        assert set(variables) == EXPECTED_ENVIRONMENT
        assert required <= set(variables)
        assert {v for v in variables if not v.startswith("POWERTOOLS_")} <= known
        assert variables["WORK_PREFIX"] == "_work/"
        assert variables["POWERTOOLS_SERVICE_NAME"] == "shardvault"
        assert variables["POWERTOOLS_METRICS_NAMESPACE"] == "ShardVault"
        # X-Ray keeps no handler's response: a URL or key returned would be in the trace.
        assert variables["POWERTOOLS_TRACER_CAPTURE_RESPONSE"] == "false"
        store = variables["STORE_URL"]["Fn::Join"][1]
        assert store[0] == "s3://"
        assert store[2] == "/backups"
        assert referenced_ids(store) == referenced_ids(variables["WORK_BUCKET"])


def _function_statements(synth: Synthesized) -> dict[str, list[dict[str, Any]]]:
    functions = resources_of(synth, "AWS::Lambda::Function")
    return {
        module: role_statements(synth.json, only_id(functions[logical_id]["Properties"]["Role"]))
        for logical_id, module in function_ids(synth).items()
    }


def only_id(value: Any) -> str:
    (logical_id,) = referenced_ids(value) - PSEUDO_PARAMETERS
    return logical_id


PSEUDO_PARAMETERS = {"AWS::Partition", "AWS::Region", "AWS::AccountId"}


def test_function_roles_have_no_broad_wildcards(synth: Synthesized) -> None:
    allowed_star_actions = {"kms:GenerateDataKey*"}
    for module, statements in _function_statements(synth).items():
        for statement in statements:
            assert statement["Effect"] == "Allow"
            wild = [a for a in actions(statement) if "*" in a and a not in allowed_star_actions]
            assert not wild, f"{module}: {wild}"
            if statement["Resource"] == "*":  # X-Ray and metrics have no resource ARNs
                if actions(statement) == ["cloudwatch:PutMetricData"]:  # the watch's
                    assert statement["Condition"] == {
                        "StringEquals": {"cloudwatch:namespace": "ShardVault"}
                    }, module
                    continue
                assert all(a.startswith("xray:") for a in actions(statement)), module
            for resource in as_list(statement["Resource"]):
                text = json.dumps(resource)
                if "/*" in text and "s3:" in json.dumps(actions(statement)):
                    narrow = (
                        '"/backups/*"]]}',
                        '"/_work/*"]]}',
                        '"/_work/*/answers/*"]]}',
                        '"/_work/*/copies/*"]]}',
                        '"/backups/_staged/*"]]}',
                        '"/_work/probes/*"]]}',
                        '"/backups/*/_wal/*"]]}',
                    )
                    assert text.endswith(narrow), (module, text)


def test_signing_role_can_create_and_upload_parts(synth: Synthesized) -> None:
    statements = _function_statements(synth)["sign_parts"]
    s3 = {a for s in statements for a in actions(s) if a.startswith("s3:")}
    assert s3 == {"s3:PutObject", "s3:ListMultipartUploadParts"}  # cleanup aborts, not Sign


PUBLISHERS = {
    "validate_backup",  # cleans up after a backup whose execution ended, when it takes its lock
    "finalize_backup",
    "cleanup_backup",
    "record_promotion_failure",
    "promote_backup",  # a copy target's failure: the backup is PARTIAL
    "finalize_restore",
    "cleanup_restore",
    "decide_retention",  # budget alerts
    "reap_execution",
    "start_drill",  # a scheduled drill's refusal
    "record_drill",  # every drill's verdict
}


def test_the_alert_addresses_are_subscribed_to_the_notifications_topic(
    synth: Synthesized,
) -> None:
    subscriptions = resources_of(synth, "AWS::SNS::Subscription").values()
    (topic,) = resources_of(synth, "AWS::SNS::Topic")
    assert sorted(
        s["Properties"]["Endpoint"]
        for s in subscriptions
        if s["Properties"]["Protocol"] == "email" and s["Properties"]["TopicArn"] == {"Ref": topic}
    ) == sorted(ALERT_EMAILS.split(","))


@pytest.mark.parametrize("value", ["oncall", "a@b.c,not an address", "x@y"])
def test_a_bad_alert_address_is_refused_at_synth(value: str) -> None:
    with pytest.raises(ValueError, match="is not an e-mail address"):
        alert_emails(App(context={"alertEmail": value}))


def test_agent_nodes_take_their_cluster_from_the_policy_and_may_not_contradict_it() -> None:
    """The policy decides membership (shardvault.workflow.membership): a node it lists is tagged
    with that cluster (what lets its agent unwrap the cluster's data keys), and a context that
    puts it elsewhere fails the synth."""
    policy = load_policy(DEFAULT_POLICY).model_copy(deep=True)
    orders = policy.clusters["orders"].model_copy(update={"nodes": ["node-1", "node-2"]})
    policy = policy.model_copy(update={"clusters": {**policy.clusters, "orders": orders}})
    app = App(context={"agentNodes": "node-1,node-2=orders,node-3"})
    assert agent_nodes(app, policy) == {"node-1": "orders", "node-2": "orders", "node-3": None}
    with pytest.raises(ValueError, match="policy lists it under 'orders'"):
        agent_nodes(App(context={"agentNodes": "node-1=sessions"}), policy)


def test_only_outcome_publishers_may_publish(synth: Synthesized) -> None:
    for module, statements in _function_statements(synth).items():
        publishes = any("sns:Publish" in actions(s) for s in statements)
        assert publishes == (module in PUBLISHERS), module


def test_download_signer_can_only_read_backups(synth: Synthesized) -> None:
    """A presigned GET carries its signer's permissions, bound to one GetObject of one key:
    reading backups is all it may do there. Its one write is the URL itself, into _work/ for
    the dispatcher (so no URL enters execution history); it reads there the items a node
    prefetches, which plan_restore wrote."""
    assert grants(synth, "sign_download") == READ_BACKUPS | {
        ("s3:GetObject", "staging/_work/*"),
        ("s3:PutObject", "staging/_work/*"),
    }


def test_no_function_holds_service_wide_actions(synth: Synthesized) -> None:
    for module, statements in _function_statements(synth).items():
        for statement in statements:
            assert not {"s3:*", "dynamodb:*", "*"} & set(actions(statement)), module


def test_only_the_retention_function_deletes_backups(synth: Synthesized) -> None:
    for module, statements in _function_statements(synth).items():
        deletes = {a for s in statements for a in actions(s) if a.startswith("s3:Delete")}
        if module == "expire_backup":
            assert deletes == {"s3:DeleteObject", "s3:DeleteObjectVersion"}
        elif module in ("cleanup_backup", "reap_execution", "validate_backup", "sweep_store"):
            # a failed backup's partial objects (validate_backup: an abandoned backup's;
            # sweep_store: what no running backup owns and no manifest names)
            assert deletes == {"s3:DeleteObject"}
        elif module == "probe_store":  # shardvault check's probes, once read back
            deleted = {g for g in grants(synth, module) if g[0].startswith("s3:Delete")}
            assert deleted == {("s3:DeleteObject", "staging/_work/probes/*")}
        elif module == "promote_backup":  # the staging copy, once the vault holds the backup
            deleted = {g for g in grants(synth, module) if g[0].startswith("s3:Delete")}
            assert deleted == {("s3:DeleteObject", "staging/backups/*")}  # never the vault
        elif module in ("thaw_objects", "finalize_restore", "cleanup_restore"):
            # a copy target's objects staged for a restore (shardvault.restore.sources)
            deleted = {g for g in grants(synth, module) if g[0].startswith("s3:Delete")}
            assert deleted == {("s3:DeleteObject", "staging/backups/_staged/*")}
        else:
            assert not deletes, module


# --- restores ---------------------------------------------------------------------------------
def _resource_names(synth: Synthesized) -> dict[str, str]:
    """Logical id -> a readable name, for the resources the functions' grants point at."""
    names = {logical_id: kind for kind, (logical_id, _) in buckets(synth).items()}
    tables = {("cluster", "backup_id"): "catalog", ("node_id",): "nodes"}
    tables[("node_id", "command_id")] = "inbox"
    for logical_id, table in resources_of(synth, "AWS::DynamoDB::Table").items():
        keys = tuple(k["AttributeName"] for k in table["Properties"]["KeySchema"])
        names[logical_id] = tables[keys]
    topic_id, topic = only(resources_of(synth, "AWS::SNS::Topic"))
    names[topic_id] = "topic"
    names[only_id(topic["Properties"]["KmsMasterKeyId"])] = "topic key"
    names.update(
        {i: "DataKey" for i in resources_of(synth, "AWS::KMS::Key") if i.startswith("DataKey")}
    )
    return names


def grants(synth: Synthesized, module: str) -> set[tuple[str, str]]:
    """(action, target) for each grant of a function's role beyond its log group and X-Ray;
    a target is a resource's name and what follows its ARN ("staging/backups/*")."""
    names = _resource_names(synth)
    out = set()
    for statement in _function_statements(synth)[module]:
        for action in actions(statement):
            if action.startswith(("logs:", "xray:")):
                continue
            for resource in as_list(statement["Resource"]):
                if isinstance(resource, str):  # "*" (PutMetricData: bound by its namespace
                    out.add((action, resource))  # condition), or another account's role
                    continue
                parts = resource.get("Fn::Join", ["", [resource]])[1]
                suffix = "".join(p for p in parts if isinstance(p, str))
                if not referenced_ids(resource) - PSEUDO_PARAMETERS:
                    # An ARN of the stack's account and region by name alone (SQS queues):
                    # the name is the target.
                    out.add((action, suffix.rsplit(":", 1)[-1]))
                    continue
                out.add((action, names.get(only_id(resource), "?") + suffix))
    return out


# In the vault, the locked version its manifest names (s3:GetObjectVersion).
READ_BACKUPS = {
    ("s3:GetObject", "staging/backups/*"),
    ("s3:GetObject", "vault/backups/*"),
    ("s3:GetObjectVersion", "vault/backups/*"),
}
# A point in time's WAL batches, found by listing (the prefix condition is not in the pair).
LIST_WAL_ARCHIVE = {("s3:ListBucket", "staging")}
NOTIFY = {
    ("sns:Publish", "topic"),
    ("kms:Decrypt", "topic key"),
    ("kms:GenerateDataKey*", "topic key"),
}
UPDATE_CATALOG = {("dynamodb:UpdateItem", "catalog")}
# A copy target's objects, staged into the store for the agents (shardvault.restore.sources).
STAGED = "staging/backups/_staged/*"
REMOVE_STAGED = {("s3:ListBucket", "staging"), ("s3:DeleteObject", STAGED)}
# What each restore function calls in shardvault/restore/, and nothing else.
# The example policy's aws copy (examples/shardvault.yaml): its role in account B, assumed by
# every function that writes or reads a copy, and by no other.
ASSUME_ACCOUNT_B = {("sts:AssumeRole", "arn:aws:iam::222233334444:role/shardvault-vault-writer")}
# Its recovery key in account B: promotion wraps data keys under it, a restore's plan unwraps
# them from it (shardvault/aws/keys.py), and no other function uses it.
RECOVERY_KEY = "arn:aws:kms:us-east-1:222233334444:key/0d4e7b52-8c1f-4e3a-9b6d-5f2a1c8e7d34"
RESTORE_GRANTS = {
    "validate_restore": READ_BACKUPS
    | LIST_WAL_ARCHIVE
    | ASSUME_ACCOUNT_B
    | {
        ("dynamodb:Query", "catalog"),
        ("dynamodb:GetItem", "catalog"),
        ("dynamodb:Query", "nodes/index/by_cluster"),
    },
    "plan_restore": READ_BACKUPS
    | LIST_WAL_ARCHIVE
    | ASSUME_ACCOUNT_B
    | {
        ("s3:PutObject", "staging/_work/*"),
        ("dynamodb:PutItem", "catalog"),
        ("kms:ReEncryptFrom", "DataKey"),  # data keys wrapped for another cluster's agents
        ("kms:ReEncryptTo", "DataKey"),
        ("kms:ReEncryptFrom", RECOVERY_KEY),  # and a copy's, from its recovery key
    },
    "thaw_objects": READ_BACKUPS
    | UPDATE_CATALOG
    | REMOVE_STAGED  # a damaged staged copy
    | ASSUME_ACCOUNT_B
    | {
        ("s3:RestoreObject", "vault/backups/*"),  # only the vault's copies are archived
        ("s3:PutObject", STAGED),
        ("s3:GetObjectAttributes", STAGED),  # each staged copy's CRC64NVME
        ("s3:AbortMultipartUpload", STAGED),
    },
    "sign_download": READ_BACKUPS
    | {("s3:GetObject", "staging/_work/*"), ("s3:PutObject", "staging/_work/*")},
    "record_download": UPDATE_CATALOG,
    "check_prepared": set(),  # it reads its input and raises
    "finalize_restore": UPDATE_CATALOG | NOTIFY | REMOVE_STAGED | {("dynamodb:GetItem", "catalog")},
    "cleanup_restore": UPDATE_CATALOG | NOTIFY | REMOVE_STAGED | {("dynamodb:Query", "inbox")},
}


def test_restore_calls_exactly_the_restore_functions() -> None:
    shared = {"dispatch", "check_nodes"}  # a command to a node; a per-node Map's check
    assert set(modules_called(RESTORE_ASL)) == set(RESTORE_GRANTS) | shared


def test_the_per_node_check_calls_nothing(synth: Synthesized) -> None:
    assert grants(synth, "check_nodes") == set()  # it reads its input and raises


@pytest.mark.parametrize("module", sorted(RESTORE_GRANTS))
def test_restore_function_gets_exactly_what_it_calls(synth: Synthesized, module: str) -> None:
    assert grants(synth, module) == RESTORE_GRANTS[module]


def test_dispatcher_reads_work_objects_and_signs_answers_only(synth: Synthesized) -> None:
    s3 = {g for g in grants(synth, "dispatch") if g[0].startswith("s3:")}
    assert s3 == {
        ("s3:GetObject", "staging/_work/*"),  # args_key
        ("s3:PutObject", "staging/_work/*/answers/*"),  # the answer URLs it signs
    }


RINGERS = {"dispatch", "cleanup_backup", "reap_execution", "validate_backup"}


def test_only_the_posters_ring_doorbells_and_only_doorbells(synth: Synthesized) -> None:
    """The dispatcher and the cleanups that post releases or aborts look a node's doorbell up
    and send to it; they may neither read, delete nor create queues, nor reach a queue
    outside the stack's account and region. No other function touches SQS."""
    for module, statements in _function_statements(synth).items():
        sqs = {g for g in grants(synth, module) if g[0].startswith("sqs:")}
        if module in RINGERS:
            doorbells = f"{DOORBELL_PREFIX}*"
            assert sqs == {("sqs:GetQueueUrl", doorbells), ("sqs:SendMessage", doorbells)}
            (ring,) = [s for s in statements if any(a.startswith("sqs:") for a in actions(s))]
            assert referenced_ids(ring["Resource"]) == PSEUDO_PARAMETERS
        else:
            assert not sqs, module


@needs_asl
@pytest.mark.parametrize("name", sorted(MACHINES))
def test_substitutions_are_the_right_resources(synth: Synthesized, name: str) -> None:
    """Every ${Placeholder} of the deployed definition is filled, each with the ARN of the
    function its name says (or the staging bucket's name)."""
    _, machine = machines(synth)[name]
    properties = machine["Properties"]
    values = properties["DefinitionSubstitutions"]
    # The definition is deployed as a file asset: the ASL file as it is, filled by CloudFormation.
    asset = synth.outdir / f"asset.{properties['DefinitionS3Location']['Key']}"
    assert asset.read_text() == MACHINES[name].read_text()
    assert placeholders(asset.read_text()) == set(values)
    module_of = {spec.placeholder: spec.module for spec in FUNCTIONS if spec.placeholder}
    functions = function_ids(synth)
    for placeholder, value in values.items():
        if placeholder == WORK_BUCKET_PLACEHOLDER:
            assert value == {"Ref": buckets(synth)["staging"][0]}
        elif placeholder == RESTORE_MACHINE_PLACEHOLDER:
            assert value == {"Ref": machines(synth)[RESTORE_STATE_MACHINE_NAME][0]}
        else:
            assert value["Fn::GetAtt"][1] == "Arn", value
            assert functions[value["Fn::GetAtt"][0]] == module_of[placeholder]


@needs_asl
@pytest.mark.parametrize("path", ASL_FILES, ids=lambda p: p.name)
def test_distributed_maps_read_their_plan_from_the_work_bucket_and_write_nothing(
    path: Path,
) -> None:
    """What the state machine's role is granted for a Distributed Map: s3:GetObject under
    _work/ of the staging bucket (its plan), no s3:PutObject (a ResultWriter would need it).
    The per-node Maps (shardvault/workflow/fanout.py) take their items from the state; each child
    catches its own failure, so that the check after the Map fails with the node's error."""
    for state in distributed_maps(path):
        assert "ResultWriter" not in state
        if "ItemsPath" in state:  # a per-node Map
            tasks = [s for s in state["ItemProcessor"]["States"].values() if s["Type"] == "Task"]
            assert tasks
            for task in tasks:
                assert task["Catch"][0]["ErrorEquals"] == ["States.ALL"]
            assert state["MaxConcurrency"] == NODE_MAP_CONCURRENCY
            continue
        reader = state["ItemReader"]
        assert reader["Resource"] == "arn:aws:states:::s3:getObject"
        assert reader["Parameters"]["Bucket"] == f"${{{WORK_BUCKET_PLACEHOLDER}}}"
    expected = {"backup.asl.json": 7, "restore.asl.json": 4, "retention.asl.json": 0}
    assert len(distributed_maps(path)) == expected.get(path.name, len(distributed_maps(path)))


@needs_asl
def test_an_answer_url_lives_as_long_as_its_task_waits() -> None:
    """The dispatcher signs each listing command's answer PUT for ANSWER_URL_TTL_SECONDS: the
    tasks that wait for those answers time out then, not before nor after."""
    states = json.loads(BACKUP_ASL.read_text())["States"]
    for name, command in (("Checkpoint", "checkpoint"), ("Scan", "scan"), ("Stop", "stop")):
        processor = states[name]["ItemProcessor"]
        task = processor["States"][processor["StartAt"]]
        assert task["Parameters"]["Payload"]["command"] == command
        assert command in ANSWERED
        assert task["TimeoutSeconds"] == ANSWER_URL_TTL_SECONDS, name


@needs_asl
def test_a_backups_per_node_maps_are_distributed_and_checked() -> None:
    """Past 40 nodes inline Maps run in waves, and at ~620 nodes their history events exceed
    AWS's 25,000: every per-node step of a backup is a Distributed Map."""
    states = json.loads(BACKUP_ASL.read_text())["States"]
    release = states["ReleaseAndFinalize"]["Branches"][0]["States"]["Release"]
    assert release["ItemProcessor"]["ProcessorConfig"]["Mode"] == "DISTRIBUTED"
    for name in ("Flush", "Checkpoint", "Scan", "Stop", "ReleaseAfterFailure"):
        assert states[name]["ItemProcessor"]["ProcessorConfig"]["Mode"] == "DISTRIBUTED", name
    # Release's children note a failure; the others' is checked by the next task on every way
    # on: CheckNodes, or the plan step, which raises the first node's failure before it plans.
    checking = {"${CheckNodesFunctionArn}", "${PlanBackupFunctionArn}"}
    for name in ("Flush", "Checkpoint", "Scan", "Stop"):
        for check in next_tasks(states, states[name]["Next"]):
            assert check["Parameters"]["FunctionName"] in checking, name
            assert check["Catch"][0]["Next"] == "ReleaseAfterFailure"


def next_tasks(states: dict, name: str) -> list[dict]:
    """The Task states reached from ``name`` through Choice states."""
    state = states[name]
    if state["Type"] != "Choice":
        return [state]
    ways = [choice["Next"] for choice in state["Choices"]] + [state["Default"]]
    return [task for way in ways for task in next_tasks(states, way)]


# --- storage, tables, topic, alarms ------------------------------------------------------------
def test_staging_bucket_is_private_encrypted_tls_only_and_aborts_uploads(
    synth: Synthesized,
) -> None:
    bucket_id, bucket = buckets(synth)["staging"]
    properties = bucket["Properties"]
    assert properties["PublicAccessBlockConfiguration"] == {
        "BlockPublicAcls": True,
        "BlockPublicPolicy": True,
        "IgnorePublicAcls": True,
        "RestrictPublicBuckets": True,
    }
    (encryption,) = properties["BucketEncryption"]["ServerSideEncryptionConfiguration"]
    assert encryption["ServerSideEncryptionByDefault"]["SSEAlgorithm"] in {"AES256", "aws:kms"}
    assert "VersioningConfiguration" not in properties
    assert bucket["DeletionPolicy"] == "Retain"
    aborts = [
        rule
        for rule in properties["LifecycleConfiguration"]["Rules"]
        if rule.get("AbortIncompleteMultipartUpload")
    ]
    assert aborts, "no lifecycle rule aborts incomplete multipart uploads"
    assert all("TagFilters" not in rule for rule in aborts)
    assert aborts[0]["AbortIncompleteMultipartUpload"]["DaysAfterInitiation"] == 2

    promoted = [
        rule
        for rule in properties["LifecycleConfiguration"]["Rules"]
        if rule.get("TagFilters") == [{"Key": PROMOTED_TAG, "Value": "true"}]
    ]
    assert promoted, "no lifecycle rule expires the staging copies of promoted backups"
    assert all(rule["Prefix"] == "backups/" for rule in promoted)
    # Untagged backup objects (never promoted) are never expired by lifecycle.
    untagged = [
        r
        for r in properties["LifecycleConfiguration"]["Rules"]
        if "ExpirationInDays" in r and not r.get("TagFilters")
    ]
    assert all(r["Prefix"] == "_work/" for r in untagged), untagged

    policy = bucket_policy(synth, bucket_id)
    assert any(
        s["Effect"] == "Deny"
        and s.get("Condition", {}).get("Bool", {}).get("aws:SecureTransport") == "false"
        for s in policy["Properties"]["PolicyDocument"]["Statement"]
    ), "no TLS-only statement in the bucket policy"


def bucket_policy(synth: Synthesized, bucket_id: str) -> dict[str, Any]:
    (policy,) = [
        p
        for p in resources_of(synth, "AWS::S3::BucketPolicy").values()
        if referenced_ids(p["Properties"]["Bucket"]) == {bucket_id}
    ]
    return policy


def test_vault_is_locked_versioned_tls_only_and_denies_deletes_and_agents(
    synth: Synthesized,
) -> None:
    vault_id, vault = buckets(synth)["vault"]
    properties = vault["Properties"]
    assert properties["ObjectLockEnabled"] is True
    assert properties["VersioningConfiguration"] == {"Status": "Enabled"}
    assert properties["PublicAccessBlockConfiguration"]["BlockPublicPolicy"] is True
    assert "BucketEncryption" in properties
    assert vault["DeletionPolicy"] == "Retain"
    statements = bucket_policy(synth, vault_id)["Properties"]["PolicyDocument"]["Statement"]
    denies = [s for s in statements if s["Effect"] == "Deny"]
    assert any(
        s.get("Condition", {}).get("Bool", {}).get("aws:SecureTransport") == "false" for s in denies
    )
    (deletes,) = [s for s in denies if "s3:DeleteObjectVersion" in as_list(s["Action"])]
    (exempt,) = deletes["Condition"]["ArnNotEquals"]["aws:PrincipalArn"]
    roles = {m: only_id(fn["Properties"]["Role"]) for m, fn in functions_by_module(synth).items()}
    assert referenced_ids(exempt) == {roles["expire_backup"]}
    (agents,) = [s for s in denies if s.get("Sid") == "DenyAgents"]
    assert agents["Action"] == "s3:*"
    assert agents["Condition"] == {"Null": {f"aws:PrincipalTag/{NODE_ID_TAG}": "false"}}


def functions_by_module(synth: Synthesized) -> dict[str, dict[str, Any]]:
    functions = resources_of(synth, "AWS::Lambda::Function")
    return {module: functions[logical_id] for logical_id, module in function_ids(synth).items()}


def test_schedules_follow_the_policy_with_window_retries_and_dead_letters(
    synth: Synthesized,
) -> None:
    from infra.constants import DEFAULT_POLICY
    from shardvault.config.policy import load_policy

    policy = load_policy(DEFAULT_POLICY)
    schedules = list(resources_of(synth, "AWS::Scheduler::Schedule").values())
    expected = sum(
        1 + bool(c.schedule.incremental) + bool(c.drill) + bool(c.cut.every_minutes)
        for c in policy.clusters.values()
    )
    assert len(schedules) == expected + 1  # cadences, drills and cuts, and retention
    assert any(c.drill for c in policy.clusters.values())
    assert any(c.cut.every_minutes for c in policy.clusters.values())
    cut_id = machines(synth)[CUT_STATE_MACHINE_NAME][0]
    backup_id = machines(synth)[BACKUP_STATE_MACHINE_NAME][0]
    retention_id = machines(synth)[RETENTION_STATE_MACHINE_NAME][0]
    drill_id = machines(synth)[DRILL_STATE_MACHINE_NAME][0]
    queues = resources_of(synth, "AWS::SQS::Queue")
    for schedule in schedules:
        properties = schedule["Properties"]
        target = properties["Target"]
        on_time = json.loads(target["Input"]).get("requested_by") == "schedule:cut"
        assert properties["FlexibleTimeWindow"]["Mode"] == ("OFF" if on_time else "FLEXIBLE")
        assert target["RetryPolicy"]["MaximumRetryAttempts"] >= 1
        assert referenced_ids(target["DeadLetterConfig"]["Arn"]) <= set(queues)
        payload = json.loads(target["Input"])
        if on_time:  # a scheduled cut: on the clock's multiples of its period, UTC
            cut = policy.clusters[payload["cluster"]].cut
            assert properties["ScheduleExpressionTimezone"] == "UTC"
            assert properties["ScheduleExpression"] == scheduler_cron(cut.cron)
            assert target["RetryPolicy"]["MaximumEventAgeInSeconds"] == 60
            assert referenced_ids(target["Arn"]) == {cut_id}
        elif payload.get("requested_by") == "schedule:drill":
            drill = policy.clusters[payload["cluster"]].drill
            assert properties["ScheduleExpressionTimezone"] == drill.timezone
            assert referenced_ids(target["Arn"]) == {drill_id}
        elif "cluster" in payload:
            cluster = policy.clusters[payload["cluster"]]
            assert properties["ScheduleExpressionTimezone"] == cluster.schedule.timezone
            assert referenced_ids(target["Arn"]) == {backup_id}
        else:
            assert referenced_ids(target["Arn"]) == {retention_id}
        assert properties["ScheduleExpression"].startswith("cron(")


def test_a_dead_lettered_schedule_start_alarms_the_notifications_topic(
    synth: Synthesized,
) -> None:
    """A schedule that could not start its run starts no execution, so only this alarm on its
    dead-letter queue can tell anyone."""
    (topic,) = resources_of(synth, "AWS::SNS::Topic")
    dead_letters = {
        target["DeadLetterConfig"]["Arn"]["Fn::GetAtt"][0]
        for target in (
            s["Properties"]["Target"]
            for s in resources_of(synth, "AWS::Scheduler::Schedule").values()
        )
    }
    alarms = [
        a["Properties"]
        for a in resources_of(synth, "AWS::CloudWatch::Alarm").values()
        if a["Properties"].get("Namespace") == "AWS/SQS"
    ]
    (alarm,) = alarms
    assert alarm["MetricName"] == "ApproximateNumberOfMessagesVisible"
    (dimension,) = alarm["Dimensions"]
    assert referenced_ids(dimension["Value"]) == dead_letters
    assert alarm["Threshold"] == 1
    assert alarm["ComparisonOperator"] == "GreaterThanOrEqualToThreshold"
    assert alarm["AlarmActions"] == [{"Ref": topic}]


def test_the_watch_reads_backups_and_agents_and_writes_its_own_metrics_only(
    synth: Synthesized,
) -> None:
    assert grants(synth, "watch_clusters") == {
        ("dynamodb:Query", "catalog"),
        ("dynamodb:Scan", "nodes"),
        ("cloudwatch:PutMetricData", "*"),  # in the ShardVault namespace only (checked above)
    }
    (rule,) = [
        r["Properties"]
        for r in resources_of(synth, "AWS::Events::Rule").values()
        if "ScheduleExpression" in r["Properties"]
    ]
    assert rule["ScheduleExpression"] == "rate(15 minutes)"
    watcher = {m: i for i, m in function_ids(synth).items()}["watch_clusters"]
    assert referenced_ids(rule["Targets"][0]["Arn"]) == {watcher}


def test_verify_reads_backups_and_writes_only_its_outcome(synth: Synthesized) -> None:
    reads = {(a, "staging/backups/*") for a in ("s3:GetObject", "s3:GetObjectAttributes")}
    # The vault is versioned: S3 authorizes GetObjectAttributes there by the version actions.
    reads |= {
        (a, "vault/backups/*")
        for a in ("s3:GetObject", "s3:GetObjectVersion", "s3:GetObjectVersionAttributes")
    }
    lists = {("s3:ListBucket", store) for store in ("staging", "vault")}
    catalog = {(a, "catalog") for a in ("dynamodb:Query", "dynamodb:GetItem")}
    assert grants(synth, "verify_backup") == (
        reads | lists | catalog | UPDATE_CATALOG | ASSUME_ACCOUNT_B
    )


def test_the_probe_signs_writes_and_deletes_probe_objects_only(synth: Synthesized) -> None:
    probes = {(a, "staging/_work/probes/*") for a in ("s3:PutObject", "s3:GetObject")}
    assert grants(synth, "probe_store") == probes | ASSUME_ACCOUNT_B | {
        ("s3:DeleteObject", "staging/_work/probes/*"),
        ("s3:ListBucket", "staging"),  # only under _work/probes/: the leftovers to delete
        ("s3:PutObject", "staging/_work/*"),  # the URLs, for the dispatcher (args_key)
        ("dynamodb:Query", "nodes"),  # the cluster's agents (its index)
        ("dynamodb:Query", "nodes/index/by_cluster"),
        ("dynamodb:Query", "inbox"),  # the agents' failure notes
        # A copy's recovery key, both ways, with a throwaway data key made without plaintext
        # (shardvault/assurance/copy_check.py: recovery_round_trip).
        ("kms:GenerateDataKeyWithoutPlaintext", "DataKey"),
        ("kms:ReEncryptFrom", "DataKey"),
        ("kms:ReEncryptTo", "DataKey"),
        ("kms:ReEncryptTo", RECOVERY_KEY),
        ("kms:ReEncryptFrom", RECOVERY_KEY),
    }


def test_a_scheduled_cut_reads_the_leaders_and_writes_one_catalog_item(synth) -> None:
    assert grants(synth, "cut_cluster") == {
        ("dynamodb:Query", "nodes"),  # the cluster's agents (its index)
        ("dynamodb:Query", "nodes/index/by_cluster"),
        ("dynamodb:PutItem", "catalog"),  # the cut's item, written once
        ("dynamodb:Query", "inbox"),  # the agents' failure notes
    }


def test_the_wal_archive_signs_and_records_wal_batches_only(synth: Synthesized) -> None:
    wal = "staging/backups/*/_wal/*"
    assert {g for g in grants(synth, "archive_wal") if not g[0].startswith("kms:")} == {
        ("s3:PutObject", wal),  # the presigned PUT of a batch, and its index
        ("s3:GetObject", wal),
        ("s3:GetObjectAttributes", wal),  # the stored checksum, never the agent's word
        ("s3:ListBucket", "staging"),  # only under backups/: a missing batch is NoSuchKey
        ("dynamodb:GetItem", "nodes"),  # the caller's registration
        ("dynamodb:GetItem", "inbox"),  # the request the node wrote into its own items
        ("dynamodb:UpdateItem", "catalog"),  # the archive's counters (the cost model)
    }


def test_agents_may_invoke_the_wal_archive_and_no_other_function(synth: Synthesized) -> None:
    _, statements = _agent_policy(synth)
    invoking = [s for s in statements if any(a.startswith("lambda:") for a in actions(s))]
    (statement,) = invoking
    assert actions(statement) == ["lambda:InvokeFunction"]
    (target,) = as_list(statement["Resource"])
    assert referenced_ids(target) == {only_id_of_kind(synth, "AWS::Lambda::Function", "ArchiveWal")}
    assert "ArchiveFunctionName" in synth.json["Outputs"]


def test_each_cluster_alarms_past_its_rpo_and_silent_outdated_agents_spools_lone_functions(
    synth: Synthesized,
) -> None:
    """The watch's metrics and the errors of the functions no workflow runs each reach the
    topic; each cluster of the policy has its own backup-age alarm at its RPO."""
    (topic,) = resources_of(synth, "AWS::SNS::Topic")
    alarms = [a["Properties"] for a in resources_of(synth, "AWS::CloudWatch::Alarm").values()]
    policy = load_policy(DEFAULT_POLICY)
    ages = {
        a["Dimensions"][0]["Value"]: a
        for a in alarms
        if a.get("MetricName") == "NewestBackupAgeHours"
    }
    assert set(ages) == set(policy.clusters)
    for cluster, alarm in ages.items():
        # Nightly: the longest gap and a quarter (Europe/Paris: 25 h across a DST change).
        assert alarm["Threshold"] == policy.rpo_hours(cluster) in (30, 32)
        assert alarm["ComparisonOperator"] == "GreaterThanThreshold"
        assert cluster in alarm["AlarmDescription"]
        assert alarm["AlarmActions"] == [{"Ref": topic}]
    (silent,) = [a for a in alarms if a.get("MetricName") == "SilentAgents"]
    assert silent["EvaluationPeriods"] == 2  # a restart between two watches is no alarm
    assert silent["AlarmActions"] == [{"Ref": topic}]
    (stalled,) = [a for a in alarms if a.get("MetricName") == "StalledWalSpools"]
    assert stalled["EvaluationPeriods"] == 2
    assert stalled["Threshold"] == 1
    assert stalled["AlarmActions"] == [{"Ref": topic}]
    (outdated,) = [a for a in alarms if a.get("MetricName") == "OutdatedAgents"]
    assert outdated["EvaluationPeriods"] == 1  # an outdated agent stays so until upgraded
    assert outdated["Threshold"] == 1
    assert "shardvault nodes" in outdated["AlarmDescription"]
    assert outdated["AlarmActions"] == [{"Ref": topic}]
    (errors,) = [a for a in alarms if "Metrics" in a]
    errored = {
        only_id(m["MetricStat"]["Metric"]["Dimensions"][0]["Value"])
        for m in errors["Metrics"]
        if "MetricStat" in m
    }
    by_id = function_ids(synth)
    assert {by_id[i] for i in errored} == {"reap_execution", "watch_clusters", "archive_wal"}
    assert errors["AlarmActions"] == [{"Ref": topic}]


def test_the_dashboard_shows_ages_outcomes_and_executions(synth: Synthesized) -> None:
    (dashboard,) = resources_of(synth, "AWS::CloudWatch::Dashboard").values()
    body = json.dumps(dashboard["Properties"]["DashboardBody"])
    for shown in (
        "NewestBackupAgeHours",
        "SilentAgents",
        "BackupsSucceeded",
        "BackupsFailed",
        "RestoresSucceeded",
        "BackupBytes",
        "ExecutionsFailed",
        "ExecutionTime",
        "message = 'outcome'",
        "orders RPO",
    ):
        assert shown in body, shown


def test_the_cost_models_deployment_line_counts_what_the_stack_holds(synth: Synthesized) -> None:
    """``shardvault cost`` prints the deployment's own month from these counts: a key or an
    alarm added to the stack must be added there too."""
    from shardvault.lifecycle import costs

    month = costs.deployment_month(len(load_policy(DEFAULT_POLICY).clusters))
    assert len(resources_of(synth, "AWS::KMS::Key")) == month.kms_keys
    alarms = resources_of(synth, "AWS::CloudWatch::Alarm").values()
    billed = sum(len(a["Properties"].get("Metrics", [])) or 1 for a in alarms)
    billed -= sum(  # the expression of a metric-math alarm is no metric
        1 for a in alarms for m in a["Properties"].get("Metrics", []) if "Expression" in m
    )
    assert billed == month.alarm_metrics
    assert len(resources_of(synth, "AWS::CloudWatch::Dashboard")) == month.dashboards


def test_tables(synth: Synthesized) -> None:
    tables = list(resources_of(synth, "AWS::DynamoDB::Table").values())
    by_keys = {
        tuple(k["AttributeName"] for k in t["Properties"]["KeySchema"]): t["Properties"]
        for t in tables
    }
    assert set(by_keys) == {("cluster", "backup_id"), ("node_id",), ("node_id", "command_id")}
    for properties in by_keys.values():
        assert properties["BillingMode"] == "PAY_PER_REQUEST"
        pitr = properties["PointInTimeRecoverySpecification"]
        assert pitr["PointInTimeRecoveryEnabled"] is True
        assert properties["SSESpecification"]["SSEEnabled"] is True
    (index,) = by_keys[("node_id",)]["GlobalSecondaryIndexes"]
    assert index["IndexName"] == "by_cluster"
    assert [k["AttributeName"] for k in index["KeySchema"]] == ["cluster", "node_id"]
    ttl = by_keys[("node_id", "command_id")]["TimeToLiveSpecification"]
    assert ttl == {"AttributeName": "expires_at", "Enabled": True}


def test_topic_is_encrypted_tls_only_and_open_to_alarms(synth: Synthesized) -> None:
    topic_id, topic = only(resources_of(synth, "AWS::SNS::Topic"))
    (key_id,) = referenced_ids(topic["Properties"]["KmsMasterKeyId"])
    key = synth.json["Resources"][key_id]["Properties"]
    assert key["EnableKeyRotation"] is True
    key_principals = [s.get("Principal") for s in key["KeyPolicy"]["Statement"]]
    assert {"Service": "cloudwatch.amazonaws.com"} in key_principals
    _, policy = only(resources_of(synth, "AWS::SNS::TopicPolicy"))
    statements = policy["Properties"]["PolicyDocument"]["Statement"]
    assert any(
        s["Effect"] == "Deny" and s["Condition"]["Bool"]["aws:SecureTransport"] == "false"
        for s in statements
    )
    assert topic_id in referenced_ids(policy["Properties"]["Topics"])


def test_alarms_on_failed_and_timed_out_executions_notify_the_topic(synth: Synthesized) -> None:
    topic_id, _ = only(resources_of(synth, "AWS::SNS::Topic"))
    alarms = [a["Properties"] for a in resources_of(synth, "AWS::CloudWatch::Alarm").values()]
    for machine_id, _ in machines(synth).values():
        mine = {
            a["MetricName"]: a
            for a in alarms
            if referenced_ids(a.get("Dimensions", [])) == {machine_id}
        }
        assert set(mine) == {"ExecutionsFailed", "ExecutionsTimedOut"}
        for properties in mine.values():
            assert properties["Namespace"] == "AWS/States"
            assert referenced_ids(properties["AlarmActions"]) == {topic_id}


def test_outputs(synth: Synthesized) -> None:
    assert set(synth.json["Outputs"]) >= {
        "StagingBucketName",
        "CatalogTableName",
        "NodesTableName",
        "InboxTableName",
        "BackupStateMachineArn",
        "RestoreStateMachineArn",
        "RetentionStateMachineArn",
        "VaultBucketName",
        "NotificationsTopicArn",
        "AgentPolicyArn",
        "CopyWriterRoleNames",
        "CopyReaderRoleNames",
    }


def test_a_copy_targets_trust_names_the_roles_that_call_it(synth: Synthesized) -> None:
    """The GCS side trusts these roles by name (docs/guide/vault-copies.md): the writers
    (promotion, check's probe) and the readers (restores' steps, verify)."""
    outputs = synth.json["Outputs"]
    roles = resources_of(synth, "AWS::IAM::Role")

    def functions_of(output: str) -> list[str]:
        named = [r["Ref"] for r in outputs[output]["Value"]["Fn::Join"][1]]
        described = [roles[r]["Properties"]["Description"] for r in named]
        return [d.split()[1].rstrip(":") for d in described]

    assert functions_of("CopyWriterRoleNames") == ["promote_backup", "probe_store"]
    assert functions_of("CopyReaderRoleNames") == [
        "validate_restore",
        "plan_restore",
        "thaw_objects",
        "verify_backup",
    ]


# --- agents -----------------------------------------------------------------------------------
def _agent_policy(synth: Synthesized) -> tuple[str, list[dict[str, Any]]]:
    policies = resources_of(synth, "AWS::IAM::ManagedPolicy")
    logical_id, policy = only(
        {
            k: v
            for k, v in policies.items()
            if v["Properties"]["Description"] == AGENT_POLICY_DESCRIPTION
        }
    )
    return logical_id, policy["Properties"]["PolicyDocument"]["Statement"]


def test_agent_policy_grants_no_s3_at_all(synth: Synthesized) -> None:
    _, statements = _agent_policy(synth)
    granted = [a for s in statements for a in actions(s)]
    assert granted, "the agent policy grants nothing"
    assert not [a for a in granted if a.lower().startswith("s3:") or a == "*"], granted
    assert all(s["Effect"] == "Allow" and "NotAction" not in s for s in statements)


def test_agent_table_access_is_confined_to_its_own_node(synth: Synthesized) -> None:
    _, statements = _agent_policy(synth)
    dynamo = [s for s in statements if any(a.startswith("dynamodb:") for a in actions(s))]
    statuses = [s for s in dynamo if "dynamodb:Attributes" in json.dumps(s["Condition"])]
    own = [s for s in dynamo if s not in statuses]
    assert len(own) == 2  # inbox and node record
    expected = {"dynamodb:LeadingKeys": [f"${{aws:PrincipalTag/{NODE_ID_TAG}}}"]}
    for statement in own:
        assert statement["Condition"] == {"ForAllValues:StringEquals": expected}
        assert "dynamodb:Scan" not in actions(statement)  # LeadingKeys cannot confine a Scan
    # Reconcile at start: the status of a catalog item it names, no other attribute or call.
    (status,) = statuses
    assert actions(status) == ["dynamodb:GetItem"]
    assert status["Condition"] == {
        "ForAllValues:StringEquals": {"dynamodb:Attributes": ["cluster", "backup_id", "status"]},
        "StringEqualsIfExists": {"dynamodb:Select": "SPECIFIC_ATTRIBUTES"},
    }
    kms_statements = [s for s in statements if any(a.startswith("kms:") for a in actions(s))]
    sqs_statements = [s for s in statements if any(a.startswith("sqs:") for a in actions(s))]
    (describe,) = [s for s in statements if "cloudformation:DescribeStacks" in actions(s)]
    assert actions(describe) == ["cloudformation:DescribeStacks"]  # init: this stack's outputs
    assert describe["Resource"]["Fn::Join"][1][-1] == ":stack/ShardVault/*"
    (invoke,) = [s for s in statements if "lambda:InvokeFunction" in actions(s)]
    known = [*dynamo, *kms_statements, *sqs_statements, describe, invoke]
    others = [a for s in statements if s not in known for a in actions(s)]
    assert sorted(others) == [
        "states:SendTaskFailure",
        "states:SendTaskHeartbeat",
        "states:SendTaskSuccess",
    ]


def test_agents_unwrap_data_keys_of_their_own_cluster_only(synth: Synthesized) -> None:
    _, statements = _agent_policy(synth)
    (unwrap,) = [s for s in statements if any(a.startswith("kms:") for a in actions(s))]
    assert actions(unwrap) == ["kms:Decrypt"]
    assert referenced_ids(unwrap["Resource"]) == {only_id_of_kind(synth, "AWS::KMS::Key", "Data")}
    assert unwrap["Condition"] == {
        "StringEquals": {
            "kms:EncryptionContext:shardvault:cluster": "${aws:PrincipalTag/shardvault:cluster}"
        }
    }
    roles = resources_of(synth, "AWS::IAM::Role").values()
    clusters = {
        t["Value"]
        for r in roles
        for t in r["Properties"].get("Tags", [])
        if t["Key"] == CLUSTER_TAG
    }
    assert clusters == {"orders"}  # node-1=orders; node-2 names no cluster: it unwraps nothing


def test_agents_reach_their_own_doorbell_only(synth: Synthesized) -> None:
    """The one queue named after the caller's node id (the tag that confines its table
    access), in the stack's account and region: no wildcard, no other node's doorbell, and
    no SendMessage (only the dispatcher rings)."""
    _, statements = _agent_policy(synth)
    (doorbell,) = [s for s in statements if any(a.startswith("sqs:") for a in actions(s))]
    assert sorted(actions(doorbell)) == [
        "sqs:CreateQueue",
        "sqs:DeleteMessage",
        "sqs:GetQueueUrl",
        "sqs:ReceiveMessage",
        "sqs:SetQueueAttributes",
    ]
    assert "Condition" not in doorbell
    parts = doorbell["Resource"]["Fn::Join"][1]
    assert referenced_ids(parts) == PSEUDO_PARAMETERS
    assert parts[-1] == f":{DOORBELL_PREFIX}${{aws:PrincipalTag/{NODE_ID_TAG}}}"
    assert "*" not in json.dumps(doorbell["Resource"])
    assert parts[:2] == ["arn:", {"Ref": "AWS::Partition"}]
    assert parts[2] == ":sqs:"


def test_only_backup_validation_makes_data_keys_and_never_in_plaintext(synth: Synthesized) -> None:
    for module, statements in _function_statements(synth).items():
        kms_actions = {a for s in statements for a in actions(s) if a.startswith("kms:")}
        data_key_actions = {
            a
            for s in statements
            for a in actions(s)
            if a.startswith("kms:") and "Data" in json.dumps(s["Resource"])
        }
        if module in {"validate_backup", "archive_wal"}:  # a backup's key; a WAL batch's
            assert data_key_actions == {"kms:GenerateDataKeyWithoutPlaintext"}
        elif module == "plan_restore":  # wraps keys for another cluster: no plaintext either
            assert data_key_actions == {"kms:ReEncryptFrom", "kms:ReEncryptTo"}
        elif module == "promote_backup":  # wraps keys under a copy's recovery key: nor here
            assert data_key_actions == {"kms:ReEncryptFrom"}
        elif module == "probe_store":  # check: a throwaway key, wrapped there and back
            assert data_key_actions == {
                "kms:GenerateDataKeyWithoutPlaintext",
                "kms:ReEncryptFrom",
                "kms:ReEncryptTo",
            }
        else:
            assert not data_key_actions, (module, kms_actions)


def only_id_of_kind(synth: Synthesized, kind: str, contains: str) -> str:
    (logical_id,) = [k for k in resources_of(synth, kind) if contains in k]
    return logical_id


def test_each_node_has_an_ec2_role_tagged_with_its_id_and_only_the_policy(
    synth: Synthesized,
) -> None:
    policy_id, statements = _agent_policy(synth)
    roles = resources_of(synth, "AWS::IAM::Role")
    agent_roles = {k: v for k, v in roles.items() if policy_id in referenced_ids(v["Properties"])}
    tags = {}
    for role_id, role in agent_roles.items():
        (trust,) = role["Properties"]["AssumeRolePolicyDocument"]["Statement"]
        assert trust["Principal"] == {"Service": "ec2.amazonaws.com"}
        assert as_list(trust["Action"]) == ["sts:AssumeRole"]
        assert role_statements(synth.json, role_id) == statements  # nothing else attached
        (tag,) = [t for t in role["Properties"]["Tags"] if t["Key"] == NODE_ID_TAG]
        tags[tag["Value"]] = role_id
    # One role per node: a role's tags are the principal tags LeadingKeys compares with.
    assert sorted(tags) == [n.partition("=")[0] for n in AGENT_NODES]
    profiles = resources_of(synth, "AWS::IAM::InstanceProfile")
    assert len(profiles) == len(AGENT_NODES)


# --- validity and compliance -------------------------------------------------------------------
def test_cfn_lint_passes(synth: Synthesized, tmp_path: Path) -> None:
    path = tmp_path / "ShardVault.template.json"
    path.write_text(json.dumps(synth.json))
    cfn_lint = Path(sys.executable).with_name("cfn-lint")
    result = subprocess.run(
        [str(cfn_lint), "--format", "json", str(path)], capture_output=True, text=True, check=False
    )
    assert result.stdout.strip(), result.stderr
    findings = json.loads(result.stdout)
    problems = [
        f"{f['Rule']['Id']} {f['Message']}"
        for f in findings
        if f["Level"] == "Error"
        or (f["Level"] == "Warning" and f["Rule"]["Id"] not in ALLOWED_CFN_LINT_WARNINGS)
    ]
    assert problems == []


def test_no_unsuppressed_cdk_nag_errors(synth: Synthesized) -> None:
    errors = Annotations.from_stack(synth.stack).find_error(
        "*", Match.string_like_regexp("AwsSolutions-.*")
    )
    assert [f"{e.id}: {e.entry.data}" for e in errors] == []


def test_stack_is_environment_agnostic(synth: Synthesized) -> None:
    assert Token.is_unresolved(synth.stack.account)
    assert Token.is_unresolved(synth.stack.region)


def test_cdk_app_synthesizes_without_aws_credentials(tmp_path: Path) -> None:
    """Runs the app as ``cdk synth`` would (the command in cdk.json), with no AWS
    configuration at all, and fails on any error annotation as ``cdk synth`` does."""
    command = shlex.split(json.loads((REPO_ROOT / "cdk.json").read_text())["app"])
    assert command[0] == "python"
    environment = {
        "PATH": os.environ["PATH"],
        "HOME": str(tmp_path),  # no ~/.aws
        "CDK_OUTDIR": str(tmp_path / "cdk.out"),
        "JSII_SILENCE_WARNING_DEPRECATED_NODE_VERSION": "1",
    }
    result = subprocess.run(
        [sys.executable, *command[1:]],
        cwd=REPO_ROOT,
        env=environment,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    metadata = json.loads((tmp_path / "cdk.out" / "ShardVault.metadata.json").read_text())
    errors = [e["data"] for entries in metadata.values() for e in entries if "error" in e["type"]]
    assert errors == []
    assert (tmp_path / "cdk.out" / "ShardVault.template.json").is_file()


def test_aborted_and_timed_out_backups_and_restores_are_reaped(synth: Synthesized) -> None:
    (rule,) = [
        r
        for r in resources_of(synth, "AWS::Events::Rule").values()
        if "EventPattern" in r["Properties"]
    ]
    pattern = rule["Properties"]["EventPattern"]
    assert pattern["detail"]["status"] == ["ABORTED", "TIMED_OUT"]
    named = machines(synth)
    reaped = {named[BACKUP_STATE_MACHINE_NAME][0], named[RESTORE_STATE_MACHINE_NAME][0]}
    assert referenced_ids(pattern["detail"]["stateMachineArn"]) == reaped
    (target,) = rule["Properties"]["Targets"]
    reaper = {m: i for i, m in function_ids(synth).items()}["reap_execution"]
    assert referenced_ids(target["Arn"]) == {reaper}


def test_only_the_copy_functions_assume_the_policys_roles_in_other_accounts(
    synth: Synthesized,
) -> None:
    """sts:AssumeRole on exactly the aws copy targets' roles (their ARNs, no wildcard), for
    the functions that write or read a copy (shardvault/aws/vault_account.py)."""
    from shardvault.aws.vault_account import COPY_READERS, COPY_WRITERS

    assuming = {
        module
        for module in _function_statements(synth)
        if any(g[0] == "sts:AssumeRole" for g in grants(synth, module))
    }
    assert assuming == {*COPY_WRITERS, *COPY_READERS}
    for module in assuming:
        assert {g for g in grants(synth, module) if g[0] == "sts:AssumeRole"} == ASSUME_ACCOUNT_B


def test_only_promotion_and_check_wrap_under_a_recovery_key_and_a_plan_and_check_unwrap(
    synth: Synthesized,
) -> None:
    """A copy's recovery key (its ARN, no wildcard): promotion re-encrypts the data keys from
    the stack's key to it, a restore's plan from it, check's probe both; none may Decrypt."""
    using = {
        module: {g for g in grants(synth, module) if g[1] == RECOVERY_KEY}
        for module in _function_statements(synth)
    }
    assert {m: g for m, g in using.items() if g} == {
        "promote_backup": {("kms:ReEncryptTo", RECOVERY_KEY)},
        "plan_restore": {("kms:ReEncryptFrom", RECOVERY_KEY)},
        "probe_store": {("kms:ReEncryptTo", RECOVERY_KEY), ("kms:ReEncryptFrom", RECOVERY_KEY)},
    }
    assert ("kms:ReEncryptFrom", "DataKey") in grants(synth, "promote_backup")


def test_promotion_may_read_back_the_lock_it_set(synth: Synthesized) -> None:
    """HeadObject shows an object's lock only to a caller with s3:GetObjectRetention: without
    it every promotion would fail its read-back (shardvault/lifecycle/promote.py confirm_lock)."""
    assert ("s3:GetObjectRetention", "vault/backups/*") in grants(synth, "promote_backup")


def test_scan_preparer_reads_backups_and_writes_only_work_objects(synth: Synthesized) -> None:
    """Its presigned GETs of parent block maps carry its permissions: reading backups only."""
    assert grants(synth, "prepare_scan") == READ_BACKUPS | {
        ("s3:PutObject", "staging/_work/*"),
        ("dynamodb:GetItem", "catalog"),
        ("dynamodb:UpdateItem", "catalog"),  # the part size it chose
    }


def test_a_second_stack_shares_the_account_without_a_name_clash() -> None:
    """IAM names are account-wide and state machine and log group names per region: a
    second deployment (-c stackName=...) has its own, and IAM's are CloudFormation's."""
    _, stack = build_app(context={"stackName": "ShardVault-staging", "agentNodes": AGENT_NODES})
    template = Template.from_stack(stack).to_json()
    resources = template["Resources"].values()
    named = {"RoleName", "ManagedPolicyName", "InstanceProfileName", "PolicyName", "GroupName"}
    for resource in resources:
        if resource["Type"].startswith("AWS::IAM::"):
            assert not named & set(resource["Properties"]) - {"PolicyName"}, resource
    machines = [
        r["Properties"]["StateMachineName"]
        for r in resources
        if r["Type"] == "AWS::StepFunctions::StateMachine"
    ]
    assert sorted(machines) == sorted(
        f"ShardVault-staging-{w}"
        for w in ("backup", "restore", "retention", "verify", "probe", "drill", "cut")
    )
    machine_logs = [
        r["Properties"].get("LogGroupName")
        for r in resources
        if r["Type"] == "AWS::Logs::LogGroup"
        and "states" in str(r["Properties"].get("LogGroupName"))
    ]
    assert sorted(machine_logs) == sorted(f"/aws/vendedlogs/states/{m}" for m in machines)
    outputs = template["Outputs"]
    assert {"AgentInstanceProfileNode1", "AgentInstanceProfileNode2"} <= set(outputs)
