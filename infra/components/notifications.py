"""Notifications: the SNS *topic* that receives backup outcomes (from the functions) and
alarms (from CloudWatch), encrypted with its own customer-managed KMS *key*.

A customer-managed key rather than ``alias/aws/sns``: CloudWatch alarms cannot publish to a
topic encrypted with the AWS-managed key, whose key policy cannot grant them ``kms:Decrypt``
and ``kms:GenerateDataKey*``; the alarm would fire and the notification would be lost.
"""

from __future__ import annotations

from aws_cdk import ArnFormat, Stack
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from aws_cdk import aws_sns as sns
from aws_cdk import aws_sns_subscriptions as subscriptions
from constructs import Construct


class Notifications(Construct):
    def __init__(self, scope: Construct, construct_id: str, emails: tuple[str, ...] = ()) -> None:
        super().__init__(scope, construct_id)
        self.key = kms.Key(
            self,
            "TopicKey",
            description="Encrypts the ShardVault notifications topic.",
            enable_key_rotation=True,
        )
        self.topic = sns.Topic(
            self,
            "Topic",
            display_name="ShardVault notifications",
            master_key=self.key,
            enforce_ssl=True,
        )
        self._allow_cloudwatch_alarms()
        # Someone to wake: without a subscriber every alarm and failed night reaches no one.
        # AWS mails each address a confirmation link first; until it is followed, nothing.
        for email in emails:
            self.topic.add_subscription(subscriptions.EmailSubscription(email))

    def _allow_cloudwatch_alarms(self) -> None:
        stack = Stack.of(self)
        cloudwatch = iam.ServicePrincipal("cloudwatch.amazonaws.com")
        alarms = stack.format_arn(
            service="cloudwatch",
            resource="alarm",
            resource_name="*",
            arn_format=ArnFormat.COLON_RESOURCE_NAME,
        )
        self.topic.add_to_resource_policy(
            iam.PolicyStatement(
                sid="AlarmsOfThisAccountPublish",
                actions=["sns:Publish"],
                principals=[cloudwatch],
                resources=[self.topic.topic_arn],
                conditions={
                    "StringEquals": {"aws:SourceAccount": stack.account},
                    "ArnLike": {"aws:SourceArn": alarms},
                },
            )
        )
        # The key serves this topic only; which alarms may publish is decided by the topic.
        self.key.add_to_resource_policy(
            iam.PolicyStatement(
                sid="CloudWatchAlarmsEncryptForTheTopic",
                actions=["kms:Decrypt", "kms:GenerateDataKey*"],
                principals=[cloudwatch],
                resources=["*"],
            )
        )
