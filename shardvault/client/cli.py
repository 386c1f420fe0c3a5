"""``shardvault``: run backups and inspect them, against AWS or the local stack.

  shardvault demo [--engine sqlite|postgres]   set up the local stack, back up a 3-node cluster
  shardvault local up                          run the local stack until Ctrl-C or local down
  shardvault local down                        stop the stack 'local up' runs in --dir
  shardvault backup CLUSTER [--wait]           start a backup (and follow it)
  shardvault list [CLUSTER] [--json]           backups in the catalog
  shardvault show CLUSTER BACKUP_ID [--json]   one backup, in full
  shardvault restore CLUSTER --into TARGET     restore a backup into another cluster
  shardvault retention [CLUSTER] [--dry-run]   expire backups by the policy's keep counts
  shardvault check CLUSTER [--policy FILE]     will the next backup run? (exit 1: no)
      [--no-probe] [--json]                      (and each agent's round trip to the store)
  shardvault verify CLUSTER [BACKUP_ID]        check a backup and its chain in the store
      [--read-data PERCENT] [--json]             (exit 1 when damaged)
  shardvault schedule --policy FILE            start scheduled backups (the local stack)
  shardvault cost [--policy FILE] [--target]   monthly cost forecasts against budgets
      [--cluster NAME] [--data-gib N] [--daily-change F]   (exit 1 when a cluster is over)

Which deployment is used comes from ``--stack NAME`` (a deployed stack's outputs, read with
CloudFormation ``DescribeStacks``), ``--stack-env`` (a local stack's ``stack.env``), or
SHARDVAULT_STATE_MACHINE_ARN and SHARDVAULT_CATALOG_TABLE set by hand.

Exit status: 0 done; 1 failed (a backup or restore followed with --wait that failed, a backup
that verify found damaged, a check that failed, a cost over its budget); 2 a usage error (the
arguments do not parse); 3 refused (a named error, on stderr with its fix, before anything
started).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    EndpointConnectionError,
    NoCredentialsError,
    NoRegionError,
)
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.table import Table

from shardvault.aws.tables import Catalog, table
from shardvault.client import cli_drills
from shardvault.client import operations as ops
from shardvault.contracts.catalog import ArchiveTotals, BackupItem, recorded_stored_bytes
from shardvault.contracts.models import (
    BackupRequest,
    RestoreRequest,
    RestoreTarget,
    RetrievalTier,
    ThrottleReport,
)
from shardvault.data.planning import MiB
from shardvault.errors import AWS_DENIED_CODES, InvalidRequest, ShardVaultError
from shardvault.lifecycle.costs import DEFAULT_DAILY_CHANGE, restore_options, stored_part
from shardvault.restore import admission
from shardvault.versions import installed

console = Console(width=cli_drills.PIPED_WIDTH)
# Refusals and their fixes go to stderr, so stdout stays what a script parses. They are never
# hard-wrapped: a path or key in an error must survive a copy and paste whole.
errors = Console(stderr=True, soft_wrap=True)
REFUSED = 3  # argparse exits 2 on a usage error
DEFAULT_STACK_DIR = Path("local-stack")
DEFAULT_DATA_GIB = 100.0  # a cost forecast's data size when neither asked nor measured


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        if getattr(args, "stack_env", None):
            ops.load_env_file(args.stack_env)
        if getattr(args, "stack", None):
            ops.load_stack_outputs(args.stack)
        return args.run(args) or 0
    except ShardVaultError as error:
        errors.print(f"[bold red]{error.name}[/]: {escape(error.message)}")
        if error.fix:
            errors.print(f"[yellow]Fix[/]: {escape(error.fix)}")
        return REFUSED
    except (BotoCoreError, ClientError) as error:  # AWS configuration: one line, no traceback
        errors.print(f"[bold red]AWS[/]: {escape(aws_problem(error))}")
        return REFUSED
    except KeyboardInterrupt:
        return 130


def aws_problem(error: BotoCoreError | ClientError) -> str:
    """What AWS refused the CLI, and the fix, in one line."""
    if isinstance(error, NoRegionError):
        return (
            "no AWS region is set. Fix: set AWS_DEFAULT_REGION (or the profile's region) to "
            "the ShardVault stack's region."
        )
    if isinstance(error, NoCredentialsError):
        return "no AWS credentials were found. Fix: set AWS_PROFILE, or log in (aws sso login)."
    if isinstance(error, EndpointConnectionError):
        return f"AWS cannot be reached ({error}). Fix: check the network and the region."
    if isinstance(error, ClientError):
        code = error.response.get("Error", {}).get("Code", "")
        if code in AWS_DENIED_CODES:
            return (
                f"this AWS identity may not do that ({code}: {error}). Fix: use an identity "
                "allowed to start the stack's executions and read its tables."
            )
        if code in ("ResourceNotFoundException", "StateMachineDoesNotExist"):
            return (
                f"{error}. Fix: set SHARDVAULT_* from the stack's outputs (the table and state "
                "machine names are generated), and AWS_DEFAULT_REGION to its region."
            )
    return f"{error}."


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(prog="shardvault", description=__doc__.splitlines()[0])
    root.add_argument("--version", action="version", version=f"%(prog)s {installed('shardvault')}")
    sub = root.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="local end-to-end backup of a 3-node cluster")
    demo.add_argument("--engine", choices=["sqlite", "postgres"], default="sqlite")
    demo.add_argument("--size-mb", type=int, default=240, help="SQLite data size (MiB)")
    demo.add_argument("--pgbench-scale", type=int, default=20, help="PostgreSQL data per node")
    demo.add_argument("--dir", type=Path, default=DEFAULT_STACK_DIR)
    demo.add_argument("--no-minio", action="store_true", help="use moto's S3 as the store")
    demo.set_defaults(run=run_demo)

    local = sub.add_parser("local", help="the local stack")
    local.add_argument("action", choices=["up", "down"])
    local.add_argument("--dir", type=Path, default=DEFAULT_STACK_DIR)
    local.add_argument("--no-minio", action="store_true", help="up: use moto's S3 as the store")
    local.set_defaults(run=run_local)

    backup = sub.add_parser("backup", help="start a backup of a cluster")
    backup.add_argument("cluster")
    backup.add_argument("--wait", action="store_true", help="follow it to the end")
    backup.add_argument("--part-size-mib", type=int, help="the one size knob (default: chosen)")
    backup.add_argument(
        "--incremental",
        action="store_true",
        help="send only the blocks changed since the cluster's newest backup (the policy's "
        "incremental settings say when a full is made instead)",
    )
    backup.set_defaults(run=run_backup)

    lister = sub.add_parser("list", help="list backups")
    lister.add_argument("cluster", nargs="?")
    lister.set_defaults(run=run_list)

    show = sub.add_parser("show", help="show one backup")
    show.add_argument("cluster")
    show.add_argument("backup_id")
    show.set_defaults(run=run_show)

    nodes = sub.add_parser("nodes", help="registered nodes, or remove a decommissioned one")
    nodes.add_argument("cluster", nargs="?")
    nodes.add_argument("--remove", metavar="NODE_ID", help="forget a decommissioned node")
    nodes.add_argument(
        "--force", action="store_true", help="with --remove: even a node whose agent is up"
    )
    nodes.set_defaults(run=run_nodes)

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
    verify.set_defaults(run=run_verify)

    for reader in (lister, show, nodes, verify, check):
        reader.add_argument(
            "--json", action="store_true", help="print JSON for scripts (docs/reference/cli.md)"
        )

    restore, retention, schedule = add_vault_parsers(sub)
    drill, drills = cli_drills.add_parsers(sub)

    for cmd in (
        backup,
        lister,
        show,
        nodes,
        restore,
        retention,
        schedule,
        verify,
        check,
        drill,
        drills,
    ):
        where = cmd.add_mutually_exclusive_group()
        where.add_argument("--stack-env", type=Path, help="a local stack's stack.env")
        where.add_argument(
            "--stack", metavar="NAME", help="a deployed stack (e.g. ShardVault): its outputs"
        )
    return root


def add_vault_parsers(sub: Any) -> tuple[argparse.ArgumentParser, ...]:
    """The commands past a backup: restore, retention, schedules and costs."""
    restore = sub.add_parser("restore", help="restore a backup into a (new) cluster")
    restore.add_argument("cluster", help="the cluster the backup was taken of")
    restore.add_argument("--into", required=True, metavar="TARGET", help="the target cluster")
    restore.add_argument("--backup-id", default="latest", help="a backup id, or latest")
    restore.add_argument("--plan-only", action="store_true", help="show the placement only")
    restore.add_argument("--replace", action="store_true", help="restore over existing data")
    restore.add_argument("--tier", choices=[t.value for t in RetrievalTier], default="Standard")
    restore.add_argument(
        "--pin", action="append", default=[], metavar="SHARD=NODE", help="place a shard"
    )
    restore.add_argument(
        "--check",
        action="append",
        default=[],
        metavar="SQL",
        help="a validation query: one read-only statement that must return true",
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
        help="PostgreSQL point-in-time restore from the WAL archive: replay every shard to this "
        "instant (ISO 8601 with its offset, e.g. '2026-11-23 14:02:59+00')",
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
        "--target-latest",
        action="store_true",
        help="PostgreSQL: replay each shard's WAL archive to its end",
    )
    restore.add_argument("--wait", action="store_true", help="follow it to the end")
    restore.set_defaults(run=run_restore)

    retention = sub.add_parser("retention", help="expire backups by the policy's keep counts")
    retention.add_argument("cluster", nargs="?", help="one cluster (default: every cluster)")
    retention.add_argument(
        "--dry-run", action="store_true", help="decide and print, delete nothing"
    )
    retention.set_defaults(run=run_retention)

    schedule = sub.add_parser("schedule", help="run the policy's schedules (local stack)")
    schedule.add_argument("--policy", type=Path, required=True, help="the policy file")
    schedule.add_argument("--interval", type=float, default=20.0, help="seconds between ticks")
    schedule.set_defaults(run=run_schedule)

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

    return restore, retention, schedule


# --- backup, list, show ------------------------------------------------------------------------
def run_backup(args: argparse.Namespace) -> int:
    config = ops.ClientConfig.from_env()
    part_size = args.part_size_mib * MiB if args.part_size_mib else None
    request = BackupRequest(
        cluster=args.cluster, part_size=part_size, incremental=args.incremental, requested_by="cli"
    )
    ops.check_cluster(config, request.cluster)  # an unknown name: refused now, not in the run
    execution = ops.start_backup(config, request)
    console.print(f"started [bold]{execution}[/]")
    if not args.wait:
        return 0
    return ops.exit_status(follow(config, execution))


def chain_root_of(config: ops.ClientConfig, record: BackupItem) -> BackupItem | None:
    """The full an incremental's chain starts with (None for a full, or when it is gone)."""
    root = record.chain_root
    if not record.is_incremental or not root:
        return None
    try:
        return ops.show_backup(config, record.cluster, root)
    except InvalidRequest:
        return None


