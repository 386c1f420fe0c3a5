"""``shardvault verify CLUSTER [BACKUP_ID]``: check a backup and its chain in the store
(``shardvault.assurance.verify``)."""

from __future__ import annotations

import argparse
from typing import Any

from rich.markup import escape
from rich.table import Table

from shardvault.client import operations as ops
from shardvault.client.output import REFUSED, console, emit_json, errors
from shardvault.data.planning import MiB
from shardvault.errors import InvalidRequest


def add_parser(sub: Any) -> tuple[argparse.ArgumentParser, ...]:
    """Its subcommands, each a parser (given the deployment options by ``cli``)."""
    verify = sub.add_parser("verify", help="check a backup and its chain in the store")
    verify.add_argument("cluster")
    verify.add_argument("backup_id", nargs="?", default="latest", help="default: latest")
    verify.add_argument(
        "--read-data",
        type=float,
        default=0.0,
        metavar="PERCENT",
        help="also download this share of the objects and check their bytes (archived ones "
        "are skipped: they need a thaw)",
    )
    verify.add_argument(
        "--from-vault",
        metavar="NAME",
        help="check the backup's copy in this vault target of the policy (a name under "
        "vault.copies) instead of where the catalog says it is",
    )
    verify.set_defaults(run=run_verify)
    return (verify,)


# A verify refused before it read anything (exit 3), as opposed to a backup found damaged (1).
VERIFY_REFUSALS = {"InvalidRequest", "BackupNotFound", "BackupNotRestorable"}


def run_verify(args: argparse.Namespace) -> int:
    if not 0 <= args.read_data <= 100:
        raise InvalidRequest(
            f"--read-data {args.read_data:g} is not a percentage.",
            fix="give 0 to 100, e.g. --read-data 5 to read back one object in twenty.",
        )
    outcome = ops.run_verify(
        ops.ClientConfig.from_env(),
        args.cluster,
        args.backup_id,
        args.read_data,
        from_vault=args.from_vault,
    )
    if outcome.status != "SUCCEEDED":
        if args.json:
            emit_json({"result": "failed", "error": outcome.error, "cause": outcome.cause})
        else:
            errors.print(
                f"[bold red]{escape(outcome.error or outcome.status)}[/]: {escape(outcome.cause)}"
            )
        return REFUSED if outcome.error in VERIFY_REFUSALS else 1
    result = outcome.record or {}
    if args.json:
        return emit_json(result)
    table = Table("backup", "where", "objects", "MiB", "read back", "skipped (archived)")
    for c in result.get("chain", []):
        table.add_row(
            c["backup_id"],
            c["location"],
            str(c["objects"]),
            f"{c['bytes'] / MiB:,.1f}",
            str(c["read"]),
            str(c["skipped"]),
        )
    console.print(table)
    console.print(
        f"[green]ok[/]: backup {result['backup_id']} of {result['cluster']} and its chain hold "
        f"every object as their manifests say ({result['objects']} objects by checksum "
        f"attributes, {result['read']} read back)"
    )
    if covered := result.get("covered"):
        console.print(
            f"[yellow]warning[/]: {len(covered)} vault key(s) of the chain were written over "
            "after promotion (the locked versions verified here are intact; look at the "
            "vault's access, e.g. CloudTrail, for who wrote):"
        )
        for note in covered:
            console.print(f"  {note}")
    for shard_id, wal in sorted((result.get("wal_archive") or {}).items()):
        console.print(
            f"[green]ok[/]: shard {shard_id}'s {wal.get('log', 'WAL')} archive runs without a "
            f"gap from {wal['from']} to {wal['to']} ({wal['batches']} batches): a "
            "point-in-time restore reaches it"
        )
    return 0
