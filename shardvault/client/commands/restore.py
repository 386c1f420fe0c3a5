"""``shardvault restore CLUSTER --into TARGET``: plan and start a restore (point-in-time for
PostgreSQL and MariaDB), showing the placement and what an archived backup costs to thaw."""

from __future__ import annotations

import argparse
from typing import Any

from rich.table import Table

from shardvault.aws.tables import Catalog, table
from shardvault.backup import cuts
from shardvault.client import operations as ops
from shardvault.client.follow import follow
from shardvault.client.output import console, print_failure
from shardvault.contracts.catalog import BackupItem, CutItem, recorded_stored_bytes
from shardvault.contracts.models import (
    RestoreRequest,
    RestoreTarget,
    RetrievalTier,
)
from shardvault.data.planning import MiB
from shardvault.errors import InvalidRequest
from shardvault.lifecycle.costs import (
    copy_restore_options,
    restore_options,
    stored_copy_part,
    stored_part,
)
from shardvault.restore import admission


def add_parser(sub: Any) -> tuple[argparse.ArgumentParser, ...]:
    """Its subcommands, each a parser (given the deployment options by ``cli``)."""
    restore = sub.add_parser("restore", help="restore a backup into a (new) cluster")
    restore.add_argument("cluster", help="the cluster the backup was taken of")
    restore.add_argument("--into", required=True, metavar="TARGET", help="the target cluster")
    restore.add_argument("--backup-id", default="latest", help="a backup id, or latest")
    restore.add_argument("--plan-only", action="store_true", help="show the placement only")
    restore.add_argument("--replace", action="store_true", help="restore over existing data")
    restore.add_argument("--tier", choices=[t.value for t in RetrievalTier], default="Standard")
    restore.add_argument(
        "--from-vault",
        metavar="NAME",
        help="read the backup from this vault target of the policy (vault.name, or a name "
        "under vault.copies); default: the stack vault once promoted",
    )
    restore.add_argument(
        "--pin", action="append", default=[], metavar="SHARD=NODE", help="place a shard"
    )
    restore.add_argument(
        "--tablespace",
        action="append",
        default=[],
        metavar="[SHARD:]NAME=DIR",
        help="PostgreSQL: place this tablespace in DIR (absolute, empty or absent, under the "
        "target agent's restore_link_dirs) instead of the node's restore_dir",
    )
    restore.add_argument(
        "--check",
        action="append",
        default=[],
        metavar="[DATABASE:]SQL",
        help="a validation query: one read-only statement that must return true on every "
        "shard, in DATABASE if given (PostgreSQL: else postgres)",
    )
    restore.add_argument(
        "--accept-damaged",
        action="store_true",
        help="restore a backup that verify found damaged (refused otherwise)",
    )
    restore.add_argument(
        "--heapallindexed",
        action="store_true",
        help="PostgreSQL: pg_amcheck --heapallindexed (every heap tuple found in its indexes)",
    )
    target = restore.add_mutually_exclusive_group()
    target.add_argument(
        "--target-time",
        metavar="TIME",
        help="point-in-time restore from the log archive: replay every shard to this instant "
        "(ISO 8601 with its offset, e.g. '2026-11-23 14:02:59+00'; MariaDB: whole seconds)",
    )
    target.add_argument(
        "--target-lsn",
        metavar="LSN",
        help="PostgreSQL, a cluster of one shard: replay its WAL archive to this position "
        "(e.g. '0/3000060')",
    )
    target.add_argument(
        "--target-name",
        metavar="NAME",
        help="PostgreSQL: replay every shard's WAL archive to the restore point of this name "
        "(pg_create_restore_point, or a backup id: every backup's cut); from the newest "
        "backup, or the one --backup-id names",
    )
    target.add_argument(
        "--target-position",
        metavar="FILE:OFFSET",
        help="MariaDB, a cluster of one shard: replay its binary log archive to this position, "
        "a transaction's boundary (e.g. 'mysql-bin.000012:1234', as SHOW MASTER STATUS shows)",
    )
    target.add_argument(
        "--target-cut",
        metavar="CUT",
        help="PostgreSQL: replay every shard's WAL archive to this scheduled cut (as "
        "'shardvault cuts CLUSTER' lists it), from the newest backup completed before it",
    )
    target.add_argument(
        "--target-cut-before",
        metavar="TIME",
        help="PostgreSQL: replay every shard to the newest scheduled cut at or before this "
        "instant that paused the commits it was asked to (ISO 8601 with its offset)",
    )
    target.add_argument(
        "--target-latest",
        action="store_true",
        help="replay each shard's log archive (WAL, binary logs) to its end",
    )
    restore.add_argument("--wait", action="store_true", help="follow it to the end")
    restore.set_defaults(run=run_restore)
    return (restore,)