def follow(
    config: ops.ClientConfig,
    execution: str,
    wait: Callable[..., ops.Progress] = ops.wait_backup,
    what: str = "backup",
) -> ops.Progress:
    """Shows bytes done, rate and ETA until the execution ends; then its summary or error."""
    columns = (
        "[progress.description]{task.description}",
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=console, transient=True) as bar:
        first = "checkpointing" if what == "backup" else "preparing"
        task = bar.add_task(first, total=None)

        def update(p: ops.Progress) -> None:
            moving = "uploading" if what == "backup" else "downloading"
            phase = moving if p.bytes_total else first
            if frozen := (p.record or {}).get("frozen"):
                phase = f"waiting for {frozen} archived objects to thaw;"
            throttle = (p.record or {}).get("throttle")
            steered = throttle_note(ThrottleReport.model_validate(throttle) if throttle else None)
            bar.update(
                task,
                description=f"{phase} {p.objects_done}/{p.objects_total} objects{steered}",
                completed=p.bytes_done,
                total=p.bytes_total or None,
            )

        outcome = wait(config, execution, update)
    if outcome.status == "SUCCEEDED" and what == "backup":
        record = BackupItem.from_item(outcome.record or {})
        print_summary(record, chain_root_of(config, record))
    elif outcome.status == "SUCCEEDED":
        print_restore(outcome.record or {})
    else:
        print_failure(what, outcome)
    return outcome


