"""Workflows: a STANDARD state machine defined by a file of ``statemachines/`` (backup,
restore, retention, verify, probe, drill), its role, its log group and its alarms.

The ASL file holds orchestration only; every ARN and bucket in it is a ``${Placeholder}``
filled by ``definition_substitutions``. A definition read from a file gets no automatic
grants from CDK, so the role's every permission is written here: invoking the functions its
file names (and no other) and, only when the file has a Distributed Map (the backup's Upload,
the restore's Download), running that Map's child executions and, when it reads its items with
an ItemReader, reading those lists (the plans) from the work prefix of the staging bucket; and
when it starts another state machine as a nested execution (the drill starts restores with
``states:startExecution.sync:2``), starting that one, watching its executions and the managed
EventBridge rule through which Step Functions learns that they ended.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from aws_cdk import Duration, Stack
from aws_cdk import aws_cloudwatch as cloudwatch
from aws_cdk import aws_cloudwatch_actions as cw_actions
from aws_cdk import aws_iam as iam
from aws_cdk import aws_lambda as lambda_
from aws_cdk import aws_logs as logs
from aws_cdk import aws_s3 as s3
from aws_cdk import aws_sns as sns
from aws_cdk import aws_stepfunctions as sfn
from cdk_nag import NagSuppressions
from constructs import Construct

from infra import policies
from infra.constants import (
    FUNCTIONS,
    WORK_BUCKET_PLACEHOLDER,
    WORK_PREFIX,
)

# The rule Step Functions manages to learn that a nested .sync execution ended.
NESTED_EXECUTIONS_RULE = "StepFunctionsGetEventsForStepFunctionsExecutionRule"

PLACEHOLDER = re.compile(r"\$\{(\w+)\}")


def placeholders_in(definition: Path) -> set[str]:
    return set(PLACEHOLDER.findall(definition.read_text()))


def modules_called(definition: Path) -> list[str]:
    """The functions a definition invokes: those whose placeholder it uses."""
    used = placeholders_in(definition)
    return [spec.module for spec in FUNCTIONS if spec.placeholder in used]


def _states(states: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every state, including those inside Map processors and Parallel branches."""
    for state in states.values():
        yield state
        processor = state.get("ItemProcessor") or state.get("Iterator") or {}
        yield from _states(processor.get("States", {}))
        for branch in state.get("Branches", []):
            yield from _states(branch.get("States", {}))


def distributed_maps(definition: Path) -> list[dict[str, Any]]:
    """The definition's Distributed Map states: they need the Map Run and ItemReader grants."""
    return [
        state
        for state in _states(json.loads(definition.read_text())["States"])
        if state.get("Type") == "Map"
        and state.get("ItemProcessor", {}).get("ProcessorConfig", {}).get("Mode") == "DISTRIBUTED"
    ]


def item_readers(definition: Path) -> list[dict[str, Any]]:
    """Map states that read their items from S3 (the plans under the work prefix)."""
    return [
        state
        for state in _states(json.loads(definition.read_text())["States"])
        if state.get("Type") == "Map" and "ItemReader" in state
    ]


def substitutions(
    functions: Mapping[str, lambda_.IFunction],
    work_bucket: s3.IBucket,
    definition: Path,
    nested: Mapping[str, sfn.IStateMachine] | None = None,
) -> dict[str, str]:
    """The value of every placeholder the definition uses (and no other)."""
    used = placeholders_in(definition)
    values = {
        spec.placeholder: functions[spec.module].function_arn
        for spec in FUNCTIONS
        if spec.placeholder in used
    }
    if WORK_BUCKET_PLACEHOLDER in used:
        values[WORK_BUCKET_PLACEHOLDER] = work_bucket.bucket_name
    for placeholder, machine in (nested or {}).items():
        if placeholder in used:
            values[placeholder] = machine.state_machine_arn
    return values


