"""Schedules: EventBridge Scheduler schedules from the policy file.

One schedule per cluster and cadence (``full``, ``incremental``) starts the backup state
machine with ``{"cluster": ..., "requested_by": "schedule:<cadence>"}``, in the schedule's time
zone, with a flexible window (runs spread over it instead of all at the same second), a retry
policy and a dead-letter queue for starts that still fail; one per cluster with a ``drill``
starts the drill state machine with ``{"cluster": ..., "requested_by": "schedule:drill"}``;
one per cluster with ``cut.every_minutes`` starts the cut state machine (scheduled cuts) on
time, with no flexible window, and gives up on a start a minute late; one daily schedule runs
retention.

*Cron conversion*: the policy's five-field cron (minute hour day-of-month month day-of-week,
days of week 0-7 with Sunday as 0 or 7) becomes Scheduler's six-field ``cron(...)`` (a year
field, days of week by name, ``?`` in whichever day field is unrestricted). Standard cron
fires when *either* day field matches if both are restricted; Scheduler cannot express that,
so the policy's validation refuses such an expression (``policy.check_day_fields``) wherever
the file is read: at synth, by ``shardvault schedule`` and by ``shardvault cost``.
"""

from __future__ import annotations

import json
import re

from aws_cdk import Duration
from aws_cdk import aws_cloudwatch as cloudwatch
from aws_cdk import aws_cloudwatch_actions as cw_actions
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from aws_cdk import aws_scheduler as scheduler
from aws_cdk import aws_sns as sns
from aws_cdk import aws_sqs as sqs
from aws_cdk import aws_stepfunctions as sfn
from cdk_nag import NagSuppressions
from constructs import Construct

from shardvault.config.policy import UNRESTRICTED_DAYS, BackupKind, Policy, check_day_fields

DAYS = ("SUN", "MON", "TUE", "WED", "THU", "FRI", "SAT", "SUN")
RETENTION_CRON = "cron(30 5 * * ? *)"  # daily, after the usual night's backups
FLEXIBLE_WINDOW_MINUTES = 15


def _day_names(field: str) -> str:
    """``1-5`` -> ``MON-FRI``; ``0,6`` -> ``SUN,SAT``; steps and ``*`` pass through."""

    def name(match: re.Match[str]) -> str:
        return DAYS[int(match.group())]

    return re.sub(r"\d+", name, field)


def scheduler_cron(expression: str) -> str:
    """The policy's five-field cron as an EventBridge Scheduler ``cron()`` expression. The
    policy's validation refuses both day fields restricted; checked again here (the same
    rule, ``PolicyError``) for an expression that did not come through it."""
    minute, hour, dom, month, dow = check_day_fields(expression).split()
    if dow in UNRESTRICTED_DAYS:
        return f"cron({minute} {hour} {dom} {month} ? *)"
    return f"cron({minute} {hour} ? {month} {_day_names(dow)} *)"