def print_failure(what: str, outcome: ops.Progress) -> None:
    """A followed run that failed: its error and cause, on stderr (stdout is the output)."""
    errors.print(f"[bold red]{what} {outcome.status}[/]: [bold]{escape(outcome.error)}[/]")
    errors.print(escape(outcome.cause))


def backup_type(record: BackupItem) -> str:
    """``full``, or ``incremental`` with its depth in the chain and its parent."""
    if not record.is_incremental:
        return "full"
    return f"incremental, depth {record.depth}, of {record.parent_id}"


def read_bytes(record: BackupItem) -> int:
    """What the backup read from the databases: an incremental reads (and hashes) the blocks
    of the files that changed since its parent, but those whose headers prove them unchanged
    (``data_screened_bytes``), and sends only the changed blocks (``bytes``); records before
    incrementals hold ``bytes``."""
    return record.read_bytes or record.bytes or 0


def read_cell(record: BackupItem) -> str:
    screened = record.data_screened_bytes
    if not screened:
        return sized(read_bytes(record))
    return f"{sized(read_bytes(record))}; {sized(screened)} more vouched for by page headers"


def full_share(record: BackupItem, root: BackupItem | None) -> float | None:
    """An incremental's stored bytes over its chain's full's; None when the full is gone from
    the catalog."""
    full = recorded_stored_bytes(root) if root else 0
    return recorded_stored_bytes(record) / full if full else None


