"""``shardvault retention``: expire backups by the policy's keep counts (``--dry-run``:
decide and print only)."""

from __future__ import annotations

import argparse
from typing import Any

from rich.table import Table

from shardvault.client import operations as ops
from shardvault.client.output import console, print_failure


def add_parser(sub: Any) -> tuple[argparse.ArgumentParser, ...]:
    """Its subcommands, each a parser (given the deployment options by ``cli``)."""
    retention = sub.add_parser("retention", help="expire backups by the policy's keep counts")
    retention.add_argument("cluster", nargs="?", help="one cluster (default: every cluster)")
    retention.add_argument(
        "--dry-run", action="store_true", help="decide and print, delete nothing"
    )
    retention.set_defaults(run=run_retention)
    return (retention,)


def run_retention(args: argparse.Namespace) -> int:
    outcome = ops.run_retention(ops.ClientConfig.from_env(), args.cluster, args.dry_run)
    if outcome.status != "SUCCEEDED":
        print_failure("retention", outcome)
        return 1
    print_retention(outcome.record or {}, args.dry_run)
    return 0


def print_retention(result: dict[str, Any], dry_run: bool) -> None:
    verb = "would expire" if dry_run else "expired"
    for d in result.get("decisions", []):
        table = Table("backup", "decision", "why", title=f"Retention of {d['cluster']}")
        for k in d["keep"]:
            table.add_row(k["backup_id"], "keep", ", ".join(k["why"]))
        for lk in d["locked"]:
            table.add_row(lk["backup_id"], "locked", f"Object Lock until {lk['until']}")
        for h in d.get("held", []):
            table.add_row(h["backup_id"], "held", f"expired by retention; {h['why']}")
        for b in d["expire"]:
            why = "an earlier run's expiry, finished" if b in d.get("unfinished", []) else ""
            table.add_row(b, verb, why or "no keep rule and no chain needs it")
        console.print(table)
        if d["unrestorable"]:
            console.print(f"[red]kept but unrestorable (chain broken)[/]: {d['unrestorable']}")
    for alert in result.get("budget_alerts", []):
        console.print(f"[bold red]{alert}[/]")
    console.print(
        f"{verb} {len(result.get('expire', []))} backups: saves "
        f"${result.get('monthly_saving_usd', 0):.4f}/month; early-deletion charges "
        f"${result.get('early_deletion_charge_usd', 0):.4f}; held until their paid minimum: "
        f"${sum(d.get('held_monthly_usd', 0) for d in result.get('decisions', [])):.4f}/month "
        "(billed whether deleted or not)"
    )
