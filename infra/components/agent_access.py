"""Agent access: what a node's agent may do, as a managed *policy* and one EC2 *role* per node.

An agent reads and answers the commands in its own *inbox* items, keeps its own *node
record* up to date and answers the task tokens it was given. Which items are its own is
decided by ``dynamodb:LeadingKeys``: the partition key must equal the caller's principal tag
``shardvault:node_id``. A caller without that tag matches no item. Agents never touch S3
with their own credentials: they upload through URLs presigned by a function's role.

Its *doorbell* (``shardvault-doorbell-<node id>``, an SQS queue the dispatcher rings after each
post) is the agent's own too: it creates it at start and long-polls it, and the queue's ARN
names the same principal tag, so an agent reaches no other node's doorbell.

The tag comes from the *role*: each node gets its own role tagged with its node id (a role's
tags are principal tags of its sessions), with an instance profile for EC2. EC2 attaches no
session tags to instance-profile sessions, so one shared role could not tell nodes apart.
Nodes are listed in the CDK context ``agentNodes``; hosts outside EC2 can use the managed
policy on any role or user tagged ``shardvault:node_id``.
"""

from __future__ import annotations

from aws_cdk import Stack, Tags
from aws_cdk import aws_dynamodb as dynamodb
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from aws_cdk import aws_lambda as lambda_
from cdk_nag import NagSuppressions
from constructs import Construct

from infra import policies
from infra.constants import AGENT_POLICY_DESCRIPTION, CLUSTER_TAG, NODE_ID_TAG
from shardvault.contracts.models import DOORBELL_PREFIX

# shardvault/aws/tables.py Inbox, as the agent uses it: its commands (Query), its ring counter
# (GetItem), a command done (DeleteItem), a failure note and a WAL batch's request (PutItem).
INBOX_ACTIONS = (
    "dynamodb:Query",
    "dynamodb:GetItem",
    "dynamodb:DeleteItem",
    "dynamodb:PutItem",
)
# The heartbeat writes the node's whole record (NodeRegistry.put); the agent never reads it.
NODE_RECORD_ACTIONS = ("dynamodb:PutItem",)
TASK_ACTIONS = ("states:SendTaskSuccess", "states:SendTaskFailure", "states:SendTaskHeartbeat")
# shardvault_agent/doorbell.py: create the queue (or find it and set its attributes), listen,
# delete the rings heard. No SendMessage: only the dispatcher rings.
DOORBELL_ACTIONS = (
    "sqs:CreateQueue",
    "sqs:GetQueueUrl",
    "sqs:SetQueueAttributes",
    "sqs:ReceiveMessage",
    "sqs:DeleteMessage",
)
# What a starting agent may read of the catalog (shardvault_agent/reconcile.py): the status of
# an item it names by key, nothing else; it cannot list the table.
CATALOG_STATUS_ATTRIBUTES = ("cluster", "backup_id", "status")


def own_items(table: dynamodb.ITable, actions: tuple[str, ...]) -> iam.PolicyStatement:
    """``actions`` on the items whose partition key is the caller's node id, and no other."""
    statement = policies.table(table, actions)
    statement.add_condition(
        "ForAllValues:StringEquals",
        {"dynamodb:LeadingKeys": [f"${{aws:PrincipalTag/{NODE_ID_TAG}}}"]},
    )
    return statement


def catalog_statuses(catalog: dynamodb.ITable) -> iam.PolicyStatement:
    """GetItem of the key and ``status`` attributes only (a projected read)."""
    statement = policies.table(catalog, ("dynamodb:GetItem",))
    statement.add_condition(
        "ForAllValues:StringEquals", {"dynamodb:Attributes": list(CATALOG_STATUS_ATTRIBUTES)}
    )
    statement.add_condition("StringEqualsIfExists", {"dynamodb:Select": "SPECIFIC_ATTRIBUTES"})
    return statement