def share_of_full(record: BackupItem, root: BackupItem | None) -> str:
    """``full_share`` as the table shows it; fulls are 100 %."""
    if not record.is_incremental:
        return "100 %" if record.bytes is not None else ""
    share = full_share(record, root)
    return "?" if share is None else f"{share:.1%}"


def sized(count: int) -> str:
    return f"{count:,} ({count / MiB:,.1f} MiB)"


def recovered_to(shard: dict[str, Any]) -> str:
    """Where a restored shard's recovery stopped: a point-in-time target, the backup's cut,
    or its own copy's end."""
    kind, where = shard.get("recovery_target"), shard.get("recovered_to")
    if kind:
        return {"name": f"restore point {where}", "lsn": f"LSN {where}"}.get(kind, str(where))
    if where:
        return f"restore point {where}"
    return "end of its copy"


def objects_cell(record: BackupItem) -> str:
    """What the backup keeps in the store: its data objects (what a restore downloads), its
    block maps (in its stored bytes) and its manifest."""
    data = record.objects
    if data is None:
        return ""
    maps = record.blockmap_objects
    if maps is None:  # recorded before block maps were counted
        return f"{data} data objects, with their block maps and the manifest"
    return f"{data} data + {maps} block maps + 1 manifest = {data + maps + 1} stored"


def cut_cell(record: BackupItem) -> str:
    """Where a restore of the backup stops every node: its restore point, and the skew."""
    if record.cut_name is None:
        return "none (each shard restores to where its own copy ends)"
    skew = (record.cut_skew_seconds or 0) * 1000
    cell = f"restore point {record.cut_name}, skew {skew:.1f} ms"
    late = record.cut_late_seconds or 0
    if late >= 0.001:  # below a millisecond: the agents' wake-up, not lateness worth a word
        cell += f" (a node came {late * 1000:.0f} ms after the cut instant)"
    paused, pause = record.cut_paused, record.cut_pause_seconds or 0
    if paused is True:
        cell += f"; commits paused at most {pause * 1000:.1f} ms"
    elif paused is False:
        cell += "; commit pause not held on every node at once: best-effort"
    return cell


def throttle_note(throttle: ThrottleReport | None) -> str:
    """An adaptive backup's rate as its agent last reported it, for the progress line."""
    if not throttle or not throttle.limited_by:
        return ""
    rate = throttle.rate_bytes_per_second or 0
    return f"; reading at {rate / MiB:,.1f} MiB/s (held back by {throttle.limited_by})"


def throttle_cell(throttle: ThrottleReport) -> str:
    """What an adaptive throttle did over the backup (as its agent last reported it)."""
    if not throttle.cuts:
        return "adaptive: never held back (the source stayed within its targets)"
    lowest = throttle.lowest_rate_bytes_per_second or 0
    cell = (
        f"adaptive: held back {throttle.cuts} times, {throttle.throttled_seconds:.1f} s "
        f"in all, lowest {lowest / MiB:,.1f} MiB/s (floor "
        f"{throttle.floor_bytes_per_second / MiB:,.1f} MiB/s)"
    )
    if throttle.limited_by:
        rate = throttle.rate_bytes_per_second or 0
        cell += f"; last {rate / MiB:,.1f} MiB/s, held back by {throttle.limited_by}"
    return cell


def held_cell(record: BackupItem) -> str:
    """The most WAL the backup held on its source (its replication slot), as last reported."""
    return f"{sized(record.held_log_bytes or 0)} at most, until the backup let it go"


def print_summary(record: BackupItem, root: BackupItem | None = None) -> None:
    table = Table(title="Backup complete", show_header=False)
    rows = [
        ("backup id", record.backup_id),
        ("type", backup_type(record)),
        ("nodes", ", ".join(record.nodes)),
        ("shards", ", ".join(record.shards)),
        ("bytes read", read_cell(record)),
    ]
    if record.is_incremental:
        rows.append(("changed bytes sent", sized(record.bytes or 0)))
    rows += [
        ("bytes stored", stored_cell(record)),
        ("of its full's stored bytes", share_of_full(record, root)),
        ("objects", objects_cell(record)),
        ("parts", str(record.parts or "")),
        ("duration", f"{record.duration_seconds or 0:.2f} s"),
        ("throughput", f"{record.throughput_mib_s or 0:.1f} MiB/s"),
        *([("throttle", throttle_cell(record.throttle))] if record.throttle else []),
        *([("source WAL held", held_cell(record))] if record.held_log_bytes else []),
        ("cut", cut_cell(record)),
        ("checkpoint spread", f"{(record.checkpoint_skew_seconds or 0) * 1000:.1f} ms"),
        ("verification", record.verification or ""),
        ("manifest", record.manifest_key or ""),
        (
            "estimated cost",
            f"${record.estimated_storage_usd_per_month or 0:.4f}/month to keep, "
            f"${record.estimated_overhead_usd or 0:.4f} to make",
        ),
    ]
    if record.location == "vault":
        rows += [
            ("vault", f"{record.storage_class}, {record.lock_mode} lock"),
            ("retain until", record.retain_until or ""),
            ("vault manifest", record.vault_manifest_key or ""),
        ]
    for key, value in rows:
        table.add_row(key, str(value))
    console.print(table)


