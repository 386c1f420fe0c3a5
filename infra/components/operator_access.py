"""Operator access: what the ``shardvault`` CLI needs, as two managed policies to attach to
the operators' roles or users.

- *read-only* (``OperatorReadOnlyPolicyArn``): ``list``, ``show``, ``nodes``, ``drills``,
  ``cost`` and ``check --no-probe``: the catalog read (a Query, a GetItem, a Scan for every
  cluster), the node registry listed (a Query of a cluster's, a Scan for every cluster), the
  stack's outputs (``--stack``).
- *operator* (``OperatorPolicyArn``): the same, and starting the stack's state machines
  (``backup``, ``restore``, ``verify``, ``check``'s probe, ``drill``, ``retention``) and
  following the executions it started (their status and history), and removing a node's
  record (``nodes --remove``: read first, to refuse a live node).

Neither reaches the store or the vault, nor the data keys: the workflows do, as their own
roles. The local stack runs the CLI with the operator policy (``shardvault/local/iam``).
"""

from __future__ import annotations

from aws_cdk import Stack
from aws_cdk import aws_dynamodb as dynamodb
from aws_cdk import aws_iam as iam
from cdk_nag import NagSuppressions
from constructs import Construct

from infra import policies
from infra.components.agent_access import own_stack_arn

READ_CATALOG = ("dynamodb:Query", "dynamodb:GetItem", "dynamodb:Scan")
LIST_NODES = ("dynamodb:Query", "dynamodb:Scan")
FOLLOW = ("states:DescribeExecution", "states:GetExecutionHistory")
OPERATOR_DESCRIPTION = "ShardVault operator: start backups, restores, drills; read the catalog."
READ_ONLY_DESCRIPTION = "ShardVault operator, read-only: the catalog, nodes and executions."


class OperatorAccess(Construct):
    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        catalog: dynamodb.ITable,
        nodes: dynamodb.ITable,
        nodes_index: str,
        machine_names: list[str],
    ) -> None:
        super().__init__(scope, construct_id)
        stack = Stack.of(self)
        read = [
            policies.table(catalog, READ_CATALOG),
            policies.table(nodes, LIST_NODES, indexes=(nodes_index,)),
            iam.PolicyStatement(
                actions=["cloudformation:DescribeStacks"], resources=[own_stack_arn(self)]
            ),
        ]
        self.read_only = iam.ManagedPolicy(
            self, "ReadOnly", description=READ_ONLY_DESCRIPTION, statements=read
        )
        self.operator = iam.ManagedPolicy(
            self,
            "Operator",
            description=OPERATOR_DESCRIPTION,
            statements=[
                *read,
                iam.PolicyStatement(
                    actions=["states:StartExecution"],
                    resources=[policies.state_machine_arn(stack, n) for n in machine_names],
                ),
                iam.PolicyStatement(
                    actions=list(FOLLOW),
                    resources=[
                        arn for n in machine_names for arn in policies.execution_arns(stack, n)
                    ],
                ),
                policies.table(nodes, ("dynamodb:GetItem", "dynamodb:DeleteItem")),  # --remove
            ],
        )
        for policy in (self.read_only, self.operator):
            NagSuppressions.add_resource_suppressions(
                policy,
                [
                    {
                        "id": "AwsSolutions-IAM5",
                        "reason": "An execution's ARN ends in its generated name: '<machine>:*' "
                        "and '<machine>/*' (its Map Runs) are this stack's executions only; a "
                        "stack's ARN ends in its generated id: '<name>/*' is this stack only.",
                        "appliesTo": [
                            {"regex": "/^Resource::arn:<AWS::Partition>:states:.+:execution:.+$/"},
                            {"regex": "/^Resource::arn:<AWS::Partition>:cloudformation:.+$/"},
                        ],
                    }
                ],
            )