def restore_target(args: argparse.Namespace) -> dict[str, Any] | None:
    if args.target_time:
        return {"time": args.target_time.strip().replace(" ", "T", 1)}
    if args.target_lsn:
        return {"lsn": args.target_lsn.strip()}
    if args.target_position:
        return {"position": args.target_position.strip()}
    if args.target_name:
        return {"name": args.target_name}
    if args.target_cut:
        return {"cut": args.target_cut.strip()}
    if args.target_cut_before:
        return {"cut_before": args.target_cut_before.strip().replace(" ", "T", 1)}
    return {"latest": True} if args.target_latest else None


def run_restore(args: argparse.Namespace) -> int:
    pins = parse_pins(args.pin)
    config = ops.ClientConfig.from_env()
    request = RestoreRequest(
        cluster=args.cluster,
        target_cluster=args.into,
        backup_id=args.backup_id,
        tier=args.tier,
        from_vault=args.from_vault,
        placement=pins,
        tablespaces=parse_tablespaces(args.tablespace),
        replace=args.replace,
        plan_only=args.plan_only,
        validation_queries=args.check,
        heapallindexed=args.heapallindexed,
        accept_damaged=args.accept_damaged,
        target=restore_target(args),
        requested_by="cli",
    )
    if request.target is None:  # the backup asked for exists: refused now, not in the run
        admission.resolve_backup(request, Catalog(table(config.catalog_table)))
    elif cut := cuts.resolve(Catalog(table(config.catalog_table)), args.cluster, request.target):
        warn_best_effort(cut)  # the cut exists and did not fail (refused now otherwise)
    execution = ops.start_restore(config, request)
    console.print(f"started [bold]{execution}[/]")
    if args.plan_only:
        outcome = ops.wait_restore(config, execution)
        if outcome.status == "SUCCEEDED":
            print_plan(outcome.record or {})
            print_restore_options(config, outcome.record or {}, args.tier, args.from_vault)
            return 0
        print_failure("plan", outcome)
        return 1
    if not args.wait:
        return 0
    return ops.exit_status(follow(config, execution, ops.wait_restore, "restore"))


def warn_best_effort(cut: CutItem) -> None:
    """A cut asked to pause the commits that did not get the pause is restored to as named,
    with its cost said: a distributed commit may be on one node's side of it and not
    another's."""
    if cut.best_effort:
        console.print(
            f"[yellow]cut {cut.cut_id} is best-effort: not every node held the commit pause at "
            "one moment, so a distributed commit may be restored on some nodes only "
            "(docs/guide/cluster-cut.md).[/]"
        )


def parse_pins(texts: list[str]) -> dict[str, str]:
    """``--pin SHARD=NODE`` options as a placement. A shard pinned to two nodes is refused by
    name (a dict would silently keep the last); the same pin given twice is accepted."""
    pins: dict[str, str] = {}
    for text in texts:
        shard, node = parse_pin(text)
        if pins.get(shard, node) != node:
            raise InvalidRequest(
                f"shard {shard} is pinned to two nodes: --pin {shard}={pins[shard]} and "
                f"--pin {text}.",
                fix=f"keep one --pin for {shard}.",
            )
        pins[shard] = node
    return pins