# --- restore -----------------------------------------------------------------------------------
def restore_target(args: argparse.Namespace) -> dict[str, Any] | None:
    if args.target_time:
        return {"time": args.target_time.strip().replace(" ", "T", 1)}
    if args.target_lsn:
        return {"lsn": args.target_lsn.strip()}
    if args.target_name:
        return {"name": args.target_name}
    return {"latest": True} if args.target_latest else None


def run_restore(args: argparse.Namespace) -> int:
    pins = parse_pins(args.pin)
    config = ops.ClientConfig.from_env()
    request = RestoreRequest(
        cluster=args.cluster,
        target_cluster=args.into,
        backup_id=args.backup_id,
        tier=args.tier,
        placement=pins,
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
    execution = ops.start_restore(config, request)
    console.print(f"started [bold]{execution}[/]")
    if args.plan_only:
        outcome = ops.wait_restore(config, execution)
        if outcome.status == "SUCCEEDED":
            print_plan(outcome.record or {})
            print_restore_options(config, outcome.record or {}, args.tier)
            return 0
        print_failure("plan", outcome)
        return 1
    if not args.wait:
        return 0
    return ops.exit_status(follow(config, execution, ops.wait_restore, "restore"))


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


def print_restore_options(config: ops.ClientConfig, plan: dict[str, Any], chosen: str) -> None:
    """Before anything moves: per retrieval tier, what the restore will cost and how long the
    thaw of its archived objects takes (``costs.restore_options``)."""
    records = chain_records(config, plan["cluster"], plan["backup_id"])
    options = restore_options(stored_part(r) for r in records)
    table = Table(
        "retrieval tier",
        "cost",
        "thaw before the first byte",
        title=f"Reading {len(records)} backup(s) "
        f"({sum(recorded_stored_bytes(r) for r in records) / MiB:,.1f} MiB stored)",
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


def print_restore(summary: dict[str, Any]) -> None:
    table = Table(show_header=False, title="Restore complete")
    rows = [
        ("restore id", summary.get("restore_id", "")),
        ("from", f"{summary.get('source_cluster')} / {summary.get('backup_id')}"),
        ("into", summary.get("target_cluster", "")),
        ("bytes", f"{summary.get('bytes', 0):,} ({summary.get('bytes', 0) / MiB:.1f} MiB)"),
        ("objects", str(summary.get("objects", ""))),
        ("duration", f"{summary.get('duration_seconds', 0):.2f} s"),
        ("throughput", f"{summary.get('throughput_mib_s', 0):.1f} MiB/s"),
        ("validation", summary.get("validation", "")),
    ]
    for key, value in rows:
        table.add_row(key, str(value))
    console.print(table)
    restored = summary.get("shards", [])
    # Only a cut's restore says where recovery stopped: SQLite shards have nothing to add.
    cut = any(s.get("recovered_to") for s in restored)
    columns = ["shard", "node", "where", *(["recovered to"] if cut else []), "checks"]
    shards = Table(*columns, title="Restored shards")
    for s in restored:
        where = f"port {s['port']}" if s.get("port") else s.get("path", "")
        checks = ", ".join(f"{k}: {v}" for k, v in s.get("checks", {}).items())
        cells = [s["shard_id"], s["node_id"], where, *([recovered_to(s)] if cut else []), checks]
        shards.add_row(*cells)
    console.print(shards)
    if summary.get("validation") == "passed":
        target = summary.get("target_cluster", "")
        console.print(
            f"The agents of {target} hold these shards now: backups of {target} include "
            "them, with no change to the agents' configuration."
        )


# --- check -------------------------------------------------------------------------------------
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


# --- verify ------------------------------------------------------------------------------------
# A verify refused before it read anything (exit 3), as opposed to a backup found damaged (1).
VERIFY_REFUSALS = {"InvalidRequest", "BackupNotFound", "BackupNotRestorable"}


def run_verify(args: argparse.Namespace) -> int:
    if not 0 <= args.read_data <= 100:
        raise InvalidRequest(
            f"--read-data {args.read_data:g} is not a percentage.",
            fix="give 0 to 100, e.g. --read-data 5 to read back one object in twenty.",
        )
    outcome = ops.run_verify(
        ops.ClientConfig.from_env(), args.cluster, args.backup_id, args.read_data
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
            f"[green]ok[/]: shard {shard_id}'s WAL archive runs without a gap from {wal['from']} "
            f"to {wal['to']} ({wal['batches']} batches): a point-in-time restore reaches it"
        )
    return 0


# --- retention ---------------------------------------------------------------------------------
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


def run_schedule(args: argparse.Namespace) -> int:
    import logging

    from shardvault.config.policy import load_policy
    from shardvault.local import scheduler

    policy = load_policy(args.policy)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    console.print(f"scheduling {', '.join(sorted(policy.clusters))}; Ctrl-C stops")
    scheduler.run(policy, ops.ClientConfig.from_env(), args.interval)
    return 0


# --- cost --------------------------------------------------------------------------------------
EXAMPLE_POLICY = Path(__file__).resolve().parents[2] / "examples" / "shardvault.yaml"
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
    return title, costs.monthly_forecast(cluster, data_bytes, change, wal=wal)


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


def stored_cell(record: BackupItem) -> str:
    """Bytes in the store (compressed, sealed: what was uploaded) and their share of the bytes
    read."""
    stored, read = recorded_stored_bytes(record), read_bytes(record)
    share = f" ({stored / read:.1%} of read)" if read else ""
    return f"{stored:,}{share}"


def hold_note(record: BackupItem) -> str:
    """What retention's hold says of a complete backup it expired, e.g. "held until
    2026-06-01: paid minimum of DEEP_ARCHIVE" (empty: not held)."""
    if record.status != "COMPLETE" or not record.held_until:
        return ""
    until = record.held_until[:10]
    return f"held until {until}: {record.held_for or 'paid minimum of its class'}"


def emit_json(data: Any) -> int:
    """``--json``: one JSON document on stdout, nothing else (no colours, no wrapping)."""
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")
    return 0


def backup_json(record: BackupItem, root: BackupItem | None) -> dict[str, Any]:
    """A backup's catalog record with what the table shows computed: ``read_bytes`` (from
    the databases), ``stored_bytes`` (in the store, after compression), and for an
    incremental ``share_of_full`` (its stored bytes over its chain's full's; None when the
    full is gone from the catalog)."""
    out = ops.as_row(record) | {"read_bytes": read_bytes(record)}
    if record.bytes is not None:
        out["stored_bytes"] = recorded_stored_bytes(record)
    if record.is_incremental:
        out["share_of_full"] = full_share(record, root)
    return out


def run_list(args: argparse.Namespace) -> int:
    records = ops.list_backups(ops.ClientConfig.from_env(), args.cluster)
    by_id = {(r.cluster, r.backup_id): r for r in records}
    if args.json:
        return emit_json(
            [backup_json(r, by_id.get((r.cluster, r.chain_root or ""))) for r in records]
        )
    table = Table(
        "cluster",
        "backup id",
        "type",
        "status",
        "MiB read",
        "MiB uploaded",
        "of its full",
        "objects",
        "duration",
        "started",
    )
    for r in records:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r.started_at))
        duration = f"{r.duration_seconds:.1f} s" if r.duration_seconds is not None else ""
        done = r.bytes is not None
        table.add_row(
            r.cluster,
            r.backup_id,
            backup_type(r).replace("incremental, depth ", "incr ").replace(", of ", " of "),
            " ".join(filter(None, [r.status, hold_note(r)])),
            f"{(read_bytes(r) if done else r.bytes_done) / MiB:,.1f}",
            f"{recorded_stored_bytes(r) / MiB:,.1f}" if done else "",
            share_of_full(r, by_id.get((r.cluster, r.chain_root or ""))),
            str(r.objects if r.objects is not None else ""),
            duration,
            started,
        )
    console.print(table)
    return 0


