"""Functions: the Lambda functions of the backup workflow (one per ``FUNCTIONS`` spec).

They share one *code asset* (built once, locally), one *environment* and one shape (runtime,
architecture, tracing, log retention). Each has its own *role*, which starts empty apart from
writing to its own *log group*; the stack adds each function's grants with ``grant``.
"""

from __future__ import annotations

from collections.abc import Mapping

from aws_cdk import Duration
from aws_cdk import aws_iam as iam
from aws_cdk import aws_lambda as lambda_
from aws_cdk import aws_logs as logs
from cdk_nag import NagSuppressions
from constructs import Construct

from infra.bundling import Platform, lambda_code
from infra.constants import FUNCTIONS, FunctionSpec

RUNTIME = lambda_.Runtime.PYTHON_3_12
# arm64 (Graviton): about 20% cheaper per GB-second than x86_64 at equal memory, and every
# dependency (awscrt, pydantic-core, PyYAML) publishes manylinux2014 aarch64 wheels.
ARCHITECTURE = lambda_.Architecture.ARM_64
PYTHON_VERSION = "3.12"  # of RUNTIME: the version the wheels are chosen for


def _pascal(module: str) -> str:
    return "".join(part.capitalize() for part in module.split("_"))


class BackupFunctions(Construct):
    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        environment: Mapping[str, str],
        log_retention: logs.RetentionDays = logs.RetentionDays.ONE_MONTH,
    ) -> None:
        super().__init__(scope, construct_id)
        code = lambda_code(Platform.for_lambda(ARCHITECTURE, PYTHON_VERSION))
        self.log_groups: dict[str, logs.ILogGroup] = {}
        self.functions: dict[str, lambda_.Function] = {
            spec.module: self._function(spec, code, dict(environment), log_retention)
            for spec in FUNCTIONS
        }

    def _function(
        self,
        spec: FunctionSpec,
        code: lambda_.Code,
        environment: dict[str, str],
        retention: logs.RetentionDays,
    ) -> lambda_.Function:
        name = _pascal(spec.module)
        role = iam.Role(
            self,
            f"{name}Role",
            assumed_by=iam.ServicePrincipal("lambda.amazonaws.com"),
            description=f"ShardVault {spec.module}: only what this function calls.",
        )
        log_group = logs.LogGroup(self, f"{name}Logs", retention=retention)
        self.log_groups[spec.module] = log_group
        log_group.grant_write(role)  # instead of AWSLambdaBasicExecutionRole (any log group)
        function = lambda_.Function(
            self,
            name,
            description=f"ShardVault backup workflow: {spec.module}",
            runtime=RUNTIME,
            architecture=ARCHITECTURE,
            handler=spec.handler,
            code=code,
            role=role,
            environment=environment,
            timeout=Duration.seconds(spec.timeout_seconds),
            memory_size=spec.memory_mb,
            tracing=lambda_.Tracing.ACTIVE,
            log_group=log_group,
        )
        self._suppress_findings(function, role)
        return function

    @staticmethod
    def _suppress_findings(function: lambda_.Function, role: iam.Role) -> None:
        NagSuppressions.add_resource_suppressions(
            function,
            [
                {
                    "id": "AwsSolutions-L1",
                    "reason": "The project pins Python 3.12 (a supported Lambda runtime): the "
                    "asset's wheels are chosen for CPython 3.12, so a newer runtime is a "
                    "deliberate change of RUNTIME and PYTHON_VERSION together, tested first.",
                }
            ],
        )
        NagSuppressions.add_resource_suppressions(
            role,
            [
                {
                    "id": "AwsSolutions-IAM5",
                    "reason": "Active tracing: xray:PutTraceSegments and "
                    "xray:PutTelemetryRecords support no resource-level permissions, so "
                    "CDK grants them on '*'; so does cloudwatch:PutMetricData (the watch's), "
                    "bound to the ShardVault namespace by its condition instead.",
                    "appliesTo": ["Resource::*"],
                }
            ],
            apply_to_children=True,
        )

    def grant(self, module: str, *statements: iam.PolicyStatement) -> None:
        role = self.functions[module].role
        assert role is not None  # every function here is given a role
        for statement in statements:
            role.add_to_principal_policy(statement)
