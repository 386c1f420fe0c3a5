"""``shardvault cost``: monthly cost forecasts per cluster against their budgets, from the
policy and what the catalog measured (``shardvault.lifecycle.costs``)."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

import boto3
from rich.table import Table

from shardvault.client import operations as ops
from shardvault.client.output import console
from shardvault.contracts.catalog import ArchiveTotals, BackupItem
from shardvault.lifecycle.costs import DEFAULT_DAILY_CHANGE


def add_parser(sub: Any) -> tuple[argparse.ArgumentParser, ...]:
    """Its subcommands; none takes ``cli``'s deployment options (it makes its own, or takes
    its catalog optionally)."""
    cost = sub.add_parser("cost", help="monthly cost forecast per cluster, against its budget")
    cost.add_argument("--policy", type=Path, help="the policy file (default: the example)")
    cost.add_argument("--cluster", help="one cluster of the policy")
    cost.add_argument(
        "--data-gib",
        type=float,
        help="data per cluster, GiB (default: the newest full's stored size in the catalog, "
        f"else {DEFAULT_DATA_GIB:g})",
    )
    cost.add_argument(
        "--daily-change",
        type=float,
        help="fraction changed a day (default: the catalog's measured incrementals, else "
        f"{DEFAULT_DAILY_CHANGE:g})",
    )
    cost.add_argument(
        "--target", action="store_true", help="the modeled 1 TiB daily-incremental case"
    )
    where = cost.add_mutually_exclusive_group()
    where.add_argument(
        "--stack-env", type=Path, help="a local stack's stack.env: also what the catalog holds"
    )
    where.add_argument("--stack", metavar="NAME", help="a deployed stack: its catalog")
    cost.set_defaults(run=run_cost)
    return ()


DEFAULT_DATA_GIB = 100.0  # a cost forecast's data size when neither asked nor measured


EXAMPLE_POLICY = Path(__file__).resolve().parents[3] / "examples" / "shardvault.yaml"


TARGET_TITLE = "The issue's target: 1 TiB, fulls on Sundays, incrementals daily (5%/day)"


def run_cost(args: argparse.Namespace) -> int:
    """Forecasts (and, with a catalog configured, what its backups cost now); 1 when a cluster
    is forecast over its budget."""

    from shardvault.config.policy import load_policy
    from shardvault.lifecycle import costs

    if args.target:
        print_forecast(TARGET_TITLE, costs.target_forecast())
        print_deployment_cost(1)
        return 0
    policy = load_policy(args.policy or EXAMPLE_POLICY)
    catalog = bool(args.stack_env or args.stack or os.environ.get("SHARDVAULT_CATALOG_TABLE"))
    records = ops.list_backups(ops.ClientConfig.from_env(), args.cluster) if catalog else []
    alerts = []
    for name in [args.cluster] if args.cluster else sorted(policy.clusters):
        totals = ops.archive_totals(ops.ClientConfig.from_env(), name) if catalog else None
        title, forecast = cluster_forecast(policy.cluster(name), name, records, args, totals)
        print_forecast(title, forecast)
        if alert := costs.budget_alert(name, forecast):
            alerts.append(alert)
    print_deployment_cost(len(policy.clusters))
    for alert in alerts:
        console.print(f"[bold red]{alert}[/]")
    if catalog:
        print_spend(costs.recorded_spend(records))
    return 1 if alerts else 0


def print_deployment_cost(clusters: int) -> None:
    """The deployment's own month, shared by its clusters (in no cluster's forecast)."""
    from shardvault.lifecycle import costs

    month = costs.deployment_month(clusters)
    console.print(
        f"the deployment itself (shared by its {clusters} cluster(s)): "
        f"${month.total_usd:,.2f} a month ({month.kms_keys} KMS keys ${month.keys_usd:,.2f}, "
        f"{month.alarm_metrics} alarm metrics ${month.alarms_usd:,.2f}, "
        f"{month.custom_metrics} custom metrics ${month.metrics_usd:,.2f}, "
        f"{month.dashboards} dashboard ${month.dashboards_usd:,.2f} (an account's first three "
        f"are free), the watch ${month.watch_usd:,.2f})"
    )


def cluster_forecast(
    cluster: Any,
    name: str,
    records: list[BackupItem],
    args: argparse.Namespace,
    archive_totals: ArchiveTotals | None = None,
) -> tuple[str, Any]:
    """One cluster's forecast and its title: at the sizes asked, else at the sizes its
    catalog measured (``costs.measured_sizes``), else at the defaults; with its WAL archive's
    growth as measured (``costs.measured_wal``), if it archives."""
    from shardvault.data.planning import GiB
    from shardvault.lifecycle import costs

    measured = costs.measured_sizes(records, name)
    data_bytes = None if args.data_gib is None else round(args.data_gib * GiB)
    change = args.daily_change
    source = []
    if measured and data_bytes is None:
        data_bytes = measured.full_bytes
        source.append(f"full {measured.full_bytes / GiB:,.2f} GiB stored (measured)")
    if measured and change is None and (daily := measured.daily_change(cluster.schedule)):
        change = daily
        source.append(
            f"incrementals {measured.incremental_share:.2%} of it (median of "
            f"{measured.incrementals} measured)"
        )
    data_bytes = round(DEFAULT_DATA_GIB * GiB) if data_bytes is None else data_bytes
    change = DEFAULT_DAILY_CHANGE if change is None else change
    asked = f"{round(data_bytes / GiB, 2):g} GiB, {round(change * 100, 2):g}% a day"
    wal = costs.measured_wal(archive_totals, time.time())
    if wal:
        source.append(f"WAL archive {wal.stored_bytes_per_day / GiB:,.2f} GiB a day (measured)")
    title = f"{name}: " + ("; ".join(source) + f" ({asked})" if source else asked)
    region = boto3.session.Session().region_name  # the stack's, as the CLI is configured
    return title, costs.monthly_forecast(cluster, data_bytes, change, wal=wal, stack_region=region)


def print_forecast(title: str, forecast: Any) -> None:
    from shardvault.data.planning import GiB, TiB
    from shardvault.lifecycle.costs import EARLY_DELETION_TARGET, OVERHEAD_TARGET

    table = Table("a month", "USD", title=title)
    for label, usd in [
        (f"storage (policy class {forecast.storage_class})", forecast.storage_usd),
        ("  of which held beyond retention (paid minimum)", forecast.held_usd),
        ("  of which early-deletion charges", forecast.early_deletion_usd),
        ("S3 requests (upload, verify, promote)", forecast.requests_usd),
        ("Step Functions and DynamoDB", forecast.orchestration_usd),
        ("Lambda", forecast.lambda_usd),
        ("idle agents (doorbell polls, inbox reads, heartbeats)", forecast.agents_usd),
        ("request overhead: S3, orchestration, Lambda, idle agents", forecast.request_overhead_usd),
        ("staging copies at STANDARD until promoted", forecast.staging_usd),
        *(
            [
                (
                    f"chain kept at STANDARD for synthesized fulls "
                    f"({forecast.kept_chain_bytes / GiB:,.1f} GiB)",
                    forecast.kept_chain_usd,
                )
            ]
            if forecast.kept_chain_usd
            else []
        ),
        *(
            [
                (
                    f"WAL archive at STANDARD ({forecast.wal_bytes / GiB:,.1f} GiB kept)",
                    forecast.wal_storage_usd,
                ),
                ("WAL archive requests (PUTs, checks, function, items)", forecast.wal_requests_usd),
            ]
            if forecast.wal_usd
            else []
        ),
        *(
            [
                (
                    f"restore drills ({forecast.drills_per_month:.1f} a month, each reading the "
                    "data back, thawed at Standard from an archive class)",
                    forecast.drill_usd,
                )
            ]
            if forecast.drills_per_month
            else []
        ),
        *(
            [
                (
                    f"scheduled cuts ({forecast.cuts_per_month:,.0f} a month: state machine "
                    "runs, Lambda calls, inbox items)",
                    forecast.cut_usd,
                )
            ]
            if forecast.cuts_per_month
            else []
        ),
        *[
            row
            for name, copy in forecast.copies_usd.items()
            for row in (
                (
                    f"copy {name}: {copy.storage_class} ({copy.backups_per_month:.1f} backups "
                    f"a month, {copy.stored_bytes / TiB:,.2f} TiB kept)",
                    copy.storage_usd + copy.requests_usd,
                ),
                (f"copy {name}: data transfer", copy.egress_usd),
            )
        ],
        ("total", forecast.total_usd),
    ]:
        table.add_row(label, f"${usd:,.2f}")
    for label, ratio, target in [
        (
            "request overhead (idle agents included) / storage",
            forecast.request_overhead_ratio,
            OVERHEAD_TARGET,
        ),
        ("early-deletion charges / storage", forecast.early_deletion_share, EARLY_DELETION_TARGET),
    ]:
        met = "green" if ratio <= target else "red"
        table.add_row(label, f"[{met}]{ratio:.2%}[/] (target: at most {target:.0%})")
    table.add_row("budget", budget_cell(forecast))
    table.add_row(
        "backups (fulls + incrementals)",
        f"{forecast.fulls_per_month:.1f} + {forecast.incrementals_per_month:.1f}",
    )
    table.add_row("backups landed per class (by lifetime)", forecast.landed_summary())
    table.add_row("objects made", f"{forecast.objects_per_month:,.0f}")
    table.add_row("kept in the vault (average)", f"{forecast.stored_bytes / TiB:,.2f} TiB")
    console.print(table)


def budget_cell(forecast: Any) -> str:
    if forecast.budget_usd is None:
        return "none set"
    left = forecast.budget_usd - forecast.total_usd
    if left < 0:
        return f"[bold red]${forecast.budget_usd:,.2f}: over by ${-left:,.2f}[/]"
    return f"[green]${forecast.budget_usd:,.2f}: ${left:,.2f} to spare[/]"


def print_spend(spend: list[Any]) -> None:
    from shardvault.data.planning import GiB

    table = Table(
        "cluster", "class", "backups", "GiB", "USD / month", title="Kept now (the catalog)"
    )
    for row in spend:
        table.add_row(
            row.cluster,
            row.storage_class,
            str(row.backups),
            f"{row.bytes / GiB:,.1f}",
            f"${row.usd_per_month:,.2f}",
        )
    table.add_row("total", "", "", "", f"${sum(r.usd_per_month for r in spend):,.2f}")
    console.print(table)