def run_nodes(args: argparse.Namespace) -> int:
    config = ops.ClientConfig.from_env()
    if args.remove:
        node = ops.remove_node(config, args.remove, force=args.force)
        console.print(f"removed node {node.node_id} of cluster {node.cluster}")
        return 0
    found = ops.list_nodes(config, args.cluster)
    if args.json:
        return emit_json([n.model_dump(mode="json") for n in found])
    table = Table(
        "cluster", "node", "engine", "agent", "status", "last heartbeat", "shards", "free"
    )
    now = time.time()
    for n in found:
        shards = ", ".join(f"{s.shard_id} ({s.role})" for s in n.shards)
        age = f"{now - n.heartbeat_at:.0f} s ago"
        agent = f"{n.version} (outdated: upgrade it)" if n.is_outdated else n.version
        free = f"{n.free_bytes / 2**30:.1f} GiB"
        table.add_row(n.cluster, n.node_id, n.engine, agent, n.status, age, shards, free)
    console.print(table)
    return 0


def run_show(args: argparse.Namespace) -> int:
    config = ops.ClientConfig.from_env()
    record = ops.show_backup(config, args.cluster, args.backup_id)
    if args.json:
        return emit_json(backup_json(record, chain_root_of(config, record)))
    table = Table(show_header=False, title=f"{args.cluster} / {args.backup_id}")
    table.add_row("type", backup_type(record))
    if record.status == "COMPLETE":
        table.add_row("objects", objects_cell(record))
        table.add_row("cut", cut_cell(record))  # and the commit pause, when one was asked
    share = share_of_full(record, chain_root_of(config, record))
    table.add_row("of its full's stored bytes", share)
    if hold := hold_note(record):
        table.add_row("retention", f"{hold} (expired, still restorable)")
    if record.throttle:
        table.add_row("throttle", throttle_cell(record.throttle))
    if record.held_log_bytes:
        table.add_row("source WAL held", held_cell(record))
    if verified := record.verify:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(verified.verified_at))
        table.add_row(
            "last verified",
            f"{verified.result} at {when} ({verified.objects} objects with their chain, "
            f"{verified.read} read back)",
        )
    row = ops.as_row(record)
    for key in sorted(row):
        table.add_row(key, str(row[key]))
    console.print(table)
    return 0