class Workflow(Construct):
    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        functions: Mapping[str, lambda_.IFunction],
        work_bucket: s3.IBucket,
        alarm_topic: sns.ITopic,
        definition: Path,
        name: str,
        log_retention: logs.RetentionDays = logs.RetentionDays.ONE_MONTH,
        nested: Mapping[str, tuple[str, sfn.IStateMachine]] | None = None,
    ) -> None:
        """``nested``: by placeholder, the name and the state machine this one starts."""
        super().__init__(scope, construct_id)
        distributed = bool(distributed_maps(definition))
        self.role = iam.Role(
            self,
            "Role",
            assumed_by=iam.ServicePrincipal("states.amazonaws.com"),
            description=f"{name}: invokes its functions"
            + (", runs its Map Runs, reads its plans." if distributed else "."),
        )
        self._grant_invoke([functions[module] for module in modules_called(definition)])
        if distributed:  # retention's Map is inline: it starts no executions
            self._grant_map_runs(name)
        if item_readers(definition):
            # The ItemReader: {"Bucket": "${WorkBucket}", "Key.$": "$.plan.plan_key"}, a _work/ key.
            self.role.add_to_principal_policy(
                policies.objects(work_bucket, WORK_PREFIX, "s3:GetObject")
            )
        for nested_name, _ in (nested or {}).values():
            self._grant_nested(nested_name)
        self.state_machine = sfn.StateMachine(
            self,
            "StateMachine",
            state_machine_name=name,
            state_machine_type=sfn.StateMachineType.STANDARD,
            definition_body=sfn.DefinitionBody.from_file(str(definition)),
            definition_substitutions=substitutions(
                functions,
                work_bucket,
                definition,
                {placeholder: machine for placeholder, (_, machine) in (nested or {}).items()},
            ),
            role=self.role,
            logs=sfn.LogOptions(
                # Under /aws/vendedlogs/states/: Step Functions then adds no statement per log
                # group to the account's CloudWatch Logs resource policy (5,120 characters).
                destination=logs.LogGroup(
                    self,
                    "Logs",
                    log_group_name=f"/aws/vendedlogs/states/{name}",
                    retention=log_retention,
                ),
                level=sfn.LogLevel.ALL,
                include_execution_data=False,  # inputs carry task tokens and presigned URLs
            ),
            tracing_enabled=True,
        )
        self._alarm_on(alarm_topic)
        self._suppress_wildcards()

    def _grant_invoke(self, functions: object) -> None:
        arns = [arn for fn in functions for arn in (fn.function_arn, f"{fn.function_arn}:*")]
        self.role.add_to_principal_policy(
            iam.PolicyStatement(actions=["lambda:InvokeFunction"], resources=arns)
        )

    def _grant_map_runs(self, name: str) -> None:
        """A Distributed Map starts executions of its own state machine and watches them (its
        own and its Map Runs' children)."""
        self._grant_start_and_watch(name, policies.execution_arns(Stack.of(self), name))

    def _grant_start_and_watch(self, name: str, executions: list[str]) -> None:
        """Start executions of the state machine ``name``; describe and stop ``executions``."""
        self.role.add_to_principal_policy(
            iam.PolicyStatement(
                actions=["states:StartExecution"],
                resources=[policies.state_machine_arn(Stack.of(self), name)],
            )
        )
        self.role.add_to_principal_policy(
            iam.PolicyStatement(
                actions=["states:DescribeExecution", "states:StopExecution"],
                resources=executions,
            )
        )

    def _grant_nested(self, name: str) -> None:
        """``startExecution.sync:2`` of the state machine ``name``: start it, describe and stop
        its executions (not its Map Runs'), and the managed rule that reports their end."""
        stack = Stack.of(self)
        self._grant_start_and_watch(name, policies.execution_arns(stack, name)[:1])
        self.role.add_to_principal_policy(
            iam.PolicyStatement(
                actions=["events:PutTargets", "events:PutRule", "events:DescribeRule"],
                resources=[
                    stack.format_arn(
                        service="events", resource="rule", resource_name=NESTED_EXECUTIONS_RULE
                    )
                ],
            )
        )

    def _alarm_on(self, topic: sns.ITopic) -> None:
        machine = self.state_machine
        for metric_name, metric in (
            ("ExecutionsFailed", machine.metric_failed(period=Duration.minutes(5))),
            ("ExecutionsTimedOut", machine.metric_timed_out(period=Duration.minutes(5))),
        ):
            alarm = cloudwatch.Alarm(
                self,
                f"{metric_name}Alarm",
                alarm_description=f"{machine.state_machine_name}: {metric_name} >= 1 in 5 min.",
                metric=metric,
                threshold=1,
                evaluation_periods=1,
                comparison_operator=cloudwatch.ComparisonOperator.GREATER_THAN_OR_EQUAL_TO_THRESHOLD,
                treat_missing_data=cloudwatch.TreatMissingData.NOT_BREACHING,
            )
            alarm.add_alarm_action(cw_actions.SnsAction(topic))

    def _suppress_wildcards(self) -> None:
        NagSuppressions.add_resource_suppressions(
            self.role,
            [
                {
                    "id": "AwsSolutions-IAM5",
                    "reason": "Each wildcard is as narrow as the API allows: ':*' after a "
                    "function ARN covers that function's versions only; execution ARNs of "
                    "this state machine only (its own and its Map Runs' children, whose names "
                    "are generated); plans under the work prefix only (their keys hold the "
                    "backup id); '*' for the log-delivery and X-Ray actions CDK adds for "
                    "logging and tracing, which support no resource-level permissions.",
                    "appliesTo": [
                        {"regex": "/^Resource::<.+\\.Arn>:\\*$/"},
                        {"regex": "/^Resource::arn:<AWS::Partition>:states:.+/"},
                        {"regex": f"/^Resource::<.+\\.Arn>\\/{WORK_PREFIX}\\*$/"},
                        "Resource::*",
                    ],
                }
            ],
            apply_to_children=True,
        )
