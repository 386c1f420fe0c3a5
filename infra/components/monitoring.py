"""Monitoring: what wakes someone when no backup run can, and one page to look at.

- *the watch*: an EventBridge rule runs ``watch_clusters`` every ``WATCH_MINUTES``; it
  publishes each cluster's backup age and the deployment's silent agents
  (``shardvault/assurance/watch.py``).
- *alarms*, each publishing to the notifications topic:
  - ``BackupAge-<cluster>``, one per cluster of the policy: its newest complete backup is
    older than its RPO (``Policy.rpo_hours``);
  - ``SilentAgents``: a registered agent stopped or missed its heartbeats on two watches in a
    row (a restart is not an alarm);
  - ``StalledWalSpools``: a shard's WAL spool has not drained for 15 minutes on two watches
    in a row (its archive is down or falling behind; PostgreSQL's disk fills next);
  - ``OutdatedAgents``: a registered agent is older than the control plane (its cluster's
    backups and restores are refused until it is upgraded);
  - ``FunctionErrors``: a function that no workflow runs (the reaper, the watch) failed. A
    function a workflow runs is retried by it, and a failure it cannot retry fails the
    execution, which the workflows' own alarms report.
- *the dashboard* (``ShardVault``): the alarms, backup ages against their RPOs, silent agents,
  backups, restores and bytes, each workflow's executions and durations, and a table by
  cluster of the outcomes the finalize and cleanup functions log.
"""

from __future__ import annotations

from aws_cdk import Duration
from aws_cdk import aws_cloudwatch as cloudwatch
from aws_cdk import aws_cloudwatch_actions as cw_actions
from aws_cdk import aws_events as events
from aws_cdk import aws_events_targets as targets
from aws_cdk import aws_lambda as lambda_
from aws_cdk import aws_logs as logs
from aws_cdk import aws_sns as sns
from aws_cdk import aws_stepfunctions as sfn
from constructs import Construct

from infra.constants import FUNCTIONS, POWERTOOLS_SERVICE_NAME
from shardvault.assurance.watch import (
    BACKUP_AGE_METRIC,
    CLUSTER_DIMENSION,
    NAMESPACE,
    OUTDATED_AGENTS_METRIC,
    SILENT_AGENTS_METRIC,
    STALLED_SPOOLS_METRIC,
)
from shardvault.config.policy import Policy
from shardvault.contracts.deployment import WATCH_MINUTES

WATCH_PERIOD = Duration.minutes(WATCH_MINUTES)
DASHBOARD_NAME = "ShardVault"
# Functions no workflow runs: their errors are no execution's failure, so they alarm apart.
UNSUPERVISED = tuple(spec.module for spec in FUNCTIONS if spec.placeholder is None)
# The outcome line the finalize and cleanup functions log (functions/*.py: OUTCOME).
OUTCOMES_QUERY = (
    "filter message = 'outcome' "
    "| stats count(*) as runs, sum(bytes) / 1048576 as MiB, avg(duration_seconds) as avg_s, "
    "max(duration_seconds) as max_s by cluster, workflow, outcome "
    "| sort cluster, workflow, outcome"
)
OUTCOME_FUNCTIONS = ("finalize_backup", "cleanup_backup", "finalize_restore", "cleanup_restore")


