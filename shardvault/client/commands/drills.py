"""The CLI's restore drills: ``shardvault drill CLUSTER`` runs one now, ``shardvault drills
CLUSTER`` lists them (``shardvault.assurance.drills`` says what a drill is)."""

from __future__ import annotations

import argparse
import time
from typing import Any

from rich.markup import escape
from rich.table import Table

from shardvault.assurance.drills import FAILED, PASSED, REFUSED, RUNNING, SLOW, DrillRequest
from shardvault.client import operations as ops
from shardvault.client.output import console, emit_json, errors
from shardvault.data.planning import MiB

VERDICT_STYLE = {PASSED: "green", SLOW: "yellow", FAILED: "bold red", REFUSED: "red"}


def add_parsers(sub: Any) -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    drill = sub.add_parser("drill", help="run a restore drill of a cluster now")
    drill.add_argument("cluster")
    drill.add_argument(
        "--into", metavar="TARGET", help="the cluster of drill nodes (default: the policy's)"
    )
    drill.add_argument(
        "--backup-id", help="a backup id, latest or random (default: the policy's choice)"
    )
    drill.add_argument(
        "--keep-minutes",
        type=int,
        help="keep the validated copy up this long before tearing it down (default: the "
        "policy's; 0: at once)",
    )
    drill.add_argument(
        "--from-vault",
        metavar="NAME",
        help="restore from this vault target of the policy, proving that copy (default: the "
        "policy's drill.from_vault, else the stack vault)",
    )
    drill.add_argument("--wait", action="store_true", help="follow it to the end")
    drill.set_defaults(run=run_drill)

    drills = sub.add_parser("drills", help="a cluster's restore drills: verdicts and RTOs")
    drills.add_argument("cluster")
    drills.add_argument("--json", action="store_true", help="print JSON for scripts")
    drills.set_defaults(run=run_drills)
    return drill, drills


def run_drill(args: argparse.Namespace) -> int:
    config = ops.ClientConfig.from_env()
    request = DrillRequest(
        cluster=args.cluster,
        target_cluster=args.into,
        backup_id=args.backup_id,
        keep_minutes=args.keep_minutes,
        from_vault=args.from_vault,
        requested_by="cli",
    )
    ops.check_drill(config, request.cluster, request.target_cluster)  # refused now, not later
    execution = ops.start_drill(config, request)
    if not args.wait:
        console.print(f"drill started: {execution}")
        return 0
    return ops.exit_status(follow_drill(config, execution))


def follow_drill(config: ops.ClientConfig, execution: str) -> ops.Progress:
    """Shows the drill's phase until it ends, then its verdict and RTO."""
    with console.status("drill: starting") as status:

        def update(progress: ops.Progress) -> None:
            status.update(f"drill: {phase(progress.record or {})}")

        outcome = ops.wait_drill(config, execution, update)
    record = outcome.record or {}
    if record.get("verdict") or record.get("status") in (PASSED, SLOW, FAILED):
        print_verdict(record)
    if outcome.status != "SUCCEEDED":
        errors.print(f"[bold red]drill {outcome.status}[/]: [bold]{escape(outcome.error)}[/]")
        errors.print(escape(outcome.cause))
    return outcome


def phase(record: dict[str, Any]) -> str:
    status = record.get("status", RUNNING)
    if status == RUNNING:
        backup, target = record.get("source_backup_id", ""), record.get("target_cluster", "")
        return f"restoring {backup} into {target}"
    if not record.get("torn_down_at") and record.get("keep_seconds"):
        return f"{status}; keeping the copy until {keep_end(record)}"
    return f"{status}; tearing the copy down"


def keep_end(record: dict[str, Any]) -> str:
    end = float(record.get("validated_at", 0)) + float(record.get("keep_seconds", 0))
    return time.strftime("%H:%M:%S", time.localtime(end))


def print_verdict(record: dict[str, Any]) -> None:
    """The drill's verdict, RTO and what it restored, one line each."""
    status = record.get("status") or record.get("verdict", "")
    style = VERDICT_STYLE.get(status, "bold")
    console.print(
        f"[bold]drill {record.get('drill_id', '')}[/] of {record.get('cluster', '')}: "
        f"[{style}]{status}[/]"
    )
    if record.get("rto_seconds") is not None:
        target = record.get("rto_target_seconds")
        console.print(
            f"  RTO {record['rto_seconds']:,.1f} s (start to validated)"
            + (f", target {target:,.0f} s" if target else "")
            + f"; the restore itself {float(record.get('restore_seconds', 0)):,.1f} s"
        )
        console.print(
            f"  restored backup {record.get('source_backup_id', record.get('backup_id', ''))} "
            f"into {record.get('target_cluster', '')}: {record.get('shards', 0)} shards, "
            f"{float(record.get('bytes', 0)) / MiB:,.1f} MiB, "
            f"{record.get('checks_passed', 0)} checks passed"
        )
    if record.get("error"):
        console.print(f"  [bold]{record['error']}[/]: {record.get('cause', '')}")


def run_drills(args: argparse.Namespace) -> int:
    config = ops.ClientConfig.from_env()
    records = ops.list_drills(config, args.cluster)
    if args.json:
        return emit_json([ops.as_row(r) for r in records])
    table = Table(
        "drill",
        "backup",
        "into",
        "verdict",
        "RTO s",
        "restore s",
        "MiB",
        "torn down",
        title=f"Restore drills of {args.cluster}",
    )
    for record in records:
        status, rto, torn = record.status, record.rto_seconds, record.torn_down_at
        table.add_row(
            record.drill_id,
            record.source_backup_id or "",
            record.target_cluster or "",
            f"[{VERDICT_STYLE.get(status, 'bold')}]{status}[/]"
            + (f" ({record.error})" if record.error else ""),
            f"{rto:,.1f}" if rto is not None else "",
            f"{record.restore_seconds:,.1f}" if record.restore_seconds else "",
            f"{record.bytes / MiB:,.1f}" if record.bytes else "",
            time.strftime("%Y-%m-%d %H:%M", time.localtime(torn)) if torn else "no",
        )
    console.print(table)
    if not records:
        console.print(f"no drills of {args.cluster} yet: 'shardvault drill {args.cluster} --wait'")
    return 0