# --- local stack and demo ----------------------------------------------------------------------
def run_local(args: argparse.Namespace) -> int:
    """``local up`` runs the stack until Ctrl-C or ``local down`` (SIGTERM, handled as Ctrl-C
    so the stack stops its agents and MinIO); ``local down`` stops the one in ``--dir``."""
    from shardvault.local.stack import LocalStack, stop_running_stack

    root = args.dir.resolve()
    if args.action == "down":
        pid = stop_running_stack(root)
        console.print(f"local stack in {root} (pid {pid}) stopped")
        return 0
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        with LocalStack(root, use_minio=not args.no_minio) as stack:
            console.print(
                f"local stack up: control plane {stack.endpoint}, "
                f"store {stack.settings.store_endpoint}"
            )
            console.print(
                f"use: shardvault backup CLUSTER --wait --stack-env {stack.root / 'stack.env'}"
            )
            console.print(f"stop: Ctrl-C, or shardvault local down --dir {root}")
            while True:
                time.sleep(3600)
    except KeyboardInterrupt:
        console.print("local stack stopped")
    return 0


def run_demo(args: argparse.Namespace) -> int:
    from shardvault.local import demo
    from shardvault.local.stack import LocalStack

    root = args.dir.resolve()
    started = time.monotonic()
    with LocalStack(root, use_minio=not args.no_minio) as stack:
        store = (
            "MinIO " + stack.settings.store_endpoint
            if stack.settings.verify_mode == "attributes"
            else "moto S3 (read-back verification)"
        )
        console.print(f"[bold]local stack[/]: control plane {stack.endpoint}; store: {store}")
        with console.status("creating the demo cluster's data"):
            cluster = demo.demo_cluster(
                args.engine, root, size_mb=args.size_mb, scale=args.pgbench_scale
            )
        try:
            for config in cluster.agent_configs:
                stack.start_agent(config)
            stack.wait_for_nodes([c["node_id"] for c in cluster.agent_configs])
            console.print(
                f"[bold]cluster {cluster.name}[/]: {len(cluster.agent_configs)} nodes, "
                f"engine {cluster.engine}, agents registered"
            )
            config = stack.client_config()
            full = demo_backup(config, cluster.name, incremental=False)
            if full is None:
                return 1
            with console.status("changing 1 % of each shard's rows"):
                rows = cluster.change(0.01)
            console.print(
                f"[bold]change[/]: {rows:,} rows rewritten, one contiguous range in each shard"
            )
            incremental = demo_backup(config, cluster.name, incremental=True)
            if incremental is None:
                return 1
            print_reduction(full, incremental)
            source = cluster.digests()  # no write since the incremental: what it must restore
            if not restore_demo(stack, cluster, root, incremental.backup_id, source):
                return 1
            if not drill_demo(stack, cluster, root):
                return 1
        finally:
            cluster.stop()
    console.print(
        f"demo finished in {time.monotonic() - started:.1f} s; logs in {root} "
        "(functions.log, agents/*.log, minio.log)"
    )
    return 0


DEMO_CHECKS = {  # a query each restored shard must answer true
    "sqlite": "SELECT count(*) > 0 FROM items",
    "postgres": "SELECT count(*) > 0 FROM pgbench_accounts",
}