class Monitoring(Construct):
    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        policy: Policy,
        functions: dict[str, lambda_.Function],
        log_groups: dict[str, logs.ILogGroup],
        machines: dict[str, sfn.StateMachine],
        topic: sns.ITopic,
    ) -> None:
        super().__init__(scope, construct_id)
        self.topic = topic
        events.Rule(
            self,
            "Watch",
            description="ShardVault: publish backup ages, silent and outdated agents and "
            "stalled WAL spools for the alarms.",
            schedule=events.Schedule.rate(WATCH_PERIOD),
            targets=[targets.LambdaFunction(functions["watch_clusters"], retry_attempts=2)],
        )
        self.backup_ages = {
            cluster: self._backup_age_alarm(cluster, policy.rpo_hours(cluster))
            for cluster in sorted(policy.clusters)
        }
        self.silent_agents = self._alarm(
            "SilentAgents",
            "ShardVault: a registered agent stopped or missed its heartbeats on two watches in "
            "a row; backups of its cluster are refused. Run 'shardvault nodes' to see which, "
            "then restart it (or remove a decommissioned node with 'shardvault nodes "
            "--remove').",
            self.silent_agents_metric(),
            threshold=1,
            evaluation_periods=2,
        )
        self.stalled_spools = self._alarm(
            "StalledWalSpools",
            "ShardVault: a shard's WAL spool has held a file for over 15 minutes on two "
            "watches in a row: its agent does not archive (down, no archive function, or the "
            "store unreachable), and once the spool is full PostgreSQL keeps its WAL in pg_wal "
            "until the disk fills. See the agent's log; 'shardvault nodes --json' shows each "
            "shard's spool.",
            self.deployment_metric(STALLED_SPOOLS_METRIC),
            threshold=1,
            evaluation_periods=2,
        )
        self.outdated_agents = self._alarm(
            "OutdatedAgents",
            "ShardVault: a registered agent is older than this control plane (it speaks an "
            "older agent protocol): every backup and restore of its cluster is refused "
            "(AgentOutdated) until it is upgraded. Run 'shardvault nodes' to see which, then "
            "upgrade shardvault-agent on that node from this release's wheels and restart it.",
            self.deployment_metric(OUTDATED_AGENTS_METRIC),
            threshold=1,
        )
        errors = {
            f"e{i}": functions[module].metric_errors(period=WATCH_PERIOD)
            for i, module in enumerate(UNSUPERVISED)
        }
        self.function_errors = self._alarm(
            "FunctionErrors",
            "ShardVault: a function no workflow runs failed (" + ", ".join(UNSUPERVISED) + "): "
            "see its log group for the error.",
            cloudwatch.MathExpression(
                expression=" + ".join(errors),
                using_metrics=errors,
                label="errors",
                period=WATCH_PERIOD,
            ),
            threshold=1,
        )
        self.dashboard = self._dashboard(policy, log_groups, machines)

    @staticmethod
    def backup_age_metric(cluster: str, label: str | None = None) -> cloudwatch.Metric:
        """``label``: for a graph (an alarm's metric has none: it then names the metric)."""
        return cloudwatch.Metric(
            namespace=NAMESPACE,
            metric_name=BACKUP_AGE_METRIC,
            dimensions_map={CLUSTER_DIMENSION: cluster},
            statistic="Maximum",
            period=WATCH_PERIOD,
            label=label,
        )

    @staticmethod
    def deployment_metric(name: str, label: str | None = None) -> cloudwatch.Metric:
        """One of the watch's counts for the whole deployment (no dimension)."""
        return cloudwatch.Metric(
            namespace=NAMESPACE,
            metric_name=name,
            statistic="Maximum",
            period=WATCH_PERIOD,
            label=label,
        )

    @classmethod
    def silent_agents_metric(cls, label: str | None = None) -> cloudwatch.Metric:
        return cls.deployment_metric(SILENT_AGENTS_METRIC, label)

    def _backup_age_alarm(self, cluster: str, rpo_hours: float) -> cloudwatch.Alarm:
        return self._alarm(
            f"BackupAge-{cluster}",
            f"ShardVault: cluster {cluster} has no complete backup newer than its RPO of "
            f"{rpo_hours:g} hours. Run 'shardvault list {cluster}' for its recent runs and "
            "their causes.",
            self.backup_age_metric(cluster),
            threshold=rpo_hours,
            comparison=cloudwatch.ComparisonOperator.GREATER_THAN_THRESHOLD,
        )

    def _alarm(
        self,
        name: str,
        description: str,
        metric: cloudwatch.IMetric,
        *,
        threshold: float,
        evaluation_periods: int = 1,
        comparison: cloudwatch.ComparisonOperator = (
            cloudwatch.ComparisonOperator.GREATER_THAN_OR_EQUAL_TO_THRESHOLD
        ),
    ) -> cloudwatch.Alarm:
        alarm = cloudwatch.Alarm(
            self,
            name,
            alarm_description=description,
            metric=metric,
            threshold=threshold,
            evaluation_periods=evaluation_periods,
            comparison_operator=comparison,
            # No data: the watch has not seen the cluster attempted yet, or (the watch itself
            # failing) FunctionErrors fires.
            treat_missing_data=cloudwatch.TreatMissingData.NOT_BREACHING,
        )
        alarm.add_alarm_action(cw_actions.SnsAction(self.topic))
        return alarm

    def _dashboard(
        self,
        policy: Policy,
        log_groups: dict[str, logs.ILogGroup],
        machines: dict[str, sfn.StateMachine],
    ) -> cloudwatch.Dashboard:
        day = Duration.days(1)
        dashboard = cloudwatch.Dashboard(
            self,
            "Dashboard",
            dashboard_name=DASHBOARD_NAME,
            default_interval=Duration.days(14),
        )
        alarms = [
            *self.backup_ages.values(),
            self.silent_agents,
            self.outdated_agents,
            self.stalled_spools,
            self.function_errors,
        ]
        dashboard.add_widgets(
            cloudwatch.AlarmStatusWidget(title="Alarms", alarms=alarms, width=24, height=3)
        )
        dashboard.add_widgets(
            cloudwatch.GraphWidget(
                title="Newest complete backup age (hours), against each RPO",
                left=[self.backup_age_metric(c, c) for c in sorted(policy.clusters)],
                left_annotations=[
                    cloudwatch.HorizontalAnnotation(value=policy.rpo_hours(c), label=f"{c} RPO")
                    for c in sorted(policy.clusters)
                ],
                width=16,
            ),
            cloudwatch.GraphWidget(
                title="Silent agents", left=[self.silent_agents_metric("silent agents")], width=8
            ),
        )
        dashboard.add_widgets(
            self._outcomes("Backups a day", ("BackupsSucceeded", "BackupsFailed"), day),
            self._outcomes("Restores a day", ("RestoresSucceeded", "RestoresFailed"), day),
            self._outcomes("Bytes a day", ("BackupBytes", "BytesUploaded"), day),
        )
        dashboard.add_widgets(
            cloudwatch.GraphWidget(
                title="Executions failed or timed out",
                left=[
                    metric
                    for name, machine in machines.items()
                    for metric in (
                        machine.metric_failed(period=day, label=f"{name} failed"),
                        machine.metric_timed_out(period=day, label=f"{name} timed out"),
                    )
                ],
                width=12,
            ),
            cloudwatch.GraphWidget(
                title="Execution duration (ms)",
                left=[
                    machine.metric_time(period=day, statistic="Maximum", label=f"{name} (max)")
                    for name, machine in machines.items()
                ],
                width=12,
            ),
        )
        dashboard.add_widgets(
            cloudwatch.LogQueryWidget(
                title="Outcomes by cluster (the dashboard's interval)",
                log_group_names=[log_groups[m].log_group_name for m in OUTCOME_FUNCTIONS],
                query_string=OUTCOMES_QUERY,
                view=cloudwatch.LogQueryVisualizationType.TABLE,
                width=24,
                height=8,
            )
        )
        return dashboard

    @staticmethod
    def _outcomes(title: str, names: tuple[str, ...], period: Duration) -> cloudwatch.GraphWidget:
        """The functions' own metrics (Powertools, dimension service)."""
        return cloudwatch.GraphWidget(
            title=title,
            left=[
                cloudwatch.Metric(
                    namespace=NAMESPACE,
                    metric_name=name,
                    dimensions_map={"service": POWERTOOLS_SERVICE_NAME},
                    statistic="Sum",
                    period=period,
                    label=name,
                )
                for name in names
            ],
            width=8,
        )
