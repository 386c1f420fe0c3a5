"""Tables: the *catalog* (one item per backup, plus a lock item per cluster), the *node
registry* (one item per agent, queried per cluster) and the *inbox* (commands waiting for an
agent, each with the task token to answer; expired commands vanish by TTL)."""

from __future__ import annotations

from aws_cdk import RemovalPolicy
from aws_cdk import aws_dynamodb as dynamodb
from constructs import Construct

NODES_BY_CLUSTER = "by_cluster"


def _key(name: str) -> dynamodb.Attribute:
    return dynamodb.Attribute(name=name, type=dynamodb.AttributeType.STRING)


class Tables(Construct):
    def __init__(self, scope: Construct, construct_id: str) -> None:
        super().__init__(scope, construct_id)
        self.catalog = self._table("Catalog", "cluster", "backup_id", deletion_protection=True)
        self.nodes = self._table("Nodes", "node_id")
        self.nodes.add_global_secondary_index(
            index_name=NODES_BY_CLUSTER,
            partition_key=_key("cluster"),
            sort_key=_key("node_id"),
            projection_type=dynamodb.ProjectionType.ALL,
        )
        self.inbox = self._table(
            "Inbox", "node_id", "command_id", time_to_live_attribute="expires_at"
        )

    def _table(
        self,
        construct_id: str,
        partition_key: str,
        sort_key: str | None = None,
        **options: object,
    ) -> dynamodb.Table:
        return dynamodb.Table(
            self,
            construct_id,
            partition_key=_key(partition_key),
            sort_key=_key(sort_key) if sort_key else None,
            billing_mode=dynamodb.BillingMode.PAY_PER_REQUEST,
            point_in_time_recovery_specification=dynamodb.PointInTimeRecoverySpecification(
                point_in_time_recovery_enabled=True
            ),
            encryption=dynamodb.TableEncryption.AWS_MANAGED,
            removal_policy=RemovalPolicy.RETAIN,
            **options,
        )