def demo_backup(config: ops.ClientConfig, cluster: str, *, incremental: bool) -> BackupItem | None:
    """One backup of the demo cluster, followed; its record, or None when it failed."""
    request = BackupRequest(cluster=cluster, incremental=incremental, requested_by="demo")
    outcome = follow(config, ops.start_backup(config, request))
    if outcome.status != "SUCCEEDED" or outcome.record is None:
        return None
    return BackupItem.from_item(outcome.record)


def print_reduction(full: BackupItem, incremental: BackupItem) -> None:
    """What the incremental sent against its full: the data reduction the demo shows."""
    stored, of_full = recorded_stored_bytes(incremental), recorded_stored_bytes(full)
    console.print(
        f"[bold]incremental[/]: read {read_bytes(incremental) / MiB:,.1f} MiB to find what "
        f"changed since its parent, sent "
        f"{(incremental.bytes or 0) / MiB:,.1f} MiB of changed blocks, "
        f"uploaded {stored / MiB:,.1f} MiB: [bold]{stored / of_full:.1%}[/] of the full's "
        f"{of_full / MiB:,.1f} MiB"
    )


def restore_demo(
    stack: Any, cluster: Any, root: Path, backup_id: str, source: dict[str, dict[str, str]]
) -> bool:
    """Restores ``backup_id`` into a new cluster of two nodes (three shards: one node takes
    two), each shard checked by its engine and then compared, table by table, with its
    source's digests; restored servers are stopped at the end."""
    from shardvault.local import demo

    target = f"{cluster.name}-restored"
    targets = demo.restore_targets(root, name=target, engine=cluster.engine, nodes=2)
    for config in targets:
        stack.start_agent(config)
    try:
        stack.wait_for_nodes([c["node_id"] for c in targets])
        console.print(f"[bold]cluster {target}[/]: 2 empty nodes, agents registered")
        config = stack.client_config()
        request = RestoreRequest(
            cluster=cluster.name,
            backup_id=backup_id,
            target_cluster=target,
            replace=True,  # a demo run again in the same directory restores over the last one
            validation_queries=[DEMO_CHECKS[cluster.engine]],
            requested_by="demo",
        )
        outcome = follow(config, ops.start_restore(config, request), ops.wait_restore, "restore")
        shards = (outcome.record or {}).get("shards", [])
        try:
            equal = outcome.status == "SUCCEEDED" and compare_with_source(
                cluster.engine, shards, source
            )
        finally:
            stop_restored_servers(shards)
        return equal
    finally:
        for config in targets:
            stack.stop_agent(config["node_id"])


def drill_demo(stack: Any, cluster: Any, root: Path) -> bool:
    """A restore drill of the demo cluster, as its policy's schedule would run it (its newest
    backup into two drill nodes, its validation query), with the copy torn down at once; prints
    the verdict and the RTO."""
    import shutil

    from shardvault.assurance.drills import DrillRequest
    from shardvault.client import cli_drills
    from shardvault.local import demo

    target = f"{cluster.name}-drill"  # the local policy's drill target
    nodes = demo.restore_targets(root, name=target, engine=cluster.engine, nodes=2)
    for config in nodes:  # a demo run again in the same directory starts its drill nodes empty
        shutil.rmtree(config["restore_dir"], ignore_errors=True)
        shutil.rmtree(config["state_dir"], ignore_errors=True)
        stack.start_agent(config)
    try:
        stack.wait_for_nodes([c["node_id"] for c in nodes])
        config = stack.client_config()
        request = DrillRequest(cluster=cluster.name, keep_minutes=0, requested_by="demo")
        outcome = cli_drills.follow_drill(config, ops.start_drill(config, request))
        return outcome.status == "SUCCEEDED"
    finally:
        for config in nodes:
            stack.stop_agent(config["node_id"])


def compare_with_source(
    engine: str, shards: list[dict[str, Any]], source: dict[str, dict[str, str]]
) -> bool:
    """Prints, per restored shard, whether every table equals its source's; True if all do."""
    from shardvault.local.demo import restored_digests

    table = Table("shard", "node", "tables", "equal to the source", title="Restored data")
    equal = True
    for shard in shards:
        restored = restored_digests(engine, shard)
        expected = source.get(shard["shard_id"], {})
        same = restored == expected
        equal = equal and same
        verdict = "[green]yes[/]" if same else "[bold red]NO[/]"
        table.add_row(shard["shard_id"], shard.get("node_id", ""), str(len(restored)), verdict)
    console.print(table)
    return equal and len(shards) == len(source)


def stop_restored_servers(shards: list[dict[str, Any]]) -> None:
    from shardvault.local.postgres import stop_server

    for shard in shards:
        if shard.get("port"):
            stop_server(Path(shard["path"]))


if __name__ == "__main__":
    sys.exit(main())
