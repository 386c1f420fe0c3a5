"""``shardvault check CLUSTER``: will the cluster's next backup run, and is its RPO met
(``shardvault.assurance.readiness``)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rich.table import Table

from shardvault.client import operations as ops
from shardvault.client.output import console, emit_json


def add_parser(sub: Any) -> tuple[argparse.ArgumentParser, ...]:
    """Its subcommands, each a parser (given the deployment options by ``cli``)."""
    check = sub.add_parser("check", help="will the cluster's next backup run? (and its RPO)")
    check.add_argument("cluster")
    check.add_argument(
        "--policy", type=Path, help="the deployment's policy file: membership and the RPO"
    )
    check.add_argument(
        "--no-probe",
        action="store_true",
        help="skip each agent's round trip to the store (the probe state machine)",
    )
    check.set_defaults(run=run_check)
    return (check,)


def run_check(args: argparse.Namespace) -> int:
    """Exit 0 when every check passes, 1 when one fails (each says its fix)."""
    from shardvault.config.policy import load_policy

    policy = load_policy(args.policy) if args.policy else None
    found = ops.check_readiness(
        ops.ClientConfig.from_env(), args.cluster, policy, probe=not args.no_probe
    )
    failed = [f for f in found if not f.ok]
    if args.json:
        emit_json(
            {
                "cluster": args.cluster,
                "ok": not failed,
                "checks": [f.model_dump() for f in found],
            }
        )
        return 1 if failed else 0
    table = Table("check", "", "found", "fix", title=f"Check of {args.cluster}")
    for f in found:
        table.add_row(f.check, "[green]ok[/]" if f.ok else "[bold red]FAIL[/]", f.detail, f.fix)
    console.print(table)
    return 1 if failed else 0