def parse_tablespaces(texts: list[str]) -> dict[str, str]:
    """``--tablespace [SHARD:]NAME=DIR`` options; one tablespace given two directories is
    refused by name."""
    placed: dict[str, str] = {}
    for text in texts:
        name, sep, directory = text.partition("=")
        if not sep or not name or not directory:
            raise InvalidRequest(
                f"--tablespace {text!r} is not [SHARD:]NAME=DIR.",
                fix="write e.g. --tablespace fast=/mnt/ssd/restored-fast.",
            )
        if placed.get(name, directory) != directory:
            raise InvalidRequest(
                f"tablespace {name} is given two directories: {placed[name]} and {directory}.",
                fix=f"keep one --tablespace for {name}.",
            )
        placed[name] = directory
    return placed


def parse_pin(text: str) -> tuple[str, str]:
    shard, sep, node = text.partition("=")
    if not sep or not shard or not node:
        raise InvalidRequest(f"--pin {text!r} is not SHARD=NODE.", fix="write e.g. shard-1=node-2.")
    return shard, node


def print_plan(plan: dict[str, Any]) -> None:
    table = Table(
        "shard",
        "target node",
        "bytes",
        title=f"Restore plan: {plan.get('cluster')} / {plan.get('backup_id')} into "
        f"{plan.get('target_cluster')}",
    )
    for p in plan.get("placements", []):
        table.add_row(p["shard_id"], p["node_id"], f"{p['bytes'] / MiB:.1f} MiB")
    console.print(table)
    for shard_id, links in sorted(plan.get("links", {}).items()):
        for path, directory in sorted(links.items()):
            console.print(f"Tablespace {path} of shard {shard_id} goes to {directory}.")
    if target := plan.get("target"):
        console.print(
            f"Point in time: from backup {plan.get('backup_id')}, replaying the archive to "
            f"{RestoreTarget.model_validate(target).describe()}: "
            f"{plan.get('wal_batches', 0):,} batch(es) of WAL "
            f"({plan.get('wal_bytes', 0) / MiB:,.1f} MiB) downloaded."
        )


def chain_records(config: ops.ClientConfig, cluster: str, backup_id: str) -> list[BackupItem]:
    """The catalog records of a backup and, for an incremental, of every ancestor (a restore
    reads them all), newest first."""
    records = [ops.show_backup(config, cluster, backup_id)]
    while records[-1].is_incremental and (parent := records[-1].parent_id):
        records.append(ops.show_backup(config, cluster, parent))
    return records


def print_restore_options(
    config: ops.ClientConfig, plan: dict[str, Any], chosen: str, from_vault: str | None = None
) -> None:
    """Before anything moves: per retrieval tier, what the restore will cost and how long the
    thaw of its archived objects takes (``costs.restore_options``), read from copy target
    ``from_vault`` when it names one (``costs.copy_restore_options``)."""
    records = chain_records(config, plan["cluster"], plan["backup_id"])
    copies = [stored_copy_part(r, from_vault) for r in records] if from_vault else []
    held = [c for c in copies if c is not None]
    if from_vault and len(held) == len(records):
        kind = records[0].vault_copies[from_vault].kind
        options = copy_restore_options(held, kind)
        where = f" from copy {from_vault} ({'GCS' if kind == 'gcs' else 'account B'})"
        stored = sum(c.bytes for c in held)
    else:  # the stack vault (by its name, or no --from-vault) or the store
        options = restore_options(stored_part(r) for r in records)
        where, stored = "", sum(recorded_stored_bytes(r) for r in records)
    table = Table(
        "retrieval tier",
        "cost",
        "thaw before the first byte",
        title=f"Reading {len(records)} backup(s){where} ({stored / MiB:,.1f} MiB stored)",
    )
    for option in options:
        name = option.tier.value.capitalize() if option.tier else "read directly (no thaw)"
        mark = " (--tier)" if option.tier and option.tier.value == chosen.upper() else ""
        table.add_row(name + mark, f"${option.usd:,.4f}", thaw_text(option.ready_within_hours))
    console.print(table)


def thaw_text(hours: float) -> str:
    if not hours:
        return "none"
    return f"up to {hours * 60:.0f} min" if hours < 1 else f"up to {hours:g} h"
