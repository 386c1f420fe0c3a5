"""``shardvault list``, ``show`` and ``nodes``: what the catalog and the node registry hold."""

from __future__ import annotations

import argparse
import time
from typing import Any

from rich.table import Table

from shardvault.client import operations as ops
from shardvault.client.output import console, emit_json
from shardvault.client.records import (
    backup_json,
    backup_type,
    chain_root_of,
    cut_cell,
    held_cell,
    hold_note,
    objects_cell,
    packing_cell,
    read_bytes,
    share_of_full,
    throttle_cell,
)
from shardvault.contracts.catalog import recorded_stored_bytes
from shardvault.data.planning import MiB


def add_parser(sub: Any) -> tuple[argparse.ArgumentParser, ...]:
    """Its subcommands, each a parser (given the deployment options by ``cli``)."""
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
    return (lister, show, nodes)


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
    if record.pack_cpu_seconds:
        table.add_row("packing CPU", packing_cell(record))
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
