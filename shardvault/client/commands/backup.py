"""``shardvault backup CLUSTER``: start a backup, and follow it with ``--wait``."""

from __future__ import annotations

import argparse
from typing import Any

from shardvault.client import operations as ops
from shardvault.client.follow import follow
from shardvault.client.output import console
from shardvault.contracts.models import (
    BackupRequest,
)
from shardvault.data.planning import MiB


def add_parser(sub: Any) -> tuple[argparse.ArgumentParser, ...]:
    """Its subcommands, each a parser (given the deployment options by ``cli``)."""
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
    backup.add_argument(
        "--read-full",
        action="store_true",
        help="read a full from the database even where the policy synthesizes fulls from the "
        "chain (incremental.synthesized_fulls)",
    )
    backup.set_defaults(run=run_backup)
    return (backup,)


def run_backup(args: argparse.Namespace) -> int:
    config = ops.ClientConfig.from_env()
    part_size = args.part_size_mib * MiB if args.part_size_mib else None
    request = BackupRequest(
        cluster=args.cluster,
        part_size=part_size,
        incremental=args.incremental,
        read_full=args.read_full,
        requested_by="cli",
    )
    ops.check_cluster(config, request.cluster)  # an unknown name: refused now, not in the run
    execution = ops.start_backup(config, request)
    console.print(f"started [bold]{execution}[/]")
    if not args.wait:
        return 0
    return ops.exit_status(follow(config, execution))