def own_doorbell(scope: Construct) -> iam.PolicyStatement:
    """The doorbell actions on the one queue whose name ends in the caller's node id."""
    name = f"{DOORBELL_PREFIX}${{aws:PrincipalTag/{NODE_ID_TAG}}}"
    return policies.queues(Stack.of(scope), name, *DOORBELL_ACTIONS)


def own_stack_arn(scope: Construct) -> str:
    """This stack's ARN (its id, a generated suffix, is the wildcard's only part)."""
    stack = Stack.of(scope)
    return stack.format_arn(
        service="cloudformation", resource="stack", resource_name=f"{stack.stack_name}/*"
    )


class AgentAccess(Construct):
    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        inbox: dynamodb.ITable,
        nodes: dynamodb.ITable,
        catalog: dynamodb.ITable,
        node_clusters: dict[str, str | None],
        data_key: kms.IKey,
        archive_function: lambda_.IFunction,
    ) -> None:
        super().__init__(scope, construct_id)
        self.policy = iam.ManagedPolicy(
            self,
            "Policy",
            description=AGENT_POLICY_DESCRIPTION,
            statements=[
                own_items(inbox, INBOX_ACTIONS),
                own_items(nodes, NODE_RECORD_ACTIONS),
                own_doorbell(self),
                catalog_statuses(catalog),
                # shardvault-agent init: the stack's outputs (table names), this stack only.
                iam.PolicyStatement(
                    actions=["cloudformation:DescribeStacks"],
                    resources=[own_stack_arn(self)],
                ),
                # Continuous WAL archiving: the archive function signs what the node wrote into
                # its own inbox items (shardvault/wal/archive.py); no other function.
                iam.PolicyStatement(
                    actions=["lambda:InvokeFunction"], resources=[archive_function.function_arn]
                ),
                # Task tokens are the capability here: these actions take no resource ARN.
                iam.PolicyStatement(actions=list(TASK_ACTIONS), resources=["*"]),
                # Data keys of the node's own cluster only (its role's cluster tag).
                iam.PolicyStatement(
                    actions=["kms:Decrypt"],
                    resources=[data_key.key_arn],
                    conditions={
                        "StringEquals": {
                            "kms:EncryptionContext:shardvault:cluster": "${aws:PrincipalTag/"
                            + CLUSTER_TAG
                            + "}"
                        }
                    },
                ),
            ],
        )
        self.profiles: dict[str, iam.CfnInstanceProfile] = {}
        self.roles = {
            node_id: self._node_role(node_id, cluster) for node_id, cluster in node_clusters.items()
        }
        NagSuppressions.add_resource_suppressions(
            self.policy,
            [
                {
                    "id": "AwsSolutions-IAM5",
                    "reason": "states:SendTaskSuccess, SendTaskFailure and SendTaskHeartbeat "
                    "support no resource-level permissions; the task token an agent receives "
                    "in its own inbox item is what lets it answer one task. A stack's ARN ends "
                    "in its generated id: '<name>/*' is this stack only.",
                    "appliesTo": [
                        "Resource::*",
                        {"regex": "/^Resource::arn:<AWS::Partition>:cloudformation:.+$/"},
                    ],
                }
            ],
        )

    def _node_role(self, node_id: str, cluster: str | None) -> iam.Role:
        """The role of one node's agent: tagged with the node id (and its cluster, which
        scopes the data keys it may unwrap), the policy and nothing else."""
        role = iam.Role(
            self,
            f"Node-{node_id}",
            description=f"ShardVault agent of node {node_id}.",
            assumed_by=iam.ServicePrincipal("ec2.amazonaws.com"),
            managed_policies=[self.policy],
        )
        Tags.of(role).add(NODE_ID_TAG, node_id)
        if cluster:
            Tags.of(role).add(CLUSTER_TAG, cluster)
        # Named by CloudFormation (as the role and the policy): IAM names are account-wide, and
        # two stacks (regions, environments) share an account. The outputs give the names.
        self.profiles[node_id] = iam.CfnInstanceProfile(
            self, f"Profile-{node_id}", roles=[role.role_name]
        )
        return role