class Schedules(Construct):
    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        policy: Policy,
        backup: sfn.IStateMachine,
        retention: sfn.IStateMachine,
        drill: sfn.IStateMachine | None = None,
        cut: sfn.IStateMachine | None = None,
        alarms_to: sns.ITopic | None = None,
    ) -> None:
        super().__init__(scope, construct_id)
        key = kms.Key(self, "DeadLetterKey", enable_key_rotation=True)
        self.dead_letters = sqs.Queue(
            self,
            "DeadLetters",
            encryption=sqs.QueueEncryption.KMS,
            encryption_master_key=key,
            enforce_ssl=True,
            retention_period=Duration.days(14),
        )
        if alarms_to is not None:
            self._alarm_on_dead_letters(alarms_to)
        self.role = iam.Role(
            self,
            "Role",
            assumed_by=iam.ServicePrincipal("scheduler.amazonaws.com"),
            description="ShardVault schedules: start backups, cuts, drills and retention, "
            "dead-letter failures.",
        )
        started = [backup, retention] + [m for m in (drill, cut) if m is not None]
        self.role.add_to_principal_policy(
            iam.PolicyStatement(
                actions=["states:StartExecution"],
                resources=[machine.state_machine_arn for machine in started],
            )
        )
        # Written out: grant_send_messages would add kms:ReEncrypt* as well.
        self.role.add_to_principal_policy(
            iam.PolicyStatement(
                actions=["sqs:SendMessage"], resources=[self.dead_letters.queue_arn]
            )
        )
        key.grant(self.role, "kms:GenerateDataKey", "kms:Decrypt")
        NagSuppressions.add_resource_suppressions(
            self.dead_letters,
            [
                {
                    "id": "AwsSolutions-SQS3",
                    "reason": "This queue is itself the schedules' dead-letter queue: what lands "
                    "here is a backup that could not be started, kept 14 days for a person.",
                }
            ],
        )
        self.schedules: dict[str, scheduler.CfnSchedule] = {}
        for name, cluster in sorted(policy.clusters.items()):
            cadences = [(BackupKind.FULL, cluster.schedule.full)]
            if cluster.schedule.incremental:
                cadences.append((BackupKind.INCREMENTAL, cluster.schedule.incremental))
            for kind, expression in cadences:
                request = {"cluster": name, "requested_by": f"schedule:{kind}"}
                if kind == BackupKind.INCREMENTAL:
                    request["incremental"] = True
                self._schedule(
                    f"{name}-{kind}",
                    scheduler_cron(expression),
                    cluster.schedule.timezone,
                    backup,
                    request,
                )
            if cluster.drill is not None and drill is not None:
                self._schedule(
                    f"{name}-drill",
                    scheduler_cron(cluster.drill.cron),
                    cluster.drill.timezone,
                    drill,
                    {"cluster": name, "requested_by": "schedule:drill"},
                )
            if cluster.cut.cron is not None and cut is not None:
                # On time, not within a window: cuts are minutes apart, and one an hour late
                # (the retries' default) marks nothing anyone asked for.
                self._schedule(
                    f"{name}-cut",
                    scheduler_cron(cluster.cut.cron),
                    "UTC",
                    cut,
                    {"cluster": name, "requested_by": "schedule:cut"},
                    on_time=True,
                )
        self._schedule("retention", RETENTION_CRON, "UTC", retention, {"dry_run": False})

    def _schedule(
        self,
        label: str,
        expression: str,
        timezone: str,
        machine: sfn.IStateMachine,
        payload: dict[str, object],
        *,
        on_time: bool = False,
    ) -> None:
        window = (
            scheduler.CfnSchedule.FlexibleTimeWindowProperty(mode="OFF")
            if on_time
            else scheduler.CfnSchedule.FlexibleTimeWindowProperty(
                mode="FLEXIBLE", maximum_window_in_minutes=FLEXIBLE_WINDOW_MINUTES
            )
        )
        self.schedules[label] = scheduler.CfnSchedule(
            self,
            re.sub(r"[^A-Za-z0-9]", "", label.title()),
            description=f"ShardVault: {label}",
            schedule_expression=expression,
            schedule_expression_timezone=timezone,
            flexible_time_window=window,
            target=scheduler.CfnSchedule.TargetProperty(
                arn=machine.state_machine_arn,
                role_arn=self.role.role_arn,
                input=json.dumps(payload),
                retry_policy=scheduler.CfnSchedule.RetryPolicyProperty(
                    maximum_event_age_in_seconds=60 if on_time else 3600,
                    maximum_retry_attempts=5,
                ),
                dead_letter_config=scheduler.CfnSchedule.DeadLetterConfigProperty(
                    arn=self.dead_letters.queue_arn
                ),
            ),
        )

    def _alarm_on_dead_letters(self, topic: sns.ITopic) -> None:
        """A scheduled run that could not even start (after the schedule's retries) lands in
        the dead-letter queue and starts no execution, so no execution alarm fires: this one
        does, when a message is there."""
        alarm = cloudwatch.Alarm(
            self,
            "DeadLettersAlarm",
            alarm_description="ShardVault schedules: a scheduled backup, drill or retention run "
            "could not be started (see the dead-letter queue's messages for the cluster and "
            "the cause).",
            metric=self.dead_letters.metric_approximate_number_of_messages_visible(
                period=Duration.minutes(5), statistic="Maximum"
            ),
            threshold=1,
            evaluation_periods=1,
            comparison_operator=cloudwatch.ComparisonOperator.GREATER_THAN_OR_EQUAL_TO_THRESHOLD,
            treat_missing_data=cloudwatch.TreatMissingData.NOT_BREACHING,
        )
        alarm.add_alarm_action(cw_actions.SnsAction(topic))
